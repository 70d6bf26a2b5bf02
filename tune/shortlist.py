"""Training shortlists: each query's N retrieved tools (BM25 fused with the dense encoder), cached by query."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

from shared.bm25 import Bm25Index, tool_terms

# The fusion the committed adapters were trained on: weight * cosine + (1 - weight) * BM25 / best BM25. Not
# decoder_service.retrieval's (standardised scores, its own DENSE_WEIGHT); changing it changes `make tune`.
DENSE_WEIGHT = 0.5
MAX_TOKENS = 256     # all-MiniLM-L6-v2's sentence-transformers max_seq_length


class DenseEncoder:
    """all-MiniLM-L6-v2 (a BERT folder) through transformers: mean-pooled, L2-normalised float32 vectors."""

    def __init__(self, model_dir: Path, device: str = "cpu"):
        import torch
        import transformers
        from tokenizers import Tokenizer
        self.torch, self.device = torch, device
        self.model = transformers.BertModel.from_pretrained(str(model_dir)).to(device).eval()
        self.tok = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
        self.tok.enable_truncation(MAX_TOKENS)
        self.tok.enable_padding(pad_id=0)

    def encode(self, texts: list[str], batch: int = 128) -> np.ndarray:
        """float32 [n, dim] unit vectors; texts are batched by length, so little of a batch is padding."""
        torch, out = self.torch, []
        order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
        with torch.no_grad():
            for s in range(0, len(texts), batch):
                enc = self.tok.encode_batch([texts[i] for i in order[s:s + batch]])
                ids = torch.tensor([e.ids for e in enc], device=self.device)
                mask = torch.tensor([e.attention_mask for e in enc], device=self.device)
                hidden = self.model(input_ids=ids, attention_mask=mask).last_hidden_state
                m = mask[..., None].float()
                v = (hidden * m).sum(1) / m.sum(1).clamp(min=1e-9)
                out.append(torch.nn.functional.normalize(v, dim=-1).cpu().numpy())
        if not out:
            return np.zeros((0, 0), np.float32)
        vectors = np.empty((len(texts), out[0].shape[1]), np.float32)
        vectors[order] = np.concatenate(out)
        return vectors


class Retriever:
    """Shortlists for queries over catalogs: from the cache file when it has them, else computed (BM25 alone,
    or fused with the dense encoder) and added to the cache. Fused shortlists missing from the cache need
    the encoder."""

    def __init__(self, encoder: DenseEncoder | None = None, cache: Path | None = None, fused: bool = False):
        if encoder is not None:
            fused = True
        self.encoder, self.cache_path, self.mode = encoder, cache, "fused" if fused else "bm25"
        self.tool_vectors: dict[str, np.ndarray] = {}   # by catalog digest
        self.cache: dict[str, list[int]] = json.loads(cache.read_text()) if cache and cache.is_file() else {}

    def shortlists(self, catalog_digest: str, names: list[str], descriptions: list[str], queries: list[str],
                   n: int) -> list[list[int]]:
        """Each query's top-n tool indices, best first (ties: lower index first)."""
        keys = [self._key(n, catalog_digest, q) for q in queries]
        todo = sorted({q for q, k in zip(queries, keys) if k not in self.cache})
        if todo and self.mode == "fused" and self.encoder is None:
            raise ValueError(f"{len(todo)} fused shortlists are not in the cache and no encoder was given")
        if todo:
            tools = None
            if self.encoder is not None:
                if catalog_digest not in self.tool_vectors:
                    self.tool_vectors[catalog_digest] = self.encoder.encode(tool_texts(names, descriptions))
                tools = self.tool_vectors[catalog_digest]
            for q, ids in zip(todo, fused_top_n(names, descriptions, todo, n, self.encoder, tools)):
                self.cache[self._key(n, catalog_digest, q)] = ids
            if self.cache_path:
                self.cache_path.write_text(json.dumps(self.cache, separators=(",", ":")))
        return [self.cache[k] for k in keys]

    def _key(self, n: int, catalog_digest: str, query: str) -> str:
        """The cache key of one query's shortlist."""
        return hashlib.sha256(f"{self.mode}|{n}|{catalog_digest}|{query}".encode()).hexdigest()[:24]


def fused_top_n(names: list[str], descriptions: list[str], queries: list[str], n: int,
                encoder: DenseEncoder | None, tools: np.ndarray | None = None) -> list[list[int]]:
    """Top-n by DENSE_WEIGHT * cosine + (1 - DENSE_WEIGHT) * BM25 / best BM25 (BM25 alone without an encoder);
    `tools`: the tools' vectors when already encoded."""
    index = Bm25Index.build([tool_terms(a, d) for a, d in zip(names, descriptions)])
    if encoder is not None:
        if tools is None:
            tools = encoder.encode(tool_texts(names, descriptions))
        intents = encoder.encode(queries)
    n = min(n, len(names))
    out = []
    for i, q in enumerate(queries):
        lexical = index.scores(q, len(names)).astype(np.float64)
        best = lexical.max()
        lexical = lexical / best if best > 0 else lexical
        score = lexical if encoder is None else DENSE_WEIGHT * (tools @ intents[i]) + (1 - DENSE_WEIGHT) * lexical
        out.append([int(j) for j in np.lexsort((np.arange(len(names)), -score))[:n]])
    return out


def tool_texts(names: list[str], descriptions: list[str]) -> list[str]:
    """What the encoder reads of each tool (decoder_service.retrieval's): its name and its description."""
    return [f"{a}: {d}" if d else a for a, d in zip(names, descriptions)]


def with_gold(shortlist: list[int], gold: list[int]) -> list[int]:
    """The shortlist with every gold tool in it: a missing one replaces the lowest-ranked non-gold tool."""
    ids = list(shortlist)
    for g in (g for g in gold if g not in shortlist):
        for pos in range(len(ids) - 1, -1, -1):
            if ids[pos] not in gold:
                ids[pos] = g
                break
    return ids
