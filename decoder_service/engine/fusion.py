"""The answer's fusion with retrieval: how much a retrieval rank is worth, per catalog version.

A selector tuned on a catalog's tools earns a small weight (it reorders near-ties); on a catalog it never saw
it is not to be trusted over retrieval, so such a catalog gets the floor's weight (retrieval's order). Which
tools the selector was tuned on is the model folder's `tuned_tools.json`, written by `tune` (docs/quality.md).
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

TUNED_TOOLS = "tuned_tools.json"
RETRIEVAL_ORDER = 1000.0   # a weight at or above which a rank outweighs any gap between the generator's logits: the
                           # answer is retrieval's order whatever the generator writes (docs/quality.md)
KNOWN_SHARE = 0.5   # a catalog is one the selector was tuned on when at least this share of its tools were


def tuned_tools(model_dir: Path) -> frozenset[str]:
    """The tool names of the registries the model was tuned on (none for a model `tune` did not write)."""
    path = Path(model_dir) / TUNED_TOOLS
    return frozenset(json.loads(path.read_text())["tools"]) if path.is_file() else frozenset()


def catalog_weight(names: list[str], tuned: frozenset[str], weight: float, unseen: float | None) -> float:
    """The fusion weight for a version with these tool names: `weight` where at least KNOWN_SHARE of them are
    tuned tools, else `unseen` (None: `weight` everywhere)."""
    if unseen is None or not names:
        return weight
    known = sum(n in tuned for n in names) / len(names)
    return weight if known >= KNOWN_SHARE else unseen


def rank_prior(order: np.ndarray, weight: float) -> np.ndarray | None:
    """float32 prior of each allowed pointer, given its retrieval rank: -weight * rank (None for weight 0:
    the generator alone)."""
    return np.float32(weight) * -order.astype(np.float32) if weight else None
