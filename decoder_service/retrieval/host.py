"""The first stage of a request: a shortlist of a catalog version's tools, from BM25 and the dense encoder.

Each tool's score is a weighted sum of its dense score and its BM25 score, each standardised over the tools the
request allows (minus the mean, over the standard deviation), so that neither scale dominates. The dense score
is the best cosine between the tool's vector and the intent or one of its clauses (a request for several tools
names each in a clause); a tool's vector is its text's, pulled towards the mean of its requests' (its examples:
requests it answers, from the registry; or one written from its description). The requests nearest the intent
also vote for their tools: a request phrased like one the catalog's owner labelled goes where that one went.
Every choice here was measured on the training split (docs/quality.md). The shortlist is the N best, the lower
pointer id on a tie: the same intent gives the same shortlist, alone or in any batch.
"""
from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass

import numpy as np

from shared.bm25 import Bm25Index
from shared.trie import Trie

from .config import DENSE_WEIGHT, MAX_PARTS, NEIGHBOURS, VOTE_TEMPERATURE, VOTE_WEIGHT
from .vectors import Vectors

# where an intent splits into clauses; each alternative starts at a space or a comma, so the lookahead turns every
# other position away at once (half the split's time)
_CLAUSE = re.compile(r"(?=[\s,])(?:(?<=[.?!;])\s+|,? and (?:then |also )?|,? then |, also )")


@dataclass(frozen=True)
class Shortlist:
    ids: np.ndarray      # int32 pointer ids, best first
    scores: np.ndarray   # float32 fused retrieval scores, in the same order
    seconds: float       # time to retrieve
    intent_ids: list[int] | None = None   # the prompt's tokens of the intent, if taken while the device scored

    def head(self, n: int) -> "Shortlist":
        """The best n of this shortlist (a shorter prompt's, from the same retrieval)."""
        return Shortlist(self.ids[:n], self.scores[:n], self.seconds, self.intent_ids)


def intent_parts(intent: str) -> list[str]:
    """The intent, then its clauses of three words or more (split at sentence ends, "and", "then") when it has
    two or more: what the encoder reads of a request."""
    clauses = [c.strip() for c in _CLAUSE.split(intent) if len(c.split()) >= 3]
    return [intent] + (clauses[:MAX_PARTS - 1] if len(clauses) > 1 else [])


def bm25_index(trie: Trie) -> Bm25Index:
    """The version's BM25 index from its blob, checked against its tool count."""
    index = Bm25Index(trie.meta["bm25_terms"], *(trie.extra[f"bm25_{a}"] for a in Bm25Index.ARRAYS))
    index.check(len(trie.pointer_names))
    return index


class Retriever:
    """One catalog version's first stage: its BM25 index, and its vectors with the encoder for intents
    (without an encoder, BM25 alone)."""

    def __init__(self, index: Bm25Index, size: int, vectors: Vectors | None = None, encoder=None,
                 dense_weight: float = DENSE_WEIGHT, vote_weight: float = VOTE_WEIGHT):
        self.index, self.size, self.vectors, self.encoder = index, size, vectors, encoder
        self.dense_weight = dense_weight if encoder is not None else 0.0
        self.vote_weight = vote_weight if encoder is not None and len(vectors.requests) else 0.0
        self.device, self.device_max = None, 0
        if encoder is not None and encoder.backend_name == "cuda":
            from .cuda import MAX_N, DeviceScorer, holds
            voters = (vectors.requests, vectors.owner) if self.vote_weight else None
            if holds(size, len(voters[1]) if voters else 0):      # larger: scored on the host
                self.device, self.device_max = DeviceScorer(vectors.tools, voters, encoder.backend), MAX_N

    def scores(self, intent: str, allow: np.ndarray | None = None) -> np.ndarray:
        """float32 [tools]: every tool's fused score (-inf for a tool the allowlist leaves out)."""
        keep = np.ones(self.size, bool)
        if allow is not None:
            keep[:] = False
            keep[allow] = True
        fused = (1.0 - self.dense_weight) * standardised(self.index.scores(intent, self.size), keep)
        if self.encoder is not None:
            parts = self.encoder.encode(intent_parts(intent))
            cos = self.vectors.tools @ parts.T    # [tools, parts]
            fused += self.dense_weight * standardised(cos.max(axis=1), keep, by=cos[:, 0])
            if self.vote_weight:
                fused += self.vote_weight * self.votes(parts, keep)
        fused = fused.astype(np.float32)
        fused[~keep] = -np.inf
        return fused

    def votes(self, parts: np.ndarray, keep: np.ndarray) -> np.ndarray:
        """float64 [tools]: the NEIGHBOURS requests of kept tools nearest the intent (best cosine over its parts)
        share one vote, by a softmax of their cosines, each giving its share to its tool."""
        owner = self.vectors.owner
        mine = np.flatnonzero(keep[owner])
        out = np.zeros(self.size)
        if len(mine) == 0:
            return out
        requests = self.vectors.requests if len(mine) == len(owner) else self.vectors.requests[mine]
        cos = (requests @ parts.T).max(axis=1)
        near = top_n(cos, min(NEIGHBOURS, len(mine)))
        share = np.exp((cos[near].astype(np.float64) - cos[near[0]]) / VOTE_TEMPERATURE)
        np.add.at(out, owner[mine[near]], share / share.sum())
        return out

    def shortlist(self, intent: str, n: int, allow: np.ndarray | None = None, tokenize=None) -> Shortlist:
        """The n best tools for the intent among those allowed (all when allow is None), best first; on a
        GPU the whole catalog is scored on the device, behind the intent's encoder pass. tokenize(intent): the
        generator's tokens of it for the prompt, taken while the device scores (P120; elsewhere the prompt's
        builder takes them)."""
        started = time.perf_counter()
        n = min(n, self.size if allow is None else len(allow))
        intent_ids = None
        if self.device is not None and allow is None and n <= self.device_max:
            beside = (lambda: tokenize(intent)) if tokenize is not None else None
            ids, scores, intent_ids = self.device.retrieve(self.encoder.token_ids(intent_parts(intent)),
                                                           self.dense_weight, lambda: self.lexical(intent), n,
                                                           self.vote_weight, beside)
        else:
            fused = self.scores(intent, allow)
            ids = top_n(fused, n)
            scores = fused[ids]
        return Shortlist(ids, scores, time.perf_counter() - started, intent_ids)

    def lexical(self, intent: str) -> tuple[np.ndarray, np.ndarray, float, float]:
        """BM25's side of `scores`' fusion over every tool, for the device: (ids, values) of the tools it
        matched (the others score 0), and (c, shift) with c * bm25 - shift its standardised, weighted term."""
        ids, values = self.index.matched(intent, self.size)
        mean = float(values.sum(dtype=np.float64)) / self.size
        sd = math.sqrt(max(float((values.astype(np.float64) ** 2).sum()) / self.size - mean * mean, 0.0))
        c = (1.0 - self.dense_weight) / sd if sd > 0 else 0.0
        return ids, values, c, c * mean


def standardised(x: np.ndarray, keep: np.ndarray, by: np.ndarray | None = None) -> np.ndarray:
    """float64 (x - mean) / std, mean and std those of `by` (default x) over the kept entries (0 where they are
    all equal)."""
    x = x.astype(np.float64)
    by = x if by is None else by.astype(np.float64)
    mean, std = by[keep].mean(), by[keep].std()
    return (x - mean) / std if std > 0 else np.zeros_like(x)


def top_n(scores: np.ndarray, n: int) -> np.ndarray:
    """int32 ids of the n highest scores, best first, the lower id on a tie."""
    if n < len(scores):
        part = np.argpartition(-scores, n - 1)[:n]
        cut = scores[part].min()
        part = np.flatnonzero(scores >= cut)   # every tie at the cut, so the lower ids win below
    else:
        part = np.arange(len(scores))
    order = np.lexsort((part, -scores[part]))
    return part[order][:n].astype(np.int32)
