"""Texts packed end to end: the backends run a chunk of whole texts as one block of token rows, no padding.

A chunk's composition never changes a text's vector (each backend computes a row from its own text
only), so chunks are simply consecutive texts up to a token budget.
"""
from __future__ import annotations

import numpy as np


def chunks(seqs: list[np.ndarray], budget: int) -> list[tuple[int, int]]:
    """Consecutive runs [a, b) of texts with at most `budget` tokens together (one text at least)."""
    out, a, used = [], 0, 0
    for i, s in enumerate(seqs):
        if i > a and used + len(s) > budget:
            out.append((a, i))
            a, used = i, 0
        used += len(s)
    if a < len(seqs):
        out.append((a, len(seqs)))
    return out
