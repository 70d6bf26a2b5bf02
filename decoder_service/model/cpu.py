"""The CPU backend: the forward step in float32 with numba njit kernels.

Determinism by construction, as on the GPU: every output element of a matrix product is computed by
the same compiled loop (a fixed 4x4 register tile, K reduced in one fixed order), and attention visits
each row's positions in ascending order, so a row's result never depends on which rows share its batch.
This is why the matrix products are not numpy BLAS: OpenBLAS takes a different code path by matrix size
(gemv for one row, a "small matrix" kernel below about 1e6 multiply-adds, the blocked kernel above),
and the paths round differently, so a token's logits would change with the batch it happened to be in.
The matrix product and the 4x4 dot kernel are shared with the CPU encoder: decoder_service/cpu_kernels.py.
"""
from __future__ import annotations

from ..cpu_kernels import dot4x4, matmul_t  # first: it sets numba's OpenMP spin (see there)

import numpy as np
from numba import njit, prange

from .batch import StepBatch
from .config import ModelConfig
from .kv_pool import HostKVPool, KVPoolSpec
from .reference import log_probabilities
from .weights import Weights, to_float32

_KEY_BLOCK = 64  # keys per block in attention (a multiple of 4)


@njit(fastmath=True, cache=True)
def rms_norm(x, weight, eps, out):
    """out = x / sqrt(mean(x^2) + eps) * weight over the last axis (rows of x are any leading axes)."""
    xs, os = x.reshape(-1, x.shape[-1]), out.reshape(-1, x.shape[-1])
    for r in range(xs.shape[0]):
        ss = np.float32(0)
        for i in range(xs.shape[1]):
            ss += xs[r, i] * xs[r, i]
        scale = np.float32(1) / np.sqrt(ss / np.float32(xs.shape[1]) + np.float32(eps))
        for i in range(xs.shape[1]):
            os[r, i] = xs[r, i] * scale * weight[i]


@njit(fastmath=True, cache=True)
def rope(x, positions, inv_freq):
    """Rotate x [R, heads, d] in place by position; HF rotate_half pairs (i, i + d/2).
    Angles are taken in float64 so long positions keep their precision."""
    half = x.shape[2] // 2
    for r in range(x.shape[0]):
        for i in range(half):
            angle = positions[r] * inv_freq[i]
            c, s = np.float32(np.cos(angle)), np.float32(np.sin(angle))
            for h in range(x.shape[1]):
                x1, x2 = x[r, h, i], x[r, h, i + half]
                x[r, h, i] = x1 * c - x2 * s
                x[r, h, i + half] = x2 * c + x1 * s


@njit(cache=True)
def write_kv(k_cache, v_cache, k, v, slots, positions, block_tables):
    """Store each row's k, v [R, n_kv, d] at its position's block and offset in the pool."""
    bs = k_cache.shape[1]
    for r in range(k.shape[0]):
        block = block_tables[slots[r], positions[r] // bs]
        k_cache[block, positions[r] % bs] = k[r]
        v_cache[block, positions[r] % bs] = v[r]


@njit(parallel=True, fastmath=True, cache=True)
def paged_attention(q, k_cache, v_cache, slots, positions, block_tables, runs, out):
    """Causal GQA attention over the paged pool.

    q [R, nh, d]; caches [num_blocks, block_size, n_kv, d]; out [R, nh, d]. `runs` splits the rows
    into runs of consecutive rows of one sequence (runs[i]..runs[i+1]); one work item is a run and a
    KV head, whose query vectors (rows x the heads of the group) share every key and value they load.
    A query vector's arithmetic depends only on itself and its positions 0..p, never on its run: scores
    through the shared 4x4 dot kernel, the softmax sum over exactly p + 1 terms, the values weighted in
    ascending groups of four positions fixed from position 0 (positions past p weigh exactly 0).
    """
    R, nh, d = q.shape
    bs, nkv = k_cache.shape[1], k_cache.shape[2]
    group = nh // nkv
    scale = np.float32(1.0 / np.sqrt(d))
    q2 = q.reshape(R * nh, d)                    # row (r * nh + head)
    k2 = k_cache.reshape(-1, d)                  # row ((block * bs + offset) * nkv + kv_head)
    v2 = v_cache.reshape(-1, d)
    for item in prange((len(runs) - 1) * nkv):
        run, g = item // nkv, item % nkv
        first, nq = runs[run], (runs[run + 1] - runs[run]) * group
        table = block_tables[slots[first]]
        span = positions[first:runs[run + 1]].max() + 1
        kv_row = np.empty(span, np.int64)  # row of k2 / v2 holding position t of this head
        for t in range(span):
            kv_row[t] = (table[t // bs] * bs + t % bs) * nkv + g
        last = np.empty(nq, np.int64)   # query vector i is head g * group + i % group of row first + i // group:
        q_row = np.empty(nq, np.int64)  # its position, and its row in q2
        for i in range(nq):
            last[i] = positions[first + i // group]
            q_row[i] = (first + i // group) * nh + g * group + i % group
        scores = np.empty((nq, span), np.float32)
        for t_block in range(0, span, _KEY_BLOCK):  # a block of keys stays in L1 for all query tiles
            for i0 in range(0, nq, 4):
                i = (i0, min(i0 + 1, nq - 1), min(i0 + 2, nq - 1), min(i0 + 3, nq - 1))
                needed = max(max(last[i[0]], last[i[1]]), max(last[i[2]], last[i[3]]))  # causal
                for t0 in range(t_block, min(t_block + _KEY_BLOCK, needed + 1), 4):
                    t = (t0, min(t0 + 1, span - 1), min(t0 + 2, span - 1), min(t0 + 3, span - 1))
                    s = dot4x4(q2, q_row[i[0]], q_row[i[1]], q_row[i[2]], q_row[i[3]],
                                k2, kv_row[t[0]], kv_row[t[1]], kv_row[t[2]], kv_row[t[3]])
                    for a in range(4):
                        for b in range(4):
                            scores[i[a], t[b]] = s[4 * a + b] * scale
        total = np.empty(nq, np.float32)
        exponent_bits = np.empty(span, np.int32)
        for i in range(nq):
            row = scores[i, : last[i] + 1]
            m = row.max()
            for t in range(row.shape[0]):
                row[t] -= m
            _exp_nonpositive(row, exponent_bits)
            total[i] = row.sum()
        acc = np.zeros((nq, d), np.float32)
        for t0 in range(0, span, 4):  # weighted values, four positions at a time, in ascending order
            r0, r1 = kv_row[t0], kv_row[min(t0 + 1, span - 1)]
            r2, r3 = kv_row[min(t0 + 2, span - 1)], kv_row[min(t0 + 3, span - 1)]
            for i in range(nq):
                if t0 <= last[i]:  # positions past the query's own weigh exactly 0
                    p0 = scores[i, t0]
                    p1 = scores[i, t0 + 1] if t0 + 1 <= last[i] else np.float32(0)
                    p2 = scores[i, t0 + 2] if t0 + 2 <= last[i] else np.float32(0)
                    p3 = scores[i, t0 + 3] if t0 + 3 <= last[i] else np.float32(0)
                    for e in range(d):
                        acc[i, e] += (p0 * v2[r0, e] + p1 * v2[r1, e]) + (p2 * v2[r2, e] + p3 * v2[r3, e])
        for i in range(nq):
            for e in range(d):
                out[first + i // group, g * group + i % group, e] = acc[i, e] / total[i]


@njit(fastmath=True, inline="always")
def _exp_nonpositive(x, exponent_bits):
    """x <- e**x in place, for float32 x <= 0 (relative error ~1e-7; below e**-87 it flushes to ~0).

    Cephes' expf polynomial, in plain arithmetic so LLVM vectorizes it: np.exp is one libm call per
    element, and softmax takes one exponential per (query, position), as many as multiply-adds / 128.
    """
    for t in range(x.shape[0]):
        y = max(x[t], np.float32(-87.0))
        k = np.floor(y * np.float32(1.44269504) + np.float32(0.5))  # e**y = 2**k * e**r, |r| <= ln2 / 2
        r = y - k * np.float32(0.693359375) + k * np.float32(2.12194440e-4)
        p = np.float32(1.9875691500e-4)
        p = p * r + np.float32(1.3981999507e-3)
        p = p * r + np.float32(8.3334519073e-3)
        p = p * r + np.float32(4.1665795894e-2)
        p = p * r + np.float32(1.6666665459e-1)
        p = p * r + np.float32(5.0000001201e-1)
        x[t] = p * r * r + r + np.float32(1)
        exponent_bits[t] = (np.int32(k) + np.int32(127)) << np.int32(23)  # the float32 2**k
    two_k = exponent_bits[: x.shape[0]].view(np.float32)
    for t in range(x.shape[0]):
        x[t] *= two_k[t]


def sequence_runs(slots: np.ndarray, max_rows: int = 32) -> np.ndarray:
    """Boundaries of runs of consecutive rows with the same slot, at most `max_rows` long."""
    change = np.flatnonzero(slots[1:] != slots[:-1]) + 1
    bounds = np.concatenate([[0], change, [len(slots)]])
    starts = [s for a, b in zip(bounds[:-1], bounds[1:]) for s in range(a, b, max_rows)]
    return np.array(starts + [len(slots)], np.int32)


@njit(fastmath=True, cache=True)
def swiglu(gate_up, out):
    """out = silu(gate) * up, with gate_up [R, 2I] holding gate then up."""
    inter = out.shape[1]
    for r in range(out.shape[0]):
        for i in range(inter):
            g = gate_up[r, i]
            out[r, i] = g / (np.float32(1) + np.exp(-g)) * gate_up[r, inter + i]


class CpuBackend:
    """The step interface of docs/model_runtime_interface.md on the CPU, in float32."""

    name = "cpu"

    def __init__(self, cfg: ModelConfig, weights: Weights, kv_spec: KVPoolSpec):
        self.cfg = cfg

        def f32(a):
            return None if a is None else np.ascontiguousarray(to_float32(a, weights.dtype))

        self.w = {name: f32(a) for name, a in vars(weights).items()
                  if name not in ("dtype", "source_dtype", "lm_head")}
        self.w["lm_head"] = self.w["embed"] if weights.lm_head is weights.embed else f32(weights.lm_head)
        self.pool = HostKVPool.allocate(cfg, kv_spec, np.float32)
        d = cfg.head_dim
        self.inv_freq = cfg.rope_theta ** (-np.arange(0, d, 2, dtype=np.float64) / d)
        self.hidden = None

    def forward(self, batch: StepBatch) -> None:
        cfg, w = self.cfg, self.w
        batch.validate(self.pool.spec.block_size, self.pool.spec.num_blocks, cfg.vocab_size)
        R, nh, nkv, d, eps = batch.num_rows, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps
        q_end, k_end = cfg.q_size, cfg.q_size + cfg.kv_size
        x = w["embed"][batch.tokens]                                   # [R, H] residual stream
        h = np.empty_like(x)
        qkv = np.empty((R, k_end + cfg.kv_size), np.float32)
        attn = np.empty((R, nh, d), np.float32)
        proj = np.empty_like(x)
        gate_up = np.empty((R, 2 * cfg.intermediate_size), np.float32)
        act = np.empty((R, cfg.intermediate_size), np.float32)
        runs = sequence_runs(batch.slots)
        for layer in range(cfg.num_layers):
            rms_norm(x, w["attn_norm"][layer], eps, h)
            matmul_t(h, w["wqkv"][layer], qkv)
            if cfg.qkv_bias:
                qkv += w["bqkv"][layer]
            q = np.ascontiguousarray(qkv[:, :q_end]).reshape(R, nh, d)
            k = np.ascontiguousarray(qkv[:, q_end:k_end]).reshape(R, nkv, d)
            v = np.ascontiguousarray(qkv[:, k_end:]).reshape(R, nkv, d)
            if cfg.qk_norm:
                rms_norm(q, w["q_norm"][layer], eps, q)
                rms_norm(k, w["k_norm"][layer], eps, k)
            rope(q, batch.positions, self.inv_freq)
            rope(k, batch.positions, self.inv_freq)
            k_cache, v_cache = self.pool.k[layer], self.pool.v[layer]
            write_kv(k_cache, v_cache, k, v, batch.slots, batch.positions, batch.block_tables)
            paged_attention(q, k_cache, v_cache, batch.slots, batch.positions, batch.block_tables, runs, attn)
            matmul_t(attn.reshape(R, nh * d), w["wo"][layer], proj)
            x += proj
            rms_norm(x, w["mlp_norm"][layer], eps, h)
            matmul_t(h, w["w_gate_up"][layer], gate_up)
            swiglu(gate_up, act)
            matmul_t(act, w["w_down"][layer], proj)
            x += proj
        self.hidden = np.empty((len(batch.logit_rows), cfg.hidden_size), np.float32)
        rms_norm(np.ascontiguousarray(x[batch.logit_rows]), w["final_norm"], eps, self.hidden)

    def copy_kv(self, src_block: int, dst_block: int, count: int) -> None:
        self.pool.copy_positions(src_block, dst_block, count)

    def place_kv(self, src: np.ndarray, dst: np.ndarray, shift: np.ndarray) -> None:
        def rotate(k, s):
            k = np.ascontiguousarray(k)
            rope(k, np.ascontiguousarray(s, np.int32), self.inv_freq)
            return k

        self.pool.place(src, dst, shift, rotate)

    def dense_logits(self) -> np.ndarray:
        out = np.empty((len(self.hidden), self.cfg.vocab_size), np.float32)
        matmul_t(self.hidden, self.w["lm_head"], out)
        return out

    def token_logprobs(self, targets: np.ndarray) -> np.ndarray:
        return log_probabilities(self.dense_logits(), targets)

    def sparse_logits(self, cand: np.ndarray, n: np.ndarray) -> np.ndarray:
        """Logits of each row's first n[i] candidates only. The same matmul kernel on the gathered head
        rows, so every value is bit-identical to the dense logit at that id."""
        out = np.zeros(cand.shape, np.float32)
        for i in range(len(cand)):
            if n[i] > 0:
                rows = self.w["lm_head"][cand[i, : n[i]]]
                row_logits = np.empty((1, n[i]), np.float32)
                matmul_t(self.hidden[i: i + 1], rows, row_logits)
                out[i, : n[i]] = row_logits[0]
        return out
