"""Trie-masked sampling: which edges a sequence may take, the winner among them, and the advance.

An edge is legal for a sequence when its pointer range [lo, hi) still holds a pointer the request
allows and the sequence has not emitted (O(k) per edge, for any catalog size; the allowlist is a
sorted array of pointer ids, so its count inside a range is two binary searches). The separator is
legal only while another pointer is still owed, the stop edge only when none is: exactly k pointers
come out because the language admits nothing else. The winner is the highest logit, the lower token
id on a tie: a fixed rule, so the same logits give the same token in any batch.
"""
from __future__ import annotations

from typing import NamedTuple, Protocol, runtime_checkable

import numpy as np
from numba import njit

from shared.trie import SEP, STOP, control_edge_legal

_control_legal = njit(cache=True)(control_edge_legal)   # the exactly-k rule (shared/trie.py)


@njit(cache=True)
def _live(lo, hi, emitted, n_emitted, allow, allow_all):
    """How many pointers in [lo, hi) are allowed and not yet emitted."""
    if allow_all:
        count = hi - lo
    else:
        count = np.searchsorted(allow, hi) - np.searchsorted(allow, lo)
    for i in range(n_emitted):
        if lo <= emitted[i] < hi:
            count -= 1  # emitted pointers were allowed, so each one was counted above
    return count


@njit(cache=True)
def _available(lo, hi, emitted, n_emitted, allow, allow_all):
    """Does [lo, hi) still hold a pointer that is allowed and not yet emitted?"""
    return _live(lo, hi, emitted, n_emitted, allow, allow_all) > 0


@njit(cache=True)
def legal_edges(node, edge_start, edge_child, edge_lo, edge_hi, emitted, n_emitted, k, allow, allow_all, out):
    """Write the legal edge indices of node into out (in token order); return how many."""
    n = 0
    for e in range(edge_start[node], edge_start[node + 1]):
        if not _control_legal(edge_child[e], n_emitted, k):
            continue
        if _available(edge_lo[e], edge_hi[e], emitted, n_emitted, allow, allow_all):
            out[n] = e
            n += 1
    return n


@njit(cache=True)
def forced_edge(node, node_lo, node_hi, edge_start, edge_child, edge_lo, edge_hi, emitted, n_emitted, k, allow,
                allow_all):
    """The node's one legal edge where a single allowed, not yet emitted pointer is left below it (its next token,
    or its separator or stop), else -1: the sampler's only candidate, which wins with log-probability 0 whatever
    the logits."""
    if _live(node_lo[node], node_hi[node], emitted, n_emitted, allow, allow_all) != 1:
        return -1
    for e in range(edge_start[node], edge_start[node + 1]):
        if _control_legal(edge_child[e], n_emitted, k) and _available(edge_lo[e], edge_hi[e], emitted, n_emitted,
                                                                     allow, allow_all):
            return e
    return -1


@njit(cache=True)
def edge_prior(lo, hi, emitted, n_emitted, allow, prior):
    """The highest prior of the allowed, not yet emitted pointers in [lo, hi): what choosing the edge is
    worth to retrieval (-inf when none is left, which a legal edge never is)."""
    best = -np.inf
    for j in range(np.searchsorted(allow, lo), np.searchsorted(allow, hi)):
        taken = False
        for i in range(n_emitted):
            taken |= emitted[i] == allow[j]
        if not taken and prior[j] > best:
            best = prior[j]
    return np.float32(best)


@njit(cache=True)
def edge_priors(edges, edge_lo, edge_hi, emitted, n_emitted, allow, prior):
    """float32 [edges]: edge_prior of each of a row's candidate edges, in one call."""
    out = np.empty(len(edges), np.float32)
    for i in range(len(edges)):
        out[i] = edge_prior(edge_lo[edges[i]], edge_hi[edges[i]], emitted, n_emitted, allow, prior)
    return out


def compile_for(catalog) -> None:
    """Compile the helpers above for a catalog version's array types now, where it is loaded: numba compiles on a
    first call, which its first request would otherwise wait for (1.8 s on 2 cores from an empty cache, P111). The
    arguments' types are a request's: Python ints, int32 arrays, a bool, float32 priors."""
    t = catalog.trie
    emitted, allow, prior = np.full(1, -1, np.int32), np.zeros(1, np.int32), np.zeros(1, np.float32)
    forced_edge(0, *catalog.node_span, t.node_edge_start, t.edge_child, t.edge_lo, t.edge_hi, emitted, 0, 1, allow,
                False)
    edges = np.empty(int(t.node_edge_start[1] - t.node_edge_start[0]), np.int32)
    n = legal_edges(0, t.node_edge_start, t.edge_child, t.edge_lo, t.edge_hi, emitted, 0, 1, allow, False, edges)
    edge_priors(edges[:n], t.edge_lo, t.edge_hi, emitted, 0, allow, prior)


def select(logits: np.ndarray, tokens: np.ndarray, bias: np.ndarray | None = None) -> tuple[int, float]:
    """(index of the winner, its log-probability under the softmax over these candidates).

    Highest logit plus bias (float32: the retrieval prior of the edge, fusion) wins; among equal values
    the lower token id. The log-softmax is of the logits alone, computed in float64 in candidate order, so
    it depends only on this row's logits.
    """
    fused = logits if bias is None else logits.astype(np.float32) + bias
    best = fused.max()
    tied = np.flatnonzero(fused == best)
    win = int(tied[np.argmin(tokens[tied])]) if len(tied) > 1 else int(tied[0])
    x = logits.astype(np.float64)
    logprob = float(x[win] - (x.max() + np.log(np.exp(x - x.max()).sum())))
    return win, logprob


class Pick(NamedTuple):
    """A sampler's choice for one row: the trie edge, its token, and the token's constrained log-prob."""
    edge: int
    token: int
    logprob: float


def empty_mask_message(seq) -> str:
    return f"empty mask: no legal token at trie node {seq.node} after {seq.n_emitted} of {seq.k} pointers"


@runtime_checkable
class Sampler(Protocol):
    """What the engine asks of a sampler (HostSampler, and cuda_sampler.DeviceSampler on a GPU). A step's picks
    are a handle: `start` makes it for the rows that get a token, `finish` reads it (a Pick, or a message saying
    why there is none, per row). Where `next_tokens(handle)` is not None the picks are on the device: the engine
    may launch the same rows' next step before reading them, its forward pass fed those tokens and gated by
    `done_flags(handle)`, and `follow(handle)` enqueues that step's picks. `bind` places a version where the
    sampler reads it (at its switch), `forget` drops a released one."""

    def bind(self, catalog, constant: bool = True) -> None: ...
    def forget(self, catalog) -> None: ...
    def start(self, seqs): ...
    def finish(self, picks) -> list[Pick | str]: ...
    def next_tokens(self, picks): ...
    def done_flags(self, picks): ...
    def follow(self, picks): ...


class HostSampler:
    """Legal edges on the host, logits from the backend's sparse head (or its dense head + gather),
    the winner by `select`. Every backend runs it; the sparse head tiles over any number of candidates. Its
    picks are computed at `start`: never on the device, so the engine never steps ahead of them."""

    def __init__(self, backend, head: str = "sparse"):
        self.backend, self.head = backend, head

    def bind(self, catalog, constant: bool = True) -> None:
        """Nothing to place: the host sampler reads each catalog's own trie."""

    def forget(self, catalog) -> None:
        """Nothing to drop: the host sampler reads each catalog's own trie."""

    def start(self, seqs) -> list[Pick | str]:
        """The engine's entry (the device sampler's only enqueues): the picks, computed now."""
        return self.choose(seqs)

    @staticmethod
    def finish(picks: list[Pick | str]) -> list[Pick | str]:
        return picks

    @staticmethod
    def next_tokens(picks) -> None:
        """Host picks are not on the device: the engine cannot step ahead of them."""
        return None

    @staticmethod
    def done_flags(picks) -> None:
        """Host picks are not on the device: nothing gates a step on them."""
        return None

    @staticmethod
    def follow(picks):
        """Never asked: next_tokens is None, so no step is launched ahead of host picks."""
        raise RuntimeError("the host sampler's picks are read before the next step: there is nothing to follow")

    def choose(self, seqs) -> list[Pick | str]:
        """A Pick per sequence, or a message saying why there is none."""
        edges_of, counts = [], np.zeros(len(seqs), np.int32)
        for i, seq in enumerate(seqs):
            t = seq.catalog.trie
            buf = np.empty(int(t.node_edge_start[seq.node + 1] - t.node_edge_start[seq.node]), np.int32)
            n = legal_edges(seq.node, t.node_edge_start, t.edge_child, t.edge_lo, t.edge_hi, seq.emitted,
                            seq.n_emitted, seq.k, seq.allow, seq.allow_all, buf)
            edges_of.append(buf[:n])
            counts[i] = n
        cand = np.zeros((len(seqs), max(1, int(counts.max()))), np.int32)
        for i, seq in enumerate(seqs):
            tokens = seq.catalog.trie.edge_token[edges_of[i]]
            cand[i, :len(tokens)] = tokens
            cand[i, len(tokens):] = tokens[0] if len(tokens) else 0
        if self.head == "dense":
            logits = np.take_along_axis(self.backend.dense_logits(), cand, axis=1)
        else:
            logits = self.backend.sparse_logits(cand, counts)
        picks = []
        for i, seq in enumerate(seqs):
            if counts[i] == 0:
                picks.append(empty_mask_message(seq))
                continue
            t = seq.catalog.trie
            bias = None if seq.prior is None else edge_priors(edges_of[i], t.edge_lo, t.edge_hi, seq.emitted,
                                                              seq.n_emitted, seq.allow, seq.prior)
            win, logprob = select(logits[i, :counts[i]], cand[i, :counts[i]], bias)
            picks.append(Pick(int(edges_of[i][win]), int(cand[i, win]), logprob))
        return picks


__all__ = ["HostSampler", "Pick", "Sampler", "compile_for", "edge_prior", "edge_priors", "forced_edge", "legal_edges",
           "select", "SEP", "STOP"]
