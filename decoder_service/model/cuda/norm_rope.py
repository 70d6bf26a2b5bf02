"""RoPE (its cos/sin table, the rotation + KV write of row tiles and q/k-normed models, and K/V moved to another
position) and the final RMSNorm of the logit rows."""
from __future__ import annotations

import math

import numpy as np

from decoder_service.gpu import compat  # noqa: F401  (numpy row_stack alias before numba-cuda compiles anything)

from numba import cuda
from numba import float32 as nb_f32

from decoder_service.gpu.intrinsics import WARP, block_sum, ldf, pdl_enter, stf
from .kv_rope import kv_base, rope_pair
from .matmul import stage_row
SIGNATURES: dict = {}   # kernel -> its parameter types, given kernels.ArgTypes (None: not compiled)


@cuda.jit(cache=True)
def k_rope_table(inv_freq, half, n, cs):
    """cs[2j], cs[2j + 1] = cos, sin of p * inv_freq[i] for j = p * half + i, positions p < n: RoPE's
    rotations, computed once (angles in float64, rounded to float32). Grid: n * half threads."""
    pdl_enter()
    j = cuda.grid(1)
    if j < n * half:
        p = j // half
        ang = np.float64(p) * inv_freq[j - p * half]
        cs[2 * j] = np.float32(math.cos(ang))
        cs[2 * j + 1] = np.float32(math.sin(ang))

SIGNATURES["k_rope_table"] = lambda t: (t.f64, t.i32, t.i32, t.f32)


ROPE_ITEMS = 4   # k_rope_kv: (row, head) items a block, a group of threads each: blocks of one warp were too small


@cuda.jit(cache=True)
def k_rope_kv(qkv, qkv_stride, slots, positions, bt, mb, kc, vc, layer_off, bs, nh, nkv, hd,
              cs, qn, kn, gofs, use_qkn, eps, R):
    """Per (row, head) of R rows: optional per-head RMSNorm (Qwen3), RoPE (rotate_half pairs (i, i + hd/2),
    rotations from k_rope_table's cs), q written back in place, k and v written to the paged pool. A block
    takes ROPE_ITEMS consecutive items (row-major over the nh + nkv heads), blockDim / ROPE_ITEMS threads
    each, whose norm sums the same tree whatever the block holds. Grid ceil(R (nh + nkv) / ROPE_ITEMS)."""
    pdl_enter()
    red = cuda.shared.array(32, nb_f32)
    T = cuda.blockDim.x // ROPE_ITEMS
    tid = cuda.threadIdx.x % T
    g = cuda.threadIdx.x // T
    nq = nh + nkv
    item = cuda.blockIdx.x * ROPE_ITEMS + g
    valid = item < R * nq
    if not valid:
        item = 0
    r = item // nq
    hh = item - r * nq
    half = hd // 2
    pos = positions[r]
    rowb = np.int64(r) * qkv_stride
    is_q = hh < nh
    kvh = hh - nh
    if is_q:
        src = rowb + hh * hd
    else:
        src = rowb + nh * hd + kvh * hd
    inv = np.float32(1.0)
    if use_qkn != 0:     # every group of the block sums (its barriers are the block's)
        ss = np.float32(0.0)
        for i in range(tid, hd, T):
            v = qkv[src + i]
            ss += v * v
        nw = T // WARP
        ss = block_sum(ss, red[g * nw:], tid, nw)
        inv = np.float32(1.0) / math.sqrt(ss / np.float32(hd) + eps)
    if not valid:
        return
    kb = np.int64(-1)
    if not is_q:
        kb = kv_base(bt, mb, slots[r], pos, bs, layer_off, np.int64(nkv) * hd, kvh, hd)
    for i in range(tid, half, T):
        x1 = qkv[src + i]
        x2 = qkv[src + i + half]
        if use_qkn != 0:
            if is_q:
                x1 = x1 * inv * qn[gofs + i]
                x2 = x2 * inv * qn[gofs + i + half]
            else:
                x1 = x1 * inv * kn[gofs + i]
                x2 = x2 * inv * kn[gofs + i + half]
        y1, y2 = rope_pair(x1, x2, cs, pos, half, i)
        if is_q:
            qkv[src + i] = y1
            qkv[src + i + half] = y2
        elif kb >= 0:
            stf(kc, kb + i, y1)
            stf(kc, kb + i + half, y2)
    if not is_q and kb >= 0:
        vsrc = rowb + (nh + nkv) * hd + kvh * hd
        for i in range(tid, hd, T):
            stf(vc, kb + i, qkv[vsrc + i])

SIGNATURES["k_rope_kv"] = lambda t: (t.f32, t.i32, t.ai, t.ai, t.ai, t.i32, t.W, t.W, t.i64, t.i32, t.i32, t.i32,
                                     t.i32, t.f32, t.f32, t.f32, t.i32, t.i32, t.f, t.i32)


@cuda.jit(cache=True)
def k_place_kv(kc, vc, moves, n, nkv, heads, layer_elems, hd, cs):
    """K/V of n pool slots moves[i] into the slots moves[n + i], each key rotated moves[2n + i] positions further
    (rotate_half pairs, table cs), for every layer and KV head (`heads`: layers x KV heads): a tool line's K/V,
    computed at its canonical place, moved to where a request's prompt lists it. A block per (slot, layer, KV
    head); grid n * heads."""
    pdl_enter()
    item = cuda.blockIdx.x
    r = item // heads
    layer = (item - r * heads) // nkv
    kvh = item - r * heads - layer * nkv
    row = np.int64(nkv) * hd
    src = layer * layer_elems + moves[r] * row + kvh * hd
    dst = layer * layer_elems + moves[n + r] * row + kvh * hd
    shift = moves[2 * n + r]
    half = hd // 2
    for i in range(cuda.threadIdx.x, half, cuda.blockDim.x):
        y1, y2 = rope_pair(ldf(kc, src + i), ldf(kc, src + i + half), cs, shift, half, i)
        stf(kc, dst + i, y1)
        stf(kc, dst + i + half, y2)
    for i in range(cuda.threadIdx.x, hd, cuda.blockDim.x):
        stf(vc, dst + i, ldf(vc, src + i))

SIGNATURES["k_place_kv"] = lambda t: (t.W, t.W, t.ai, t.i32, t.i32, t.i32, t.i64, t.i32, t.f32)


@cuda.jit(cache=True)
def k_final_norm(x, x_stride, rows, gamma, eps, K, Q, out, out_stride):
    """out[i] = RMSNorm(x[rows[i]]) * gamma: the final-normed hidden state of the logit rows
    (the same staging and tree as the fused norms; padding columns stay zero)."""
    pdl_enter()
    xs = cuda.shared.array(0, nb_f32)
    red = cuda.shared.array(32, nb_f32)
    i = cuda.blockIdx.x
    tid = cuda.threadIdx.x
    T = cuda.blockDim.x
    stage_row(xs, 0, x, np.int64(rows[i]) * x_stride, gamma, eps, 1, K, Q, tid, T, red, T // WARP)
    ob = np.int64(i) * out_stride
    for c in range(tid, Q, T):          # each thread writes back the chunks it staged
        for e in range(8):
            out[ob + c * 8 + e] = xs[e * Q + c]

SIGNATURES["k_final_norm"] = lambda t: (t.f32, t.i32, t.ai, t.f32, t.f, t.i32, t.i32, t.f32, t.i32)

