"""The matrix kernels: GEMVs for decode rows (one row, or row tiles) and `mma.sync` GEMMs for a bf16
model's prompt rows, with their fused RMSNorm staging and epilogues (residual, SwiGLU, RoPE + KV write)."""
from __future__ import annotations

import math

import numpy as np

from decoder_service.gpu import compat  # noqa: F401  (numpy row_stack alias before numba-cuda compiles anything)

from numba import cuda
from numba import float32 as nb_f32, int64 as nb_i64, uint32 as nb_u32

from decoder_service.gpu.intrinsics import (
    MMA, SIM, WARP, block_sum, ld8, ld_words, mma_bf16, pdl_enter, prefetch_l1, prefetch_l2, quad_sum, split_bf16,
    stf, warp_sum)
from .kv_rope import kv_base, rope_pair

TILE_ROWS = 4                 # k_gemv_tile: input rows per block (8 was slower: P24)
TILE_ACC = 4 * TILE_ROWS      # k_gemv_tile: a lane's partial sums (2 weight rows x even/odd x rows)
TILE_RED = 32 * TILE_ROWS     # k_gemv_tile: the rows' per-warp norm partials (up to 32 warps)
# Prompt rows of bf16 models (k_gemm and its variants, GEMM_TILES): mma.sync m16n8k16 on the tensor cores, a
# block of warps per (mt m16 tiles x nt n8 tiles), each warp every (warps)-th 32-wide K chunk.
GEMM_ROWS = 16                # k_gemm: rows of an m-tile (the mma's M)
GEMM_WARPS = 4                # k_gemm: warps per block (split K)
GEMM_MAX_WARPS = 8            # k_gemm_wide: warps per block (K split twice as finely: P68)
GEMM_MAX_MT, GEMM_MAX_NT = 2, 8              # k_gemm_big: m16 and n8 tiles a block (the local arrays' size)
GEMM_ACC = 4 * GEMM_MAX_MT * GEMM_MAX_NT     # a lane's accumulators (4 per m16 x n8 tile)
GEMM_CX = 8 + 16 * GEMM_MAX_MT               # a lane's chunk of gamma and x rows
GEMM_CW = 4 * GEMM_MAX_NT                    # a lane's chunk of weight words
GEMM_PAIRS = 2 * GEMM_MAX_MT                 # a lane's rows (g, g+8 of each m-tile): offsets, sums of squares
# A matrix launch's epilogue (its `mode`): out = dot (+ bias); out += dot (the residual); SwiGLU over interleaved
# gate/up rows; QKV with RoPE and the KV write (k_gemv's one-row launch only: rope_store). Module constants, so
# numba compiles them as literals.
STORE, ACCUMULATE, SWIGLU, ROPE_KV = 0, 1, 2, 3
GEMV_REGISTERS = 128    # k_gemv's register cap: two 256-thread blocks per SM (152 uncapped; P30)
_GEMV_JIT = {} if SIM else {"max_registers": GEMV_REGISTERS}
SIGNATURES: dict = {}   # kernel -> its parameter types, given kernels.ArgTypes (None: not compiled)


def _gemv(t):
    """The parameters k_gemv and k_gemv_tile share (x .. epl)."""
    return (t.f32, t.i32, t.ai, t.i32, t.f32, t.f, t.i32, t.W, t.i32, t.i32, t.i32, t.f32, t.i32, t.f32, t.i32,
            t.i32, t.i32, t.i32)


def _gemm(t):
    """The parameters of every k_gemm variant (bf16 models only: None otherwise)."""
    if not t.bf16:
        return None
    return (t.f32, t.i32, t.f32, t.f, t.i32, t.W, t.i32, t.i32, t.i32, t.f32, t.i32, t.f32, t.i32, t.i32, t.i32,
            t.i32)


@cuda.jit(device=True, inline="always")
def sq8(s, v0, v1, v2, v3, v4, v5, v6, v7):
    """s plus the squares of eight values, added in order."""
    s += v0 * v0
    s += v1 * v1
    s += v2 * v2
    s += v3 * v3
    s += v4 * v4
    s += v5 * v5
    s += v6 * v6
    s += v7 * v7
    return s


@cuda.jit(device=True, inline="always")
def planes(o, Q):
    """The shared-memory indices o + e*Q (e = 0..7) of a planar chunk's elements, unsigned: numba adds
    negative-index wraparound code to every access through a signed index (P42,
    docs/gpu.md#what-numbas-code-generation-adds)."""
    return (np.uint32(o), np.uint32(o + Q), np.uint32(o + 2 * Q), np.uint32(o + 3 * Q), np.uint32(o + 4 * Q),
            np.uint32(o + 5 * Q), np.uint32(o + 6 * Q), np.uint32(o + 7 * Q))


@cuda.jit(device=True, inline="always")
def put_chunk(xs, o, Q, ss, v0, v1, v2, v3, v4, v5, v6, v7):
    """Store one 8-element chunk into the planar layout (element e at xs[o + e*Q]); return ss plus the
    chunk's squares, added in order."""
    i0, i1, i2, i3, i4, i5, i6, i7 = planes(o, Q)
    xs[i0], xs[i1], xs[i2], xs[i3], xs[i4], xs[i5], xs[i6], xs[i7] = v0, v1, v2, v3, v4, v5, v6, v7
    return sq8(ss, v0, v1, v2, v3, v4, v5, v6, v7)


@cuda.jit(device=True, inline="always")
def scale_chunks(xs, xo, gamma, inv, Q, tid, T):
    """RMSNorm's rescale of the chunks t, t+T, ... of the planar row at xs[xo:] (those thread t
    staged): x * inv * gamma."""
    c = tid
    while c < Q:
        g0, g1, g2, g3, g4, g5, g6, g7 = ld8(gamma, c * 8)
        i0, i1, i2, i3, i4, i5, i6, i7 = planes(xo + c, Q)
        xs[i0] = xs[i0] * inv * g0
        xs[i1] = xs[i1] * inv * g1
        xs[i2] = xs[i2] * inv * g2
        xs[i3] = xs[i3] * inv * g3
        xs[i4] = xs[i4] * inv * g4
        xs[i5] = xs[i5] * inv * g5
        xs[i6] = xs[i6] * inv * g6
        xs[i7] = xs[i7] * inv * g7
        c += T


@cuda.jit(device=True, inline="always")
def stage_row(xs, xo, x, xb, gamma, eps, use_norm, K, Q, tid, T, red, nw):
    """Stage the row x[xb : xb + 8Q] (its padding beyond K is zero in memory) into shared memory at
    xs[xo:], in 8 planes (plane e holds element 8q+e at e*Q+q: lane l reading chunk q touches bank
    (e*Q+q) % 32, conflict-free), with a fused RMSNorm when use_norm: x * rsqrt(mean(x^2)+eps) * gamma.

    Thread t owns chunks t, t+T, ... and loads two 8-element chunks per trip with 16-byte loads; its
    sum of squares runs over its chunks in ascending order, then one fixed block tree (T is fixed
    per launch geometry, which depends on the model only). Each thread rescales only what it wrote.
    Block-uniform call (contains barriers when use_norm)."""
    ss = np.float32(0.0)
    c = tid
    while c < Q:
        c2 = c + T
        cc = c2 if c2 < Q else c
        v0, v1, v2, v3, v4, v5, v6, v7 = ld8(x, xb + c * 8)
        y0, y1, y2, y3, y4, y5, y6, y7 = ld8(x, xb + cc * 8)
        ss = put_chunk(xs, xo + c, Q, ss, v0, v1, v2, v3, v4, v5, v6, v7)
        if c2 < Q:
            ss = put_chunk(xs, xo + c2, Q, ss, y0, y1, y2, y3, y4, y5, y6, y7)
        c += 2 * T
    if use_norm != 0:
        ss = block_sum(ss, red, tid, nw)
        inv = np.float32(1.0) / math.sqrt(ss / np.float32(K) + eps)
        scale_chunks(xs, xo, gamma, inv, Q, tid, T)


@cuda.jit(device=True, inline="always")
def prefetch_row(W, base, Kp, lane, pf, epl):
    """Cache hint for one weight row (pf 1: into L2, 2: into L1), one line per lane per trip."""
    if pf == 1:
        for e in range(lane * epl, Kp, WARP * epl):
            prefetch_l2(W, base + e)
    elif pf == 2:
        for e in range(lane * epl, Kp, WARP * epl):
            prefetch_l1(W, base + e)


@cuda.jit(device=True, inline="always")
def acc8(a0, a1, w0, w1, w2, w3, w4, w5, w6, w7, x0, x1, x2, x3, x4, x5, x6, x7):
    """Accumulate one 8-element chunk: even elements into a0, odd into a1, in ascending order."""
    a0 += w0 * x0
    a1 += w1 * x1
    a0 += w2 * x2
    a1 += w3 * x3
    a0 += w4 * x4
    a1 += w5 * x5
    a0 += w6 * x6
    a1 += w7 * x7
    return a0, a1


@cuda.jit(device=True, inline="always")
def xchunk(xs, xo, Q, q):
    """The 8 staged x values of chunk q (planar layout)."""
    i0, i1, i2, i3, i4, i5, i6, i7 = planes(xo + q, Q)
    return xs[i0], xs[i1], xs[i2], xs[i3], xs[i4], xs[i5], xs[i6], xs[i7]


@cuda.jit(device=True, inline="always")
def acc8t(a0, a1, w, xv):
    return acc8(a0, a1, w[0], w[1], w[2], w[3], w[4], w[5], w[6], w[7],
                xv[0], xv[1], xv[2], xv[3], xv[4], xv[5], xv[6], xv[7])


@cuda.jit(device=True, inline="always")
def dot2(W, wa, wb, xs, Q, lane):
    """Dot products of two weight rows (element offsets wa, wb; row length 8Q) with the staged planar
    vector, by one warp. Lane l accumulates chunks l, l+WARP, l+2WARP, ... in ascending order, even
    elements into one accumulator and odd into another, then the xor butterfly. Four chunks per trip
    (eight 16-byte loads in flight per lane; out-of-range chunks load a valid duplicate and are not
    accumulated). The arithmetic of a row never depends on its partner, the trip grouping or the
    launch: dot2_rows and the sparse head produce the same bits for the same row and vector."""
    a0 = np.float32(0.0)
    a1 = np.float32(0.0)
    b0 = np.float32(0.0)
    b1 = np.float32(0.0)
    last = Q - 1
    q = lane
    while q < Q:
        q1 = q + WARP
        q2 = q + 2 * WARP
        q3 = q + 3 * WARP
        c1 = min(q1, last) * 8
        c2 = min(q2, last) * 8
        c3 = min(q3, last) * 8
        wq = ld8(W, wa + q * 8)
        uq = ld8(W, wb + q * 8)
        w1 = ld8(W, wa + c1)
        u1 = ld8(W, wb + c1)
        w2 = ld8(W, wa + c2)
        u2 = ld8(W, wb + c2)
        w3 = ld8(W, wa + c3)
        u3 = ld8(W, wb + c3)
        xv = xchunk(xs, 0, Q, q)
        a0, a1 = acc8t(a0, a1, wq, xv)
        b0, b1 = acc8t(b0, b1, uq, xv)
        if q1 < Q:
            xv = xchunk(xs, 0, Q, q1)
            a0, a1 = acc8t(a0, a1, w1, xv)
            b0, b1 = acc8t(b0, b1, u1, xv)
        if q2 < Q:
            xv = xchunk(xs, 0, Q, q2)
            a0, a1 = acc8t(a0, a1, w2, xv)
            b0, b1 = acc8t(b0, b1, u2, xv)
        if q3 < Q:
            xv = xchunk(xs, 0, Q, q3)
            a0, a1 = acc8t(a0, a1, w3, xv)
            b0, b1 = acc8t(b0, b1, u3, xv)
        q += 4 * WARP
    return warp_sum(a0 + a1), warp_sum(b0 + b1)


@cuda.jit(device=True, inline="always")
def dot2_rows(W, wa, wb, xs, Q, lane, n, acc):
    """dot2 for the tile's first n staged vectors (planar rows at xs[i * 8Q]): each weight chunk is
    loaded once and used n times. acc[4i .. 4i+3] end as the even/odd partials of (row a, vector i)
    and (row b, vector i): per (row, vector) the same operations in the same order as dot2, so a row's
    result is bit-identical whichever kernel computed it. n is uniform over the warp."""
    for i in range(TILE_ACC):
        acc[i] = np.float32(0.0)
    last = Q - 1
    S = 8 * Q
    q = lane
    while q < Q:
        q1 = q + WARP
        k1 = min(q1, last) * 8
        wq = ld8(W, wa + q * 8)
        uq = ld8(W, wb + q * 8)
        w1 = ld8(W, wa + k1)
        u1 = ld8(W, wb + k1)
        for i in range(TILE_ROWS):
            if i < n:
                xv = xchunk(xs, i * S, Q, q)
                acc[4 * i], acc[4 * i + 1] = acc8t(acc[4 * i], acc[4 * i + 1], wq, xv)
                acc[4 * i + 2], acc[4 * i + 3] = acc8t(acc[4 * i + 2], acc[4 * i + 3], uq, xv)
        if q1 < Q:
            for i in range(TILE_ROWS):
                if i < n:
                    xv = xchunk(xs, i * S, Q, q1)
                    acc[4 * i], acc[4 * i + 1] = acc8t(acc[4 * i], acc[4 * i + 1], w1, xv)
                    acc[4 * i + 2], acc[4 * i + 3] = acc8t(acc[4 * i + 2], acc[4 * i + 3], u1, xv)
        q += 2 * WARP


@cuda.jit(device=True, inline="always")
def gemv_store(out, ob, p, ra, rb, N, a, b, bias, use_bias, mode):
    """Epilogue of one row pair (lane 0): mode STORE (+ bias), ACCUMULATE (the residual) or SWIGLU."""
    if mode == SWIGLU:
        out[ob + p] = a / (np.float32(1.0) + math.exp(-a)) * b
    else:
        if use_bias != 0:
            a += bias[ra]
            if rb < N:
                b += bias[rb]
        if mode == ACCUMULATE:
            out[ob + ra] += a
            if rb < N:
                out[ob + rb] += b
        else:
            out[ob + ra] = a
            if rb < N:
                out[ob + rb] = b


@cuda.jit(device=True, inline="always")
def rope_store(out, ob, p, N, a, b, bias, use_bias, r, positions, slots, bt, mb, kc, vc, layer_off, bs,
               nkv, hd, cs):
    """k_gemv's ROPE_KV epilogue, QKV with RoPE (lane 0): the weight rows are permuted so that pair p
    is (i, i + hd/2) of head p // (hd/2); q is rotated into out, k rotated and v written to the paged
    pool, the arithmetic of k_rope_kv without a q/k norm (and gemv_store's bias)."""
    half = hd // 2
    hh = p // half
    i = p - hh * half
    if use_bias != 0:
        a += bias[2 * p]
        b += bias[2 * p + 1]
    nq = N // hd - 2 * nkv               # query heads
    pos = positions[r]
    if hh < nq + nkv:
        a, b = rope_pair(a, b, cs, pos, half, i)
    if hh < nq:
        out[ob + hh * hd + i] = a
        out[ob + hh * hd + i + half] = b
        return
    kvh = hh - nq
    pool = kc
    if kvh >= nkv:
        kvh -= nkv
        pool = vc
    kb = kv_base(bt, mb, slots[r], pos, bs, layer_off, np.int64(nkv) * hd, kvh, hd)
    if kb >= 0:
        stf(pool, kb + i, a)
        stf(pool, kb + i + half, b)


@cuda.jit(cache=True, **_GEMV_JIT)
def k_gemv(x, x_stride, row_map, use_map, gamma, eps, use_norm, W, Q, K, N, bias, use_bias,
           out, out_stride, mode, pf, epl, positions, slots, bt, mb, kc, vc, layer_off, bs, nkv, hd, cs):
    """out[r] (op)= W @ f(x[src]) for one input row per blockIdx.y; f = RMSNorm(gamma) if use_norm.

    src = row_map[r] if use_map else r. Each warp owns output row pairs (2p, 2p+1), grid-striding over
    pairs; at one input row it first issues cache hints (pf) for its pairs' rows, so that the weight
    fetch overlaps the previous kernel and the staging. mode STORE: out[j] = dot (+ bias[j]); ACCUMULATE:
    out[j] += dot (residual); SWIGLU over interleaved gate/up rows, out[p] = silu(dot(2p)) * dot(2p+1); ROPE_KV:
    QKV with RoPE and the KV write (rope_store; the parameters from `positions` on serve only this mode).
    Dynamic shared memory: 8Q floats. Padding columns of x (and gamma) must be zero.
    """
    xs = cuda.shared.array(0, nb_f32)
    red = cuda.shared.array(32, nb_f32)
    tid = cuda.threadIdx.x
    T = cuda.blockDim.x
    nw = T // WARP
    lane = tid % WARP
    r = cuda.blockIdx.y
    npairs = (N + 1) // 2
    Kp = np.int64(Q) * 8
    p0 = cuda.blockIdx.x * nw + tid // WARP
    # Cache hints for the warp's weight rows, issued before the wait for the previous kernel: no kernel
    # writes the weights, so their fetch overlaps that kernel's tail and this one's staging. One input
    # row only: with several, the hints' traffic slows the previous kernel more than it saves
    # (P44, P45).
    if pf != 0 and cuda.gridDim.y == 1:
        p = p0
        while p < npairs:
            prefetch_row(W, 2 * p * Kp, Kp, lane, pf, epl)
            prefetch_row(W, min(2 * p + 1, N - 1) * Kp, Kp, lane, pf, epl)
            p += cuda.gridDim.x * nw
    pdl_enter()
    src = r
    if use_map != 0:
        src = row_map[r]
    stage_row(xs, 0, x, np.int64(src) * x_stride, gamma, eps, use_norm, K, Q, tid, T, red, nw)
    cuda.syncthreads()
    ob = np.int64(r) * out_stride
    for p in range(p0, npairs, cuda.gridDim.x * nw):
        ra = 2 * p
        rb = ra + 1
        a, b = dot2(W, ra * Kp, min(rb, N - 1) * Kp, xs, Q, lane)
        if lane == 0:
            if mode == ROPE_KV:
                rope_store(out, ob, p, N, a, b, bias, use_bias, r, positions, slots, bt, mb, kc, vc,
                           layer_off, bs, nkv, hd, cs)
            else:
                gemv_store(out, ob, p, ra, rb, N, a, b, bias, use_bias, mode)

SIGNATURES["k_gemv"] = lambda t: _gemv(t) + (t.ai, t.ai, t.ai, t.i32, t.W, t.W, t.i64, t.i32, t.i32, t.i32,
                                             t.f32)


@cuda.jit(device=True, inline="always")
def stage_rows(xs, x, x_stride, row_map, use_map, r0, R, gamma, eps, use_norm, K, Q, tid, T, red, nw):
    """stage_row for the tile's rows r0 .. r0 + TILE_ROWS - 1 (row i planar at xs[i * 8Q]; rows past R
    repeat row R - 1 and are never stored): every row's loads of a chunk are issued together, and one
    block reduction serves all the rows' norms. Per row the arithmetic of stage_row: each thread sums
    its chunks t, t + T, ... in ascending order, then the warp butterfly and the warps in ascending
    order. Block-uniform call (contains a barrier when use_norm)."""
    ss = cuda.local.array(TILE_ROWS, nb_f32)
    xb = cuda.local.array(TILE_ROWS, nb_i64)
    S = 8 * Q
    for i in range(TILE_ROWS):
        ss[i] = np.float32(0.0)
        src = min(r0 + i, R - 1)
        if use_map != 0:
            src = row_map[src]
        xb[i] = np.int64(src) * x_stride
    for c in range(tid, Q, T):
        for i in range(TILE_ROWS):
            v0, v1, v2, v3, v4, v5, v6, v7 = ld8(x, xb[i] + c * 8)
            ss[i] = put_chunk(xs, i * S + c, Q, ss[i], v0, v1, v2, v3, v4, v5, v6, v7)
    if use_norm == 0:
        return
    for i in range(TILE_ROWS):
        v = warp_sum(ss[i])
        if tid % WARP == 0:
            red[i * nw + tid // WARP] = v
    cuda.syncthreads()
    for i in range(TILE_ROWS):
        s = red[i * nw]
        for w in range(1, nw):
            s += red[i * nw + w]
        inv = np.float32(1.0) / math.sqrt(s / np.float32(K) + eps)
        scale_chunks(xs, i * S, gamma, inv, Q, tid, T)


@cuda.jit(cache=True)
def k_gemv_tile(x, x_stride, row_map, use_map, gamma, eps, use_norm, W, Q, K, N, bias, use_bias,
                out, out_stride, mode, pf, epl, R):
    """k_gemv for TILE_ROWS input rows per blockIdx.y (rows from TILE_ROWS * y; a last partial tile
    stores only rows below R): each weight chunk is read once for the tile's rows. Per output element
    the same arithmetic as k_gemv. Dynamic shared memory: TILE_ROWS * 8Q floats."""
    pdl_enter()
    xs = cuda.shared.array(0, nb_f32)
    red = cuda.shared.array(TILE_RED, nb_f32)
    acc = cuda.local.array(TILE_ACC, nb_f32)
    tid = cuda.threadIdx.x
    T = cuda.blockDim.x
    nw = T // WARP
    lane = tid % WARP
    r0 = cuda.blockIdx.y * TILE_ROWS
    n = min(TILE_ROWS, R - r0)
    npairs = (N + 1) // 2
    Kp = np.int64(Q) * 8
    p0 = cuda.blockIdx.x * nw + tid // WARP
    if pf != 0 and p0 < npairs:
        prefetch_row(W, 2 * p0 * Kp, Kp, lane, pf, epl)
        prefetch_row(W, min(2 * p0 + 1, N - 1) * Kp, Kp, lane, pf, epl)
    stage_rows(xs, x, x_stride, row_map, use_map, r0, R, gamma, eps, use_norm, K, Q, tid, T, red, nw)
    cuda.syncthreads()
    for p in range(p0, npairs, cuda.gridDim.x * nw):
        ra = 2 * p
        rb = ra + 1
        dot2_rows(W, ra * Kp, min(rb, N - 1) * Kp, xs, Q, lane, n, acc)
        for i in range(TILE_ROWS):
            if i < n:
                a = warp_sum(acc[4 * i] + acc[4 * i + 1])
                b = warp_sum(acc[4 * i + 2] + acc[4 * i + 3])
                if lane == 0:
                    gemv_store(out, np.int64(r0 + i) * out_stride, p, ra, rb, N, a, b, bias, use_bias, mode)

SIGNATURES["k_gemv_tile"] = lambda t: _gemv(t) + (t.i32,)


@cuda.jit(device=True, inline="always")
def mma_chunk(h0, h1, h2, h3, h4, h5, h6, h7, l0, l1, l2, l3, l4, l5, l6, l7, w0, w1, w2, w3, c0, c1, c2, c3):
    """C + A B over one 32-wide K chunk, in the k permutation of k_gemm and k_attn_mma: lane (g, t)
    holds k = 8t .. 8t+7 of A's rows g, g+8 as bf16 hi words h0..h7 and lo words l0..l7 (fragment
    order: rows g, g+8 at k 8t, 8t+1, then at 8t+2, 8t+3; then the same at 8t+4 .. 8t+7) and of B's
    column g as w0..w3. Four mmas: hi then lo of the chunk's first half, then of its second."""
    c0, c1, c2, c3 = mma_bf16(h0, h1, h2, h3, w0, w1, c0, c1, c2, c3)
    c0, c1, c2, c3 = mma_bf16(l0, l1, l2, l3, w0, w1, c0, c1, c2, c3)
    c0, c1, c2, c3 = mma_bf16(h4, h5, h6, h7, w2, w3, c0, c1, c2, c3)
    return mma_bf16(l4, l5, l6, l7, w2, w3, c0, c1, c2, c3)


@cuda.jit(device=True, inline="always")
def gemm_load(cx, cw, x, xr, gamma, use_norm, W, Kp, N, n0, g, t, c, mt, nt):
    """k_gemm's operands of the 32-wide K chunk at c for lane (g, t): gamma at k = c + 8t .. + 7 into cx[0:8],
    then each m-tile's x rows g, g+8 (offsets xr[2i], xr[2i+1]) there into cx[8+16i : 24+16i]; the nt n8 tiles'
    weight row g there into cw (4 words each). Past K (or past Kp: no chunk) the values are zeros, the loads
    still valid."""
    k = c + 8 * t
    ok = k < Kp
    kk = k if ok else 0
    z = np.float32(0.0)
    if use_norm != 0:
        cx[0], cx[1], cx[2], cx[3], cx[4], cx[5], cx[6], cx[7] = ld8(gamma, kk)
    for i in range(mt):
        v0, v1, v2, v3, v4, v5, v6, v7 = ld8(x, xr[2 * i] + kk)
        y0, y1, y2, y3, y4, y5, y6, y7 = ld8(x, xr[2 * i + 1] + kk)
        if not ok:
            v0 = v1 = v2 = v3 = v4 = v5 = v6 = v7 = z
            y0 = y1 = y2 = y3 = y4 = y5 = y6 = y7 = z
        o = 8 + 16 * i
        cx[o], cx[o + 1], cx[o + 2], cx[o + 3], cx[o + 4], cx[o + 5], cx[o + 6], cx[o + 7] = \
            v0, v1, v2, v3, v4, v5, v6, v7
        cx[o + 8], cx[o + 9], cx[o + 10], cx[o + 11], cx[o + 12], cx[o + 13], cx[o + 14], cx[o + 15] = \
            y0, y1, y2, y3, y4, y5, y6, y7
    for j in range(nt):
        w0, w1, w2, w3 = ld_words(W, np.int64(min(n0 + 8 * j + g, N - 1)) * Kp + kk)
        cw[4 * j], cw[4 * j + 1], cw[4 * j + 2], cw[4 * j + 3] = w0, w1, w2, w3


@cuda.jit(device=True, inline="always")
def gemm_chunk(cx, cw, acc, ss, use_norm, mt, nt):
    """k_gemm's work on one 32-wide K chunk whose operands gemm_load put in cx, cw: per m-tile i, its rows'
    sums of squares (ss[2i], ss[2i+1]) under a norm, x times gamma as bf16 hi + lo, and the n8 tiles' mma
    pairs into acc[(i * nt + j) * 4 ..]."""
    for i in range(mt):
        o = 8 + 16 * i
        a0, a1, a2, a3, a4, a5, a6, a7 = cx[o], cx[o + 1], cx[o + 2], cx[o + 3], cx[o + 4], cx[o + 5], cx[o + 6], \
            cx[o + 7]
        b0, b1, b2, b3, b4, b5, b6, b7 = cx[o + 8], cx[o + 9], cx[o + 10], cx[o + 11], cx[o + 12], cx[o + 13], \
            cx[o + 14], cx[o + 15]
        if use_norm != 0:
            ss[2 * i] = sq8(ss[2 * i], a0, a1, a2, a3, a4, a5, a6, a7)
            ss[2 * i + 1] = sq8(ss[2 * i + 1], b0, b1, b2, b3, b4, b5, b6, b7)
            g0, g1, g2, g3, g4, g5, g6, g7 = cx[0], cx[1], cx[2], cx[3], cx[4], cx[5], cx[6], cx[7]
            a0, a1, a2, a3, a4, a5, a6, a7 = a0 * g0, a1 * g1, a2 * g2, a3 * g3, a4 * g4, a5 * g5, a6 * g6, a7 * g7
            b0, b1, b2, b3, b4, b5, b6, b7 = b0 * g0, b1 * g1, b2 * g2, b3 * g3, b4 * g4, b5 * g5, b6 * g6, b7 * g7
        ha0, la0 = split_bf16(a0, a1)
        ha1, la1 = split_bf16(a2, a3)
        ha2, la2 = split_bf16(a4, a5)
        ha3, la3 = split_bf16(a6, a7)
        hb0, lb0 = split_bf16(b0, b1)
        hb1, lb1 = split_bf16(b2, b3)
        hb2, lb2 = split_bf16(b4, b5)
        hb3, lb3 = split_bf16(b6, b7)
        for j in range(nt):
            e = 4 * (i * nt + j)
            acc[e], acc[e + 1], acc[e + 2], acc[e + 3] = mma_chunk(
                ha0, hb0, ha1, hb1, ha2, hb2, ha3, hb3, la0, lb0, la1, lb1, la2, lb2, la3, lb3,
                cw[4 * j], cw[4 * j + 1], cw[4 * j + 2], cw[4 * j + 3], acc[e], acc[e + 1], acc[e + 2], acc[e + 3])


@cuda.jit(device=True, inline="always")
def gemm_block(x, x_stride, gamma, eps, use_norm, W, Kp, K, N, bias, use_bias, out, out_stride, mode, first, end,
               warps, mt, nt, ahead):
    """k_gemm's block: `warps` warps, mt m16 tiles x nt n8 tiles, constants of the kernel that calls it (so the
    loops over them unroll as they would over literals). Every output element takes the same path whatever
    mt and nt are (its row's warp-w chunks chained in order, the warps' partials summed in warp order), so the
    tile shape is free to change with the batch: only `warps` fixes a row's bits. `ahead`: load the next chunk
    while this one's mmas run (two register sets), or not (one: fewer registers, more warps an SM)."""
    pdl_enter()
    sh = cuda.shared.array(0, nb_f32)   # the warps' partial tiles, then their partial sums of squares per row
    tiles = mt * nt
    ssq0 = warps * tiles * 4 * MMA
    acc = cuda.local.array(GEMM_ACC, nb_f32)
    ss = cuda.local.array(GEMM_PAIRS, nb_f32)
    xr = cuda.local.array(GEMM_PAIRS, nb_i64)
    tid = cuda.threadIdx.x
    w = tid // MMA
    lane = tid % MMA
    g = lane // 4
    t = lane % 4
    m0 = first + cuda.blockIdx.y * (GEMM_ROWS * mt)
    n0 = cuda.blockIdx.x * (8 * nt)
    for i in range(mt):
        xr[2 * i] = np.int64(min(m0 + 16 * i + g, end - 1)) * x_stride
        xr[2 * i + 1] = np.int64(min(m0 + 16 * i + g + 8, end - 1)) * x_stride
        ss[2 * i] = np.float32(0.0)
        ss[2 * i + 1] = np.float32(0.0)
    for i in range(4 * tiles):
        acc[i] = np.float32(0.0)
    # chunk c's operands in registers (cx: gamma then the m-tiles' x rows; cw: the n8 tiles' weight words);
    # ahead: the next chunk's loads issued before this chunk's mmas, two register sets taking turns
    cx = cuda.local.array(GEMM_CX, nb_f32)
    cw = cuda.local.array(GEMM_CW, nb_u32)
    step = warps * 32
    c = w * 32
    if ahead:
        nx = cuda.local.array(GEMM_CX, nb_f32)
        nw = cuda.local.array(GEMM_CW, nb_u32)
        gemm_load(cx, cw, x, xr, gamma, use_norm, W, Kp, N, n0, g, t, c, mt, nt)
        while c < Kp:
            gemm_load(nx, nw, x, xr, gamma, use_norm, W, Kp, N, n0, g, t, c + step, mt, nt)
            gemm_chunk(cx, cw, acc, ss, use_norm, mt, nt)
            c += step
            if c >= Kp:
                break
            gemm_load(cx, cw, x, xr, gamma, use_norm, W, Kp, N, n0, g, t, c + step, mt, nt)
            gemm_chunk(nx, nw, acc, ss, use_norm, mt, nt)
            c += step
    else:       # one register set: fewer registers, more warps an SM to hide the loads
        while c < Kp:
            gemm_load(cx, cw, x, xr, gamma, use_norm, W, Kp, N, n0, g, t, c, mt, nt)
            gemm_chunk(cx, cw, acc, ss, use_norm, mt, nt)
            c += step
    for q in range(tiles):
        for e in range(4):
            sh[((w * tiles + q) * 4 + e) * MMA + lane] = acc[4 * q + e]
    if use_norm != 0:
        for i in range(mt):
            sa = quad_sum(ss[2 * i])
            sb = quad_sum(ss[2 * i + 1])
            if t == 0:
                sh[ssq0 + w * GEMM_ROWS * mt + 16 * i + g] = sa
                sh[ssq0 + w * GEMM_ROWS * mt + 16 * i + g + 8] = sb
    cuda.syncthreads()
    # epilogue: thread (w, lane) finishes fragment `lane` of tiles w, w + warps, ... (tile q: m-tile q // nt,
    # n8 tile q % nt)
    for q in range(w, tiles, warps):
        i = q // nt
        col = n0 + 8 * (q % nt) + 2 * t
        if col < N:
            for h in range(2):
                r = 16 * i + g + 8 * h
                row = m0 + r
                if row < end:
                    v0 = sh[(q * 4 + 2 * h) * MMA + lane]
                    v1 = sh[(q * 4 + 2 * h + 1) * MMA + lane]
                    for u in range(1, warps):
                        v0 += sh[((u * tiles + q) * 4 + 2 * h) * MMA + lane]
                        v1 += sh[((u * tiles + q) * 4 + 2 * h + 1) * MMA + lane]
                    if use_norm != 0:
                        s = sh[ssq0 + r]
                        for u in range(1, warps):
                            s += sh[ssq0 + u * GEMM_ROWS * mt + r]
                        inv = np.float32(1.0) / math.sqrt(s / np.float32(K) + eps)
                        v0 *= inv
                        v1 *= inv
                    gemv_store(out, np.int64(row) * out_stride, col // 2, col, col + 1, N, v0, v1, bias, use_bias,
                               mode)


def gemm_shared(warps: int, mt: int, nt: int) -> int:
    """Dynamic shared bytes of a k_gemm block: the warps' partial tiles and partial sums of squares."""
    return 4 * warps * (mt * nt * 4 * MMA + GEMM_ROWS * mt)


@cuda.jit(cache=True)
def k_gemm(x, x_stride, gamma, eps, use_norm, W, Kp, K, N, bias, use_bias, out, out_stride, mode, first, end):
    """out[r] (op)= W @ f(x[r]) for the prompt rows first .. end-1 on the tensor cores (bf16 weights);
    f = RMSNorm(gamma) if use_norm; modes as k_gemv's but ROPE_KV (gemv_store).

    Block (x: 8 nt output columns, y: 16 mt rows; here mt, nt = 1, 4); its GEMM_WARPS warps each take every
    GEMM_WARPS-th 32-wide K chunk (k_gemm_wide: GEMM_MAX_WARPS; which one a matrix runs is a choice of
    the model, never of the batch). In a chunk, lane (g, t) = (lane // 4, lane % 4) holds rows g and g+8
    at k .. k+7 (k = chunk + 8t) and the same eight k of weight row g of each n8 tile: the mma's k
    index is permuted within the chunk the same way for both operands, so each mma pair sums the chunk's
    full dot product, with one 16-byte load per operand row. x (times gamma under a norm) enters as bf16
    hi + lo (two mmas, ~16 significant bits); weights are exact. The norm's 1/rms scales the finished
    sum. The warps' partials are summed in warp order. What an output element computes depends on its
    row's x and its weight row only, never on the other rows of the tile, M, the tile's shape or where its
    row falls: a row's bits are its own (checked by tests/test_gemm.py, under the simulator and on the
    device). Block: GEMM_WARPS * MMA threads, gemm_shared bytes. Padding columns of x and gamma (to Kp)
    must be zero."""
    gemm_block(x, x_stride, gamma, eps, use_norm, W, Kp, K, N, bias, use_bias, out, out_stride, mode, first, end,
               GEMM_WARPS, 1, 4, True)


@cuda.jit(cache=True)
def k_gemm_one(x, x_stride, gamma, eps, use_norm, W, Kp, K, N, bias, use_bias, out, out_stride, mode, first, end):
    """k_gemm on one register set, no loads ahead (the same bits): for prompts of 128 rows or more, where more
    resident blocks beat the loads in flight (P98; as k_gemm_big's P93)."""
    gemm_block(x, x_stride, gamma, eps, use_norm, W, Kp, K, N, bias, use_bias, out, out_stride, mode, first, end,
               GEMM_WARPS, 1, 4, False)


@cuda.jit(cache=True)
def k_gemm_wide(x, x_stride, gamma, eps, use_norm, W, Kp, K, N, bias, use_bias, out, out_stride, mode, first,
                end):
    """k_gemm with GEMM_MAX_WARPS warps a block: each takes every GEMM_MAX_WARPS-th chunk, half as many
    in a row, for matrices whose K is long (P68). Block: GEMM_MAX_WARPS * MMA threads."""
    gemm_block(x, x_stride, gamma, eps, use_norm, W, Kp, K, N, bias, use_bias, out, out_stride, mode, first, end,
               GEMM_MAX_WARPS, 1, 4, True)


@cuda.jit(cache=True)
def k_gemm_big(x, x_stride, gamma, eps, use_norm, W, Kp, K, N, bias, use_bias, out, out_stride, mode, first, end):
    """k_gemm on 32 x 64 tiles (mt, nt = 2, 8): each weight and x load feeds twice the mmas, for long prompts
    (the same bits as k_gemm). One register set, no loads ahead: 168 registers and three blocks an SM, where
    two sets took 255, spilled and ran slower (P93)."""
    gemm_block(x, x_stride, gamma, eps, use_norm, W, Kp, K, N, bias, use_bias, out, out_stride, mode, first, end,
               GEMM_WARPS, 2, 8, False)


@cuda.jit(cache=True)
def k_gemm_wide_big(x, x_stride, gamma, eps, use_norm, W, Kp, K, N, bias, use_bias, out, out_stride, mode,
                    first, end):
    """k_gemm_wide on 32 x 32 tiles (mt, nt = 2, 4; the same bits as k_gemm_wide): with twice the warps, 2 x 8
    tiles were slower (P87)."""
    gemm_block(x, x_stride, gamma, eps, use_norm, W, Kp, K, N, bias, use_bias, out, out_stride, mode, first, end,
               GEMM_MAX_WARPS, 2, 4, True)


GEMM_TILES = {"k_gemm": (GEMM_WARPS, 1, 4), "k_gemm_one": (GEMM_WARPS, 1, 4), "k_gemm_big": (GEMM_WARPS, 2, 8),
              "k_gemm_wide": (GEMM_MAX_WARPS, 1, 4), "k_gemm_wide_big": (GEMM_MAX_WARPS, 2, 4)}   # (warps, mt, nt)
SIGNATURES.update(dict.fromkeys(GEMM_TILES, _gemm))

