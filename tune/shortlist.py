"""Training shortlists: the service's retriever over the catalog as published, a query's own fold left out."""
from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path

import numpy as np

from compiler_service.compiler import compile_catalog
from decoder_service.retrieval.host import Retriever, bm25_index
from decoder_service.retrieval.vectors import VECTORS_RECIPE, computed_vectors
from shared.catalog import parse_registry
from shared.dataset import Query, bucket, normalise, published
from shared.tokenizer import ModelTokenizer

FOLDS = 4   # a training query's shortlist comes from the catalog published without its fold's examples


def fold_of(query: str, folds: int = FOLDS) -> int:
    """A query's fold: a stable hash of its normalised text."""
    return bucket("fold:", normalise(query), folds)


class CachedEncoder:
    """The service's encoder, each distinct text encoded once: every fold publishes most examples again."""

    def __init__(self, encoder):
        self.encoder, self.rows = encoder, {}

    def __getattr__(self, name):
        return getattr(self.encoder, name)

    def encode(self, texts: list[str]) -> np.ndarray:
        todo = [t for t in dict.fromkeys(texts) if t not in self.rows]
        if todo:
            self.rows.update(zip(todo, self.encoder.encode(todo)))
        if not texts:
            return np.zeros((0, self.encoder.dim), np.float32)
        return np.stack([self.rows[t] for t in texts])


class Shortlister:
    """Each query's top-n tools from decoder_service.retrieval.host (BM25 fused with the dense encoder, or BM25
    alone without one) over the catalog published with the labelled queries as examples
    (shared.dataset.published), exactly as the service would shortlist it. A training query's catalog leaves
    out the examples of its fold, so that no shortlist is made with the query itself among the examples.
    Shortlists are cached by the published registry's digest and the query (a JSON file, read then extended)."""

    def __init__(self, tok: ModelTokenizer, encoder_dir: Path | None = None, cache: Path | None = None,
                 folds: int = FOLDS, backend: str = "auto"):
        self.tok, self.encoder_dir, self.backend, self.folds = tok, encoder_dir, backend, folds
        self.encoder = None
        self.kind = f"r{VECTORS_RECIPE}|{Path(encoder_dir).resolve().name}" if encoder_dir else "bm25"
        self.cache_path = cache
        self.cache: dict[str, list[str]] = json.loads(cache.read_text()) if cache and cache.is_file() else {}

    def shortlists(self, tools: list[dict], labelled: list[Query], new: frozenset[str], queries: list[str],
                   n: int, leave_own_fold: bool) -> list[list[str]]:
        """Each query's top-n tool names, best first; `labelled` are published as examples (none for the tools
        in `new`), less each query's fold when leave_own_fold."""
        fold = (lambda q: fold_of(q, self.folds)) if leave_own_fold else (lambda q: -1)
        out: dict[str, list[str]] = {}
        for f in sorted({fold(q) for q in queries}):
            leave_out = frozenset(q.text for q in labelled if fold_of(q.text, self.folds) == f)
            registry = published(tools, labelled, leave_out, new)
            digest = hashlib.sha256(f"{self.kind}|{n}|{registry}".encode()).hexdigest()[:16]
            mine = [q for q in dict.fromkeys(queries) if fold(q) == f]
            todo = [q for q in mine if self._key(digest, q) not in self.cache]
            if todo:
                self._compute(registry, digest, todo, n)
            out.update((q, self.cache[self._key(digest, q)]) for q in mine)
        return [out[q] for q in queries]

    def _compute(self, registry: str, digest: str, queries: list[str], n: int) -> None:
        """Shortlist the queries over the published registry and add them to the cache."""
        trie = compile_catalog(parse_registry(registry), self.tok)
        vectors = None
        if self.encoder_dir and self.encoder is None:
            from decoder_service.encoder import load_encoder
            self.encoder = CachedEncoder(load_encoder(self.encoder_dir, self.backend))
        if self.encoder is not None:
            vectors, _ = computed_vectors(trie, self.encoder)
        retriever = Retriever(bm25_index(trie), len(trie.pointer_names), vectors, self.encoder)
        names = trie.pointer_names
        for q in queries:
            self.cache[self._key(digest, q)] = [names[i] for i in retriever.shortlist(q, n).ids]
        if self.cache_path:
            self.cache_path.parent.mkdir(parents=True, exist_ok=True)
            self.cache_path.write_text(json.dumps(self.cache, separators=(",", ":")))

    @staticmethod
    def _key(digest: str, query: str) -> str:
        return hashlib.sha256(f"{digest}|{query}".encode()).hexdigest()[:24]


def with_gold(shortlist: list[int], gold: list[int], rng: random.Random | None = None) -> list[int]:
    """The shortlist with every gold tool in it: the lowest-ranked non-gold tool gives way to a missing one,
    which takes a random position (with rng; else the freed one) so that no rank is where inserted gold sits."""
    ids = list(shortlist)
    for g in (g for g in gold if g not in ids):
        pos = max((p for p, i in enumerate(ids) if i not in gold), default=None)
        if pos is None:
            break
        del ids[pos]
        ids.insert(rng.randrange(len(ids) + 1) if rng else pos, g)
    return ids
