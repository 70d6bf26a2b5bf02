"""The float64 reference forward pass: the oracle both backends are checked against.

Written to be read, not to be fast: plain numpy in float64, one row at a time where that is clearer,
the same StepBatch interface and the same paged KV layout as the backends (its own pool, in float64).
"""
from __future__ import annotations

import numpy as np

from .batch import StepBatch
from .config import ModelConfig
from .kv_pool import HostKVPool, KVPoolSpec
from .weights import Weights, to_float32


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """x / sqrt(mean(x^2) + eps) * weight, over the last axis."""
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * weight


def rope(x: np.ndarray, positions: np.ndarray, theta: float) -> np.ndarray:
    """Rotate x [R, heads, d] by its position, HF "rotate_half" pairs (i, i + d/2)."""
    d = x.shape[-1]
    inv_freq = theta ** (-np.arange(0, d, 2, dtype=np.float64) / d)          # [d/2]
    angle = positions[:, None, None].astype(np.float64) * inv_freq           # [R, 1, d/2]
    cos, sin = np.cos(angle), np.sin(angle)
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def attend(k: np.ndarray, v: np.ndarray, table_row: np.ndarray, pos: int, q: np.ndarray) -> np.ndarray:
    """Causal GQA attention of one row's heads q [nh, d] over positions 0..pos of its sequence, whose
    K/V live in one layer of a paged pool, k and v [blocks, block_size, nkv, d], at the blocks of
    table_row."""
    bs, group = k.shape[1], q.shape[0] // k.shape[2]
    span = np.arange(pos + 1)
    blocks = table_row[span // bs]
    keys = np.repeat(k[blocks, span % bs], group, axis=1)                    # [T, nh, d]
    values = np.repeat(v[blocks, span % bs], group, axis=1)
    scores = np.einsum("hd,thd->ht", q, keys) / np.sqrt(q.shape[1])          # [nh, T]
    probs = np.exp(scores - scores.max(axis=1, keepdims=True))
    probs /= probs.sum(axis=1, keepdims=True)
    return np.einsum("ht,thd->hd", probs, values)


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def log_probabilities(logits: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """Each row's log-probability of its target token: logits[r, targets[r]] - logsumexp(logits[r])."""
    m = logits.max(axis=1)
    total = np.log(np.exp(logits - m[:, None]).sum(axis=1)) + m
    return logits[np.arange(len(targets)), targets] - total


class ReferenceModel:
    """Same interface as a backend: forward(batch), dense_logits(), sparse_logits(cand, n)."""

    def __init__(self, cfg: ModelConfig, weights: Weights, kv_spec: KVPoolSpec):
        self.cfg = cfg
        self.w = {name: to_float32(a, weights.dtype).astype(np.float64)
                  for name, a in vars(weights).items() if isinstance(a, np.ndarray) and name != "lm_head"}
        self.w["lm_head"] = self.w["embed"] if weights.lm_head is weights.embed else \
            to_float32(weights.lm_head, weights.dtype).astype(np.float64)
        self.pool = HostKVPool.allocate(cfg, kv_spec, np.float64)
        self.hidden = None

    def forward(self, batch: StepBatch) -> None:
        cfg, w = self.cfg, self.w
        R, nh, nkv, d = batch.num_rows, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q_end, k_end = cfg.q_size, cfg.q_size + cfg.kv_size
        x = w["embed"][batch.tokens]                                               # [R, H]
        for layer in range(cfg.num_layers):
            h = rms_norm(x, w["attn_norm"][layer], cfg.rms_norm_eps)
            qkv = h @ w["wqkv"][layer].T
            if cfg.qkv_bias:
                qkv = qkv + w["bqkv"][layer]
            q = qkv[:, :q_end].reshape(R, nh, d)
            k = qkv[:, q_end:k_end].reshape(R, nkv, d)
            v = qkv[:, k_end:].reshape(R, nkv, d)
            if cfg.qk_norm:
                q = rms_norm(q, w["q_norm"][layer], cfg.rms_norm_eps)
                k = rms_norm(k, w["k_norm"][layer], cfg.rms_norm_eps)
            q, k = rope(q, batch.positions, cfg.rope_theta), rope(k, batch.positions, cfg.rope_theta)
            self._write_kv(layer, batch, k, v)
            k_pool, v_pool = self.pool.k[layer], self.pool.v[layer]
            attn = np.stack([attend(k_pool, v_pool, batch.block_tables[batch.slots[r]], batch.positions[r], q[r])
                             for r in range(R)])
            x = x + attn.reshape(R, nh * d) @ w["wo"][layer].T
            h = rms_norm(x, w["mlp_norm"][layer], cfg.rms_norm_eps)
            gate, up = np.split(h @ w["w_gate_up"][layer].T, 2, axis=1)
            x = x + (silu(gate) * up) @ w["w_down"][layer].T
        self.hidden = rms_norm(x[batch.logit_rows], w["final_norm"], cfg.rms_norm_eps)

    def _write_kv(self, layer: int, batch: StepBatch, k: np.ndarray, v: np.ndarray) -> None:
        bs = self.pool.spec.block_size
        for r in range(batch.num_rows):
            pos = batch.positions[r]
            block = batch.block_tables[batch.slots[r], pos // bs]
            self.pool.k[layer, block, pos % bs] = k[r]
            self.pool.v[layer, block, pos % bs] = v[r]

    def copy_kv(self, src_block: int, dst_block: int, count: int) -> None:
        self.pool.copy_positions(src_block, dst_block, count)

    def place_kv(self, src: np.ndarray, dst: np.ndarray, shift: np.ndarray) -> None:
        self.pool.place(src, dst, shift, lambda k, s: rope(k, s, self.cfg.rope_theta))

    def dense_logits(self) -> np.ndarray:
        return self.hidden @ self.w["lm_head"].T

    def token_logprobs(self, targets: np.ndarray) -> np.ndarray:
        return log_probabilities(self.dense_logits(), targets)

    def sparse_logits(self, cand: np.ndarray, n: np.ndarray) -> np.ndarray:
        out = np.zeros(cand.shape, np.float64)
        for i in range(len(cand)):
            out[i, : n[i]] = self.w["lm_head"][cand[i, : n[i]]] @ self.hidden[i]
        return out
