"""The model's own tokenizer (tokenizer.json), as both services load it.

The compiler tokenizes tool names with it and the decoder tokenizes prompts with it; the hash stored
in every trie lets the decoder refuse a trie that was compiled for another tokenizer.
"""
from __future__ import annotations

import hashlib
from functools import cached_property
from pathlib import Path

from tokenizers import Tokenizer

from shared.prompt import chat_format


class TokenizerError(ValueError):
    """The tokenizer lacks something the trie needs (a single-token separator, a stop token)."""


class ModelTokenizer:
    def __init__(self, model_dir: str | Path):
        self.model_dir = Path(model_dir)
        path = self.model_dir / "tokenizer.json"
        if not path.is_file():
            raise TokenizerError(f"{path} not found (run `make model`, or pass --model DIR)")
        self.tokenizer = Tokenizer.from_file(str(path))
        # user text's tokenizer built now, not by the first request (a copy of the whole vocabulary)
        self.plain = Tokenizer.from_str(self.tokenizer.to_str())
        self.plain.encode_special_tokens = True

    @cached_property
    def hash(self) -> str:
        """sha256 of the tokenizer's canonical JSON: equal for equal tokenizers, whatever the file layout."""
        return hashlib.sha256(self.tokenizer.to_str().encode("utf-8")).hexdigest()

    @cached_property
    def special_ids(self) -> frozenset[int]:
        return frozenset(i for i, t in self.tokenizer.get_added_tokens_decoder().items() if t.special)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """encode of each text, the tokenizer's threads sharing the work."""
        return [e.ids for e in self.tokenizer.encode_batch(texts, add_special_tokens=False)]

    def encode_plain(self, text: str) -> list[int]:
        """User text: a special token's spelling stays text ("<|im_end|>" typed by a user cannot end a turn)."""
        return self.plain.encode(text, add_special_tokens=False).ids

    def decode(self, ids) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)

    def single_token(self, text: str, what: str) -> int:
        """The one token id that spells text; a TokenizerError if text is not exactly one token."""
        ids = self.encode(text)
        if len(ids) != 1:
            raise TokenizerError(f"the tokenizer has no single token for the {what} {text!r} (got {ids})")
        return ids[0]

    def chat_format(self) -> tuple[str, str, str]:
        return chat_format(self.model_dir)
