"""The catalog trie: CSR arrays over the model's token ids, as both services see it.

Node 0 is the root. Node n's edges are `edge_*[node_edge_start[n]:node_edge_start[n + 1]]`, sorted
by token id. An edge's child is a node id, or a sentinel for the two control edges: SEP ("another
pointer follows", back to the root) and STOP (the answer ends). Pointers (tool names) are numbered
in depth-first order, so the pointers below any edge form one range `[edge_lo, edge_hi)`; a control
edge carries the range of the one pointer that ends at its node. A node may be both the end of one
pointer and the inside of longer ones.
"""
from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field

import numpy as np
from safetensors.numpy import load as st_load, save as st_save

SEP = -1   # edge_child sentinel: the separator, another pointer follows
STOP = -2  # edge_child sentinel: the stop token, the answer is complete
FORMAT = "tooltrie-csr-1"
CONSTANT_MEMORY_BUDGET = 64 * 1024
ARRAYS = ("node_edge_start", "edge_token", "edge_child", "edge_lo", "edge_hi")
PACKED_HEADER_WORDS = 2   # the packed trie's header (nodes + 1, edges) before its arrays' int32 words


def fits_constant_memory(packed_bytes: int) -> bool:
    """The placement rule, one for the compiler's stat and the device (engine/device_trie.py): a trie whose
    packed form is at most 64 KiB may be bound to constant memory; larger ones are read from the global arena."""
    return packed_bytes <= CONSTANT_MEMORY_BUDGET


def control_edge_legal(child, n_emitted, k):
    """The exactly-k rule for an edge into `child` taken after n_emitted of k pointers: the separator only
    while another pointer is owed after this one, the stop only after the k-th, any other edge always (whether
    its pointers are still available is the sampler's other test). One definition, compiled for the host
    sampler (numba), the device's k_mask (numba.cuda) and read by the engine's forced tails."""
    return (child != SEP or n_emitted + 1 < k) and (child != STOP or n_emitted + 1 == k)


class TrieCorrupt(ValueError):
    """The arrays or metadata of a blob do not form a well-formed trie (Trie.check)."""


class TrieWalkError(ValueError):
    """A token sequence is not a path through the trie (or breaks the exactly-k rule)."""


@dataclass
class Trie:
    """A catalog version as both services hold it: the names' token trie, the rest of the version (descriptions,
    examples, schemas, prompt, hashes; the BM25 index's arrays) riding in `meta` and `extra`."""

    node_edge_start: np.ndarray  # int32 [nodes + 1]
    edge_token: np.ndarray       # int32 [edges]
    edge_child: np.ndarray       # int32 [edges]: node id, SEP or STOP
    edge_lo: np.ndarray          # int32 [edges]: first pointer id below the edge
    edge_hi: np.ndarray          # int32 [edges]: one past the last
    pointer_names: list[str]     # by pointer id
    sep_id: int
    stop_id: int
    meta: dict = field(default_factory=dict)  # catalog name, version, hashes, prompt, descriptions, stats
    extra: dict = field(default_factory=dict)  # more arrays of the version (the BM25 index), stored as they are

    @property
    def num_nodes(self) -> int:
        return len(self.node_edge_start) - 1

    @property
    def num_edges(self) -> int:
        return len(self.edge_token)

    @property
    def nbytes(self) -> int:
        return sum(getattr(self, a).nbytes for a in ARRAYS)

    @property
    def packed_nbytes(self) -> int:
        """The bytes of the trie packed for the device: its arrays as int32 words after the header."""
        return 4 * (PACKED_HEADER_WORDS + sum(getattr(self, a).size for a in ARRAYS))

    @property
    def fits_constant_memory(self) -> bool:
        return fits_constant_memory(self.packed_nbytes)

    def max_fanout(self) -> int:
        return int(np.diff(self.node_edge_start).max())

    def find_edge(self, node: int, token: int) -> int:
        """Index of node's edge labelled token, or -1 (binary search: edges are sorted by token)."""
        lo, hi = int(self.node_edge_start[node]), int(self.node_edge_start[node + 1])
        i = lo + int(np.searchsorted(self.edge_token[lo:hi], token))
        return i if i < hi and self.edge_token[i] == token else -1

    def walk(self, tokens, k: int | None = None) -> list[int]:
        """Pointer ids spelled by an answer's tokens; raises TrieWalkError on any token off the trie.

        With k, also checks the answer's language: exactly k distinct pointers, then the stop token.
        """
        node, pointers = 0, []
        for pos, tok in enumerate(tokens):
            if node == STOP:
                raise TrieWalkError(f"token {tok} at position {pos} follows the stop token")
            e = self.find_edge(node, int(tok))
            if e < 0:
                raise TrieWalkError(f"token {tok} at position {pos} is not an edge of node {node}")
            child = int(self.edge_child[e])
            if child in (SEP, STOP):
                pointers.append(int(self.edge_lo[e]))
                node = 0 if child == SEP else STOP
            else:
                node = child
        if k is not None:
            if node != STOP:
                raise TrieWalkError("the answer does not end with the stop token")
            if len(pointers) != k or len(set(pointers)) != k:
                raise TrieWalkError(f"expected {k} distinct pointers, got {pointers}")
        return pointers

    def check(self, vocab_size: int) -> None:
        """Refuse (TrieCorrupt) arrays that are not a well-formed trie over a vocabulary of vocab_size:
        CSR offsets monotonic from 0 to the edge count, token ids below the vocabulary and sorted within a
        node, every child a later node or one of the two sentinels (so every node is reached once, from the
        root, and no walk loops), control edges labelled with the separator and stop ids, pointer ranges
        nested inside their parent's and within the pointer count, each pointer ending exactly once, the
        recorded depth the real one, and the metadata's per-tool lists as long as the pointer list.
        A decoder runs this on every blob it loads: a stored blob is not trusted."""
        def bad(why: str):
            raise TrieCorrupt(f"catalog {self.meta.get('name')!r} v{self.meta.get('version')}: {why}")

        for a in ARRAYS:
            arr = getattr(self, a)
            if not isinstance(arr, np.ndarray) or arr.ndim != 1 or arr.dtype != np.int32:
                bad(f"{a} is not a 1-D int32 array")
        start, tok, child, lo, hi = (getattr(self, a).astype(np.int64) for a in ARRAYS)
        n_nodes, n_edges = len(start) - 1, len(tok)
        n_ptr = len(self.pointer_names) if isinstance(self.pointer_names, list) else -1
        if n_nodes < 1 or start[0] != 0 or start[-1] != n_edges or np.any(np.diff(start) < 0):
            bad("node_edge_start is not monotonic from 0 to the edge count")
        if not (len(child) == len(lo) == len(hi) == n_edges):
            bad("the edge arrays differ in length")
        if n_ptr < 1 or not all(isinstance(x, str) for x in self.pointer_names):
            bad("pointer_names is not a non-empty list of strings")
        if not (0 <= self.sep_id < vocab_size and 0 <= self.stop_id < vocab_size) or self.sep_id == self.stop_id:
            bad(f"separator {self.sep_id} or stop {self.stop_id} is not a distinct token id below {vocab_size}")
        if n_edges and (tok.min() < 0 or tok.max() >= vocab_size):
            bad(f"an edge's token id is outside the vocabulary of {vocab_size}")
        parent = np.repeat(np.arange(n_nodes), np.diff(start))
        same = parent[1:] == parent[:-1]
        if np.any(same & (tok[1:] <= tok[:-1])):
            bad("a node's edges are not sorted by token id (or repeat one)")
        control = child < 0
        if np.any((child < -2) | (child >= n_nodes)) or np.any(~control & (child <= parent)):
            bad("an edge's child is neither a later node nor a sentinel")
        if np.any((child == SEP) & (tok != self.sep_id)) or np.any((child == STOP) & (tok != self.stop_id)):
            bad("a control edge is not labelled with the separator or stop token")
        if np.any(~control & ((tok == self.sep_id) | (tok == self.stop_id))):
            bad("a node edge is labelled with the separator or stop token")
        if np.any(lo < 0) or np.any(hi > n_ptr) or np.any(lo >= hi) or np.any(control & (hi != lo + 1)):
            bad(f"a pointer range is empty or outside the {n_ptr} pointers")
        inner = child[~control]
        if len(inner) != n_nodes - 1 or len(np.unique(inner)) != n_nodes - 1:
            bad("a node is reached by no edge or by more than one")
        for kind in (SEP, STOP):
            ends = np.sort(lo[child == kind])
            if len(ends) != n_ptr or np.any(ends != np.arange(n_ptr)):
                bad("a pointer does not end exactly once")
        inner_e = np.flatnonzero(~control)
        node_lo, node_hi = np.zeros(n_nodes, np.int64), np.full(n_nodes, n_ptr, np.int64)
        node_lo[child[inner_e]], node_hi[child[inner_e]] = lo[inner_e], hi[inner_e]
        if np.any(lo < node_lo[parent]) or np.any(hi > node_hi[parent]):
            bad("an edge's pointer range is not inside its parent's")
        depth = np.zeros(n_nodes, np.int64)
        for _ in range(n_nodes):   # one pass per level: children are later nodes, so this ends
            new = depth.copy()
            new[child[inner_e]] = depth[parent[inner_e]] + 1
            if np.array_equal(new, depth):
                break
            depth = new
        ctl = np.flatnonzero(control)
        if np.any(depth[parent[ctl]] < 1):
            bad("a pointer is spelled by no token")
        recorded = self.meta.get("max_pointer_tokens")
        if not isinstance(recorded, int) or recorded != int(depth[parent[ctl]].max()):
            bad(f"max_pointer_tokens {recorded!r} is not the trie's depth {int(depth[parent[ctl]].max())}")
        descriptions = self.meta.get("descriptions", [None] * n_ptr)
        if not isinstance(descriptions, list) or len(descriptions) != n_ptr:
            bad("metadata 'descriptions' does not hold one entry per tool")
        examples = self.meta.get("examples", [[]] * n_ptr)
        if (not isinstance(examples, list) or len(examples) != n_ptr
                or not all(isinstance(e, list) and all(isinstance(x, str) for x in e) for e in examples)):
            bad("metadata 'examples' does not hold one list of strings per tool")
        schemas = self.meta.get("input_schemas", [""] * n_ptr)
        if not isinstance(schemas, list) or len(schemas) != n_ptr or not all(isinstance(s, str) for s in schemas):
            bad("metadata 'input_schemas' does not hold one string per tool")

    def definition(self, pointer_id: int) -> dict[str, str]:
        """A tool's description and input schema (JSON text, "" when it has none), as Discover returns them on
        request so that a caller can call what it found; versions compiled before schemas were kept have none."""
        schemas = self.meta.get("input_schemas")
        return {"description": self.meta["descriptions"][pointer_id] or "",
                "input_schema": schemas[pointer_id] if schemas else ""}

    def spelled(self) -> list[list[int]]:
        """Each pointer's tokens, by pointer id, from one walk over the trie (a checked trie)."""
        out: list[list[int]] = [[] for _ in self.pointer_names]
        start, tok, child, lo = self.node_edge_start, self.edge_token, self.edge_child, self.edge_lo
        stack = [(0, [])]
        while stack:
            node, path = stack.pop()
            for e in range(int(start[node]), int(start[node + 1])):
                c = int(child[e])
                if c == SEP:
                    out[int(lo[e])] = path
                elif c >= 0:
                    stack.append((c, path + [int(tok[e])]))
        return out

    def stats(self) -> dict:
        depth = self.meta.get("max_pointer_tokens", 0)
        return {"tools": len(self.pointer_names), "nodes": self.num_nodes, "edges": self.num_edges,
                "max_fanout": self.max_fanout(), "max_pointer_tokens": depth, "bytes": self.nbytes,
                "fits_constant_memory": self.fits_constant_memory}

    # --- serialization: one safetensors blob, metadata in its header -------------------------

    def to_blob(self) -> bytes:
        meta = {"format": FORMAT, "pointer_names": json.dumps(self.pointer_names, ensure_ascii=False),
                "sep_id": str(self.sep_id), "stop_id": str(self.stop_id),
                "meta": json.dumps(self.meta, ensure_ascii=False, sort_keys=True)}
        arrays = {a: np.ascontiguousarray(getattr(self, a), dtype=np.int32) for a in ARRAYS}
        return st_save({**arrays, **{k: np.ascontiguousarray(v) for k, v in self.extra.items()}}, meta)

    @classmethod
    def from_blob(cls, blob: bytes) -> "Trie":
        meta = read_blob_metadata(blob)
        if meta.get("format") != FORMAT:
            raise ValueError(f"not a tooltrie trie blob (format {meta.get('format')!r}, expected {FORMAT!r})")
        arrays = st_load(blob)
        return cls(**{a: arrays[a] for a in ARRAYS}, pointer_names=json.loads(meta["pointer_names"]),
                   sep_id=int(meta["sep_id"]), stop_id=int(meta["stop_id"]), meta=json.loads(meta["meta"]),
                   extra={k: v for k, v in arrays.items() if k not in ARRAYS})


def read_blob_metadata(blob: bytes) -> dict:
    """The safetensors header's __metadata__, without touching the arrays."""
    (n,) = struct.unpack("<Q", blob[:8])
    return json.loads(blob[8:8 + n]).get("__metadata__", {})


def build_trie(bodies: list[list[int]], names: list[str], sep_id: int, stop_id: int) -> Trie:
    """Build the CSR trie from each pointer's token ids.

    Pointer ids are the ranks of the token sequences in lexicographic order, which is the trie's
    depth-first order (a prefix sorts before its extensions, siblings by token id), so every
    subtree's pointers are one contiguous range.
    """
    order = sorted(range(len(bodies)), key=lambda i: bodies[i])
    parents, tokens, children, los, his = [], [], [], [], []
    path: list[int] = [0]   # path[d] = node at depth d along the previous pointer
    prev: list[int] = []
    num_nodes = 1
    incoming: list[int] = [-1]  # incoming[n] = index (in the lists above) of the edge into node n
    for pid, i in enumerate(order):
        body = bodies[i]
        common = 0
        while common < min(len(prev), len(body)) and prev[common] == body[common]:
            common += 1
        del path[common + 1:]
        for d in range(common, len(body)):  # new nodes for the part not shared with the previous pointer
            parents.append(path[d])
            tokens.append(body[d])
            children.append(num_nodes)
            los.append(pid)
            his.append(pid + 1)
            incoming.append(len(parents) - 1)
            path.append(num_nodes)
            num_nodes += 1
        for d in range(common):  # shared edges: extend their range to this pointer
            his[incoming[path[d + 1]]] = pid + 1
        end = path[len(body)]
        for tok, child in ((sep_id, SEP), (stop_id, STOP)):
            parents.append(end)
            tokens.append(tok)
            children.append(child)
            los.append(pid)
            his.append(pid + 1)
        prev = body
    parents = np.asarray(parents, np.int64)
    tokens_a = np.asarray(tokens, np.int64)
    perm = np.lexsort((tokens_a, parents))
    counts = np.bincount(parents, minlength=num_nodes)
    start = np.zeros(num_nodes + 1, np.int32)
    np.cumsum(counts, out=start[1:])
    return Trie(node_edge_start=start, edge_token=tokens_a[perm].astype(np.int32),
                edge_child=np.asarray(children, np.int32)[perm], edge_lo=np.asarray(los, np.int32)[perm],
                edge_hi=np.asarray(his, np.int32)[perm], pointer_names=[names[i] for i in order],
                sep_id=sep_id, stop_id=stop_id,
                meta={"max_pointer_tokens": max(len(b) for b in bodies)})
