"""The model's CUDA kernels (numba.cuda), and the few primitives they are built from.

Conventions (every kernel):
- Activations are float32. Weights and the KV pool are in the storage dtype, told apart by the array
  element type the kernel is compiled for: ``uint16`` = bfloat16 bits, ``float16``, ``float32``. Each
  kernel is compiled once per storage dtype; every load widens to float32 and every sum is float32.
- Arrays are 1-D and C-contiguous; the backend passes element offsets and strides. Weight matrices
  are row-major with rows padded with zeros to ``Kp`` (a multiple of 8 elements), so each lane reads
  8 elements with one 16-byte ``ld.global.nc.v4.u32`` (two for float32).
- Determinism by construction: one block (or one warp) owns an output row; every reduction is a fixed
  tree (per-lane strided partials in ascending order, a xor-butterfly across the warp, warps summed
  in ascending order). Which rows share a launch never changes any row's arithmetic: the launch
  geometry of a kernel depends on the model's shapes only, never on the batch.
- Warp-level primitives are called by whole warps (never under lane-divergent control flow); a block
  only leaves early where the condition is uniform over the block or over the warp.

Under numba's CUDA simulator (NUMBA_ENABLE_CUDASIM=1) the same kernel bodies run in Python; the
primitives (vector loads, dtype conversions, warp reductions) then have plain-Python twins below, and
the "warp" is ``WARP = 4`` lanes wide so the simulator's one-OS-thread-per-CUDA-thread stays cheap
while multi-lane and multi-warp paths are still exercised.
"""
from __future__ import annotations

import math

import numpy as np

from . import compat  # noqa: F401  (numpy row_stack alias before numba-cuda compiles anything)

import numba  # noqa: E402
from numba import cuda  # noqa: E402
from numba import float32 as nb_f32, int64 as nb_i64  # noqa: E402

SIM = bool(getattr(numba.config, "ENABLE_CUDASIM", 0))
WARP = 4 if SIM else 32
MAX_TILE = 256          # attention tile (= its block size) upper bound; static shared array size

if SIM:  # ------------------------------------------------------------------ simulator twins
    import threading

    _sim_lock = threading.Lock()

    def _to_f32(v, dt):
        if dt == np.uint16:
            return np.array([np.uint32(v) << np.uint32(16)], np.uint32).view(np.float32)[0]
        return np.float32(v)

    def ld8(arr, i):
        """8 consecutive elements from `arr[i]` as float32 (a 16-byte vector load on the GPU)."""
        dt = arr.dtype
        return tuple(_to_f32(arr[i + j], dt) for j in range(8))

    def ldf(arr, i):
        """One element as float32 (bf16 = uint16 bits)."""
        return _to_f32(arr[i], arr.dtype)

    def stf(arr, i, v):
        """Store a float32 in the array's storage dtype (bf16: round to nearest even)."""
        if arr.dtype == np.uint16:
            u = int(np.array([v], np.float32).view(np.uint32)[0])
            arr[i] = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) & 0xFFFF
        else:
            arr[i] = v

    def _warp_exchange(v):
        th = threading.current_thread()
        mgr = th._manager
        warp, lane = divmod(th.thread_id, WARP)
        with _sim_lock:
            table = mgr.__dict__.setdefault("_tt_warps", {})
            if warp not in table:
                nthreads = int(np.prod(mgr._block_dim))
                parties = min(WARP, nthreads - warp * WARP)
                table[warp] = (threading.Barrier(parties), np.zeros(WARP, np.float32))
            bar, buf = table[warp]
        buf[lane] = v
        bar.wait()
        vals = buf.copy()
        bar.wait()
        return vals, lane

    def warp_sum(v):
        """Xor-butterfly sum over the warp, the same tree as the GPU's shfl_xor version."""
        vals, lane = _warp_exchange(v)
        idx = np.arange(WARP)
        off = WARP // 2
        while off:
            vals = (vals + vals[idx ^ off]).astype(np.float32)
            off //= 2
        return vals[lane]

    def warp_max(v):
        vals, lane = _warp_exchange(v)
        return np.float32(vals.max())

else:  # ------------------------------------------------------------------------ GPU primitives
    from llvmlite import ir
    from numba.cuda import types as nbt
    from numba.cuda.extending import intrinsic

    _I16, _I32, _I64 = ir.IntType(16), ir.IntType(32), ir.IntType(64)
    _F32 = ir.FloatType()
    _STORAGE = (nbt.uint16, nbt.float16, nbt.float32)

    def _elem_ptr(context, builder, aryty, ary, idx, idxty):
        a = context.make_array(aryty)(context, builder, value=ary)
        i = context.cast(builder, idx, idxty, nbt.int64)
        return builder.gep(a.data, [i])

    def _ldg_v4(builder, ptr):
        """ld.global.nc.v4.u32: 16 bytes through the read-only data path (ptr must be 16-aligned)."""
        addr = builder.ptrtoint(ptr, _I64)
        fnty = ir.FunctionType(ir.LiteralStructType([_I32] * 4), [_I64])
        asm = ir.InlineAsm(fnty, "ld.global.nc.v4.u32 {$0, $1, $2, $3}, [$4];",
                           "=r,=r,=r,=r,l")
        res = builder.call(asm, [addr])
        return [builder.extract_value(res, j) for j in range(4)]

    def _bf16_lo(b, w):
        return b.bitcast(b.shl(w, ir.Constant(_I32, 16)), _F32)

    def _bf16_hi(b, w):
        return b.bitcast(b.and_(w, ir.Constant(_I32, -65536)), _F32)

    def _h2f(b, h16):
        """fp16 bits (i16; numba keeps float16 as i16) -> float32, exactly (cvt.f32.f16)."""
        asm = ir.InlineAsm(ir.FunctionType(_F32, [_I16]), "cvt.f32.f16 $0, $1;", "=f,h")
        return b.call(asm, [h16])

    def _f2h(b, f):
        """float32 -> fp16 bits, round to nearest even (cvt.rn.f16.f32)."""
        asm = ir.InlineAsm(ir.FunctionType(_I16, [_F32]), "cvt.rn.f16.f32 $0, $1;", "=h,f")
        return b.call(asm, [f])

    def _f16_lo(b, w):
        return _h2f(b, b.trunc(w, _I16))

    def _f16_hi(b, w):
        return _h2f(b, b.trunc(b.lshr(w, ir.Constant(_I32, 16)), _I16))

    @intrinsic
    def ld8(typingctx, arr, i):
        """8 elements from arr[i] (i a multiple of 8) as a float32 8-tuple, 128-bit nc loads."""
        if not isinstance(arr, nbt.Array) or arr.dtype not in _STORAGE:
            return None
        sig = nbt.UniTuple(nbt.float32, 8)(arr, i)

        def codegen(context, builder, sig, args):
            aty, ity = sig.args
            ptr = _elem_ptr(context, builder, aty, args[0], args[1], ity)
            if aty.dtype == nbt.float32:
                words = _ldg_v4(builder, ptr) + _ldg_v4(builder, builder.gep(ptr, [ir.Constant(_I64, 4)]))
                vals = [builder.bitcast(w, _F32) for w in words]
            else:
                lo, hi = (_bf16_lo, _bf16_hi) if aty.dtype == nbt.uint16 else (_f16_lo, _f16_hi)
                vals = []
                for w in _ldg_v4(builder, ptr):
                    vals += [lo(builder, w), hi(builder, w)]
            return context.make_tuple(builder, sig.return_type, vals)

        return sig, codegen

    @intrinsic
    def ldf(typingctx, arr, i):
        """One element as float32 (bf16 bits shifted into the high half of a word)."""
        if not isinstance(arr, nbt.Array) or arr.dtype not in _STORAGE:
            return None
        sig = nbt.float32(arr, i)

        def codegen(context, builder, sig, args):
            aty, ity = sig.args
            v = builder.load(_elem_ptr(context, builder, aty, args[0], args[1], ity))
            if aty.dtype == nbt.uint16:
                return builder.bitcast(builder.shl(builder.zext(v, _I32), ir.Constant(_I32, 16)), _F32)
            if aty.dtype == nbt.float16:
                return _h2f(builder, v)
            return v

        return sig, codegen

    @intrinsic
    def stf(typingctx, arr, i, v):
        """Store float32 `v` in the array's storage dtype (bf16: round to nearest even)."""
        if not isinstance(arr, nbt.Array) or arr.dtype not in _STORAGE:
            return None
        sig = nbt.void(arr, i, nbt.float32)

        def codegen(context, builder, sig, args):
            aty, ity, vty = sig.args
            ptr = _elem_ptr(context, builder, aty, args[0], args[1], ity)
            x = args[2]
            if aty.dtype == nbt.uint16:
                u = builder.bitcast(x, _I32)
                odd = builder.and_(builder.lshr(u, ir.Constant(_I32, 16)), ir.Constant(_I32, 1))
                r = builder.add(u, builder.add(ir.Constant(_I32, 0x7FFF), odd))
                builder.store(builder.trunc(builder.lshr(r, ir.Constant(_I32, 16)), _I16), ptr)
            elif aty.dtype == nbt.float16:
                builder.store(_f2h(builder, x), ptr)
            else:
                builder.store(x, ptr)
            return context.get_dummy_value()

        return sig, codegen

    @cuda.jit(device=True, inline="always")
    def warp_sum(v):
        v += cuda.shfl_xor_sync(0xFFFFFFFF, v, 16)
        v += cuda.shfl_xor_sync(0xFFFFFFFF, v, 8)
        v += cuda.shfl_xor_sync(0xFFFFFFFF, v, 4)
        v += cuda.shfl_xor_sync(0xFFFFFFFF, v, 2)
        v += cuda.shfl_xor_sync(0xFFFFFFFF, v, 1)
        return v

    @cuda.jit(device=True, inline="always")
    def warp_max(v):
        v = max(v, cuda.shfl_xor_sync(0xFFFFFFFF, v, 16))
        v = max(v, cuda.shfl_xor_sync(0xFFFFFFFF, v, 8))
        v = max(v, cuda.shfl_xor_sync(0xFFFFFFFF, v, 4))
        v = max(v, cuda.shfl_xor_sync(0xFFFFFFFF, v, 2))
        v = max(v, cuda.shfl_xor_sync(0xFFFFFFFF, v, 1))
        return v


# ---------------------------------------------------------------------------------- device helpers

@cuda.jit(device=True, inline="always")
def block_sum(v, red, tid, nw):
    """Sum over the block: butterfly per warp, then warps in ascending order. Block-uniform call."""
    v = warp_sum(v)
    if tid % WARP == 0:
        red[tid // WARP] = v
    cuda.syncthreads()
    s = red[0]
    for w in range(1, nw):
        s += red[w]
    cuda.syncthreads()
    return s


@cuda.jit(device=True, inline="always")
def block_max(v, red, tid, nw):
    v = warp_max(v)
    if tid % WARP == 0:
        red[tid // WARP] = v
    cuda.syncthreads()
    m = red[0]
    for w in range(1, nw):
        m = max(m, red[w])
    cuda.syncthreads()
    return m


@cuda.jit(device=True, inline="always")
def stage_planar(xs, x, xb, K, Q, tid, T):
    """x[xb : xb+K] into shared memory in 8 planes (plane e holds x[8q+e] at e*Q+q, zero beyond K), so
    that lane l reading element e of its chunk q hits bank (e*Q+q) % 32: conflict-free."""
    for k in range(tid, Q * 8, T):
        v = np.float32(0.0)
        if k < K:
            v = x[xb + k]
        xs[(k % 8) * Q + k // 8] = v


@cuda.jit(device=True, inline="always")
def norm_planar(xs, gamma, eps, K, Q, tid, T):
    """RMSNorm of the staged row in place: x * rsqrt(mean(x^2) + eps) * gamma. Every warp computes the
    same sum with the same tree (lane-strided over the planar layout, then the butterfly)."""
    lane = tid % WARP
    ss = np.float32(0.0)
    for p in range(lane, Q * 8, WARP):
        v = xs[p]
        ss += v * v
    ss = warp_sum(ss)
    inv = np.float32(1.0) / math.sqrt(ss / np.float32(K) + eps)
    cuda.syncthreads()
    for p in range(tid, Q * 8, T):
        k = (p % Q) * 8 + p // Q
        if k < K:
            xs[p] = xs[p] * inv * gamma[k]
    cuda.syncthreads()


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
def dot2(W, wa, wb, xs, Q, lane):
    """Dot products of two weight rows (element offsets wa, wb; row length Q*8) with the staged planar
    vector, one warp. Lane l takes chunks l, l+WARP, ... in ascending order (two chunks per loop trip,
    so four 16-byte loads are in flight per lane), two accumulators per row (even/odd elements), then
    the butterfly. The arithmetic of a row never depends on its partner or on the launch."""
    a0 = np.float32(0.0)
    a1 = np.float32(0.0)
    b0 = np.float32(0.0)
    b1 = np.float32(0.0)
    Qu = np.uint64(Q)
    q = np.uint64(lane)
    step = np.uint64(WARP)
    while q + step < Qu:
        q2 = q + step
        w0, w1, w2, w3, w4, w5, w6, w7 = ld8(W, wa + np.int64(q * np.uint64(8)))
        u0, u1, u2, u3, u4, u5, u6, u7 = ld8(W, wb + np.int64(q * np.uint64(8)))
        y0, y1, y2, y3, y4, y5, y6, y7 = ld8(W, wa + np.int64(q2 * np.uint64(8)))
        v0, v1, v2, v3, v4, v5, v6, v7 = ld8(W, wb + np.int64(q2 * np.uint64(8)))
        x0 = xs[q]
        x1 = xs[Qu + q]
        x2 = xs[np.uint64(2) * Qu + q]
        x3 = xs[np.uint64(3) * Qu + q]
        x4 = xs[np.uint64(4) * Qu + q]
        x5 = xs[np.uint64(5) * Qu + q]
        x6 = xs[np.uint64(6) * Qu + q]
        x7 = xs[np.uint64(7) * Qu + q]
        a0, a1 = acc8(a0, a1, w0, w1, w2, w3, w4, w5, w6, w7, x0, x1, x2, x3, x4, x5, x6, x7)
        b0, b1 = acc8(b0, b1, u0, u1, u2, u3, u4, u5, u6, u7, x0, x1, x2, x3, x4, x5, x6, x7)
        x0 = xs[q2]
        x1 = xs[Qu + q2]
        x2 = xs[np.uint64(2) * Qu + q2]
        x3 = xs[np.uint64(3) * Qu + q2]
        x4 = xs[np.uint64(4) * Qu + q2]
        x5 = xs[np.uint64(5) * Qu + q2]
        x6 = xs[np.uint64(6) * Qu + q2]
        x7 = xs[np.uint64(7) * Qu + q2]
        a0, a1 = acc8(a0, a1, y0, y1, y2, y3, y4, y5, y6, y7, x0, x1, x2, x3, x4, x5, x6, x7)
        b0, b1 = acc8(b0, b1, v0, v1, v2, v3, v4, v5, v6, v7, x0, x1, x2, x3, x4, x5, x6, x7)
        q = q2 + step
    if q < Qu:
        w0, w1, w2, w3, w4, w5, w6, w7 = ld8(W, wa + np.int64(q * np.uint64(8)))
        u0, u1, u2, u3, u4, u5, u6, u7 = ld8(W, wb + np.int64(q * np.uint64(8)))
        x0 = xs[q]
        x1 = xs[Qu + q]
        x2 = xs[np.uint64(2) * Qu + q]
        x3 = xs[np.uint64(3) * Qu + q]
        x4 = xs[np.uint64(4) * Qu + q]
        x5 = xs[np.uint64(5) * Qu + q]
        x6 = xs[np.uint64(6) * Qu + q]
        x7 = xs[np.uint64(7) * Qu + q]
        a0, a1 = acc8(a0, a1, w0, w1, w2, w3, w4, w5, w6, w7, x0, x1, x2, x3, x4, x5, x6, x7)
        b0, b1 = acc8(b0, b1, u0, u1, u2, u3, u4, u5, u6, u7, x0, x1, x2, x3, x4, x5, x6, x7)
    return warp_sum(a0 + a1), warp_sum(b0 + b1)


@cuda.jit(device=True, inline="always")
def kv_base(bt, mb, slot, pos, bs, layer_off, rowlen, kvh, hd):
    """Element offset of (layer, position `pos` of sequence `slot`, kv head) in the paged pool, or -1
    where the block table has no block there."""
    blk = bt[np.int64(slot) * mb + pos // bs]
    if blk < 0:
        return np.int64(-1)
    return layer_off + (np.int64(blk) * bs + pos % bs) * rowlen + kvh * hd


# ----------------------------------------------------------------------------------------- kernels

@cuda.jit(cache=True)
def k_embed(tokens, E, Kp, H, x):
    """x[r, :] = E[tokens[r], :H] (widened to float32). Grid (R,)."""
    r = cuda.blockIdx.x
    base = np.int64(tokens[r]) * Kp
    xb = np.int64(r) * H
    for k in range(cuda.threadIdx.x, H, cuda.blockDim.x):
        x[xb + k] = ldf(E, base + k)


@cuda.jit(cache=True)
def k_gemv(x, x_stride, row_map, use_map, gamma, eps, use_norm, W, Q, K, N, bias, use_bias,
           out, out_stride, mode):
    """out[r] (op)= W @ f(x[src]) for one input row per blockIdx.y; f = RMSNorm(gamma) if use_norm.

    src = row_map[r] if use_map else r. Each warp owns output row pairs (2p, 2p+1), grid-striding over
    pairs. mode 0: out[j] = dot (+ bias[j]); mode 1: out[j] += dot (residual); mode 2: SwiGLU over
    interleaved gate/up rows: out[p] = silu(dot(2p)) * dot(2p+1). Dynamic shared memory: Q*8 floats.
    """
    xs = cuda.shared.array(0, nb_f32)
    tid = cuda.threadIdx.x
    T = cuda.blockDim.x
    r = cuda.blockIdx.y
    src = r
    if use_map != 0:
        src = row_map[r]
    stage_planar(xs, x, np.int64(src) * x_stride, K, Q, tid, T)
    cuda.syncthreads()
    if use_norm != 0:
        norm_planar(xs, gamma, eps, K, Q, tid, T)
    lane = tid % WARP
    nw = T // WARP
    npairs = (N + 1) // 2
    ob = np.int64(r) * out_stride
    Kp = np.int64(Q) * 8
    for p in range(cuda.blockIdx.x * nw + tid // WARP, npairs, cuda.gridDim.x * nw):
        ra = 2 * p
        rb = ra + 1
        rbl = rb
        if rb >= N:
            rbl = ra
        a, b = dot2(W, ra * Kp, rbl * Kp, xs, Q, lane)
        if lane == 0:
            if mode == 2:
                out[ob + p] = a / (np.float32(1.0) + math.exp(-a)) * b
            else:
                if use_bias != 0:
                    a += bias[ra]
                    if rb < N:
                        b += bias[rb]
                if mode == 1:
                    out[ob + ra] += a
                    if rb < N:
                        out[ob + rb] += b
                else:
                    out[ob + ra] = a
                    if rb < N:
                        out[ob + rb] = b


@cuda.jit(cache=True)
def k_rope_kv(qkv, qkv_stride, slots, positions, bt, mb, kc, vc, layer_off, bs, nh, nkv, hd,
              inv_freq, qn, kn, gofs, use_qkn, eps):
    """Per (row, head): optional per-head RMSNorm (Qwen3), RoPE (rotate_half pairs (i, i + hd/2),
    angles in float64), q written back in place, k and v written to the paged pool. Grid (R, nh+nkv)."""
    red = cuda.shared.array(32, nb_f32)
    r = cuda.blockIdx.x
    hh = cuda.blockIdx.y
    tid = cuda.threadIdx.x
    T = cuda.blockDim.x
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
    if use_qkn != 0:
        ss = np.float32(0.0)
        for i in range(tid, hd, T):
            v = qkv[src + i]
            ss += v * v
        ss = block_sum(ss, red, tid, T // WARP)
        inv = np.float32(1.0) / math.sqrt(ss / np.float32(hd) + eps)
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
        ang = np.float64(pos) * inv_freq[i]
        c = np.float32(math.cos(ang))
        s = np.float32(math.sin(ang))
        y1 = x1 * c - x2 * s
        y2 = x2 * c + x1 * s
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


@cuda.jit(cache=True)
def k_attn(qkv, qkv_stride, slots, positions, bt, mb, kc, vc, layer_off, bs, nkv, hd, group, scale,
           out, out_stride):
    """Causal GQA attention of one (row, q head) per block over the paged pool, positions 0..pos.

    Tiles of T positions in ascending order with an online softmax: thread t scores position t of the
    tile (a full head_dim dot, ascending); tile max and sum are fixed block trees; thread d accumulates
    output dims d and d+T over the tile's positions in ascending order. T is fixed per model, so a
    row's result never depends on the batch. Dynamic shared: hd + T floats. Grid (R, nh).
    """
    sh = cuda.shared.array(0, nb_f32)
    base_s = cuda.shared.array(MAX_TILE, nb_i64)
    red = cuda.shared.array(32, nb_f32)
    r = cuda.blockIdx.x
    h = cuda.blockIdx.y
    tid = cuda.threadIdx.x
    T = cuda.blockDim.x
    nw = T // WARP
    kvh = h // group
    slot = slots[r]
    n_ctx = positions[r] + 1
    rowlen = np.int64(nkv) * hd
    qb = np.int64(r) * qkv_stride + h * hd
    for d in range(tid, hd, T):
        sh[d] = qkv[qb + d] * scale
    cuda.syncthreads()
    m = np.float32(-math.inf)
    l = np.float32(0.0)
    acc0 = np.float32(0.0)
    acc1 = np.float32(0.0)
    d1 = tid + T
    for t0 in range(0, n_ctx, T):
        p = t0 + tid
        s = np.float32(-math.inf)
        if p < n_ctx:
            kb = kv_base(bt, mb, slot, p, bs, layer_off, rowlen, kvh, hd)
            base_s[tid] = kb
            if kb >= 0:
                s = np.float32(0.0)
                for c in range(0, hd, 8):
                    k0, k1, k2, k3, k4, k5, k6, k7 = ld8(kc, kb + c)
                    s += sh[c] * k0
                    s += sh[c + 1] * k1
                    s += sh[c + 2] * k2
                    s += sh[c + 3] * k3
                    s += sh[c + 4] * k4
                    s += sh[c + 5] * k5
                    s += sh[c + 6] * k6
                    s += sh[c + 7] * k7
        tmax = block_max(s, red, tid, nw)
        m_new = max(m, tmax)
        e = np.float32(0.0)
        if p < n_ctx and s > np.float32(-math.inf):
            e = math.exp(s - m_new)
        sh[hd + tid] = e
        tsum = block_sum(e, red, tid, nw)
        alpha = math.exp(m - m_new)
        l = l * alpha + tsum
        cnt = min(T, n_ctx - t0)
        if tid < hd:
            a = acc0 * alpha
            for j in range(cnt):
                vb = base_s[j]
                if vb >= 0:
                    a += sh[hd + j] * ldf(vc, vb + tid)
            acc0 = a
        if d1 < hd:
            a = acc1 * alpha
            for j in range(cnt):
                vb = base_s[j]
                if vb >= 0:
                    a += sh[hd + j] * ldf(vc, vb + d1)
            acc1 = a
        m = m_new
        cuda.syncthreads()
    ob = np.int64(r) * out_stride + h * hd
    if tid < hd:
        out[ob + tid] = acc0 / l
    if d1 < hd:
        out[ob + d1] = acc1 / l


@cuda.jit(cache=True)
def k_final_norm(x, H, rows, gamma, eps, out):
    """out[i] = RMSNorm(x[rows[i]]) * gamma: the final-normed hidden state of the logit rows."""
    red = cuda.shared.array(32, nb_f32)
    i = cuda.blockIdx.x
    tid = cuda.threadIdx.x
    T = cuda.blockDim.x
    xb = np.int64(rows[i]) * H
    ss = np.float32(0.0)
    for k in range(tid, H, T):
        v = x[xb + k]
        ss += v * v
    ss = block_sum(ss, red, tid, T // WARP)
    inv = np.float32(1.0) / math.sqrt(ss / np.float32(H) + eps)
    ob = np.int64(i) * H
    for k in range(tid, H, T):
        out[ob + k] = x[xb + k] * inv * gamma[k]


@cuda.jit(cache=True)
def k_sparse(h, H, W, Q, V, cand, ncand, cmax, out):
    """Logits of candidate tokens only: out[i, c] = W[cand[i, c]] . h[i] for c < ncand[i].

    The same staging and the same dot2 as the dense head, so a candidate's logit is bit-identical to
    the dense head's. Ids outside [0, V) give NaN (the caller fails loudly). Grid (tiles, N).
    """
    xs = cuda.shared.array(0, nb_f32)
    i = cuda.blockIdx.y
    n = ncand[i]
    tid = cuda.threadIdx.x
    T = cuda.blockDim.x
    nw = T // WARP
    if cuda.blockIdx.x * nw * 2 >= n:
        return
    stage_planar(xs, h, np.int64(i) * H, H, Q, tid, T)
    cuda.syncthreads()
    lane = tid % WARP
    ca = (cuda.blockIdx.x * nw + tid // WARP) * 2
    if ca >= n:
        return
    cb = ca + 1
    cbase = np.int64(i) * cmax
    ta = cand[cbase + ca]
    tb = ta
    if cb < n:
        tb = cand[cbase + cb]
    va = ta >= 0 and ta < V
    vb = tb >= 0 and tb < V
    sa = ta if va else 0
    sb = tb if vb else 0
    Kp = np.int64(Q) * 8
    a, b = dot2(W, sa * Kp, sb * Kp, xs, Q, lane)
    if lane == 0:
        out[cbase + ca] = a if va else np.float32(math.nan)
        if cb < n:
            out[cbase + cb] = b if vb else np.float32(math.nan)



# ------------------------------------------------------------------------------------- signatures

def _arr(dt):
    from numba.cuda import types as t
    return t.Array(dt, 1, "C")


def signatures(storage: str) -> dict:
    """Argument types of each kernel for weights/KV stored as `storage` ("bfloat16" | "float16" |
    "float32"). The launcher packs parameters in exactly this order."""
    from numba.cuda import types as t
    st = {"bfloat16": t.uint16, "float16": t.float16, "float32": t.float32}[storage]
    f32, i32, i64, f64 = _arr(t.float32), t.int32, t.int64, _arr(t.float64)
    ai, W = _arr(t.int32), _arr(st)
    return {
        "k_embed": (ai, W, i32, i32, f32),
        "k_gemv": (f32, i32, ai, i32, f32, t.float32, i32, W, i32, i32, i32, f32, i32, f32, i32, i32),
        "k_rope_kv": (f32, i32, ai, ai, ai, i32, W, W, i64, i32, i32, i32, i32, f64, f32, f32, i32,
                      i32, t.float32),
        "k_attn": (f32, i32, ai, ai, ai, i32, W, W, i64, i32, i32, i32, i32, t.float32, f32, i32),
        "k_final_norm": (f32, i32, ai, f32, t.float32, f32),
        "k_sparse": (f32, i32, W, i32, i32, ai, ai, i32, f32),
    }


KERNELS = {"k_embed": k_embed, "k_gemv": k_gemv, "k_rope_kv": k_rope_kv, "k_attn": k_attn,
           "k_final_norm": k_final_norm, "k_sparse": k_sparse}
