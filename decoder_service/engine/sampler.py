"""Trie-masked sampling: which edges a sequence may take, the winner among them, and the advance.

An edge is legal for a sequence when its pointer range [lo, hi) still holds a pointer the request
allows and the sequence has not emitted (O(k) per edge, for any catalog size; the allowlist is a
sorted array of pointer ids, so its count inside a range is two binary searches). The separator is
legal only while another pointer is still owed, the stop edge only when none is: exactly k pointers
come out because the language admits nothing else. The winner is the highest logit, the lower token
id on a tie: a fixed rule, so the same logits give the same token in any batch.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from shared.trie import SEP, STOP


class EngineFault(RuntimeError):
    """The constrained decoder reached a state that must never happen (an empty mask, a walk mismatch).

    The request fails loudly with this message; a plausible wrong answer is never returned.
    """


@njit(cache=True)
def _available(lo, hi, emitted, n_emitted, allow, allow_all):
    """Does [lo, hi) still hold a pointer that is allowed and not yet emitted?"""
    if allow_all:
        count = hi - lo
    else:
        count = np.searchsorted(allow, hi) - np.searchsorted(allow, lo)
    for i in range(n_emitted):
        if lo <= emitted[i] < hi:
            count -= 1  # emitted pointers were allowed, so each one was counted above
    return count > 0


@njit(cache=True)
def legal_edges(node, edge_start, edge_child, edge_lo, edge_hi, emitted, n_emitted, k, allow, allow_all, out):
    """Write the legal edge indices of node into out (in token order); return how many."""
    n = 0
    for e in range(edge_start[node], edge_start[node + 1]):
        child = edge_child[e]
        if child == SEP and n_emitted + 1 >= k:
            continue
        if child == STOP and n_emitted + 1 != k:
            continue
        if _available(edge_lo[e], edge_hi[e], emitted, n_emitted, allow, allow_all):
            out[n] = e
            n += 1
    return n


def select(logits: np.ndarray, tokens: np.ndarray) -> tuple[int, float]:
    """(index of the winner, its log-probability under the softmax over these candidates).

    Highest logit wins; among equal logits the lower token id. The log-softmax is computed in float64
    in candidate order, so it depends only on this row's logits.
    """
    best = logits.max()
    tied = np.flatnonzero(logits == best)
    win = int(tied[np.argmin(tokens[tied])]) if len(tied) > 1 else int(tied[0])
    x = logits.astype(np.float64)
    logprob = float(x[win] - (x.max() + np.log(np.exp(x - x.max()).sum())))
    return win, logprob


__all__ = ["EngineFault", "legal_edges", "select", "SEP", "STOP"]
