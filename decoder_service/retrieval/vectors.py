"""A catalog version's tool vectors: the texts the encoder reads, the vectors, their stored form, and their cache."""
from __future__ import annotations

import hashlib
import logging
import time
from dataclasses import dataclass

import numpy as np
import redis
from prometheus_client import Counter
from safetensors.numpy import load as st_load, save as st_save

from shared.store import BlobRejected, CatalogStore
from shared.trie import Trie, read_blob_metadata

log = logging.getLogger("tooltrie.catalogs")   # its lines are a catalog load's (bench slow-catalog reads them)
VECTORS = Counter("tooltrie_tool_vectors_total", "Catalog versions' tool vectors, by where they came from", ["source"])
# Texts a version's vectors are encoded by, per encoder backend: a load reports progress and can be abandoned between
# slices, and two loads alternate slices (Encoder's turns); on the CPU a slice is a few seconds.
VECTOR_SLICE = {"cpu": 64, "cuda": 2048}
VECTORS_RECIPE = 3   # tool_vectors' recipe: 1 the text alone; 2 with its requests' mean; 3 and the requests'
                     # own vectors


@dataclass(frozen=True)
class Vectors:
    """A catalog version's dense side: every tool's unit vector, and the vector of every request that stands for
    a tool (tool_requests) with the tool it belongs to."""
    tools: np.ndarray      # float32 [tools, dim]
    requests: np.ndarray   # float32 [requests, dim]
    owner: np.ndarray      # int32 [requests]: the request's tool (pointer id)


def tool_texts(trie: Trie) -> list[str]:
    """What the encoder reads of each tool, by pointer id: its name and its description."""
    return [f"{n}: {d}" if d else n for n, d in zip(trie.pointer_names, trie.meta["descriptions"])]


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


class ToolVectorCache:
    """A catalog version's vectors for one encoder, kept in the store beside the version: read back on a start or
    by another replica (signed with the store's key when it has one), computed once otherwise."""

    def __init__(self, store: CatalogStore, encoder, rejected=None):
        self.store, self.encoder = store, encoder
        self.rejected = rejected   # rejected(reason): a stored copy refused by the store (BlobRejected's reason)

    def stored(self, name: str, version: int, trie: Trie) -> Vectors | None:
        """The version's stored vectors, or None: none stored, Redis unreachable, or refused (logged)."""
        digest = vectors_digest(self.encoder)
        try:
            blob = self.store.vectors(name, version, digest)
            if blob is None:
                return None
            vectors = vectors_from_blob(blob, trie, digest, self.encoder.dim)
        except (redis.ConnectionError, redis.TimeoutError, ValueError) as e:
            if isinstance(e, BlobRejected) and self.rejected is not None:
                self.rejected(e.reason)
            log.warning("%s v%d: stored tool vectors not used (%s); computing them", name, version, e)
            return None
        VECTORS.labels("store").inc()
        return vectors

    def computed(self, name: str, version: int, trie: Trie, progress=None) -> Vectors:
        """The version's vectors computed now (progress: see tool_vectors), and stored for the next start or
        replica."""
        started = time.perf_counter()
        vectors, blob = computed_vectors(trie, self.encoder, progress)
        VECTORS.labels("computed").inc()
        log.info("%s v%d: %d tool vectors computed in %.2f s", name, version, len(trie.pointer_names),
                 time.perf_counter() - started)
        try:
            self.store.put_vectors(name, version, vectors_digest(self.encoder), blob)
        except (redis.ConnectionError, redis.TimeoutError) as e:
            log.warning("%s v%d: tool vectors not stored (%s)", name, version, e)
        return vectors
