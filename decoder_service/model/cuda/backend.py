"""CudaBackend: the model step on the GPU, behind docs/model_runtime_interface.md's interface.

The host-level calls (forward, dense_logits, sparse_logits) are the cpu backend's; the device-level
entries the engine keeps the step on the GPU with (stage, launch_forward, launch_sparse, capture),
the device buffers (the engine's device trie reads and writes the candidate ones) and the launch plan are in
model/cuda/README.md.
"""
from __future__ import annotations

import ctypes
import math
import threading
from bisect import bisect_right

import numpy as np

from decoder_service.gpu import compat  # noqa: F401  (numpy row_stack alias before numba-cuda compiles anything)
from decoder_service.gpu.graph_gate import GATE_SIGNATURE, k_gate
from decoder_service.gpu.intrinsics import MMA, SIM, TQ, WARP
from decoder_service.gpu.launcher import Graph, Kernel, Launch, Scalar, Stream, dptr, event_wait_host, new_event
from ..batch import StepBatch
from ..config import ModelConfig, ModelError
from ..kv_pool import KVPoolSpec
from ..weights import STORAGE_DTYPES, Weights, to_float32
from .attention import (ATT_WARPS, MAX_SPLITS, MMA_SPLIT, MQ, QB, ROW_SPLITS, TP, attn_mma_shared_floats,
                        attn_shared_floats)
from .kernels import GEMM_KERNELS, GEMM_KINDS, MMA_ATTN_KERNELS, model_kernel
from .matmul import (ACCUMULATE, GEMM_MAX_WARPS, GEMM_ROWS, GEMM_TILES, GEMM_WARPS, ROPE_KV, STORE, SWIGLU, TILE_ROWS,
                     gemm_shared)
from .norm_rope import ROPE_ITEMS
from .plan import GEMM_BIG_FROM, GEMM_ONE_FROM, RowPlan, attention_plan, compile_step_helpers, gemm_kind

from numba import cuda  # after compat

PROMPT_ROWS = 64  # prompt rows of one request whose tile attention the split rule fits in one wave (P63)


def _rope_pairs(a: np.ndarray, hd: int) -> np.ndarray:
    """[L, rows, ...] QKV rows (or [L, rows] biases) reordered per head of hd rows into rotate_half
    pairs: i, i + hd/2 for i = 0 .. hd/2 - 1."""
    L, rows = a.shape[:2]
    return np.ascontiguousarray(a.reshape((L, rows // hd, 2, hd // 2) + a.shape[2:]).swapaxes(2, 3)).reshape(a.shape)


def _pad_cols(a: np.ndarray, kp: int) -> np.ndarray:
    """Rows padded with zeros to kp columns (no copy when already kp wide and contiguous)."""
    if a.shape[-1] == kp:
        return np.ascontiguousarray(a)
    out = np.zeros(a.shape[:-1] + (kp,), a.dtype)
    out[..., : a.shape[-1]] = a
    return out


def _round8(k: int) -> int:
    return -(-k // 8) * 8


class CudaBackend:
    name = "cuda"

    def __init__(self, cfg: ModelConfig, weights: Weights, kv_spec: KVPoolSpec, *,
                 max_rows: int = 1024, max_logit_rows: int = 128, max_candidates: int = 256,
                 max_table: int | None = None, gemv_threads: int | None = None, prefetch: int = 1,
                 attn_split: int | None = None, attn_splits: int | None = None, attn_tile_from: int = 0,
                 gemm_warps: int | None = None, gemm_big_from: int | None = None, graph_rows: int = 16,
                 max_graphs: int = 64):
        if weights.dtype not in STORAGE_DTYPES:
            raise ModelError(f"cuda backend: unsupported weight dtype {weights.dtype!r}")
        if cfg.head_dim % 8:
            raise ModelError(f"cuda backend: head_dim={cfg.head_dim} must be a multiple of 8 "
                             f"(16-byte K/V row loads)")
        self.cfg, self.spec, self.storage = cfg, kv_spec, weights.dtype
        self.np_dtype = np.dtype(STORAGE_DTYPES[weights.dtype])
        H, I = cfg.hidden_size, cfg.intermediate_size
        self.max_rows, self.max_logit_rows, self.max_candidates = max_rows, max_logit_rows, max_candidates
        self.max_table = max_table or max(64 * 64, 8 * max(1, -(-cfg.max_position_embeddings // kv_spec.block_size)))
        self.dqkv = cfg.q_size + 2 * cfg.kv_size
        self.kp_h, self.kp_q, self.kp_i = _round8(H), _round8(cfg.q_size), _round8(I)
        self.prefetch = int(prefetch)            # weight cache hints: 0 none, 1 L2 (P44), 2 L1
        self.gemv_threads = gemv_threads         # None: by matrix size (P04)
        # forward() replays a captured graph for steps of up to graph_rows decode rows (one per shape
        # of launch: rows, logit rows, table stride, attention grid; at most max_graphs kept)
        self.graph_rows, self.max_graphs = int(graph_rows), int(max_graphs)
        self._graphs: dict[tuple, Graph] = {}
        self._choose_kernels(attn_split, attn_splits, attn_tile_from, gemm_warps)
        # prompt rows from which each matrix takes k_gemm's big tiles: GEMM_BIG_FROM, or one figure for all
        big_from = GEMM_BIG_FROM if gemm_big_from is None else dict.fromkeys(GEMM_BIG_FROM, int(gemm_big_from))
        # each matrix's k_gemm launch per span of prompt rows between those figures, so a step only looks one up
        self._gemm_from = sorted({f for t in (big_from, GEMM_ONE_FROM) for f in t.values() if f is not None})
        self._gemm_plans = [{k: f"{k}/{gemm_kind(rows, big_from[k], GEMM_ONE_FROM[k])}" for k in big_from}
                            for rows in [0] + self._gemm_from]
        self._check_memory(weights)
        self.stream = Stream()
        self._upload_weights(weights)
        self._allocate_buffers()
        self._load_kernels(attn_splits)
        self._fill_rope_table()
        self._build_launches()
        compile_step_helpers(kv_spec.block_size, kv_spec.num_blocks, cfg.vocab_size, self.rows_per_tile,
                             self.attn_split, self.most_splits)
        self.stream.synchronize()

    # ------------------------------------------------------------------------------------ set-up
    def _choose_kernels(self, attn_split, attn_splits, attn_tile_from, gemm_warps) -> None:
        """Launch geometry and which kernel takes which rows: fixed per model, never per batch (determinism
        by construction)."""
        cfg, hd = self.cfg, self.cfg.head_dim
        nh, nkv = cfg.num_heads, cfg.num_kv_heads
        if SIM:
            self.t_gemv, self.t_attn, self.t_small = 2 * WARP, 2 * WARP, 2 * WARP
            self.sm_count = 2
        else:
            self.t_gemv, self.t_attn, self.t_small = 256, 128, 128
            self.sm_count = cuda.get_current_device().MULTIPROCESSOR_COUNT
        if hd > 2 * self.t_attn:
            raise ModelError(f"cuda backend: head_dim={hd} > {2 * self.t_attn}")
        # Prompt rows of a bf16 model (head_dim <= 128) attend in tiles on the tensor cores (k_attn_mma, or
        # k_attn_mma_wide above head_dim 64; MQ queries a tile; P35, P74), others in k_attn_tiles (QB)
        mma_bound = min((b for b in MMA_ATTN_KERNELS if hd <= b), default=None)
        self.mma_attn = self.storage == "bfloat16" and mma_bound is not None
        self.tiles_kernel = MMA_ATTN_KERNELS[mma_bound] if self.mma_attn else "k_attn_tiles"
        tile_queries = MQ if self.mma_attn else QB
        self.rows_per_tile = tile_queries // (nh // nkv)   # rows whose queries share a block
        self.attn_tile_from = int(attn_tile_from)  # prompt rows from this position on attend in tiles (P83)
        if self.rows_per_tile < 1:
            raise ModelError(f"cuda backend: {nh // nkv} query heads per KV head > {tile_queries}")
        # Prompt attention splits contexts at multiples of attn_split positions (fixed per model: a
        # row's arithmetic never depends on the batch); enough for max_position_embeddings.
        limit = -(-cfg.max_position_embeddings // (TP * MAX_SPLITS)) * TP
        # k_attn_mma's warps take 16-position blocks; a shortlist prompt (~550 rows) fits one split of MMA_SPLIT (P96)
        self.attn_split = max(MMA_SPLIT if self.mma_attn else TP, limit) if attn_split is None else int(attn_split)
        if self.attn_split % TP or self.attn_split < TP:
            raise ModelError(f"cuda backend: attn_split={self.attn_split} must be a positive multiple "
                             f"of {TP}")
        self.reach = self.attn_split * MAX_SPLITS   # positions the attention (and the RoPE table) cover
        if attn_splits is not None and not 1 <= attn_splits <= MAX_SPLITS:
            raise ModelError(f"cuda backend: attn_splits={attn_splits} must be in [1, {MAX_SPLITS}]")
        self.t_rope = min(128, max(WARP, -(-(hd // 2) // WARP) * WARP))
        # Without a q/k norm, a one-row step runs RoPE and the KV write in k_gemv's epilogue (ROPE_KV,
        # rope_store), on a copy of the QKV rows (and bias) permuted into rotate_half pairs
        # (i, i + hd/2); row tiles keep the plain rows and k_rope_kv (P31, P32).
        self.fused_rope = not cfg.qk_norm
        # Prompt rows of a bf16 model run the tensor-core GEMM (k_gemm: bf16 hi + lo activations, float32
        # sums; P33); decode rows, and every row of other storage dtypes, the GEMVs.
        self.gemm = self.storage == "bfloat16"
        if gemm_warps is not None and gemm_warps not in (GEMM_WARPS, GEMM_MAX_WARPS):
            raise ModelError(f"cuda backend: gemm_warps={gemm_warps} must be {GEMM_WARPS} (k_gemm) or "
                             f"{GEMM_MAX_WARPS} (k_gemm_wide)")
        self.gemm_warps = gemm_warps             # k_gemm's split of K for every matrix (None: _gemm_warps' rule)

    def _upload_weights(self, weights: Weights) -> None:
        """The weights, repacked for the kernels (rows padded to a multiple of 8 elements) and uploaded once."""
        cfg, hd = self.cfg, self.cfg.head_dim
        L, H, I = cfg.num_layers, cfg.hidden_size, cfg.intermediate_size
        dev = cuda.to_device
        self.w_embed = dev(_pad_cols(weights.embed, self.kp_h).reshape(-1))
        tied = weights.lm_head is weights.embed
        self.w_head = self.w_embed if tied else dev(_pad_cols(weights.lm_head, self.kp_h).reshape(-1))
        self.w_qkv = dev(_pad_cols(weights.wqkv, self.kp_h).reshape(-1))
        self.w_qkv_pairs = dev(_pad_cols(_rope_pairs(weights.wqkv, hd), self.kp_h).reshape(-1)) \
            if self.fused_rope else None
        self.w_o = dev(_pad_cols(weights.wo, self.kp_q).reshape(-1))
        gu = weights.w_gate_up.reshape(L, 2, I, H).transpose(0, 2, 1, 3).reshape(L, 2 * I, H)
        self.w_gu = dev(_pad_cols(gu, self.kp_h).reshape(-1))   # rows interleaved gate0, up0, gate1, ...
        del gu
        self.w_down = dev(_pad_cols(weights.w_down, self.kp_i).reshape(-1))

        def f32(a):
            return np.ascontiguousarray(to_float32(a, weights.dtype), np.float32).reshape(-1)

        def f32p(a):
            return _pad_cols(to_float32(a, weights.dtype).astype(np.float32), self.kp_h).reshape(-1)

        self.n_attn = dev(f32p(weights.attn_norm))     # padded with zeros like the rows they scale
        self.n_mlp = dev(f32p(weights.mlp_norm))
        self.n_final = dev(f32p(weights.final_norm))
        one = dev(np.zeros(1, np.float32))
        self.b_qkv = dev(f32(weights.bqkv)) if cfg.qkv_bias else one
        self.b_qkv_pairs = dev(f32(_rope_pairs(weights.bqkv, hd))) if cfg.qkv_bias and self.fused_rope else one
        self.n_q = dev(f32(weights.q_norm)) if cfg.qk_norm else one
        self.n_k = dev(f32(weights.k_norm)) if cfg.qk_norm else one
        self.rope_cs = cuda.device_array(self.reach * hd, np.float32)   # cos, sin per (position, pair)

    def _allocate_buffers(self) -> None:
        """The KV pool, the step's device buffers (zeroed in stream order) and their pinned host staging."""
        cfg, kv_spec, s = self.cfg, self.spec, self.stream
        L, V, nh, nkv, hd = cfg.num_layers, cfg.vocab_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        per_layer = kv_spec.num_blocks * kv_spec.block_size * nkv * hd
        self.kv_layer_elems = per_layer
        self.kv_k = cuda.device_array(L * per_layer, self.np_dtype)
        self.kv_v = cuda.device_array(L * per_layer, self.np_dtype)
        s.memset0(self.kv_k)
        s.memset0(self.kv_v)
        R, N, C = self.max_rows, self.max_logit_rows, self.max_candidates
        # One int32 input buffer (one copy per step): tokens | slots | positions | attention rows |
        # attention tiles | logit_rows | tables
        self._o_slots, self._o_pos, self._o_arows, self._o_tiles = R, 2 * R, 3 * R, 4 * R
        self._o_lrows, self._o_tab = 7 * R, 7 * R + N
        n_ints = 7 * R + N + self.max_table
        self.ints = cuda.device_array(n_ints, np.int32)
        self.tokens = self.ints[0:R]
        self.slots = self.ints[self._o_slots:self._o_slots + R]
        self.positions = self.ints[self._o_pos:self._o_pos + R]
        self.attn_rows = self.ints[self._o_arows:self._o_tiles]
        self.attn_tiles = self.ints[self._o_tiles:self._o_lrows]
        self.logit_rows = self.ints[self._o_lrows:self._o_lrows + N]
        self.block_tables = self.ints[self._o_tab:n_ints]
        # Activations: rows padded to a multiple of 8 floats (16-byte staging loads); padding zero.
        self.x = cuda.device_array(R * self.kp_h, np.float32)
        self.qkv = cuda.device_array(R * self.dqkv, np.float32)
        self.att = cuda.device_array(R * self.kp_q, np.float32)
        self.act = cuda.device_array(R * self.kp_i, np.float32)
        self.hidden = cuda.device_array(N * self.kp_h, np.float32)
        for buf in (self.x, self.att, self.act, self.hidden):
            s.memset0(buf)
        self.logits = cuda.device_array(N * V, np.float32)
        self.cand_ints = cuda.device_array(N * C + N, np.int32)
        self.cand = self.cand_ints[0:N * C]
        self.ncand = self.cand_ints[N * C:N * C + N]
        self.sparse = cuda.device_array(N * C, np.float32)
        self.targets = cuda.device_array(N, np.int32)
        self.logprob = cuda.device_array(N, np.float32)
        # attention context splits: partials (max, sum, acc[hd]) per (row, head, split) and a
        # done-counter per (row, head) or (row tile, KV head); the two kernels run one after the other
        self.attn_part = cuda.device_array(R * nh * MAX_SPLITS * (hd + 2), np.float32)
        self.attn_count = cuda.device_array(R * nh, np.int32)
        s.memset0(self.attn_count)
        self._max_ctx, self._n_attn_rows, self._n_tiles, self._n_decode = 1, 0, 0, 0
        # Host staging: pinned on a device (async, capturable copies); a ring of two so a step's
        # inputs can be written while the previous step's copy may still be queued.
        pin = np.zeros if SIM else cuda.pinned_array
        self._ring = [pin(n_ints, np.int32) for _ in range(2)]
        self._ring_ev = [new_event() for _ in range(2)]
        self._ring_i = 0
        self._cand_host = pin(N * C + N, np.int32)
        self.moves = cuda.device_array(3 * R, np.int32)   # place_kv's slots from, slots to and shifts
        self._moves_host, self._moves_ev = pin(3 * R, np.int32), new_event()
        self.n_moves = Scalar(ctypes.c_int32, 0)
        self._out_host = pin(max(N * V, N * C), np.float32)
        self.table_stride = Scalar(ctypes.c_int32, 1)
        self.n_rows = Scalar(ctypes.c_int32, 1)        # rows of this step's GEMV row tiles
        self.rope_rows = Scalar(ctypes.c_int32, 1)     # rows of this step's k_rope_kv
        self.gemm_rows = (Scalar(ctypes.c_int32, 0), Scalar(ctypes.c_int32, 0))   # k_gemm's rows [first, end)
        self.n_logit = Scalar(ctypes.c_int32, 1)       # logit rows of this step (dense head tiles)
        self._R = self._N = 0
        self._threads = {threading.get_ident()}

    def _load_kernels(self, attn_splits: int | None) -> None:
        """The kernels this model launches, compiled or loaded from the disk cache (the prompt tiles' kernel
        is one of MMA_ATTN_KERNELS or k_attn_tiles), and what depends on their occupancy."""
        names = ["k_embed", "k_gemv", "k_gemv_tile", "k_rope_kv", "k_attn_rows", "k_final_norm", "k_sparse",
                 "k_logprob", "k_rope_table", "k_place_kv", self.tiles_kernel]
        if self.gemm:     # the GEMM kernels of the matrices' input widths (qkv, gate_up: H; o: q_size; down: I)
            names += sorted({GEMM_KERNELS[self._gemm_warps(kp), kind] for kp in (self.kp_h, self.kp_q, self.kp_i)
                             for kind in GEMM_KINDS})
        self.kernels = {name: model_kernel(name, self.storage) for name in names}
        self.gate = Kernel("k_gate", k_gate, GATE_SIGNATURE)   # gated graphs (forward)
        # the prompt tiles' attention: kernel, block, dynamic shared memory
        block, shared_floats = (ATT_WARPS * MMA, attn_mma_shared_floats) if self.mma_attn \
            else (QB * TQ, attn_shared_floats)
        self.tile_attention = (self.kernels[self.tiles_kernel], block,
                               shared_floats(self.cfg.head_dim, MAX_SPLITS) * 4)
        # Longer splits where a long context would cut a request's prompt into more blocks than fit
        # one wave (prompt_split; fixed per model and device, never per batch)
        self.most_splits = self._most_splits() if attn_splits is None else int(attn_splits)

    def _fill_rope_table(self) -> None:
        """RoPE's cos and sin for every position within the attention's reach, computed once."""
        hd = self.cfg.head_dim
        inv_freq = cuda.to_device(self.cfg.rope_theta ** (-np.arange(0, hd, 2, dtype=np.float64) / hd))
        Launch(self.kernels["k_rope_table"], self.t_small, 0,
               dict(inv_freq=inv_freq, half=hd // 2, n=self.reach, cs=self.rope_cs),
               self.stream.handle, "rope_table").launch(-(-self.reach * (hd // 2) // self.t_small))

    def _most_splits(self) -> int:
        """The most splits a prompt row's context is cut into: on k_attn_mma as many as let a prompt of
        PROMPT_ROWS rows (tiles x KV heads x splits blocks) run in one wave of resident blocks
        (P63). k_attn_tiles (not measured with it) and the simulator (its tests merge many splits) keep
        attn_split at every context."""
        if SIM or not self.mma_attn:
            return MAX_SPLITS
        kernel, block, shmem = self.tile_attention
        resident = self.sm_count * kernel.occupancy(block, shmem)
        tiles = -(-PROMPT_ROWS // self.rows_per_tile)
        return max(1, min(MAX_SPLITS, resident // (self.cfg.num_kv_heads * tiles)))

    def _check_memory(self, weights: Weights) -> None:
        cfg, spec = self.cfg, self.spec
        isz = self.np_dtype.itemsize
        w = weights.nbytes() + (weights.wqkv.nbytes if self.fused_rope else 0)   # + the paired QKV copy
        kv = 2 * cfg.num_layers * spec.num_blocks * spec.block_size * cfg.kv_size * isz
        R, N = self.max_rows, self.max_logit_rows
        act = 4 * (R * (cfg.hidden_size + self.dqkv + cfg.q_size + cfg.intermediate_size)
                   + N * (cfg.hidden_size + cfg.vocab_size + 2 * self.max_candidates))
        need = w + kv + act + 4 * self.reach * cfg.head_dim   # + the RoPE table
        if SIM:
            return
        free, total = cuda.current_context().get_memory_info()
        if need > free:
            raise ModelError(
                f"cuda backend: needs {need / 2**30:.2f} GiB on the device (weights {w / 2**30:.2f}, "
                f"KV pool {spec.num_blocks} blocks x {spec.block_size} tokens = {kv / 2**30:.2f}, "
                f"activations {act / 2**30:.2f}) but only {free / 2**30:.2f} of {total / 2**30:.2f} "
                f"GiB are free")

    def _gemv_threads(self, n_rows: int, kp: int) -> int:
        """Threads per block of one matrix (fixed per matrix: its norm tree depends on it). Measured on
        the H200 (P04): 128 wins below ~12 MB (more blocks in flight), 256 above."""
        if SIM:
            return self.t_gemv
        if self.gemv_threads:
            return self.gemv_threads
        return 128 if n_rows * kp * self.np_dtype.itemsize < 12e6 else 256

    def _gemm_warps(self, kp: int) -> int:
        """k_gemm's warps a block for a matrix kp columns wide (fixed per model: a row's bits): k_gemm_wide's
        where K is long enough that each of k_gemm's warps would chain more than 8 chunks (SmolLM2's down
        projection: 12 chunks a warp, 10.3 against 7.2 µs a layer at 58 rows; P68), else k_gemm's."""
        if self.gemm_warps is not None:
            return self.gemm_warps
        return GEMM_MAX_WARPS if kp > 8 * GEMM_WARPS * 32 else GEMM_WARPS

    def _gemv_grid(self, kernel: Kernel, threads: int, n_out_rows: int, shmem: int) -> tuple[int, int]:
        """(blocks along x: enough for every row pair, at most one resident wave (grid-stride beyond);
        the resident wave)."""
        nw = threads // WARP
        need = -(-((n_out_rows + 1) // 2) // nw)
        cap = self.sm_count * (2 if SIM else max(1, kernel.occupancy(threads, shmem)))
        return max(1, min(need, cap)), cap

    def _gemv_pair(self, name: str, x, x_stride: int, gamma, use_norm: int, W, K: int, kp: int, N: int,
                   bias, use_bias: int, out, out_stride: int, mode: int, rope: tuple | None = None):
        """(launch, grid_x, resident wave) for one row and for row tiles of the same product. With
        rope = (paired W, paired bias, the layer's offset in the KV pool) the one-row launch runs
        the ROPE_KV epilogue (RoPE and the KV write) on the paired rows."""
        def args(W, bias, mode):
            return dict(x=x, x_stride=x_stride, row_map=self.logit_rows, use_map=0, gamma=gamma,
                        eps=float(self.cfg.rms_norm_eps), use_norm=use_norm, W=W, Q=kp // 8, K=K, N=N, bias=bias,
                        use_bias=use_bias, out=out, out_stride=out_stride, mode=mode, pf=self.prefetch,
                        epl=128 // self.np_dtype.itemsize)
        w1, b1, mode1, layer_off = (rope[0], rope[1], ROPE_KV, rope[2]) if rope else (W, bias, mode, 0)
        one = dict(args(w1, b1, mode1), positions=self.positions, slots=self.slots, bt=self.block_tables,
                   mb=self.table_stride, kc=self.kv_k, vc=self.kv_v, layer_off=layer_off, bs=self.spec.block_size,
                   nkv=self.cfg.num_kv_heads, hd=self.cfg.head_dim, cs=self.rope_cs)
        tile = dict(args(W, bias, mode), R=self.n_rows if name != "dense_head" else self.n_logit)
        k1, kt = self.kernels["k_gemv"], self.kernels["k_gemv_tile"]
        st = self.stream.handle
        t = self._gemv_threads(N, kp)
        tile_shmem = TILE_ROWS * kp * 4
        l1 = Launch(k1, t, kp * 4, one, st, name)
        lt = Launch(kt, t, tile_shmem, tile, st, name + "/tile")
        return (l1, *self._gemv_grid(k1, t, N, kp * 4)), (lt, *self._gemv_grid(kt, t, N, tile_shmem))

    def _matrix(self, key: str, name: str, x, x_stride: int, gamma, use_norm: int, W, K: int, kp: int, N: int,
                bias, use_bias: int, out, out_stride: int, mode: int, rope: tuple | None = None) -> dict:
        """A layer's launches of one matrix: `key` (one row), `key/tile` (row tiles) and, for a bf16
        model, `key/small`, `key/one` and `key/big` (k_gemm over the prompt rows, GEMM_KINDS: launch, blocks along
        x, rows a block)."""
        one, tile = self._gemv_pair(name, x, x_stride, gamma, use_norm, W, K, kp, N, bias, use_bias, out,
                                    out_stride, mode, rope)
        launches = {key: one, key + "/tile": tile}
        if self.gemm:
            first, end = self.gemm_rows
            args = dict(x=x, x_stride=x_stride, gamma=gamma, eps=float(self.cfg.rms_norm_eps), use_norm=use_norm,
                        W=W, Kp=kp, K=K, N=N, bias=bias, use_bias=use_bias, out=out, out_stride=out_stride,
                        mode=mode, first=first, end=end)
            warps = self._gemm_warps(kp)
            for kind in GEMM_KINDS:
                kernel = GEMM_KERNELS[warps, kind]
                _, mt, nt = GEMM_TILES[kernel]
                launches[f"{key}/{kind}"] = (Launch(self.kernels[kernel], warps * MMA, gemm_shared(warps, mt, nt),
                                                    args, self.stream.handle, f"{name}/{kind}"), -(-N // (8 * nt)),
                                             GEMM_ROWS * mt)
        return launches

    def _build_launches(self) -> None:
        cfg, k, st = self.cfg, self.kernels, self.stream.handle
        L, H, I, V = cfg.num_layers, cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
        nh, nkv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        eps = float(cfg.rms_norm_eps)
        kh, kq, ki = self.kp_h, self.kp_q, self.kp_i
        epl = 128 // self.np_dtype.itemsize
        self.l_embed = Launch(k["k_embed"], self.t_small, 0,
                              dict(tokens=self.tokens, E=self.w_embed, Q=kh // 8, x=self.x, x_stride=kh), st, "embed")
        self.layers = []
        for l in range(L):
            wq = self.w_qkv[l * self.dqkv * kh:(l + 1) * self.dqkv * kh]
            wo = self.w_o[l * H * kq:(l + 1) * H * kq]
            wgu = self.w_gu[l * 2 * I * kh:(l + 1) * 2 * I * kh]
            wd = self.w_down[l * H * ki:(l + 1) * H * ki]
            na = self.n_attn[l * kh:(l + 1) * kh]
            nm = self.n_mlp[l * kh:(l + 1) * kh]
            bias = self.b_qkv[l * self.dqkv:(l + 1) * self.dqkv] if cfg.qkv_bias else self.b_qkv
            kvo = l * self.kv_layer_elems
            rope = None
            if self.fused_rope:
                bp = self.b_qkv_pairs[l * self.dqkv:(l + 1) * self.dqkv] if cfg.qkv_bias else self.b_qkv_pairs
                rope = (self.w_qkv_pairs[l * self.dqkv * kh:(l + 1) * self.dqkv * kh], bp, kvo)
            layer = self._matrix("qkv", f"qkv[{l}]", self.x, kh, na, 1, wq, H, kh, self.dqkv, bias,
                                 int(cfg.qkv_bias), self.qkv, self.dqkv, STORE, rope)
            pool = dict(slots=self.slots, positions=self.positions, bt=self.block_tables, mb=self.table_stride,
                        kc=self.kv_k, vc=self.kv_v, layer_off=kvo, bs=self.spec.block_size, nkv=nkv, hd=hd)
            layer["rope"] = Launch(k["k_rope_kv"], self.t_rope * ROPE_ITEMS, 0,
                                   dict(pool, qkv=self.qkv, qkv_stride=self.dqkv, nh=nh, cs=self.rope_cs, qn=self.n_q,
                                        kn=self.n_k, gofs=l * hd if cfg.qk_norm else 0, use_qkn=int(cfg.qk_norm),
                                        eps=eps, R=self.rope_rows), st, f"rope_kv[{l}]")
            attention = dict(pool, qkv=self.qkv, qkv_stride=self.dqkv, group=nh // nkv, scale=1.0 / math.sqrt(hd),
                             out=self.att, out_stride=kq, part=self.attn_part, counters=self.attn_count)
            layer["attn_rows"] = Launch(k["k_attn_rows"], self.t_attn, (hd + 9 * self.t_attn) * 4,
                                        dict(attention, rows=self.attn_rows, maxs=ROW_SPLITS), st, f"attn_rows[{l}]")
            layer["attn_tiles"] = Launch(*self.tile_attention, dict(attention, tiles=self.attn_tiles, maxs=MAX_SPLITS),
                                         st, f"attn_tiles[{l}]")
            layer.update(self._matrix("o", f"o_proj[{l}]", self.att, kq, na, 0, wo, cfg.q_size, kq, H,
                                      self.b_qkv, 0, self.x, kh, ACCUMULATE))
            layer.update(self._matrix("gate_up", f"gate_up[{l}]", self.x, kh, nm, 1, wgu, H, kh, 2 * I,
                                      self.b_qkv, 0, self.act, ki, SWIGLU))
            layer.update(self._matrix("down", f"down[{l}]", self.act, ki, nm, 0, wd, I, ki, H, self.b_qkv,
                                      0, self.x, kh, ACCUMULATE))
            self.layers.append(layer)
        self.l_final = Launch(k["k_final_norm"], self.t_small, kh * 4,
                              dict(x=self.x, x_stride=kh, rows=self.logit_rows, gamma=self.n_final, eps=eps, K=H,
                                   Q=kh // 8, out=self.hidden, out_stride=kh), st, "final_norm")
        head = self._matrix("dense_head", "dense_head", self.hidden, kh, self.n_final, 0, self.w_head, H, kh, V,
                            self.b_qkv, 0, self.logits, V, STORE)
        self.l_dense, self.l_dense_tile = head["dense_head"], head["dense_head/tile"]
        self.l_head_gemm = head.get("dense_head/big")   # token_logprobs' head on the tensor cores (bf16)
        nwc = self.t_gemv // WARP
        self.l_sparse = (Launch(k["k_sparse"], self.t_gemv, kh * 4,
                                dict(h=self.hidden, h_stride=kh, W=self.w_head, Q=kh // 8, V=V, cand=self.cand,
                                     ncand=self.ncand, cmax=self.max_candidates, out=self.sparse, pf=self.prefetch,
                                     epl=epl), st, "sparse_head"),
                         max(1, -(-self.max_candidates // (2 * nwc))))
        self.l_logprob = Launch(k["k_logprob"], self.t_gemv, 0, dict(logits=self.logits, V=V, targets=self.targets,
                                                                    out=self.logprob), st, "logprob")
        self.l_place = Launch(k["k_place_kv"], self.t_rope, 0,
                              dict(kc=self.kv_k, vc=self.kv_v, moves=self.moves, n=self.n_moves, nkv=cfg.num_kv_heads,
                                   heads=cfg.num_layers * cfg.num_kv_heads, layer_elems=self.kv_layer_elems,
                                   hd=hd, cs=self.rope_cs), st, "place_kv")

    # ------------------------------------------------------------------------- device-level entries
    def _ensure_context(self) -> None:
        """The raw driver calls need the device's context current in the calling thread; numba makes
        it current in the thread that built the backend. Other threads (an engine's worker) get it
        here, once per thread."""
        tid = threading.get_ident()
        if tid not in self._threads:
            if not SIM:
                cuda.current_context()
            self._threads.add(tid)

    def launches_per_step(self) -> int:
        return 2 + 6 * self.cfg.num_layers

    def stage(self, batch: StepBatch) -> None:
        """Copy a validated batch's inputs into the device input buffers (asynchronous)."""
        self._ensure_context()
        R, N = batch.num_rows, len(batch.logit_rows)
        S, mb = batch.block_tables.shape
        if R > self.max_rows or N > self.max_logit_rows or S * mb > self.max_table:
            raise ModelError(f"cuda backend: step of {R} rows / {N} logit rows / block table {S}x{mb} "
                             f"exceeds the buffers ({self.max_rows} rows, {self.max_logit_rows} logit "
                             f"rows, {self.max_table} table entries)")
        max_ctx = int(batch.positions.max()) + 1
        if max_ctx > self.reach:
            raise ModelError(f"cuda backend: position {max_ctx - 1} is past the attention's reach "
                             f"({self.attn_split} x {MAX_SPLITS} positions)")
        i = self._ring_i = (self._ring_i + 1) % 2
        event_wait_host(self._ring_ev[i])  # the copy that last used this staging buffer has run
        h = self._ring[i]
        h[:R] = batch.tokens
        h[self._o_slots:self._o_slots + R] = batch.slots
        h[self._o_pos:self._o_pos + R] = batch.positions
        rows, tiles = attention_plan(batch, max_ctx, self.attn_tile_from, self.rows_per_tile, self.attn_split,
                                     self.most_splits, TP)
        h[self._o_arows:self._o_arows + len(rows)] = rows
        h[self._o_tiles:self._o_tiles + tiles.size] = tiles.reshape(-1)
        h[self._o_lrows:self._o_lrows + N] = batch.logit_rows
        stride = self._table_stride(S, mb)
        tab = h[self._o_tab:self._o_tab + S * stride].reshape(S, stride)
        tab[:, :mb] = batch.block_tables
        tab[:, mb:] = -1
        self.stream.h2d(self.ints, h, self._o_tab + S * stride)
        self.stream.record(self._ring_ev[i])
        self.table_stride.value = stride
        self._max_ctx, self._n_attn_rows, self._n_tiles = max_ctx, len(rows), len(tiles)
        self._n_decode = batch.decode_rows

    def _table_stride(self, S: int, mb: int) -> int:
        """Row stride of the staged block tables: mb rounded up to a power of two where the table
        buffer holds it, so that steps whose tables grow by a block share a captured graph (the
        stride is a launch parameter; the padding is -1, never read)."""
        stride = 1 << max(0, mb - 1).bit_length()
        return stride if S * stride <= self.max_table else mb

    def launch_forward(self, R: int, N: int, max_ctx: int | None = None) -> None:
        """Enqueue the forward pass of rows 0..R-1 (inputs already in the device buffers; the first
        `decode_rows` of the staged batch are decode rows), its matrices as row_plan(R) says.
        max_ctx bounds every row's position + 1 (default: the last staged batch's); a graph captured
        for a bound serves every batch within it."""
        attn = self.attn_grids(self._max_ctx if max_ctx is None else max_ctx)
        plan = self.row_plan(R)
        self.l_embed.launch(R)
        for layer in self.layers:
            self.launch_matrix(layer, "qkv", plan)
            if plan.rope:
                self.launch_rope(layer, R)
            self.launch_attention(layer, attn)
            for key in ("o", "gate_up", "down"):
                self.launch_matrix(layer, key, plan)
        if N:
            self.l_final.launch(N)

    _ONE_ROW = {k: k for k in ("qkv", "o", "gate_up", "down")}
    _ROW_TILES = {k: k + "/tile" for k in _ONE_ROW}

    def row_plan(self, R: int) -> RowPlan:
        """Which kernels compute the matrices for the staged step of R rows (and the row scalars they
        read, set here). Prompt rows of a bf16 model (rows decode_rows .. R-1) go to k_gemm (each matrix on
        its tiles by the step's prompt rows: gemm_kind, the same bits whichever); the other
        rows to the GEMVs: a lone row to the one-row kernels (RoPE and the KV write in the QKV GEMV's
        epilogue where the model has no q/k norm), more rows to tiles of TILE_ROWS rows. Either GEMV
        gives a row the same bits (launch_tiles); which kernel takes a row is its kind's, never the
        batch's."""
        D = min(self._n_decode, R) if self.gemm else R
        if D == 1 == R:
            return RowPlan(self._ONE_ROW, 1, 0, self._gemm_plans[0], not self.fused_rope)
        self.n_rows.value = D
        self.gemm_rows[0].value, self.gemm_rows[1].value = D, R
        gemm = self._gemm_plans[bisect_right(self._gemm_from, R - D)]
        return RowPlan(self._ROW_TILES, -(-D // TILE_ROWS), R - D, gemm, True)

    def launch_rope(self, layer: dict, R: int) -> None:
        """A layer's k_rope_kv over the staged step's R rows."""
        self.rope_rows.value = R
        layer["rope"].launch(-(-R * (self.cfg.num_heads + self.cfg.num_kv_heads) // ROPE_ITEMS))

    def launch_matrix(self, layer: dict, key: str, plan: RowPlan) -> None:
        """One matrix of a layer for a step's rows: GEMV tiles (or the one-row GEMV), then k_gemm."""
        if plan.tiles:
            self.launch_tiles(layer[plan.gemv[key]], plan.tiles)
        if plan.prompt:
            lz, gx, rows = layer[plan.gemm[key]]
            lz.launch(gx, -(-plan.prompt // rows))

    def attn_grids(self, max_ctx: int, row_splits: int = ROW_SPLITS) -> tuple[tuple, tuple]:
        """Attention's grids for the staged batch, its positions + 1 at most max_ctx: rows one at a time
        (rows, heads, splits: a row uses those its own context needs, at most row_splits, k_attn_rows'
        `maxs`) and row tiles (tiles, KV heads, the most splits a tile's rows have: prompt_split)."""
        rows = (self._n_attn_rows, self.cfg.num_heads, max(1, min(-(-int(max_ctx) // self.t_attn), row_splits)))
        tiles = (self._n_tiles, self.cfg.num_kv_heads,
                 max(1, min(self.most_splits, -(-int(max_ctx) // self.attn_split))))
        return rows, tiles

    @staticmethod
    def launch_attention(layer: dict, grids: tuple) -> None:
        """One layer's attention: k_attn_rows for the listed rows, k_attn_tiles for the row tiles."""
        rows, tiles = grids
        if rows[0]:
            layer["attn_rows"].launch(*rows)
        if tiles[0]:
            layer["attn_tiles"].launch(*tiles)

    @staticmethod
    def launch_tiles(gemv: tuple, tiles: int) -> None:
        """A (launch, grid_x, wave) GEMV over `tiles` row tiles: grid_x blocks per tile, fewer where the
        tiles together would exceed two resident waves, so that a block stages (and normalises) its
        rows once for more output rows. The arithmetic of an output element does not depend on which
        block computes it."""
        lz, gx, wave = gemv
        lz.launch(min(gx, max(1, -(-2 * wave // tiles))), tiles)

    def launch_dense(self, N: int) -> None:
        if N == 1:
            self.launch_tiles(self.l_dense, 1)
        elif N > 1:
            self.n_logit.value = N
            self.launch_tiles(self.l_dense_tile, -(-N // TILE_ROWS))

    def stage_candidates(self, cand: np.ndarray, n: np.ndarray) -> None:
        """cand int32 [N, C <= max_candidates], n int32 [N] into `cand` (row stride max_candidates)."""
        N, C = cand.shape
        Cm = self.max_candidates
        h = self._cand_host
        h[: N * Cm].reshape(N, Cm)[:, :C] = cand
        h[N * Cm:N * Cm + N] = n
        # cand and ncand live in one buffer: copy the rows used, then the counts
        self.stream.h2d(self.cand, h, N * Cm)
        self.stream.h2d(self.ncand, h[N * Cm:], N)

    def launch_sparse(self, N: int) -> None:
        ls, gs = self.l_sparse
        if N:
            ls.launch(gs, N)

    def capture(self, fn, gate: tuple | None = None) -> Graph:
        """Capture `fn` (which calls launch_* entries) into a CUDA graph on this backend's stream; with
        gate = (done, n), the graph runs fn only where some of done[0..n) is 0 (launcher.Graph)."""
        self._ensure_context()
        return Graph(self.stream, fn, None if gate is None else (self.gate, *gate))

    @property
    def num_graphs(self) -> int:
        """Captured decode-step graphs held for forward()."""
        return len(self._graphs)

    def synchronize(self) -> None:
        self.stream.synchronize()

    # ------------------------------------------------------------------------------ host interface
    def forward(self, batch: StepBatch, device_tokens=None, skip_if_done=None) -> None:
        """Validate, stage and enqueue the step. A step of decode rows only (up to graph_rows) replays
        the graph captured for its launch shape, one cuGraphLaunch instead of 2 + 6L raw launches
        (~5 µs of host time each, docs/gpu.md#launch-cost); the graph runs the same kernels with the same
        parameters, so the bits are those of the launches it replaces.

        device_tokens (a device int32 array) replaces batch.tokens with its first R entries, copied in
        stream order: the engine feeds a step the tokens the previous step's sampler wrote on the
        device before the host has read them. skip_if_done (a device int32 array, the sampler's done
        flags) makes such a replayed step's forward pass run only if some of its first R entries is 0
        when the step reaches the device (a gated graph; other steps always run): the engine's step
        ahead of rows whose answers may all have ended at the picks before it."""
        self._ensure_context()
        batch.validate(self.spec.block_size, self.spec.num_blocks, self.cfg.vocab_size)
        self.stage(batch)
        R = self._R = batch.num_rows
        if device_tokens is not None:
            self.stream.d2d(self.tokens, device_tokens, R)
        N = self._N = len(batch.logit_rows)
        if not (batch.decode_rows == R <= self.graph_rows):
            self.launch_forward(R, N)
            return
        key = self.graph_key(R, N, skip_if_done)
        graph = self._graphs.get(key)
        if graph is None:
            if len(self._graphs) >= self.max_graphs:
                self._graphs.pop(next(iter(self._graphs)))   # the oldest capture
            gate = None if skip_if_done is None else (skip_if_done, R)
            graph = self._graphs[key] = self.capture(lambda: self.launch_forward(R, N), gate)
        graph.replay()

    def graph_key(self, R: int, N: int, skip_if_done=None) -> tuple:
        """The graph forward() replays for the staged step of R decode rows and N logit rows: one per
        launch shape (rows, logit rows, table stride, attention grid) and gate buffer (its address)."""
        gate = None if skip_if_done is None else dptr(skip_if_done)
        return R, N, self.table_stride.value, self.attn_grids(self._max_ctx), gate

    def copy_kv(self, src_block: int, dst_block: int, count: int) -> None:
        """K/V of src_block's first `count` positions, every layer, into dst_block's, in stream order
        (one strided copy per pool: a row per layer)."""
        self._ensure_context()
        per_position = self.cfg.num_kv_heads * self.cfg.head_dim
        per_block = self.spec.block_size * per_position
        for pool in (self.kv_k, self.kv_v):
            self.stream.d2d_rows(pool, dst_block * per_block, pool, src_block * per_block, count * per_position,
                                 self.cfg.num_layers, self.kv_layer_elems)

    def place_kv(self, src: np.ndarray, dst: np.ndarray, shift: np.ndarray) -> None:
        """K/V of the pool slots src into the slots dst, keys rotated shift positions further, every layer, in
        stream order (k_place_kv, max_rows slots a launch)."""
        self._ensure_context()
        R, h = self.max_rows, self._moves_host
        for a in range(0, len(src), R):
            n = min(R, len(src) - a)
            event_wait_host(self._moves_ev)   # the copy that last read the staging buffer has run
            for i, part in enumerate((src, dst, shift)):
                h[i * n:(i + 1) * n] = part[a:a + n]
            self.stream.h2d(self.moves, h, 3 * n)
            self.stream.record(self._moves_ev)
            self.n_moves.value = n
            self.l_place.launch(n * self.cfg.num_layers * self.cfg.num_kv_heads)

    def dense_logits(self) -> np.ndarray:
        self._ensure_context()
        N, V = self._N, self.cfg.vocab_size
        self.launch_dense(N)
        self.stream.d2h(self._out_host, self.logits, N * V)
        self.stream.synchronize()
        return self._out_host[: N * V].reshape(N, V).copy()

    def sparse_logits(self, cand: np.ndarray, n: np.ndarray) -> np.ndarray:
        self._ensure_context()
        cand = np.ascontiguousarray(cand, np.int32)
        n = np.ascontiguousarray(n, np.int32)
        N, C = cand.shape
        if N != self._N or n.shape != (N,):
            raise ModelError(f"sparse_logits: cand must be [{self._N}, C] and n [{self._N}], "
                             f"got {cand.shape} and {n.shape}")
        Cm = self.max_candidates
        out = np.empty((N, C), np.float32)
        for c0 in range(0, max(C, 1), Cm):  # tiles of max_candidates columns: never drops any
            c1 = min(C, c0 + Cm)
            self.stage_candidates(cand[:, c0:c1], np.clip(n - c0, 0, c1 - c0).astype(np.int32))
            self.launch_sparse(N)
            self.stream.d2h(self._out_host, self.sparse, N * Cm)
            self.stream.synchronize()
            out[:, c0:c1] = self._out_host[: N * Cm].reshape(N, Cm)[:, : c1 - c0]
        return out

    def token_logprobs(self, targets: np.ndarray) -> np.ndarray:
        """Each logit row's log-probability of its target token (float32 [N]): the dense head and k_logprob on
        the device, N floats back instead of N x vocab. A bf16 model's head runs on the tensor cores (k_gemm):
        the reader asks for hundreds of rows, which the GEMV's row tiles read the head's weights for four at a
        time."""
        self._ensure_context()
        N, V = self._N, self.cfg.vocab_size
        targets = np.ascontiguousarray(targets, np.int32)
        if targets.shape != (N,) or N and (targets.min() < 0 or targets.max() >= V):
            raise ModelError(f"token_logprobs: targets must be [{N}] token ids in [0, {V})")
        self._cand_host[:N] = targets
        self.stream.h2d(self.targets, self._cand_host, N)
        if self.l_head_gemm is None:
            self.launch_dense(N)
        else:   # every row on k_gemm: its bits are its own whatever the rows beside it, as with the GEMVs
            self.gemm_rows[0].value, self.gemm_rows[1].value = 0, N
            lz, gx, rows = self.l_head_gemm
            lz.launch(gx, -(-N // rows))
        self.l_logprob.launch(N)
        self.stream.d2h(self._out_host, self.logprob, N)
        self.stream.synchronize()
        return self._out_host[:N].copy()

    def kv_cache(self) -> tuple[np.ndarray, np.ndarray]:
        """The pool as host arrays [L, num_blocks, block_size, n_kv, head_dim] (synchronous copy)."""
        self.stream.synchronize()
        shape = (self.cfg.num_layers, self.spec.num_blocks, self.spec.block_size,
                 self.cfg.num_kv_heads, self.cfg.head_dim)
        return self.kv_k.copy_to_host().reshape(shape), self.kv_v.copy_to_host().reshape(shape)
