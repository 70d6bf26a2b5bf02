"""Texts to token ids as sentence-transformers makes them: WordPiece from tokenizer.json, [CLS] ... [SEP],
cut to max_seq_length tokens (special tokens included), never padded (the backends pack texts end to end).

all-MiniLM-L6-v2's tokenizer.json itself says "truncate to 128, pad to 128": sentence-transformers
overrides both, so they are overridden here too.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from decoder_service.model.config import ModelError


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
