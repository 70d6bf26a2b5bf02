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

import hashlib
import math
import re
import time
from dataclasses import dataclass

import numpy as np
from safetensors.numpy import load as st_load, save as st_save

from shared.bm25 import Bm25Index
from shared.trie import Trie, read_blob_metadata

DENSE_WEIGHT = 0.6
SHORTLIST = 12    # docs/quality.md: chosen on the selection split
MAX_PARTS = 8    # the intent and at most 7 of its clauses
VOTE_WEIGHT = 1.0         # what the nearest requests' whole vote adds to a tool's fused score
NEIGHBOURS = 10           # the requests nearest the intent that vote
VOTE_TEMPERATURE = 0.05   # their shares: a softmax of their cosines at this temperature
# Texts a version's vectors are encoded by, per encoder backend: a load reports progress and can be abandoned between
# slices, and two loads alternate slices (Encoder's turns); on the CPU a slice is a few seconds.
VECTOR_SLICE = {"cpu": 64, "cuda": 2048}
VECTORS_RECIPE = 3   # tool_vectors' recipe: 1 the text alone; 2 with its requests' mean; 3 and the requests'
                     # own vectors
# where an intent splits into clauses; each alternative starts at a space or a comma, so the lookahead turns every
# other position away at once (half the split's time)
_CLAUSE = re.compile(r"(?=[\s,])(?:(?<=[.?!;])\s+|,? and (?:then |also )?|,? then |, also )")


@dataclass(frozen=True)
class Vectors:
    """A catalog version's dense side: every tool's unit vector, and the vector of every request that stands for
    a tool (tool_requests) with the tool it belongs to."""
    tools: np.ndarray      # float32 [tools, dim]
    requests: np.ndarray   # float32 [requests, dim]
    owner: np.ndarray      # int32 [requests]: the request's tool (pointer id)


@dataclass(frozen=True)
class Shortlist:
    ids: np.ndarray      # int32 pointer ids, best first
    scores: np.ndarray   # float32 fused retrieval scores, in the same order
    seconds: float       # time to retrieve
    intent_ids: list[int] | None = None   # the prompt's tokens of the intent, if taken while the device scored

    def head(self, n: int) -> "Shortlist":
        """The best n of this shortlist (a shorter prompt's, from the same retrieval)."""
        return Shortlist(self.ids[:n], self.scores[:n], self.seconds, self.intent_ids)


def tool_texts(trie: Trie) -> list[str]:
    """What the encoder reads of each tool, by pointer id: its name and its description."""
    return [f"{n}: {d}" if d else n for n, d in zip(trie.pointer_names, trie.meta["descriptions"])]


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


def vectors_digest(encoder) -> str:
    """What stored tool vectors must have been made with: the encoder, and this module's recipe (VECTORS_RECIPE),
    so that a new recipe never reuses vectors an older one stored."""
    return f"{encoder.digest}-r{VECTORS_RECIPE}"


def vectors_blob(vectors: Vectors, content_hash: str, encoder_digest: str) -> bytes:
    """A version's vectors as stored beside it: float16, with what they were computed from and their hash."""
    tools, requests = (np.ascontiguousarray(v, np.float16) for v in (vectors.tools, vectors.requests))
    return st_save({"vectors": tools, "requests": requests},
                   {"content_hash": content_hash, "encoder": encoder_digest, "sha256": _digest(tools, requests)})


def vectors_from_blob(blob: bytes, trie: Trie, encoder_digest: str, dim: int) -> Vectors:
    """Stored vectors, refused (ValueError) unless they are this version's, this encoder's and intact."""
    meta = read_blob_metadata(blob)
    arrays = st_load(blob)
    if meta.get("content_hash") != trie.meta["content_hash"] or meta.get("encoder") != encoder_digest:
        raise ValueError("stored tool vectors belong to another catalog version or encoder")
    if set(arrays) != {"vectors", "requests"} or _digest(arrays["vectors"], arrays["requests"]) != meta.get("sha256"):
        raise ValueError("stored tool vectors do not match their recorded hash")
    owner = request_owner(trie)
    for key, rows in (("vectors", len(trie.pointer_names)), ("requests", len(owner))):
        if arrays[key].shape != (rows, dim) or not np.all(np.isfinite(arrays[key])):
            raise ValueError(f"stored {key} have shape {arrays[key].shape}, expected {(rows, dim)}")
    return Vectors(arrays["vectors"].astype(np.float32), arrays["requests"].astype(np.float32), owner)


def _digest(*arrays: np.ndarray) -> str:
    h = hashlib.sha256()
    for a in arrays:
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


def request_owner(trie: Trie) -> np.ndarray:
    """int32 [requests]: the tool of each request that stands for a tool, by pointer id, without writing them: a
    tool's examples, or for a tool without any one written from its description (none without a description),
    so that every tool leans alike towards how requests are phrased and has a voice in the vote."""
    examples = trie.meta.get("examples") or [[]] * len(trie.pointer_names)
    counts = [len(e) if e else int(bool(d.strip())) for e, d in zip(examples, trie.meta["descriptions"])]
    return np.repeat(np.arange(len(counts), dtype=np.int32), counts)


def tool_requests(trie: Trie) -> tuple[list[str], np.ndarray]:
    """(texts, owner): request_owner's requests, tool by tool, and their owners."""
    owner = request_owner(trie)
    counts = np.bincount(owner, minlength=len(trie.pointer_names))
    examples = trie.meta.get("examples") or [[]] * len(counts)
    texts = [x for e, d, c in zip(examples, trie.meta["descriptions"], counts) for x in e or [written_request(d)] * c]
    return texts, owner


def written_request(description: str, template: str = "I need to {d}") -> str:
    """A request written from a tool's description with a template ("{d}": the description, its first letter
    lower-cased where it starts a sentence)."""
    d = " ".join(description.split()).rstrip(". ")
    if template != "{d}" and d[:1].isupper() and not d[1:2].isupper():
        d = d[0].lower() + d[1:]
    return template.format(d=d)


def tool_vectors(trie: Trie, encoder, progress=None) -> Vectors:
    """Each tool's unit vector, its text's plus the mean of its requests' (tool_requests), normalised; and the
    requests' own vectors. progress(done, total) is called once the texts are written and after each slice of
    VECTOR_SLICE texts (a text's vector is the same in any batch), and may raise to abandon the work."""
    n = len(trie.pointer_names)
    texts, owner = tool_requests(trie)
    texts = tool_texts(trie) + texts
    parts, size = [], VECTOR_SLICE.get(encoder.backend_name, VECTOR_SLICE["cuda"])
    if progress is not None:
        progress(0, len(texts))
    for at in range(0, len(texts), size):
        parts.append(encoder.encode(texts[at:at + size]))
        if progress is not None:
            progress(min(at + size, len(texts)), len(texts))
    encoded = np.concatenate(parts).astype(np.float64)
    sums = np.zeros((n, encoded.shape[1]))
    np.add.at(sums, owner, encoded[n:])
    tools = encoded[:n] + sums / np.maximum(np.bincount(owner, minlength=n), 1)[:, None]
    tools /= np.linalg.norm(tools, axis=1, keepdims=True)
    return Vectors(tools.astype(np.float32), encoded[n:].astype(np.float32), owner)


def computed_vectors(trie: Trie, encoder, progress=None) -> tuple[Vectors, bytes]:
    """(vectors, blob): the version's vectors computed now, returned through their stored form (float16) so
    that a version answers the same whichever replica computed them, and the blob to store (progress: see
    tool_vectors)."""
    digest = vectors_digest(encoder)
    blob = vectors_blob(tool_vectors(trie, encoder, progress), trie.meta["content_hash"], digest)
    return vectors_from_blob(blob, trie, digest, encoder.dim), blob


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
            from decoder_service.retrieval_cuda import MAX_N, DeviceScorer, holds
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
