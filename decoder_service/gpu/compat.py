"""Work-arounds for the package versions the GPU machines carry, applied before any kernel compiles.

numba-cuda 0.30.4 registers an overload for ``np.row_stack`` while building its typing context; numpy
2.5 removed that alias, so on such an image *every* kernel compile fails with
``AttributeError: module 'numpy' has no attribute 'row_stack'`` (docs/gpu.md#numpy-25-against-numba-cuda-0304).
``np.vstack`` is what the alias always meant. The fix is idempotent and does nothing where numpy still has the
name.
"""
from __future__ import annotations

import numpy as np

_applied = False


def apply() -> None:
    global _applied
    if _applied:
        return
    if not hasattr(np, "row_stack"):
        np.row_stack = np.vstack  # type: ignore[attr-defined]
    _applied = True


apply()
