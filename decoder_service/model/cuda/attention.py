"""Causal GQA attention over the paged KV pool: one row at a time (`k_attn_rows`), or row tiles of a
prompt (`k_attn_tiles`; `k_attn_mma` on the tensor cores), context splits merged in a fixed order."""
from __future__ import annotations

import math

import numpy as np

from decoder_service.gpu import compat  # noqa: F401  (numpy row_stack alias before numba-cuda compiles anything)

from numba import cuda
from numba import float32 as nb_f32, int32 as nb_i32, int64 as nb_i64, uint32 as nb_u32

from decoder_service.gpu.intrinsics import (
    MMA, SIM, TQ, WARP, block_max, block_sum, cdiv, divmod_u32, lane_take, lanes_max, lanes_sum, ld8, ld_l2,
    ld_words, mma_bf16, mma_sync, pdl_enter, quad_max, quad_sum, split_bf16)
from .kv_rope import kv_base
from .matmul import mma_chunk

MAX_SPLITS = 64         # attention: at most this many context splits per query
ROW_SPLITS = 32         # k_attn_rows: at most this many splits per (row, head) (P12; 64 rejected: P27)
MAX_TILE = 256          # k_attn_rows: tile (= its block size) upper bound; static shared array size
ATTN_REGISTERS = 64     # k_attn_rows' register cap: more resident blocks per SM (P18)
_ATTN_JIT = {} if SIM else {"max_registers": ATTN_REGISTERS}   # the simulator takes no cap
MQ = 16                       # k_attn_mma: queries per block (the mma's M)
MMA_HDS = (64, 128)           # k_attn_mma's head_dim bounds, a kernel each (registers, shared sizes; P36, P74)
MMA_SPLIT = 1024              # k_attn_mma: default split (positions) of a prompt row's context (P35, P96; long: P63)
VT_STRIDE = 12                # k_attn_mma: words per V^T row (8 position pairs, padded: conflict-free reads)
ATT_WARPS = 4                 # k_attn_mma: warps per block, each every ATT_WARPS-th 16-position block
MMA_ATTN_REGISTERS = {64: 168, 128: 255}   # k_attn_mma's register caps: at 64, three 128-thread blocks an SM,
                                           # no spills (P42); at 128, none below the hardware's (P74)
# Attention tiles (k_attn_tiles): a block holds up to QB queries (consecutive rows of one sequence x the query
# heads of one KV head); TQ threads own a query (its max and sum are TQ-lane xor trees, so a query's
# lanes sit in one warp), each scoring PPT positions of a TP-position K/V tile held in shared memory.
QB = 4 if SIM else 16
PPT = 2 if SIM else 8
TP = TQ * PPT
SIGNATURES: dict = {}   # kernel -> its parameter types, given kernels.ArgTypes (None: not compiled)


def _attn(t):
    """The parameters every attention kernel shares (qkv .. maxs)."""
    return (t.f32, t.i32, t.ai, t.ai, t.ai, t.ai, t.i32, t.W, t.W, t.i64, t.i32, t.i32, t.i32, t.i32, t.f, t.f32,
            t.i32, t.f32, t.ai, t.i32)


@cuda.jit(device=True, inline="always")
def qk8(s, qs, c, k):
    """s + q[c:c+8] . k, in ascending order (unsigned indices: no negative-index wraparound code: P42)."""
    i = np.uint32(c)
    s += qs[i] * k[0]
    s += qs[i + 1] * k[1]
    s += qs[i + 2] * k[2]
    s += qs[i + 3] * k[3]
    s += qs[i + 4] * k[4]
    s += qs[i + 5] * k[5]
    s += qs[i + 6] * k[6]
    s += qs[i + 7] * k[7]
    return s


@cuda.jit(device=True, inline="always")
def axpy8(a, w, v):
    """a + w * v for 8-tuples a and v."""
    return (a[0] + w * v[0], a[1] + w * v[1], a[2] + w * v[2], a[3] + w * v[3],
            a[4] + w * v[4], a[5] + w * v[5], a[6] + w * v[6], a[7] + w * v[7])


@cuda.jit(device=True, inline="always")
def pv_tile(sh, wo, base_s, vc, ro, tid, hd, cnt):
    """This thread's share of sum_j w[j] * V[j] over the tile's cnt positions (weights w at sh[wo:]).
    Thread (g, c) takes the 8 dims of chunk c (one 16-byte load per position) over positions g, g + G,
    g + 2G, ... in ascending order, four loads in flight, G = threads // (hd / 8) groups, and writes its
    8 sums to sh[ro + g * hd + 8c ...]; tile_sum adds them over g in ascending order. A missing block
    (base -1) contributes nothing and is never read."""
    c8 = np.uint32(hd // 8)
    G = np.uint32(cuda.blockDim.x) // c8
    g = np.uint32(tid) // c8
    if g >= G:
        return
    o = (tid - g * c8) * 8
    z = np.float32(0.0)
    a = (z, z, z, z, z, z, z, z)
    last = cnt - 1
    j = g
    while j < cnt:
        j1, j2, j3 = min(j + G, last), min(j + 2 * G, last), min(j + 3 * G, last)
        b0, b1, b2, b3 = base_s[np.uint32(j)], base_s[np.uint32(j1)], base_s[np.uint32(j2)], base_s[np.uint32(j3)]
        v0 = ld8(vc, max(b0, 0) + o)
        v1 = ld8(vc, max(b1, 0) + o)
        v2 = ld8(vc, max(b2, 0) + o)
        v3 = ld8(vc, max(b3, 0) + o)
        if b0 >= 0:
            a = axpy8(a, sh[np.uint32(wo + j)], v0)
        if j + G < cnt and b1 >= 0:
            a = axpy8(a, sh[np.uint32(wo + j1)], v1)
        if j + 2 * G < cnt and b2 >= 0:
            a = axpy8(a, sh[np.uint32(wo + j2)], v2)
        if j + 3 * G < cnt and b3 >= 0:
            a = axpy8(a, sh[np.uint32(wo + j3)], v3)
        j += 4 * G
    r = np.uint32(ro + g * hd + o)
    for i in range(8):
        sh[r + i] = a[i]


@cuda.jit(device=True, inline="always")
def tile_sum(sh, off, groups, hd, d):
    """pv_tile's partial sums of dim d, added over the groups in ascending order."""
    t = np.float32(0.0)
    for g in range(groups):
        t += sh[np.uint32(off + g * hd + d)]
    return t


@cuda.jit(device=True, inline="always")
def v_stride(hd):
    """Row stride of k_attn_tiles' V tile: head_dim rounded up to a multiple of 8 TQ (the dims a lane
    reads in one pass), plus one (odd: no bank conflicts)."""
    return (hd + 8 * TQ - 1) // (8 * TQ) * (8 * TQ) + 1


@cuda.jit(device=True, inline="always")
def st8(sh, i, v):
    """sh[i:i+8] = the 8-tuple v (unsigned indices: no negative-index wraparound code: P42)."""
    sh[np.uint64(i)] = v[0]
    sh[np.uint64(i + 1)] = v[1]
    sh[np.uint64(i + 2)] = v[2]
    sh[np.uint64(i + 3)] = v[3]
    sh[np.uint64(i + 4)] = v[4]
    sh[np.uint64(i + 5)] = v[5]
    sh[np.uint64(i + 6)] = v[6]
    sh[np.uint64(i + 7)] = v[7]


@cuda.jit(cache=True, **_ATTN_JIT)
def k_attn_rows(qkv, qkv_stride, rows, slots, positions, bt, mb, kc, vc, layer_off, bs, nkv, hd, group,
                scale, out, out_stride, part, counters, maxs):
    """Causal GQA attention over the paged pool, positions 0..pos, one row at a time: one block per
    (row, q head, split) for the rows listed in `rows` (decode rows, and prompt rows whose context is
    too short for k_attn_tiles to pay).

    A row's context is cut into ns <= maxs splits of whole T-position tiles, a function of that row's
    context length alone (never of the batch). In a split, tiles run in ascending order with an online
    softmax: thread t scores position t of the tile (head_dim dot, ascending); tile max and sum are
    fixed block trees; pv_tile sums weight x V over the tile's positions in fixed groups of threads
    (16-byte V loads), added over the groups in ascending order, into an accumulator per dim that the
    tile's max rescales. One split writes the output directly. With several, each writes (max, sum, acc) partials;
    the block that finishes last (a counter per row and head) merges them in ascending split order,
    so whichever block that is, the arithmetic is the same. Dynamic shared: hd + 9T floats.
    Grid (R, nh, max splits over the batch); blocks beyond their row's ns return at once.
    """
    sh = cuda.shared.array(0, nb_f32)
    base_s = cuda.shared.array(MAX_TILE, nb_i64)
    red = cuda.shared.array(32, nb_f32)
    flag = cuda.shared.array(1, nb_i32)
    r = rows[cuda.blockIdx.x]
    h = cuda.blockIdx.y
    sp = cuda.blockIdx.z
    tid = cuda.threadIdx.x
    T = cuda.blockDim.x
    nw = T // WARP
    n_ctx = positions[r] + 1
    ntiles = cdiv(n_ctx, T)
    ns = min(ntiles, np.uint32(maxs))
    tps = cdiv(ntiles, ns)
    ns = cdiv(ntiles, tps)
    if sp >= ns:
        return
    p_begin = sp * tps * T
    p_end = min(p_begin + tps * T, n_ctx)
    kvh, _ = divmod_u32(h, group)
    slot = slots[r]
    rowlen = np.int64(nkv) * hd
    # The first tile's pool offsets before the wait for the previous kernel: rows, positions, slots
    # and block tables are the host's step inputs, which no kernel writes, so this chain of dependent
    # loads overlaps that kernel (PDL); q and the pool's newest K/V are its output and wait.
    kb = np.int64(-1)
    if p_begin + tid < p_end:
        kb = kv_base(bt, mb, slot, p_begin + tid, bs, layer_off, rowlen, kvh, hd)
    pdl_enter()
    qb = np.int64(r) * qkv_stride + h * hd
    d = tid                                   # while loops: a range with a runtime step divides
    while d < hd:
        sh[np.uint32(d)] = qkv[qb + d] * scale
        d += T
    cuda.syncthreads()
    m = np.float32(-math.inf)
    l = np.float32(0.0)
    acc0 = np.float32(0.0)
    acc1 = np.float32(0.0)
    d1 = tid + T
    groups = np.uint32(T) // np.uint32(hd // 8)     # pv_tile's groups of threads
    t0 = p_begin
    while t0 < p_end:
        p = t0 + tid
        s = np.float32(-math.inf)
        if p < p_end:
            if t0 != p_begin:         # the first tile's offsets were looked up before the wait
                kb = kv_base(bt, mb, slot, p, bs, layer_off, rowlen, kvh, hd)
            base_s[np.uint32(tid)] = kb
            if kb >= 0:
                s = np.float32(0.0)
                c = 0
                while c < hd:                 # four 16-byte K loads in flight, summed in order
                    k0 = ld8(kc, kb + c)
                    k1 = ld8(kc, kb + min(c + 8, hd - 8))
                    k2 = ld8(kc, kb + min(c + 16, hd - 8))
                    k3 = ld8(kc, kb + min(c + 24, hd - 8))
                    s = qk8(s, sh, c, k0)
                    if c + 8 < hd:
                        s = qk8(s, sh, c + 8, k1)
                    if c + 16 < hd:
                        s = qk8(s, sh, c + 16, k2)
                    if c + 24 < hd:
                        s = qk8(s, sh, c + 24, k3)
                    c += 32
        tmax = block_max(s, red, tid, nw)
        m_new = max(m, tmax)
        e = np.float32(0.0)
        if p < p_end and s > np.float32(-math.inf):
            e = math.exp(s - m_new)
        sh[np.uint32(hd + tid)] = e
        tsum = block_sum(e, red, tid, nw)
        alpha = math.exp(m - m_new)
        l = l * alpha + tsum
        cnt = min(T, p_end - t0)
        cuda.syncthreads()
        pv_tile(sh, hd, base_s, vc, hd + T, tid, hd, cnt)
        cuda.syncthreads()
        if tid < hd:
            acc0 = acc0 * alpha + tile_sum(sh, hd + T, groups, hd, tid)
        if d1 < hd:
            acc1 = acc1 * alpha + tile_sum(sh, hd + T, groups, hd, d1)
        m = m_new
        cuda.syncthreads()
        t0 += T
    ob = np.int64(r) * out_stride + h * hd
    if ns == 1:
        if tid < hd:
            out[ob + tid] = acc0 / l
        if d1 < hd:
            out[ob + d1] = acc1 / l
        return
    rh = np.int64(r) * cuda.gridDim.y + h
    stride = hd + 2
    pb = (rh * maxs + sp) * stride
    if tid == 0:
        part[pb] = m
        part[pb + 1] = l
    if tid < hd:
        part[pb + 2 + tid] = acc0
    if d1 < hd:
        part[pb + 2 + d1] = acc1
    cuda.threadfence()
    cuda.syncthreads()
    if tid == 0:
        ticket = cuda.atomic.add(counters, rh, 1)
        flag[0] = 1 if ticket == ns - 1 else 0
    cuda.syncthreads()
    if flag[0] == 0:
        return
    cuda.threadfence()
    rb = rh * maxs * stride                   # the last block merges splits 0..ns-1 in order
    M = np.float32(-math.inf)
    for k in range(ns):
        M = max(M, ld_l2(part, rb + k * stride))
    L = np.float32(0.0)
    for k in range(ns):
        L += ld_l2(part, rb + k * stride + 1) * math.exp(ld_l2(part, rb + k * stride) - M)
    d = tid
    while d < hd:
        o = np.float32(0.0)
        for k in range(ns):
            o += ld_l2(part, rb + k * stride + 2 + d) * math.exp(ld_l2(part, rb + k * stride) - M)
        out[ob + d] = o / L
        d += T
    if tid == 0:
        counters[rh] = 0

SIGNATURES["k_attn_rows"] = lambda t: _attn(t)


@cuda.jit(device=True, inline="always")
def part_base(row, h, nh, maxs, hd):
    """Where (row, query head h)'s split partials start in `part`: maxs records of (max, sum, acc[hd])."""
    return (np.int64(row) * nh + h) * maxs * (hd + 2)


@cuda.jit(device=True, inline="always")
def merge_splits(sh, wo, lo, part, counters, flag, positions, out, out_stride, r0, nq, group, kvh, nkv, hd, split,
                 maxs, tile, ns, qi, sub, active, n_q, rb, tid, T):
    """The end of a prompt-attention block (128 threads: TQ lanes per query qi) whose split partials
    (max, sum, acc) are in `part` (query qi's from rb): the (tile, KV head)'s last block to finish
    merges each query's splits into `out`. Shared scratch: weights at sh[wo + qi * maxs + k], sums at
    sh[lo + qi]. Index arithmetic in unsigned 32 bits where it divides (P42)."""
    stride = hd + 2
    cuda.threadfence()
    cuda.syncthreads()
    if tid == 0:
        ticket = cuda.atomic.add(counters, tile * nkv + kvh, 1)
        flag[0] = 1 if ticket == ns - 1 else 0
    cuda.syncthreads()
    if flag[0] == 0:
        return
    cuda.threadfence()
    # The last block merges each query's splits 0..nsq-1: the query's lanes find the max M over the
    # splits and their weights exp(m_k - M) (into shared, over the K/V tile), and sum l_k x weight
    # (lane partials in ascending k, then the lanes' tree); then thread tid takes dims tid % hd (+ T, ...
    # when hd > T) of queries tid // hd, + T // hd, ... and sums acc_k x weight over k in ascending
    # order, four loads in flight.
    nsq = cdiv(n_q, split)
    big = np.float32(-math.inf)
    for k in range(sub, nsq, TQ):
        big = max(big, ld_l2(part, rb + k * stride))
    big = lanes_max(big)
    lp = np.float32(0.0)
    for k in range(sub, nsq, TQ):
        w = math.exp(ld_l2(part, rb + k * stride) - big)
        sh[np.uint64(wo + qi * maxs + k)] = w
        lp += ld_l2(part, rb + k * stride + 1) * w
    lp = lanes_sum(lp)
    if active and sub == 0:
        sh[np.uint64(lo + qi)] = lp
    cuda.syncthreads()
    per = max(np.uint32(T) // np.uint32(hd), np.uint32(1))      # queries a pass
    qq, d0 = divmod_u32(tid, hd)
    if qq >= per:
        qq = np.uint32(nq)                          # threads past the last whole query idle
    while qq < nq:
        qr, qh = divmod_u32(qq, group)
        rq = r0 + qr
        hq = kvh * group + qh
        nk = cdiv(positions[rq] + 1, split)          # query qq's nsq
        wq = np.uint32(wo + qq * maxs)
        d = np.int64(d0)             # a while loop: a range with a runtime step divides (d0 is unsigned:
        while d < hd:                # d0 + T would unify to float64)
            src = part_base(rq, hq, nkv * group, maxs, hd) + 2 + d
            o = ld_l2(part, src) * sh[wq]
            k = np.uint32(1)
            while k + 3 < nk:
                x1 = ld_l2(part, src + k * stride)
                x2 = ld_l2(part, src + (k + 1) * stride)
                x3 = ld_l2(part, src + (k + 2) * stride)
                x4 = ld_l2(part, src + (k + 3) * stride)
                o += x1 * sh[np.uint32(wq + k)]
                o += x2 * sh[np.uint32(wq + k + 1)]
                o += x3 * sh[np.uint32(wq + k + 2)]
                o += x4 * sh[np.uint32(wq + k + 3)]
                k += 4
            while k < nk:
                o += ld_l2(part, src + k * stride) * sh[np.uint32(wq + k)]
                k += 1
            out[np.int64(rq) * out_stride + hq * hd + d] = o / sh[np.uint32(lo + qq)]
            d += T
        qq += per
    if tid == 0:
        counters[tile * nkv + kvh] = 0


@cuda.jit(cache=True)
def k_attn_tiles(qkv, qkv_stride, positions, tiles, slots, bt, mb, kc, vc, layer_off, bs, nkv, hd, group,
                 scale, out, out_stride, part, counters, maxs):
    """Prompt rows' causal GQA attention over the paged pool: one block per (row tile, KV head,
    context split).

    A row tile is up to QB // group consecutive rows of one sequence at consecutive positions (tiles:
    first row, rows, split); its queries are those rows x the KV head's `group` query heads, so every
    K/V tile is read from the pool once for all of them (a prompt chunk's rows share the whole context).
    Splits cut the context at absolute multiples of the tile's `split` (one for all its rows: a function
    of a row's position, attention_plan); a query with n = position + 1 uses the first ceil(n / split)
    splits. Per split, TP-position K/V tiles are staged in shared memory as float32; lane `sub` of a
    query scores positions sub, sub + TQ, ... (a dot over head_dim in ascending order), the tile's max
    and sum are TQ-lane xor trees, and the lane owns dims sub, sub + TQ, ... of the output, summing
    weight x V over the query's own positions in ascending order into an accumulator the tile's max
    rescales. Positions past the query's own are never summed: what a query computes depends on its
    position and the pool alone, never on its tile mates, the tile it lands in or the batch. Several
    splits write (max, sum, acc) partials; the tile's last block to finish (a counter per tile and KV
    head) merges each query's splits in ascending order (one split merges to exactly acc / sum, the
    value a single-split tile writes directly).
    Dynamic shared: attn_shared_floats(hd, maxs). Grid (tiles, nkv, the most splits a tile has);
    blocks past their tile's splits return at once.
    """
    pdl_enter()
    sh = cuda.shared.array(0, nb_f32)
    base_s = cuda.shared.array(TP, nb_i64)
    flag = cuda.shared.array(1, nb_i32)
    tile = cuda.blockIdx.x
    kvh = cuda.blockIdx.y
    sp = cuda.blockIdx.z
    tid = cuda.threadIdx.x
    T = cuda.blockDim.x
    r0 = tiles[3 * tile]
    nrows = tiles[3 * tile + 1]
    split = tiles[3 * tile + 2]
    nq = nrows * group
    n_max = positions[r0 + nrows - 1] + 1    # the tile's rows are at consecutive positions
    ns = cdiv(n_max, split)
    if sp >= ns:
        return
    qi = tid // TQ
    sub = tid - qi * TQ
    active = qi < nq
    qr, qh = divmod_u32(min(qi, nq - 1), group)
    row = r0 + qr
    h = kvh * group + qh
    n_q = positions[row] + 1 if active else 0
    hs = hd + 1                       # row stride of q, K, acc in shared (odd: no bank conflicts)
    hv = v_stride(hd)                 # V's: lane sub reads dims sub + TQ i unclamped
    ko = QB * hs
    vo = ko + TP * hs
    po = vo + TP * hv
    ao = po + QB * (TP + 1)
    qrow = qi * hs
    prow = po + qi * (TP + 1)
    arow = ao + qi * hs
    for i in range(tid, QB * hd, T):
        qq = i // hd
        d = i - qq * hd
        v = np.float32(0.0)
        if qq < nq:
            v = qkv[np.int64(r0 + qq // group) * qkv_stride + (kvh * group + qq % group) * hd + d] * scale
        sh[np.uint64(qq * hs + d)] = v
        sh[np.uint64(ao + qq * hs + d)] = np.float32(0.0)
    p_begin = sp * split
    p_end = min(p_begin + split, n_max)
    slot = slots[r0]
    rowlen = np.int64(nkv) * hd
    c8 = hd // 8
    nchunks = TP * c8
    z = np.float32(0.0)
    zero8 = (z, z, z, z, z, z, z, z)
    s = cuda.local.array(PPT, nb_f32)
    a = cuda.local.array(8, nb_f32)
    m = np.float32(-math.inf)
    l = np.float32(0.0)
    for t0 in range(p_begin, p_end, TP):
        cuda.syncthreads()            # the previous tile's K, V and weights are no longer read
        if tid < TP:
            kb = np.int64(-1)
            if t0 + tid < p_end:
                kb = kv_base(bt, mb, slot, t0 + tid, bs, layer_off, rowlen, kvh, hd)
            base_s[tid] = kb
        cuda.syncthreads()
        for c in range(tid, nchunks, 2 * T):     # two 8-element chunks of K and of V in flight
            c2 = min(c + T, nchunks - 1)
            pp = c // c8
            pp2 = c2 // c8
            o = (c - pp * c8) * 8
            o2 = (c2 - pp2 * c8) * 8
            b1 = base_s[pp]
            b2 = base_s[pp2]
            k1 = ld8(kc, max(b1, 0) + o)
            v1 = ld8(vc, max(b1, 0) + o)
            k2 = ld8(kc, max(b2, 0) + o2)
            v2 = ld8(vc, max(b2, 0) + o2)
            if b1 < 0:
                k1 = zero8
                v1 = zero8
            if b2 < 0:
                k2 = zero8
                v2 = zero8
            st8(sh, ko + pp * hs + o, k1)
            st8(sh, vo + pp * hv + o, v1)
            if c + T < nchunks:
                st8(sh, ko + pp2 * hs + o2, k2)
                st8(sh, vo + pp2 * hv + o2, v2)
        cuda.syncthreads()
        for j in range(PPT):
            s[j] = np.float32(0.0)
        for d in range(0, hd, 4):          # four dims a trip: the loads share one address
            q0 = sh[np.uint64(qrow + d)]
            q1 = sh[np.uint64(qrow + d + 1)]
            q2 = sh[np.uint64(qrow + d + 2)]
            q3 = sh[np.uint64(qrow + d + 3)]
            for j in range(PPT):
                kb = ko + (j * TQ + sub) * hs + d
                x = s[j]
                x += q0 * sh[np.uint64(kb)]
                x += q1 * sh[np.uint64(kb + 1)]
                x += q2 * sh[np.uint64(kb + 2)]
                x += q3 * sh[np.uint64(kb + 3)]
                s[j] = x
        tmax = np.float32(-math.inf)
        for j in range(PPT):
            if t0 + j * TQ + sub >= n_q:
                s[j] = np.float32(-math.inf)
            tmax = max(tmax, s[j])
        tmax = lanes_max(tmax)
        m_new = max(m, tmax)
        tsum = np.float32(0.0)
        for j in range(PPT):
            e = np.float32(0.0)
            if s[j] > np.float32(-math.inf):
                e = math.exp(s[j] - m_new)
            sh[np.uint64(prow + j * TQ + sub)] = e
            tsum += e
        tsum = lanes_sum(tsum)
        cuda.syncthreads()            # the query's weights are visible to all its lanes
        if t0 < n_q:
            alpha = math.exp(m - m_new)
            l = l * alpha + tsum
            cnt = min(TP, n_q - t0)
            for g in range(0, hd, 8 * TQ):
                for i in range(8):
                    a[i] = np.float32(0.0)
                vg = vo + g + sub
                pp = 0
                while pp + 3 < cnt:       # four positions a trip, each dim's sum in ascending order
                    w0 = sh[np.uint64(prow + pp)]
                    w1 = sh[np.uint64(prow + pp + 1)]
                    w2 = sh[np.uint64(prow + pp + 2)]
                    w3 = sh[np.uint64(prow + pp + 3)]
                    b0 = vg + pp * hv
                    for i in range(8):
                        x = a[i]
                        x += w0 * sh[np.uint64(b0 + i * TQ)]
                        x += w1 * sh[np.uint64(b0 + hv + i * TQ)]
                        x += w2 * sh[np.uint64(b0 + 2 * hv + i * TQ)]
                        x += w3 * sh[np.uint64(b0 + 3 * hv + i * TQ)]
                        a[i] = x
                    pp += 4
                while pp < cnt:
                    w0 = sh[np.uint64(prow + pp)]
                    b0 = vg + pp * hv
                    for i in range(8):
                        a[i] += w0 * sh[np.uint64(b0 + i * TQ)]
                    pp += 1
                for i in range(8):
                    d = g + sub + i * TQ
                    if d < hd:
                        sh[np.uint64(arow + d)] = sh[np.uint64(arow + d)] * alpha + a[i]
            m = m_new
    ob = np.int64(row) * out_stride + h * hd
    if ns == 1:
        if active:
            for d in range(sub, hd, TQ):
                out[ob + d] = sh[np.uint64(arow + d)] / l
        return
    stride = hd + 2
    rb = part_base(row, h, nkv * group, maxs, hd)
    if active and p_begin < n_q:
        pb = rb + sp * stride
        if sub == 0:
            part[pb] = m
            part[pb + 1] = l
        for d in range(sub, hd, TQ):
            part[pb + 2 + d] = sh[np.uint64(arow + d)]
    merge_splits(sh, ko, 0, part, counters, flag, positions, out, out_stride, r0, nq, group, kvh, nkv, hd, split,
                 maxs, tile, ns, qi, sub, active, n_q, rb, tid, T)

SIGNATURES["k_attn_tiles"] = lambda t: _attn(t)


@cuda.jit(device=True, inline="always")
def softmax_step(m, mn, a, b, c, d):
    """One online-softmax step of a query row: (the old accumulator's factor exp(m - mn), the weights
    exp(x - mn) of scores a..d); masked scores (-inf) weigh 0, and a row with no score yet keeps 1."""
    if mn == -math.inf:
        return np.float32(1.0), np.float32(0.0), np.float32(0.0), np.float32(0.0), np.float32(0.0)
    return (math.exp(m - mn), math.exp(a - mn), math.exp(b - mn), math.exp(c - mn), math.exp(d - mn))


@cuda.jit(device=True, inline="always")
def att_load(kw, vv, kc, vc, bt, mb, slot, pb, p_end, bs, layer_off, rowlen, kvh, hd, nch, nj, g, t, lane, hdm):
    """k_attn_mma's pool words for the 16-position block at pb (zeros past p_end or hd; hdm is the kernel's
    head_dim bound, a constant: the loops unroll and kw, vv stay in registers): K of positions
    pb + g and pb + 8 + g at dims 32c + 8t .. + 7 into kw[8c .. 8c+3] and kw[8c+4 .. 8c+7]; V of
    positions pb + 2pr and pb + 2pr + 1 (pr = lane % 8) at dims 8dg .. + 7 for the lane's units
    u = lane + MMA i (dg = u // 8) into vv[8i .. 8i+3] and vv[8i+4 .. 8i+7].
    Lane L looks up the pool offset of position pb + L % 16 (-1 past p_end or without a block) and
    the lanes take the offsets they read from each other: one block-table lookup a lane, not six.
    Called by all 32 lanes of the warp (pb is the same in all)."""
    z = np.uint32(0)
    p = pb + lane % 16
    mine = np.int64(-1)
    if p < p_end:
        mine = kv_base(bt, mb, slot, p, bs, layer_off, rowlen, kvh, hd)
    k0 = lane_take(mine, g)
    k1 = lane_take(mine, g + 8)
    va = lane_take(mine, 2 * (lane % 8))
    vb = lane_take(mine, 2 * (lane % 8) + 1)
    for c in range(hdm // 32):
        d = c * 32 + 8 * t
        w0 = w1 = w2 = w3 = u0 = u1 = u2 = u3 = z
        if c < nch and d < hd:
            if k0 >= 0:
                w0, w1, w2, w3 = ld_words(kc, k0 + d)
            if k1 >= 0:
                u0, u1, u2, u3 = ld_words(kc, k1 + d)
        kw[8 * c], kw[8 * c + 1], kw[8 * c + 2], kw[8 * c + 3] = w0, w1, w2, w3
        kw[8 * c + 4], kw[8 * c + 5], kw[8 * c + 6], kw[8 * c + 7] = u0, u1, u2, u3
    for i in range(hdm // MMA):
        u = lane + MMA * i
        dg = u // 8
        x0 = x1 = x2 = x3 = y0 = y1 = y2 = y3 = z
        if u < nj * 8:
            if va >= 0:
                x0, x1, x2, x3 = ld_words(vc, va + 8 * dg)
            if vb >= 0:
                y0, y1, y2, y3 = ld_words(vc, vb + 8 * dg)
        vv[8 * i], vv[8 * i + 1], vv[8 * i + 2], vv[8 * i + 3] = x0, x1, x2, x3
        vv[8 * i + 4], vv[8 * i + 5], vv[8 * i + 6], vv[8 * i + 7] = y0, y1, y2, y3


@cuda.jit(device=True, inline="always")
def att_block(kw, vv, qw, vt, acc, m_a, m_b, l_a, l_b, pb, n_a, n_b, nch, nj, vw, g, t, lane, hdm):
    """k_attn_mma's work on one 16-position block at pb, whose K and V words att_load put in kw, vv:
    S = q K^T by mma, positions at or past a row's n (n_a for row g, n_b for row g + 8) masked, the
    online-softmax step of (m, l) and acc, then P (hi + lo) V by mma with V staged in this warp's V^T
    (from word vw of vt). Returns the new (m_a, m_b, l_a, l_b). Shared-memory indices are unsigned:
    numba wraps signed ones around for negative values (instructions in every access: P42,
    docs/gpu.md#what-numbas-code-generation-adds)."""
    ninf = np.float32(-math.inf)
    s0 = s1 = s2 = s3 = s4 = s5 = s6 = s7 = np.float32(0.0)
    for c in range(hdm // 32):
        if c < nch:
            o = np.uint32(c * 16 * MMA + lane)
            h0, h1, h2, h3 = qw[o], qw[o + MMA], qw[o + 2 * MMA], qw[o + 3 * MMA]
            h4, h5, h6, h7 = qw[o + 4 * MMA], qw[o + 5 * MMA], qw[o + 6 * MMA], qw[o + 7 * MMA]
            e0, e1, e2, e3 = qw[o + 8 * MMA], qw[o + 9 * MMA], qw[o + 10 * MMA], qw[o + 11 * MMA]
            e4, e5, e6, e7 = qw[o + 12 * MMA], qw[o + 13 * MMA], qw[o + 14 * MMA], qw[o + 15 * MMA]
            s0, s1, s2, s3 = mma_chunk(h0, h1, h2, h3, h4, h5, h6, h7, e0, e1, e2, e3, e4, e5, e6, e7,
                                       kw[8 * c], kw[8 * c + 1], kw[8 * c + 2], kw[8 * c + 3], s0, s1, s2, s3)
            s4, s5, s6, s7 = mma_chunk(h0, h1, h2, h3, h4, h5, h6, h7, e0, e1, e2, e3, e4, e5, e6, e7,
                                       kw[8 * c + 4], kw[8 * c + 5], kw[8 * c + 6], kw[8 * c + 7], s4, s5, s6, s7)
    # lane (g, t): s0, s1 / s2, s3 = rows g / g+8 at positions pb + 2t, + 1; s4 .. s7 at pb + 8 + 2t, + 1;
    # a row keeps the block's first n - pb positions: offsets 2t, 2t + 1, 8 + 2t, 9 + 2t (32-bit compares)
    keep_a = np.int32(n_a - pb)
    keep_b = np.int32(n_b - pb)
    o0 = np.int32(2 * t)
    o1 = np.int32(2 * t + 1)
    o8 = np.int32(2 * t + 8)
    o9 = np.int32(2 * t + 9)
    s0 = s0 if o0 < keep_a else ninf
    s1 = s1 if o1 < keep_a else ninf
    s4 = s4 if o8 < keep_a else ninf
    s5 = s5 if o9 < keep_a else ninf
    s2 = s2 if o0 < keep_b else ninf
    s3 = s3 if o1 < keep_b else ninf
    s6 = s6 if o8 < keep_b else ninf
    s7 = s7 if o9 < keep_b else ninf
    mn_a = max(m_a, quad_max(max(max(s0, s1), max(s4, s5))))
    mn_b = max(m_b, quad_max(max(max(s2, s3), max(s6, s7))))
    al_a, s0, s1, s4, s5 = softmax_step(m_a, mn_a, s0, s1, s4, s5)
    al_b, s2, s3, s6, s7 = softmax_step(m_b, mn_b, s2, s3, s6, s7)
    l_a = l_a * al_a + quad_sum(s0 + s1 + s4 + s5)
    l_b = l_b * al_b + quad_sum(s2 + s3 + s6 + s7)
    pa0, qa0 = split_bf16(s0, s1)
    pb0, qb0 = split_bf16(s2, s3)
    pa1, qa1 = split_bf16(s4, s5)
    pb1, qb1 = split_bf16(s6, s7)
    # V of the 16 positions into this warp's V^T: unit u = lane + MMA i (pair lane % 8, dims 8dg ..)
    mma_sync()
    for i in range(hdm // MMA):
        u = lane + MMA * i
        if u < nj * 8:
            dg = u // 8
            o = np.uint32(vw + 8 * dg * VT_STRIDE + u - dg * 8)
            for j in range(4):
                x = vv[8 * i + j]
                y = vv[8 * i + 4 + j]
                vt[o + 2 * j * VT_STRIDE] = (x & np.uint32(0xFFFF)) | (y << np.uint32(16))
                vt[o + (2 * j + 1) * VT_STRIDE] = (x >> np.uint32(16)) | (y & np.uint32(0xFFFF0000))
    mma_sync()
    for j in range(hdm // 8):
        if j < nj:
            o = np.uint32(vw + (8 * j + g) * VT_STRIDE + t)
            b0 = vt[o]
            b1 = vt[o + 4]
            c0 = acc[4 * j] * al_a
            c1 = acc[4 * j + 1] * al_a
            c2 = acc[4 * j + 2] * al_b
            c3 = acc[4 * j + 3] * al_b
            c0, c1, c2, c3 = mma_bf16(pa0, pb0, pa1, pb1, b0, b1, c0, c1, c2, c3)
            acc[4 * j], acc[4 * j + 1], acc[4 * j + 2], acc[4 * j + 3] = \
                mma_bf16(qa0, qb0, qa1, qb1, b0, b1, c0, c1, c2, c3)
    return mn_a, mn_b, l_a, l_b


@cuda.jit(device=True, inline="always")
def attn_mma(qkv, qkv_stride, positions, tiles, slots, bt, mb, kc, vc, layer_off, bs, nkv, hd, group, scale, out,
             out_stride, part, counters, maxs, hdm, qw, vt, acc, kw, vv, kn, vn):
    """k_attn_tiles on the tensor cores (bf16 pool): the same grid, tiles, splits and split merge, for
    MQ queries a tile (MQ // group rows x the KV head's query heads).

    Each of the block's ATT_WARPS warps takes every ATT_WARPS-th 16-position block of the split with its own
    online softmax: S = q K^T by mma (q scaled, as bf16 hi + lo from shared memory; K straight from the
    pool, lane (g, t) reading dims 8t .. 8t+7 of position g of each n8 tile, the k permutation of
    k_gemm), positions past a query's own masked; per row the block's max and sum are quad trees
    over the lane's four values in order; P (hi + lo) times V by mma, V staged per warp in shared
    memory as V^T bf16 pairs (att_block); the next block's K and V loads are issued before this
    block's mmas (att_load). The warps' (max, sum, acc) merge in warp order, then the split's
    partial goes where k_attn_tiles puts it and merge_splits finishes. A query's arithmetic depends on
    its position and the pool alone (the 16-position blocks and the warp that takes each are fixed by
    absolute position), never on its tile mates, the tile it lands in or the batch.
    Block: ATT_WARPS * MMA threads. Dynamic shared: attn_mma_shared_floats(hd, maxs). hdm: the kernel's
    head_dim bound (MMA_HDS), a constant: the loops over dims unroll and the lane's accumulators and K/V
    words (acc, kw, vv, kn, vn: hdm / 2, hdm / 4 each) stay in registers; q words (qw, MQ hdm) and
    the warps' V^T (vt, ATT_WARPS hdm VT_STRIDE) are the block's shared arrays."""
    sh = cuda.shared.array(0, nb_f32)
    flag = cuda.shared.array(1, nb_i32)
    tile = cuda.blockIdx.x
    kvh = cuda.blockIdx.y
    sp = cuda.blockIdx.z
    tid = cuda.threadIdx.x
    T = cuda.blockDim.x
    w = tid // MMA
    lane = tid % MMA
    g = lane // 4
    t = lane % 4
    r0 = tiles[3 * tile]
    nrows = tiles[3 * tile + 1]
    split = tiles[3 * tile + 2]
    nq = nrows * group
    n_max = positions[r0 + nrows - 1] + 1
    ns = cdiv(n_max, split)
    if sp >= ns:
        return
    p_begin = sp * split
    p_end = min(p_begin + split, n_max)
    slot = slots[r0]
    rowlen = np.int64(nkv) * hd
    nch = (hd + 31) // 32
    # q (scaled) as the mma's A words: chunk c, lane L: rows gL and gL + 8 at dims 32c + 8tL .. + 7,
    # words j = 0..7 hi (row pairs interleaved as the A fragment wants them), 8..15 lo; the block's
    # threads outnumber the nch * MMA units
    if tid < nch * MMA:
        c = tid // MMA
        ln = tid - c * MMA
        d = c * 32 + 8 * (ln % 4)
        for half in range(2):
            qq = ln // 4 + 8 * half
            v0 = v1 = v2 = v3 = v4 = v5 = v6 = v7 = np.float32(0.0)
            if qq < nq and d < hd:
                qr, qh = divmod_u32(qq, group)
                v0, v1, v2, v3, v4, v5, v6, v7 = ld8(qkv, np.int64(r0 + qr) * qkv_stride
                                                     + (kvh * group + qh) * hd + d)
            o = np.uint32(c * 16 * MMA + half * MMA + ln)
            qw[o], qw[o + 8 * MMA] = split_bf16(v0 * scale, v1 * scale)
            qw[o + 2 * MMA], qw[o + 10 * MMA] = split_bf16(v2 * scale, v3 * scale)
            qw[o + 4 * MMA], qw[o + 12 * MMA] = split_bf16(v4 * scale, v5 * scale)
            qw[o + 6 * MMA], qw[o + 14 * MMA] = split_bf16(v6 * scale, v7 * scale)
    cuda.syncthreads()
    qa = g
    qb = g + 8
    # a row's scores count up to its own position and the split's end
    n_a = min(positions[r0 + divmod_u32(min(qa, nq - 1), group)[0]] + 1, p_end) if qa < nq else 0
    n_b = min(positions[r0 + divmod_u32(min(qb, nq - 1), group)[0]] + 1, p_end) if qb < nq else 0
    ninf = np.float32(-math.inf)
    m_a = ninf
    m_b = ninf
    l_a = np.float32(0.0)
    l_b = np.float32(0.0)
    for i in range(hdm // 2):                    # O: dim tile j's C fragment at 4j .. 4j+3
        acc[i] = np.float32(0.0)
    nj = hd // 8
    vw = w * hdm * VT_STRIDE
    # the block's K and V words in registers, the next block's loads issued before this one's mmas;
    # the two register sets take turns (no copies between them)
    step = 16 * ATT_WARPS
    pb = p_begin + 16 * w
    att_load(kw, vv, kc, vc, bt, mb, slot, pb, p_end, bs, layer_off, rowlen, kvh, hd, nch, nj, g, t, lane, hdm)
    while pb < p_end:
        att_load(kn, vn, kc, vc, bt, mb, slot, pb + step, p_end, bs, layer_off, rowlen, kvh, hd, nch, nj, g, t, lane,
                 hdm)
        m_a, m_b, l_a, l_b = att_block(kw, vv, qw, vt, acc, m_a, m_b, l_a, l_b, pb, n_a, n_b, nch, nj, vw, g, t, lane,
                                       hdm)
        pb += step
        if pb >= p_end:
            break
        att_load(kw, vv, kc, vc, bt, mb, slot, pb + step, p_end, bs, layer_off, rowlen, kvh, hd, nch, nj, g, t, lane,
                 hdm)
        m_a, m_b, l_a, l_b = att_block(kn, vn, qw, vt, acc, m_a, m_b, l_a, l_b, pb, n_a, n_b, nch, nj, vw, g, t, lane,
                                       hdm)
        pb += step
    # the warps' states into shared: max and sum at [w * MQ + q] and [ATT_WARPS MQ + w * MQ + q], acc after
    # (unsigned indices, as in att_block)
    ao = 2 * ATT_WARPS * MQ
    if t == 0:
        sh[np.uint32(w * MQ + qa)] = m_a
        sh[np.uint32(w * MQ + qb)] = m_b
        sh[np.uint32(ATT_WARPS * MQ + w * MQ + qa)] = l_a
        sh[np.uint32(ATT_WARPS * MQ + w * MQ + qb)] = l_b
    sa = np.uint32(ao + (w * MQ + qa) * hd + 2 * t)
    sb = np.uint32(ao + (w * MQ + qb) * hd + 2 * t)
    for j in range(hdm // 8):
        if j < nj:
            sh[sa + 8 * j], sh[sa + 8 * j + 1] = acc[4 * j], acc[4 * j + 1]
            sh[sb + 8 * j], sh[sb + 8 * j + 1] = acc[4 * j + 2], acc[4 * j + 3]
    cuda.syncthreads()
    # merge the warps in order: thread (query qi = tid // TQ, lane sub) takes dims sub, sub + TQ, ...
    qi = tid // TQ
    sub = tid - qi * TQ
    active = qi < nq
    qr, qh = divmod_u32(min(qi, nq - 1), group)
    row = r0 + qr
    h = kvh * group + qh
    n_q = positions[row] + 1 if active else 0
    big = ninf
    if qi < MQ:
        for u in range(ATT_WARPS):
            big = max(big, sh[np.uint32(u * MQ + qi)])
    l = np.float32(0.0)
    ob = np.int64(row) * out_stride + h * hd
    rb = part_base(row, h, nkv * group, maxs, hd)
    pbase = rb + sp * (hd + 2)
    if active and p_begin < n_q:
        # each warp's weight exp(m_w - big), once; warps without a score for the query are left out
        wt = cuda.local.array(ATT_WARPS, nb_f32)
        has = cuda.local.array(ATT_WARPS, nb_i32)
        for u in range(ATT_WARPS):
            mu = sh[np.uint32(u * MQ + qi)]
            has[u] = mu > ninf
            wt[u] = np.float32(0.0)
            if has[u]:
                wt[u] = math.exp(mu - big)
                l += sh[np.uint32(ATT_WARPS * MQ + u * MQ + qi)] * wt[u]
        for d in range(sub, hd, TQ):
            x = np.float32(0.0)
            for u in range(ATT_WARPS):
                if has[u]:
                    x += sh[np.uint32(ao + (u * MQ + qi) * hd + d)] * wt[u]
            if ns == 1:
                out[ob + d] = x / l
            else:
                part[pbase + 2 + d] = x
        if ns > 1 and sub == 0:
            part[pbase] = big
            part[pbase + 1] = l
    if ns == 1:
        return
    cuda.syncthreads()   # the warps' states are read: merge_splits may reuse the shared memory
    merge_splits(sh, 0, MQ * maxs, part, counters, flag, positions, out, out_stride, r0, nq, group, kvh, nkv, hd,
                 split, maxs, tile, ns, qi, sub, active, n_q, rb, tid, T)


def _attn_mma_kernel(hdm: int):
    """k_attn_mma for head_dim up to hdm: attn_mma with its shared and local arrays sized for hdm."""
    qwn, vtn, accn, kwn = MQ * hdm, ATT_WARPS * hdm * VT_STRIDE, hdm // 2, hdm // 4

    def kernel(qkv, qkv_stride, positions, tiles, slots, bt, mb, kc, vc, layer_off, bs, nkv, hd, group, scale,
               out, out_stride, part, counters, maxs):
        """Prompt attention on the tensor cores for head_dim <= hdm (attn_mma)."""
        pdl_enter()
        attn_mma(qkv, qkv_stride, positions, tiles, slots, bt, mb, kc, vc, layer_off, bs, nkv, hd, group, scale,
                 out, out_stride, part, counters, maxs, hdm,
                 cuda.shared.array(qwn, nb_u32), cuda.shared.array(vtn, nb_u32), cuda.local.array(accn, nb_f32),
                 cuda.local.array(kwn, nb_u32), cuda.local.array(kwn, nb_u32),
                 cuda.local.array(kwn, nb_u32), cuda.local.array(kwn, nb_u32))
    return cuda.jit(cache=True, **({} if SIM else {"max_registers": MMA_ATTN_REGISTERS[hdm]}))(kernel)


k_attn_mma, k_attn_mma_wide = (_attn_mma_kernel(hdm) for hdm in MMA_HDS)
SIGNATURES["k_attn_mma"] = SIGNATURES["k_attn_mma_wide"] = lambda t: _attn(t) if t.bf16 else None  # bf16 pools


def attn_mma_shared_floats(hd: int, maxs: int) -> int:
    """k_attn_mma's dynamic shared memory in floats: the warps' (max, sum, acc), then merge_splits'."""
    return max(2 * ATT_WARPS * MQ + ATT_WARPS * MQ * hd, MQ * maxs + MQ)


def attn_shared_floats(hd: int, maxs: int) -> int:
    """k_attn_tiles' dynamic shared memory in floats: q, K tile, V tile, weights, acc, and the merge's
    split weights over the K/V tile."""
    hs = hd + 1
    return max(2 * QB * hs + TP * (hs + v_stride.py_func(hd)) + QB * (TP + 1), QB * hs + QB * maxs)
