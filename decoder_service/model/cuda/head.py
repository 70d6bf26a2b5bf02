"""The model's ends: the token embedding in, the sparse head (logits of candidate tokens only) out, and a target
token's log-probability over the dense head's logits; the dense head is a GEMV (matmul.k_gemv over the
vocabulary)."""
from __future__ import annotations

import math

import numpy as np

from decoder_service.gpu import compat  # noqa: F401  (numpy row_stack alias before numba-cuda compiles anything)

from numba import cuda
from numba import float32 as nb_f32

from decoder_service.gpu.intrinsics import WARP, block_max, block_sum, ld8, pdl_enter
from .matmul import dot2, prefetch_row, stage_row
SIGNATURES: dict = {}   # kernel -> its parameter types, given kernels.ArgTypes (None: not compiled)


@cuda.jit(cache=True)
def k_embed(tokens, E, Q, x, x_stride):
    """x[r, :8Q] = E[tokens[r], :8Q] (rows padded with zeros; widened to float32). Grid (R,)."""
    pdl_enter()
    r = cuda.blockIdx.x
    base = np.int64(tokens[r]) * (Q * 8)
    xb = np.int64(r) * x_stride
    for c in range(cuda.threadIdx.x, Q, cuda.blockDim.x):
        v0, v1, v2, v3, v4, v5, v6, v7 = ld8(E, base + c * 8)
        o = xb + c * 8
        x[o] = v0
        x[o + 1] = v1
        x[o + 2] = v2
        x[o + 3] = v3
        x[o + 4] = v4
        x[o + 5] = v5
        x[o + 6] = v6
        x[o + 7] = v7

SIGNATURES["k_embed"] = lambda t: (t.ai, t.W, t.i32, t.f32, t.i32)


@cuda.jit(cache=True)
def k_sparse(h, h_stride, W, Q, V, cand, ncand, cmax, out, pf, epl):
    """Logits of candidate tokens only: out[i, c] = W[cand[i, c]] . h[i] for c < ncand[i].

    The same staging and the same dot2 as the dense head, so a candidate's logit is bit-identical to
    the dense head's. Ids outside [0, V) give NaN (the caller fails loudly). Grid (tiles, N).
    """
    pdl_enter()
    xs = cuda.shared.array(0, nb_f32)
    red = cuda.shared.array(32, nb_f32)
    i = cuda.blockIdx.y
    n = ncand[i]
    tid = cuda.threadIdx.x
    T = cuda.blockDim.x
    nw = T // WARP
    if cuda.blockIdx.x * nw * 2 >= n:
        return
    lane = tid % WARP
    Kp = np.int64(Q) * 8
    ca = (cuda.blockIdx.x * nw + tid // WARP) * 2
    cb = ca + 1
    cbase = np.int64(i) * cmax
    ta = cand[cbase + min(ca, n - 1)]
    tb = ta
    if cb < n:
        tb = cand[cbase + cb]
    va = ta >= 0 and ta < V
    vb = tb >= 0 and tb < V
    sa = ta if va else 0
    sb = tb if vb else 0
    if pf != 0 and ca < n:
        prefetch_row(W, sa * Kp, Kp, lane, pf, epl)
        prefetch_row(W, sb * Kp, Kp, lane, pf, epl)
    stage_row(xs, 0, h, np.int64(i) * h_stride, red, np.float32(0.0), 0, Q * 8, Q, tid, T, red, nw)
    cuda.syncthreads()
    if ca >= n:
        return
    a, b = dot2(W, sa * Kp, sb * Kp, xs, Q, lane)
    if lane == 0:
        out[cbase + ca] = a if va else np.float32(math.nan)
        if cb < n:
            out[cbase + cb] = b if vb else np.float32(math.nan)

SIGNATURES["k_sparse"] = lambda t: (t.f32, t.i32, t.W, t.i32, t.i32, t.ai, t.ai, t.i32, t.f32, t.i32,
                                    t.i32)


@cuda.jit(cache=True)
def k_logprob(logits, V, targets, out):
    """out[r] = logits[r, targets[r]] - logsumexp(logits[r, :V]): the log-probability of a row's target token (the
    reader's query likelihood), with only a float a row leaving the device. A block a row, its reductions in a fixed
    order, so a row's value never depends on the other rows. Grid (N,)."""
    pdl_enter()
    red = cuda.shared.array(32, nb_f32)
    r = cuda.blockIdx.x
    tid = cuda.threadIdx.x
    T = cuda.blockDim.x
    nw = T // WARP
    base = np.int64(r) * V
    m = np.float32(-math.inf)
    for j in range(tid, V, T):
        m = max(m, logits[base + j])
    m = block_max(m, red, tid, nw)
    s = np.float32(0.0)
    for j in range(tid, V, T):
        s += math.exp(logits[base + j] - m)
    s = block_sum(s, red, tid, nw)
    if tid == 0:
        out[r] = logits[base + targets[r]] - (m + math.log(s))

SIGNATURES["k_logprob"] = lambda t: (t.f32, t.i32, t.ai, t.f32)


# ------------------------------------------------------------------------------------- signatures
