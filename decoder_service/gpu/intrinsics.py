"""The primitives every kernel is built from (16-byte loads, bf16/fp16 widening, warp reductions,
`mma.sync`, programmatic dependent launch), with plain-Python twins for numba's CUDA simulator, where
the "warp" is `WARP = 4` lanes wide (cheap to simulate, multi-lane and multi-warp paths still run)."""
from __future__ import annotations

import functools
import math

import numpy as np

from . import compat  # noqa: F401  (numpy row_stack alias before numba-cuda compiles anything)

import numba
from numba import cuda

SIM = bool(getattr(numba.config, "ENABLE_CUDASIM", 0))
WARP = 4 if SIM else 32
TQ = WARP if SIM else 8        # lanes of a query in lanes_sum / lanes_max (attention tiles: k_attn_tiles)
MMA = 32                      # lanes of an mma warp (the simulator's too: the fragments are 32-lane)

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

    ld8_once = ld8

    def ldf(arr, i):
        """One element as float32 (bf16 = uint16 bits)."""
        return _to_f32(arr[i], arr.dtype)

    def _bf16(v):
        """float32 -> bf16 bits, round to nearest even (the GPU's cvt.rn)."""
        u = int(np.array([v], np.float32).view(np.uint32)[0])
        return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) & 0xFFFF

    def stf(arr, i, v):
        """Store a float32 in the array's storage dtype (bf16: round to nearest even)."""
        arr[i] = _bf16(v) if arr.dtype == np.uint16 else v

    def _exchange(vals, width):
        """Every lane's `vals` (a tuple) across a group of `width` consecutive threads: ([width, n]
        float64, this lane). Called by every thread of the group."""
        th = threading.current_thread()
        mgr = th._manager
        group, lane = divmod(th.thread_id, width)
        key = (width, group, len(vals))
        with _sim_lock:
            table = mgr.__dict__.setdefault("_tt_warps", {})
            if key not in table:
                nthreads = int(np.prod(mgr._block_dim))
                parties = min(width, nthreads - group * width)
                table[key] = (threading.Barrier(parties), np.zeros((width, len(vals)), np.float64))
            bar, buf = table[key]
        buf[lane] = vals
        bar.wait()
        out = buf.copy()
        bar.wait()
        return out, lane

    def _warp_exchange(v):
        vals, lane = _exchange((v,), WARP)
        return vals[:, 0].astype(np.float32), lane

    def quad_sum(v):
        """Sum over the 4 lanes of an mma lane quad (xor 1, then xor 2: the GPU's tree)."""
        vals, lane = _exchange((v,), 4)
        vals = vals[:, 0].astype(np.float32)
        idx = np.arange(4)
        for off in (1, 2):
            vals = (vals + vals[idx ^ off]).astype(np.float32)
        return vals[lane]

    def mma_sync():
        """A barrier of the 32 lanes of an mma warp (__syncwarp)."""
        _exchange((0.0,), MMA)

    def quad_max(v):
        """Max over the 4 lanes of an mma lane quad."""
        vals, lane = _exchange((v,), 4)
        return np.float32(vals[:, 0].max())

    def pdl_capable() -> bool:
        """The simulator runs launches one after another: no programmatic dependent launch."""
        return False

    def pdl_enter():
        """No-op in the simulator."""

    def lane_take(v, src):
        """Lane `src`'s integer v, for every lane of the mma warp (exact below 2**53: the exchange is
        float64)."""
        vals, lane = _exchange((float(v),), MMA)
        return np.int64(vals[src, 0])

    def ld_words(arr, i):
        """8 bf16 from arr[i] as 4 raw 32-bit words, element i in the low half of the first."""
        return tuple(np.uint32(int(arr[i + 2 * j]) | int(arr[i + 2 * j + 1]) << 16) for j in range(4))

    def split_bf16(a, b):
        """(hi, lo) bf16x2 words (a in the low half): hi = (a, b) rounded to bf16, lo = the remainders
        rounded to bf16, so that a = hi + lo to ~16 significant bits."""
        ha, hb = _bf16(a), _bf16(b)
        la = _bf16(np.float32(a) - _to_f32(ha, np.uint16))
        lb = _bf16(np.float32(b) - _to_f32(hb, np.uint16))
        return np.uint32(ha | hb << 16), np.uint32(la | lb << 16)

    def mma_bf16(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        """mma.sync m16n8k16 (bf16 in, float32 accumulate) over the 32 lanes of the warp, in the PTX
        fragment layout: lane (g, t) holds A[g | g+8][2t, 2t+1 | 2t+8, 2t+9] in a0..a3, B[2t, 2t+1 |
        2t+8, 2t+9][g] in b0, b1 and C/D[g | g+8][2t, 2t+1]. Each output is its exactly rounded sum
        (math.fsum), so it depends on that element's operands only, as on the GPU."""
        frag, lane = _exchange((a0, a1, a2, a3, b0, b1, c0, c1, c2, c3), MMA)
        w = frag[:, :6].astype(np.uint32)
        lo = (w << np.uint32(16)).view(np.float32).astype(np.float64)    # the word's first element
        hi = (w & np.uint32(0xFFFF0000)).view(np.float32).astype(np.float64)

        def k16(quad, r0, r1):
            """The 16 k of a row of A (or a column of B) held by lane quad `quad` in registers r0, r1."""
            ln = np.arange(4 * quad, 4 * quad + 4)
            return np.concatenate([np.stack([lo[ln, r], hi[ln, r]], 1).ravel() for r in (r0, r1)])

        g, t = divmod(lane, 4)
        rows = (k16(g, 0, 2), k16(g, 1, 3))
        cols = (k16(2 * t, 4, 5), k16(2 * t + 1, 4, 5))
        return tuple(np.float32(math.fsum(list(rows[e // 2] * cols[e % 2]) + [frag[lane, 6 + e]]))
                     for e in range(4))

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

    def xor_pair(v, i, off):
        """Lane (this lane ^ off)'s float32 v and int32 i (exact: the exchange is float64)."""
        vals, lane = _exchange((v, i), WARP)
        return np.float32(vals[lane ^ off, 0]), np.int32(vals[lane ^ off, 1])

    def _lanes(v, op):
        vals, lane = _warp_exchange(v)
        idx = np.arange(WARP)
        off = TQ // 2
        while off:
            vals = op(vals, vals[idx ^ off]).astype(np.float32)
            off //= 2
        return vals[lane]

    def lanes_sum(v):
        """Xor-butterfly sum over the TQ lanes of a query, the GPU's tree."""
        return _lanes(v, np.add)

    def lanes_max(v):
        return _lanes(v, np.maximum)

    def prefetch_l2(arr, i):
        """No-op in the simulator (a cache hint on the GPU)."""

    def ld_l2(arr, i):
        """A load that bypasses L1 on the GPU (data written by other blocks of the same launch)."""
        return arr[i]

    def prefetch_l1(arr, i):
        """No-op in the simulator (a cache hint on the GPU)."""

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

    def _ldg_v4(builder, ptr, load="ld.global.nc"):
        """<load>.v4.u32: 16 bytes through the read-only data path (ptr must be 16-aligned)."""
        addr = builder.ptrtoint(ptr, _I64)
        fnty = ir.FunctionType(ir.LiteralStructType([_I32] * 4), [_I64])
        asm = ir.InlineAsm(fnty, f"{load}.v4.u32 {{$0, $1, $2, $3}}, [$4];",
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

    def _ld8(load: str, doc: str):
        @intrinsic
        def impl(typingctx, arr, i):
            if not isinstance(arr, nbt.Array) or arr.dtype not in _STORAGE:
                return None
            sig = nbt.UniTuple(nbt.float32, 8)(arr, i)

            def codegen(context, builder, sig, args):
                aty, ity = sig.args
                ptr = _elem_ptr(context, builder, aty, args[0], args[1], ity)
                if aty.dtype == nbt.float32:
                    words = (_ldg_v4(builder, ptr, load)
                             + _ldg_v4(builder, builder.gep(ptr, [ir.Constant(_I64, 4)]), load))
                    vals = [builder.bitcast(w, _F32) for w in words]
                else:
                    lo, hi = (_bf16_lo, _bf16_hi) if aty.dtype == nbt.uint16 else (_f16_lo, _f16_hi)
                    vals = []
                    for w in _ldg_v4(builder, ptr, load):
                        vals += [lo(builder, w), hi(builder, w)]
                return context.make_tuple(builder, sig.return_type, vals)

            return sig, codegen
        impl.__doc__ = doc
        return impl

    ld8 = _ld8("ld.global.nc", "8 elements from arr[i] (i a multiple of 8) as a float32 8-tuple, 128-bit nc loads.")
    ld8_once = _ld8("ld.global.cs.nc", "ld8 of data read once (ld.global.cs: evict-first in L1 and L2), so that "
                    "a stream of it leaves in L2 what other kernels will read again.")

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

    def _prefetch(level):
        @intrinsic
        def impl(typingctx, arr, i):
            """prefetch.global.<level> of the line holding arr[i]: a hint, no register, no result."""
            if not isinstance(arr, nbt.Array):
                return None
            sig = nbt.void(arr, i)

            def codegen(context, builder, sig, args):
                aty, ity = sig.args
                addr = builder.ptrtoint(_elem_ptr(context, builder, aty, args[0], args[1], ity), _I64)
                asm = ir.InlineAsm(ir.FunctionType(ir.VoidType(), [_I64]),
                                   f"prefetch.global.{level} [$0];", "l", side_effect=True)
                builder.call(asm, [addr])
                return context.get_dummy_value()

            return sig, codegen
        return impl

    prefetch_l2 = _prefetch("L2")
    prefetch_l1 = _prefetch("L1")

    @intrinsic
    def ld_l2(typingctx, arr, i):
        """ld.global.cg of a float32 or float64: cached in L2 only, so data other blocks of this launch wrote
        (before their threadfence) is never read stale from this SM's L1 (P06; docs/gpu.md#the-memory-system)."""
        if not isinstance(arr, nbt.Array) or arr.dtype not in (nbt.float32, nbt.float64):
            return None
        sig = arr.dtype(arr, i)
        wide = arr.dtype == nbt.float64

        def codegen(context, builder, sig, args):
            aty, ity = sig.args
            addr = builder.ptrtoint(_elem_ptr(context, builder, aty, args[0], args[1], ity), _I64)
            ty = ir.DoubleType() if wide else _F32
            asm = ir.InlineAsm(ir.FunctionType(ty, [_I64]), f"ld.global.cg.{'f64' if wide else 'f32'} $0, [$1];",
                               f"={'d' if wide else 'f'},l", side_effect=True)
            return builder.call(asm, [addr])

        return sig, codegen

    @intrinsic
    def ld_words(typingctx, arr, i):
        """8 bf16 from arr[i] (i a multiple of 8) as 4 raw 32-bit words, one 16-byte nc load."""
        if not isinstance(arr, nbt.Array) or arr.dtype != nbt.uint16:
            return None
        sig = nbt.UniTuple(nbt.uint32, 4)(arr, i)

        def codegen(context, builder, sig, args):
            aty, ity = sig.args
            words = _ldg_v4(builder, _elem_ptr(context, builder, aty, args[0], args[1], ity))
            return context.make_tuple(builder, sig.return_type, words)

        return sig, codegen

    @intrinsic
    def split_bf16(typingctx, a, b):
        """(hi, lo) bf16x2 words (a in the low half): hi = (a, b) rounded to bf16, lo = the remainders
        (exact in float32) rounded to bf16, so that a = hi + lo to ~16 significant bits."""
        if a != nbt.float32 or b != nbt.float32:
            return None
        sig = nbt.UniTuple(nbt.uint32, 2)(a, b)

        def codegen(context, builder, sig, args):
            a, b = args
            cvt = ir.InlineAsm(ir.FunctionType(_I32, [_F32, _F32]), "cvt.rn.bf16x2.f32 $0, $1, $2;", "=r,f,f")
            hi = builder.call(cvt, [b, a])        # the first operand goes to the high half
            lo = builder.call(cvt, [builder.fsub(b, _bf16_hi(builder, hi)),
                                    builder.fsub(a, _bf16_lo(builder, hi))])
            return context.make_tuple(builder, sig.return_type, [hi, lo])

        return sig, codegen

    @intrinsic
    def mma_bf16(typingctx, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        """mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32: D = A B + C for the warp, A (16x16) in
        a0..a3, B (16x8) in b0, b1 (bf16x2 words), C and D (16x8 float32) four per lane."""
        words, floats = (a0, a1, a2, a3, b0, b1), (c0, c1, c2, c3)
        if any(w != nbt.uint32 for w in words) or any(f != nbt.float32 for f in floats):
            return None
        sig = nbt.UniTuple(nbt.float32, 4)(*words, *floats)

        def codegen(context, builder, sig, args):
            fnty = ir.FunctionType(ir.LiteralStructType([_F32] * 4), [_I32] * 6 + [_F32] * 4)
            asm = ir.InlineAsm(fnty, "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                                     "{$0, $1, $2, $3}, {$4, $5, $6, $7}, {$8, $9}, {$10, $11, $12, $13};",
                               "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f")
            res = builder.call(asm, list(args))
            return context.make_tuple(builder, sig.return_type, [builder.extract_value(res, j) for j in range(4)])

        return sig, codegen

    @cuda.jit(device=True, inline="always")
    def quad_sum(v):
        """Sum over the 4 lanes of an mma lane quad (lanes 4g .. 4g + 3)."""
        v += cuda.shfl_xor_sync(0xFFFFFFFF, v, 1)
        v += cuda.shfl_xor_sync(0xFFFFFFFF, v, 2)
        return v

    @cuda.jit(device=True, inline="always")
    def mma_sync():
        """A barrier of the 32 lanes of an mma warp (__syncwarp)."""
        cuda.syncwarp()

    @cuda.jit(device=True, inline="always")
    def quad_max(v):
        """Max over the 4 lanes of an mma lane quad."""
        v = max(v, cuda.shfl_xor_sync(0xFFFFFFFF, v, 1))
        v = max(v, cuda.shfl_xor_sync(0xFFFFFFFF, v, 2))
        return v

    @functools.cache
    def pdl_capable() -> bool:
        """Whether the GPU has programmatic dependent launch (sm_90 on); without one (offline PTX
        for the H200, `python -m bench ptx`), yes. Asked once."""
        try:
            return cuda.get_current_device().compute_capability >= (9, 0)
        except Exception:  # noqa: BLE001 - no device to ask (offline PTX for the H200): assume sm_90
            return True

    @intrinsic
    def pdl_enter(typingctx):
        """Called by every model kernel before it reads anything (programmatic dependent launch, sm_90;
        k_gemv issues weight cache hints first): wait until the kernel before it in the stream has
        finished and its writes are visible, then let the next kernel's blocks be scheduled, so that
        its launch overlaps this kernel's run instead of following it. A kernel launched without the
        PDL attribute passes straight through."""
        sig = nbt.void()

        def codegen(context, builder, sig, args):
            if pdl_capable():
                asm = ir.InlineAsm(ir.FunctionType(ir.VoidType(), []),
                                   "griddepcontrol.wait;\n\tgriddepcontrol.launch_dependents;", "~{memory}",
                                   side_effect=True)
                builder.call(asm, [])
            return context.get_dummy_value()

        return sig, codegen

    @cuda.jit(device=True, inline="always")
    def lane_take(v, src):
        """Lane `src`'s integer v, for every lane of the mma warp (shfl.sync.idx)."""
        return cuda.shfl_sync(0xFFFFFFFF, v, src)

    @cuda.jit(device=True, inline="always")
    def lanes_sum(v):
        """Sum over the TQ = 8 lanes of a query (an xor butterfly: every lane gets the same bits)."""
        v += cuda.shfl_xor_sync(0xFFFFFFFF, v, 4)
        v += cuda.shfl_xor_sync(0xFFFFFFFF, v, 2)
        v += cuda.shfl_xor_sync(0xFFFFFFFF, v, 1)
        return v

    @cuda.jit(device=True, inline="always")
    def lanes_max(v):
        v = max(v, cuda.shfl_xor_sync(0xFFFFFFFF, v, 4))
        v = max(v, cuda.shfl_xor_sync(0xFFFFFFFF, v, 2))
        v = max(v, cuda.shfl_xor_sync(0xFFFFFFFF, v, 1))
        return v

    @cuda.jit(device=True, inline="always")
    def warp_sum(v):
        """The same butterfly over the whole warp: the 16- and 8-lane steps, then lanes_sum's."""
        v += cuda.shfl_xor_sync(0xFFFFFFFF, v, 16)
        v += cuda.shfl_xor_sync(0xFFFFFFFF, v, 8)
        return lanes_sum(v)

    @cuda.jit(device=True, inline="always")
    def warp_max(v):
        v = max(v, cuda.shfl_xor_sync(0xFFFFFFFF, v, 16))
        v = max(v, cuda.shfl_xor_sync(0xFFFFFFFF, v, 8))
        return lanes_max(v)

    @cuda.jit(device=True, inline="always")
    def xor_pair(v, i, off):
        """Lane (this lane ^ off)'s v and i (shfl.sync.bfly)."""
        return cuda.shfl_xor_sync(0xFFFFFFFF, v, off), cuda.shfl_xor_sync(0xFFFFFFFF, i, off)


# ---------------------------------------------------------------------------------- device helpers

@cuda.jit(device=True, inline="always")
def dot8(x, y, s):
    """s plus the 8 products x[i] * y[i] of two 8-tuples (ld8's), in ascending i (fma, one rounding each)."""
    for i in range(8):
        s = cuda.fma(x[i], y[i], s)
    return s


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
def cdiv(a, b):
    """ceil(a / b) of non-negative int32 values, as an unsigned 32-bit division (numba's // on them is a
    64-bit floor division with a sign fix-up: ~60 instructions more; P42,
    docs/gpu.md#what-numbas-code-generation-adds)."""
    return np.uint32(a + b - 1) // np.uint32(b)


@cuda.jit(device=True, inline="always")
def divmod_u32(a, b):
    """(a // b, a % b) of non-negative int32 values, as one unsigned 32-bit division (see cdiv): a
    position's block and slot in it, a head's KV head, a tile query's row and head."""
    q = np.uint32(a) // np.uint32(b)
    return q, np.uint32(a) - q * np.uint32(b)
