"""Texts to token ids as sentence-transformers makes them: WordPiece from tokenizer.json, [CLS] ... [SEP],
cut to max_seq_length tokens (special tokens included), never padded (the backends pack texts end to end).

all-MiniLM-L6-v2's tokenizer.json itself says "truncate to 128, pad to 128": sentence-transformers
overrides both, so they are overridden here too.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from shared.errors import ModelError

_WORDS = re.compile(r"[a-z0-9]+|[^a-z0-9 ]")     # BERT's split of lower-cased printable ASCII
_CACHED_RUNS = 200_000                           # runs between spaces whose pieces WordPieces keeps (then anew)


def load_tokenizer(model_dir: str | Path, max_seq_length: int) -> Tokenizer:
    path = Path(model_dir) / "tokenizer.json"
    if not path.is_file():
        raise ModelError(f"{path}: missing (run `make model`)")
    tok = Tokenizer.from_file(str(path))
    tok.no_padding()
    tok.enable_truncation(max_length=max_seq_length)
    return tok


def token_ids(tok: Tokenizer, texts: list[str]) -> list[np.ndarray]:
    """One int32 id array per text (at least [CLS] [SEP], also for an empty text); without character offsets,
    which nothing reads (a request's texts in about two thirds of the time)."""
    return [np.asarray(e.ids, dtype=np.int32) for e in tok.encode_batch_fast(list(texts))]


class WordPieces:
    """token_ids for a BERT WordPiece tokenizer, printable ASCII texts split here: lower case, runs of letters
    and digits, every other character alone (BERT's normaliser and pre-tokeniser do nothing else to such text),
    then each word's pieces, longest first, cached by the run between spaces they come from. Other texts (and
    those that hold a special token's text, which `tokenizers` matches whole), and every text of a tokenizer.json
    this does not describe, go to `tokenizers` (token_ids). The same ids either way (tests/test_encoder.py over
    every text of the data sets); a request's parts in a fraction of `tokenizers`' per-call cost (P114, P125)."""

    def __init__(self, tok: Tokenizer, max_seq_length: int):
        self.tok, self.max_pieces = tok, max_seq_length - 2
        spec = json.loads(tok.to_str())
        model, norm = spec["model"], spec.get("normalizer") or {}
        self.splits = (model.get("type") == "WordPiece" and norm.get("type") == "BertNormalizer"
                       and norm.get("lowercase") is True and norm.get("clean_text") is True
                       and (spec.get("pre_tokenizer") or {}).get("type") == "BertPreTokenizer"
                       and token_ids(tok, [""])[0].tolist() == [tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")])
        if self.splits:
            self.vocab = tok.get_vocab()
            self.unk, self.prefix = self.vocab[model["unk_token"]], model["continuing_subword_prefix"]
            self.longest = model["max_input_chars_per_word"]
            self.cls, self.sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
            self.added = [a["content"].lower() for a in spec.get("added_tokens") or []]   # matched whole, first
        self.runs: dict[str, list[int]] = {}

    def __call__(self, texts: list[str]) -> list[np.ndarray]:
        if not self.splits or not all(t.isascii() and t.isprintable() for t in texts):   # " " to "~" only
            return token_ids(self.tok, texts)
        lowered = [t.lower() for t in texts]
        joined = "\n".join(lowered)    # a match across two texts only sends them to `tokenizers`, never wrong
        if any(a in joined for a in self.added):     # "[MASK]" in a text: one token
            return token_ids(self.tok, texts)
        return [self._ids(t) for t in lowered]

    def _ids(self, text: str) -> np.ndarray:
        """[CLS], the pieces of a lower-cased text's words (as many as fit), [SEP]; a run between spaces at a time,
        its pieces cached (a run's words never cross a space, so its pieces are its words' pieces in order)."""
        out = [self.cls]
        for run in text.split():
            pieces = self.runs.get(run)
            if pieces is None:
                pieces = self._run(run)
            out += pieces
            if len(out) > self.max_pieces:
                break
        out = out[:self.max_pieces + 1]
        out.append(self.sep)
        return np.asarray(out, dtype=np.int32)

    def _run(self, run: str) -> list[int]:
        """The pieces of a run's words ("papers?": "papers", "?"), cached."""
        pieces = [p for word in _WORDS.findall(run) for p in self._pieces(word)]
        if len(self.runs) >= _CACHED_RUNS:
            self.runs.clear()
        self.runs[run] = pieces
        return pieces

    def _pieces(self, word: str) -> list[int]:
        """WordPiece of one word: the longest vocabulary entry at each position ("##" after the first), the
        unknown token for the whole word where one position has none or the word is too long."""
        pieces, start = [], 0
        while start < len(word) <= self.longest:
            for end in range(len(word), start, -1):
                piece = word[start:end] if start == 0 else self.prefix + word[start:end]
                if piece in self.vocab:
                    pieces.append(self.vocab[piece])
                    start = end
                    break
            else:
                break
        return pieces if start == len(word) else [self.unk]
