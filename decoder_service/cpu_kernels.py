"""The CPU kernels the generator's and the encoder's CPU backends share: the deterministic matrix product.

Every output element of `matmul_t` is computed by the same compiled loop (a fixed 4x4 register tile, K reduced
in one fixed order), so a row's result never depends on which rows share its batch. This is why the matrix
products are not numpy BLAS: OpenBLAS takes a different code path by matrix size (gemv for one row, a "small
matrix" kernel below about 1e6 multiply-adds, the blocked kernel above), and the paths round differently.
Importing this module also sets numba's OpenMP spin (below), before any parallel region runs.
"""
from __future__ import annotations

import os

# numba's OpenMP threading layer (libgomp) lets idle workers spin for up to 300,000 iterations. When
# the cores are shared with other busy processes (the services of `make run`, tests, a CPU quota)
# every parallel region then waits on a descheduled spinner: on 2 cores with 2 busy neighbours a
# SmolLM2 decode step took 1.05-1.2 s with the default spin, 0.14 s with 10,000 (0.12 s on one thread).
# On an idle machine the short spin is as fast as the long one (44-47 ms vs 44-53 ms per token).
# It must be set before OpenMP starts; an explicit setting in the environment wins.
os.environ.setdefault("GOMP_SPINCOUNT", "10000")

import numpy as np
from numba import njit, prange

_ROW_BLOCK = 64  # rows of x per work item: with _COL_BLOCK weight rows, both stay in L2
_COL_BLOCK = 64


@njit(fastmath=True, inline="always")
def dot4x4(a, a0, a1, a2, a3, b, b0, b1, b2, b3):
    """The 16 dot products of rows a0..a3 of `a` with rows b0..b3 of `b`, as a flat tuple (a-major).

    The one reduction of the CPU backends: every matrix product and every attention score (the
    generator's paged_attention) goes through it, and each of the 16 sums runs the same instructions in
    the same order whatever the other rows are, so a result never depends on its neighbours in the tile.
    (Rows are passed as indices: slicing out row views would cost a reference count per view.)
    """
    s00 = s01 = s02 = s03 = s10 = s11 = s12 = s13 = np.float32(0)
    s20 = s21 = s22 = s23 = s30 = s31 = s32 = s33 = np.float32(0)
    for k in range(a.shape[1]):
        x0, x1, x2, x3 = a[a0, k], a[a1, k], a[a2, k], a[a3, k]
        y0, y1, y2, y3 = b[b0, k], b[b1, k], b[b2, k], b[b3, k]
        s00 += x0 * y0; s01 += x0 * y1; s02 += x0 * y2; s03 += x0 * y3  # noqa: E702 - the 4x4 tile as a grid
        s10 += x1 * y0; s11 += x1 * y1; s12 += x1 * y2; s13 += x1 * y3  # noqa: E702 - the 4x4 tile as a grid
        s20 += x2 * y0; s21 += x2 * y1; s22 += x2 * y2; s23 += x2 * y3  # noqa: E702 - the 4x4 tile as a grid
        s30 += x3 * y0; s31 += x3 * y1; s32 += x3 * y2; s33 += x3 * y3  # noqa: E702 - the 4x4 tile as a grid
    return (s00, s01, s02, s03, s10, s11, s12, s13, s20, s21, s22, s23, s30, s31, s32, s33)


@njit(parallel=True, fastmath=True, cache=True)
def matmul_t(x, w, out):
    """out[M, N] = x[M, K] @ w[N, K].T in float32: 4x4 tiles, in blocks that stay in L2.
    Tiles at the edges repeat the last row or column, so they run the same code as the others."""
    M, N = x.shape[0], w.shape[0]
    row_blocks = (M + _ROW_BLOCK - 1) // _ROW_BLOCK
    col_blocks = (N + _COL_BLOCK - 1) // _COL_BLOCK
    for b in prange(row_blocks * col_blocks):
        rb, cb = b % row_blocks, b // row_blocks
        for c0 in range(cb * _COL_BLOCK, min(cb * _COL_BLOCK + _COL_BLOCK, N), 4):
            c = (c0, min(c0 + 1, N - 1), min(c0 + 2, N - 1), min(c0 + 3, N - 1))
            for r0 in range(rb * _ROW_BLOCK, min(rb * _ROW_BLOCK + _ROW_BLOCK, M), 4):
                r = (r0, min(r0 + 1, M - 1), min(r0 + 2, M - 1), min(r0 + 3, M - 1))
                s = dot4x4(x, r[0], r[1], r[2], r[3], w, c[0], c[1], c[2], c[3])
                for i in range(4):
                    for j in range(4):
                        out[r[i], c[j]] = s[4 * i + j]
