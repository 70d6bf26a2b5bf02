"""The dense sentence encoder (all-MiniLM-L6-v2, BERT) on the project's own runtime: numba CPU or numba.cuda."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from decoder_service.gpu.device import resolve_backend

from .batcher import Batcher
from .config import EncoderConfig
from .tokenizer import WordPieces, load_tokenizer
from .turns import Turns
from .weights import digest, load_weights

# Calls of up to this many texts (a request's intent and its clauses) share one encoder call with those that arrive
# together (Batcher); larger ones (a version's tool vectors) run alone, so that no request waits for them to end.
BATCHED_TEXTS = 8


class Encoder:
    """Texts -> L2-normalised float32 vectors [n, dim], as sentence-transformers' pipeline computes them
    (WordPiece with [CLS]/[SEP] cut at max_seq_length tokens, BERT, mean over the tokens, L2 norm).

    A text's vector is bit-identical whatever else is encoded with it. `digest` names the weights and
    tokenizer (a key part for cached vectors), `name` is the model folder's ("all-MiniLM-L6-v2"),
    `backend_name` "cpu" or "cuda".
    """

    def __init__(self, model_dir: Path, cfg: EncoderConfig, backend, backend_name: str, name: str, digest: str):
        self.model_dir, self.cfg = model_dir, cfg
        self.backend, self.backend_name = backend, backend_name
        self.name, self.digest = name, digest
        self.tokenizer = load_tokenizer(model_dir, cfg.max_seq_length)
        self._ids = WordPieces(self.tokenizer, cfg.max_seq_length)
        self._batcher = Batcher(backend)
        self._turns = Turns()   # larger calls (versions' vectors, a slice each) one at a time, first come first served

    @property
    def dim(self) -> int:
        return self.cfg.hidden_size

    def token_ids(self, texts: list[str]) -> list[np.ndarray]:
        return self._ids(texts)

    def encode(self, texts: list[str]) -> np.ndarray:
        if isinstance(texts, str):
            raise TypeError("encode takes a list of texts, not one string")
        if not texts:
            return np.zeros((0, self.dim), np.float32)
        ids = self.token_ids(texts)
        if len(ids) <= BATCHED_TEXTS:
            return self._batcher(ids)
        with self._turns:   # two versions loading alternate slices instead of sharing the cores
            return self.backend.embed(ids)


def load_encoder(model_dir: str | Path, backend: str = "auto", **options) -> Encoder:
    """The encoder in `model_dir` (a sentence-transformers folder, see modelkit/encoder_fetch.py) on `backend`:
    "auto" (cuda where numba.cuda has a real GPU, else cpu), "cpu" or "cuda". `options` go to the backend:
    chunk_tokens (token rows a forward pass), on cuda also graphs (see cuda.py)."""
    model_dir = Path(model_dir)
    cfg = EncoderConfig.from_dir(model_dir)
    kind = resolve_backend(backend)
    weights = load_weights(model_dir, cfg)
    if kind == "cpu":
        from .cpu import CpuEncoder
        impl = CpuEncoder(cfg, weights, **options)
    else:
        from .cuda import CudaEncoder
        impl = CudaEncoder(cfg, weights, **options)
    return Encoder(model_dir, cfg, impl, kind, model_dir.resolve().name, digest(model_dir))
