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

import functools
import math

import numpy as np

from . import compat  # noqa: F401  (numpy row_stack alias before numba-cuda compiles anything)

import numba  # noqa: E402
from numba import cuda  # noqa: E402
from numba import float32 as nb_f32, int32 as nb_i32, int64 as nb_i64, uint32 as nb_u32  # noqa: E402

SIM = bool(getattr(numba.config, "ENABLE_CUDASIM", 0))
WARP = 4 if SIM else 32
TILE_ROWS = 4                 # k_gemv_tile: input rows per block (8 was slower: perf log g1)
TILE_ACC = 4 * TILE_ROWS      # k_gemv_tile: a lane's partial sums (2 weight rows x even/odd x rows)
TILE_RED = 32 * TILE_ROWS     # k_gemv_tile: the rows' per-warp norm partials (up to 32 warps)
MAX_SPLITS = 64         # attention: at most this many context splits per query
ROW_SPLITS = 32         # k_attn_rows: at most this many splits per (row, head) (its perf log b6 setting)
MAX_TILE = 256          # k_attn_rows: tile (= its block size) upper bound; static shared array size
ATTN_REGISTERS = 64     # k_attn_rows' register cap: more resident blocks per SM (perf_log.md, b6)
_ATTN_JIT = {} if SIM else {"max_registers": ATTN_REGISTERS}   # the simulator takes no cap
# Prompt rows of bf16 models (k_gemm, k_gemm_wide): mma.sync m16n8k16 on the tensor cores, a block of warps
# per (GEMM_ROWS rows x GEMM_COLS columns), each warp every (warps)-th 32-wide K chunk.
MMA = 32                      # lanes of an mma warp (the simulator's too: the fragments are 32-lane)
GEMM_ROWS = 16                # k_gemm: input rows per block (the mma's M)
GEMM_NT = 4                   # k_gemm: n8 tiles per block (its first GEMM_NT warps finish one each)
GEMM_COLS = 8 * GEMM_NT       # k_gemm: output columns per block
GEMM_WARPS = 4                # k_gemm: warps per block (split K; at least GEMM_NT)
GEMM_MAX_WARPS = 8            # k_gemm_wide: warps per block (the shared arrays are sized for it)
GEMM_ACC = 4 * GEMM_NT        # k_gemm: a lane's accumulators (4 per n8 tile)
GEMM_PART = GEMM_MAX_WARPS * GEMM_NT * 4 * MMA   # k_gemm: the warps' partial tiles in shared memory
GEMM_SSQ = GEMM_MAX_WARPS * GEMM_ROWS            # k_gemm: the warps' partial sums of squares per row
MQ = 16                       # k_attn_mma: queries per block (the mma's M)
MMA_HDS = (64, 128)           # k_attn_mma's head_dim bounds, a kernel each (registers, shared sizes; perf log m3, q1)
MMA_SPLIT = 256               # k_attn_mma: default split (positions) of a prompt row's context (perf log m2)
VT_STRIDE = 12                # k_attn_mma: words per V^T row (8 position pairs, padded: conflict-free reads)
ATT_WARPS = 4                 # k_attn_mma: warps per block, each every ATT_WARPS-th 16-position block
MMA_ATTN_REGISTERS = {64: 168, 128: 255}   # k_attn_mma's register caps: at 64, three 128-thread blocks an SM,
                                           # no spills (perf log m5); at 128, none below the hardware's (q1)
GEMV_REGISTERS = 128    # k_gemv's register cap: two 256-thread blocks per SM (152 uncapped; perf log r2)
_GEMV_JIT = {} if SIM else {"max_registers": GEMV_REGISTERS}
# Attention tiles (k_attn_tiles): a block holds up to QB queries (consecutive rows of one sequence x the query
# heads of one KV head); TQ threads own a query (its max and sum are TQ-lane xor trees, so a query's
# lanes sit in one warp), each scoring PPT positions of a TP-position K/V tile held in shared memory.
QB = 4 if SIM else 16
TQ = WARP if SIM else 8
PPT = 2 if SIM else 8
TP = TQ * PPT

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
        """ld.global.cg of a float32: cached in L2 only, so data other blocks of this launch wrote
        (before their threadfence) is never read stale from this SM's L1."""
        if not isinstance(arr, nbt.Array) or arr.dtype != nbt.float32:
            return None
        sig = nbt.float32(arr, i)

        def codegen(context, builder, sig, args):
            aty, ity = sig.args
            addr = builder.ptrtoint(_elem_ptr(context, builder, aty, args[0], args[1], ity), _I64)
            asm = ir.InlineAsm(ir.FunctionType(_F32, [_I64]), "ld.global.cg.f32 $0, [$1];", "=f,l",
                               side_effect=True)
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
        for the H200, bench/ptx_report.py), yes. Asked once."""
        try:
            return cuda.get_current_device().compute_capability >= (9, 0)
        except Exception:
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
    negative-index wraparound code to every access through a signed index."""
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
def qk8(s, qs, c, k):
    """s + q[c:c+8] . k, in ascending order (unsigned indices: no negative-index wraparound code)."""
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
    """sh[i:i+8] = the 8-tuple v (unsigned indices: no negative-index wraparound code)."""
    sh[np.uint64(i)] = v[0]
    sh[np.uint64(i + 1)] = v[1]
    sh[np.uint64(i + 2)] = v[2]
    sh[np.uint64(i + 3)] = v[3]
    sh[np.uint64(i + 4)] = v[4]
    sh[np.uint64(i + 5)] = v[5]
    sh[np.uint64(i + 6)] = v[6]
    sh[np.uint64(i + 7)] = v[7]


@cuda.jit(device=True, inline="always")
def cdiv(a, b):
    """ceil(a / b) of non-negative int32 values, as an unsigned 32-bit division (numba's // on them is a
    64-bit floor division with a sign fix-up: ~60 instructions more; perf log m5)."""
    return np.uint32(a + b - 1) // np.uint32(b)


@cuda.jit(device=True, inline="always")
def divmod_u32(a, b):
    """(a // b, a % b) of non-negative int32 values, as one unsigned 32-bit division (see cdiv): a
    position's block and slot in it, a head's KV head, a tile query's row and head."""
    q = np.uint32(a) // np.uint32(b)
    return q, np.uint32(a) - q * np.uint32(b)


@cuda.jit(device=True, inline="always")
def kv_base(bt, mb, slot, pos, bs, layer_off, rowlen, kvh, hd):
    """Element offset of (layer, position `pos` of sequence `slot`, kv head) in the paged pool, or -1
    where the block table has no block there."""
    i, o = divmod_u32(pos, bs)
    blk = bt[np.int64(slot) * mb + i]
    if blk < 0:
        return np.int64(-1)
    return layer_off + (np.int64(blk) * bs + o) * rowlen + kvh * hd


# ----------------------------------------------------------------------------------------- kernels

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


@cuda.jit(device=True, inline="always")
def rope_pair(a, b, cs, pos, half, i):
    """RoPE of the rotate_half pair (a, b) = (x[i], x[i + hd/2]) at position pos (table cs)."""
    j = 2 * (np.int64(pos) * half + i)
    c = cs[j]
    s = cs[j + 1]
    return a * c - b * s, b * c + a * s


@cuda.jit(device=True, inline="always")
def gemv_store(out, ob, p, ra, rb, N, a, b, bias, use_bias, mode):
    """Epilogue of one row pair (lane 0): mode 0 store (+ bias), 1 accumulate (residual), 2 SwiGLU."""
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


@cuda.jit(device=True, inline="always")
def rope_store(out, ob, p, N, a, b, bias, use_bias, r, positions, slots, bt, mb, kc, vc, layer_off, bs,
               nkv, hd, cs):
    """k_gemv's mode 3 epilogue, QKV with RoPE (lane 0): the weight rows are permuted so that pair p
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
    fetch overlaps the previous kernel and the staging. mode 0: out[j] = dot (+ bias[j]); 1: out[j] +=
    dot (residual); 2: SwiGLU over interleaved gate/up rows, out[p] = silu(dot(2p)) * dot(2p+1); 3: QKV
    with RoPE and the KV write (rope_store; the parameters from `positions` on serve only this mode).
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
    # (perf log m6).
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
            if mode == 3:
                rope_store(out, ob, p, N, a, b, bias, use_bias, r, positions, slots, bt, mb, kc, vc,
                           layer_off, bs, nkv, hd, cs)
            else:
                gemv_store(out, ob, p, ra, rb, N, a, b, bias, use_bias, mode)


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
def gemm_load(cx, cw, x, xa, xb, gamma, use_norm, W, Kp, N, n0, g, t, c):
    """k_gemm's operands of the 32-wide K chunk at c for lane (g, t): x rows (offsets xa, xb) and gamma
    at k = c + 8t .. + 7 into cx[0:8], cx[8:16], cx[16:24]; the four n8 tiles' weight row g there into
    cw (4 words each). Past K (or past Kp: no chunk) the values are zeros, the loads still valid."""
    k = c + 8 * t
    ok = k < Kp
    kk = k if ok else 0
    v0, v1, v2, v3, v4, v5, v6, v7 = ld8(x, xa + kk)
    y0, y1, y2, y3, y4, y5, y6, y7 = ld8(x, xb + kk)
    z = np.float32(0.0)
    if not ok:
        v0 = v1 = v2 = v3 = v4 = v5 = v6 = v7 = z
        y0 = y1 = y2 = y3 = y4 = y5 = y6 = y7 = z
    cx[0], cx[1], cx[2], cx[3], cx[4], cx[5], cx[6], cx[7] = v0, v1, v2, v3, v4, v5, v6, v7
    cx[8], cx[9], cx[10], cx[11], cx[12], cx[13], cx[14], cx[15] = y0, y1, y2, y3, y4, y5, y6, y7
    if use_norm != 0:
        cx[16], cx[17], cx[18], cx[19], cx[20], cx[21], cx[22], cx[23] = ld8(gamma, kk)
    for j in range(GEMM_NT):
        w0, w1, w2, w3 = ld_words(W, np.int64(min(n0 + 8 * j + g, N - 1)) * Kp + kk)
        cw[4 * j], cw[4 * j + 1], cw[4 * j + 2], cw[4 * j + 3] = w0, w1, w2, w3


@cuda.jit(device=True, inline="always")
def gemm_chunk(cx, cw, acc, sa, sb, use_norm):
    """k_gemm's work on one 32-wide K chunk whose operands gemm_load put in cx, cw: the rows' sums of
    squares (sa, sb) under a norm, x times gamma as bf16 hi + lo, and the n8 tiles' mma pairs into acc.
    Returns the new (sa, sb)."""
    a0, a1, a2, a3, a4, a5, a6, a7 = cx[0], cx[1], cx[2], cx[3], cx[4], cx[5], cx[6], cx[7]
    b0, b1, b2, b3, b4, b5, b6, b7 = cx[8], cx[9], cx[10], cx[11], cx[12], cx[13], cx[14], cx[15]
    if use_norm != 0:
        sa = sq8(sa, a0, a1, a2, a3, a4, a5, a6, a7)
        sb = sq8(sb, b0, b1, b2, b3, b4, b5, b6, b7)
        g0, g1, g2, g3, g4, g5, g6, g7 = cx[16], cx[17], cx[18], cx[19], cx[20], cx[21], cx[22], cx[23]
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
    for j in range(GEMM_NT):
        acc[4 * j], acc[4 * j + 1], acc[4 * j + 2], acc[4 * j + 3] = mma_chunk(
            ha0, hb0, ha1, hb1, ha2, hb2, ha3, hb3, la0, lb0, la1, lb1, la2, lb2, la3, lb3,
            cw[4 * j], cw[4 * j + 1], cw[4 * j + 2], cw[4 * j + 3], acc[4 * j], acc[4 * j + 1], acc[4 * j + 2],
            acc[4 * j + 3])
    return sa, sb


@cuda.jit(device=True, inline="always")
def gemm_block(x, x_stride, gamma, eps, use_norm, W, Kp, K, N, bias, use_bias, out, out_stride, mode, first, end,
               warps):
    """k_gemm's block with `warps` warps, a constant of the kernel that calls it (so the loops over the
    warps unroll as they would over a literal)."""
    pdl_enter()
    part = cuda.shared.array(GEMM_PART, nb_f32)
    ssq = cuda.shared.array(GEMM_SSQ, nb_f32)
    acc = cuda.local.array(GEMM_ACC, nb_f32)
    tid = cuda.threadIdx.x
    w = tid // MMA
    lane = tid % MMA
    g = lane // 4
    t = lane % 4
    m0 = first + cuda.blockIdx.y * GEMM_ROWS
    n0 = cuda.blockIdx.x * GEMM_COLS
    xa = np.int64(min(m0 + g, end - 1)) * x_stride
    xb = np.int64(min(m0 + g + 8, end - 1)) * x_stride
    for i in range(GEMM_ACC):
        acc[i] = np.float32(0.0)
    sa = np.float32(0.0)
    sb = np.float32(0.0)
    # chunk c's operands in registers (cx: x rows g, g+8 then gamma; cw: the n8 tiles' weight words),
    # the next chunk's loads issued before this chunk's mmas; the two register sets take turns
    cx = cuda.local.array(24, nb_f32)
    cw = cuda.local.array(GEMM_ACC, nb_u32)
    nx = cuda.local.array(24, nb_f32)
    nw = cuda.local.array(GEMM_ACC, nb_u32)
    step = warps * 32
    c = w * 32
    gemm_load(cx, cw, x, xa, xb, gamma, use_norm, W, Kp, N, n0, g, t, c)
    while c < Kp:
        gemm_load(nx, nw, x, xa, xb, gamma, use_norm, W, Kp, N, n0, g, t, c + step)
        sa, sb = gemm_chunk(cx, cw, acc, sa, sb, use_norm)
        c += step
        if c >= Kp:
            break
        gemm_load(cx, cw, x, xa, xb, gamma, use_norm, W, Kp, N, n0, g, t, c + step)
        sa, sb = gemm_chunk(nx, nw, acc, sa, sb, use_norm)
        c += step
    for j in range(GEMM_NT):
        for e in range(4):
            part[((w * GEMM_NT + j) * 4 + e) * MMA + lane] = acc[4 * j + e]
    if use_norm != 0:
        sa = quad_sum(sa)
        sb = quad_sum(sb)
        if t == 0:
            ssq[w * GEMM_ROWS + g] = sa
            ssq[w * GEMM_ROWS + g + 8] = sb
    cuda.syncthreads()
    # epilogue: thread (w, lane) of the first GEMM_NT warps finishes fragment `lane` of n8 tile w
    col = n0 + 8 * w + 2 * t
    if w >= GEMM_NT or col >= N:
        return
    for h in range(2):
        row = m0 + g + 8 * h
        if row < end:
            v0 = part[(w * 4 + 2 * h) * MMA + lane]
            v1 = part[(w * 4 + 2 * h + 1) * MMA + lane]
            for u in range(1, warps):
                v0 += part[((u * GEMM_NT + w) * 4 + 2 * h) * MMA + lane]
                v1 += part[((u * GEMM_NT + w) * 4 + 2 * h + 1) * MMA + lane]
            if use_norm != 0:
                s = ssq[g + 8 * h]
                for u in range(1, warps):
                    s += ssq[u * GEMM_ROWS + g + 8 * h]
                inv = np.float32(1.0) / math.sqrt(s / np.float32(K) + eps)
                v0 *= inv
                v1 *= inv
            gemv_store(out, np.int64(row) * out_stride, col // 2, col, col + 1, N, v0, v1, bias, use_bias, mode)


@cuda.jit(cache=True)
def k_gemm(x, x_stride, gamma, eps, use_norm, W, Kp, K, N, bias, use_bias, out, out_stride, mode, first, end):
    """out[r] (op)= W @ f(x[r]) for the prompt rows first .. end-1 on the tensor cores (bf16 weights);
    f = RMSNorm(gamma) if use_norm; modes as k_gemv's 0-2 (gemv_store).

    Block (x: GEMM_COLS output columns, y: GEMM_ROWS rows); its GEMM_WARPS warps each take every
    GEMM_WARPS-th 32-wide K chunk (k_gemm_wide: GEMM_MAX_WARPS; which one a matrix runs is a choice of
    the model, never of the batch). In a chunk, lane (g, t) = (lane // 4, lane % 4) holds rows g and g+8
    at k .. k+7 (k = chunk + 8t) and the same eight k of weight row g of each n8 tile: the mma's k
    index is permuted within the chunk the same way for both operands, so each mma pair sums the chunk's
    full dot product, with one 16-byte load per operand row. x (times gamma under a norm) enters as bf16
    hi + lo (two mmas, ~16 significant bits); weights are exact. The norm's 1/rms scales the finished
    sum. The warps' partials are summed in warp order. What an output element computes depends on its
    row's x and its weight row only, never on the other rows of the tile, M, or where its row falls:
    a row's bits are its own (checked by bench/gemm_check.py on the device).
    Block: GEMM_WARPS * MMA threads. Padding columns of x and gamma (to Kp) must be zero."""
    gemm_block(x, x_stride, gamma, eps, use_norm, W, Kp, K, N, bias, use_bias, out, out_stride, mode, first, end,
               GEMM_WARPS)


@cuda.jit(cache=True)
def k_gemm_wide(x, x_stride, gamma, eps, use_norm, W, Kp, K, N, bias, use_bias, out, out_stride, mode, first,
                end):
    """k_gemm with GEMM_MAX_WARPS warps a block: each takes every GEMM_MAX_WARPS-th chunk, half as many
    in a row, for matrices whose K is long (perf log g1). Block: GEMM_MAX_WARPS * MMA threads."""
    gemm_block(x, x_stride, gamma, eps, use_norm, W, Kp, K, N, bias, use_bias, out, out_stride, mode, first, end,
               GEMM_MAX_WARPS)


@cuda.jit(cache=True)
def k_rope_kv(qkv, qkv_stride, slots, positions, bt, mb, kc, vc, layer_off, bs, nh, nkv, hd,
              cs, qn, kn, gofs, use_qkn, eps):
    """Per (row, head): optional per-head RMSNorm (Qwen3), RoPE (rotate_half pairs (i, i + hd/2),
    rotations from k_rope_table's cs), q written back in place, k and v written to the paged pool.
    Grid (R, nh+nkv)."""
    pdl_enter()
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
    sh[lo + qi]. Index arithmetic in unsigned 32 bits where it divides (perf log m5)."""
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
    numba wraps signed ones around for negative values (instructions in every access)."""
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


def attn_mma_shared_floats(hd: int, maxs: int) -> int:
    """k_attn_mma's dynamic shared memory in floats: the warps' (max, sum, acc), then merge_splits'."""
    return max(2 * ATT_WARPS * MQ + ATT_WARPS * MQ * hd, MQ * maxs + MQ)


def attn_shared_floats(hd: int, maxs: int) -> int:
    """k_attn_tiles' dynamic shared memory in floats: q, K tile, V tile, weights, acc, and the merge's
    split weights over the K/V tile."""
    hs = hd + 1
    return max(2 * QB * hs + TP * (hs + v_stride.py_func(hd)) + QB * (TP + 1), QB * hs + QB * maxs)


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
    gemv = (f32, i32, ai, i32, f32, t.float32, i32, W, i32, i32, i32, f32, i32, f32, i32, i32, i32, i32)
    gemm = (f32, i32, f32, t.float32, i32, W, i32, i32, i32, f32, i32, f32, i32, i32, i32, i32)
    attn = (f32, i32, ai, ai, ai, ai, i32, W, W, i64, i32, i32, i32, i32, t.float32, f32, i32, f32, ai, i32)
    return {
        "k_embed": (ai, W, i32, f32, i32),
        "k_gemv": gemv + (ai, ai, ai, i32, W, W, i64, i32, i32, i32, f32),
        "k_gemv_tile": gemv + (i32,),
        "k_rope_kv": (f32, i32, ai, ai, ai, i32, W, W, i64, i32, i32, i32, i32, f32, f32, f32, i32,
                      i32, t.float32),
        "k_rope_table": (f64, i32, i32, f32),
        "k_attn_rows": attn,
        "k_attn_tiles": attn,
        "k_final_norm": (f32, i32, ai, f32, t.float32, i32, i32, f32, i32),
        "k_sparse": (f32, i32, W, i32, i32, ai, ai, i32, f32, i32, i32),
        **({"k_gemm": gemm,
            "k_gemm_wide": gemm,
            "k_attn_mma": attn, "k_attn_mma_wide": attn} if storage == "bfloat16" else {}),
    }


KERNELS = {"k_embed": k_embed, "k_gemv": k_gemv, "k_gemv_tile": k_gemv_tile, "k_rope_kv": k_rope_kv,
           "k_rope_table": k_rope_table, "k_attn_rows": k_attn_rows, "k_attn_tiles": k_attn_tiles,
           "k_final_norm": k_final_norm, "k_sparse": k_sparse, "k_gemm": k_gemm, "k_gemm_wide": k_gemm_wide,
           "k_attn_mma": k_attn_mma, "k_attn_mma_wide": k_attn_mma_wide}
GEMM_KERNELS = {GEMM_WARPS: "k_gemm", GEMM_MAX_WARPS: "k_gemm_wide"}   # the prompt GEMM by its warps a block
MMA_ATTN_KERNELS = dict(zip(MMA_HDS, ("k_attn_mma", "k_attn_mma_wide")))   # prompt attention by head_dim bound
