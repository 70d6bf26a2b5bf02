"""The CPU encoder: the BERT forward pass in float32 with numba njit kernels, texts packed end to end.

Texts are never padded: a chunk's token rows are the texts' rows one after another, and attention
and pooling read only the rows of their own text. Matrix products go through `matmul_t`, shared with the
generator's CPU backend (decoder_service/cpu_kernels.py: one fixed 4x4 register tile, K reduced in one order),
not numpy's BLAS, whose code path and rounding change with the matrix size: with it, a text's vector would
change with the texts that happened to share its chunk. Every other kernel works on one row or one text at a time.
So a text's vector is bit-identical alone, in any batch and at any place in it.
"""
from __future__ import annotations

import math

import numba
import numpy as np
from numba import njit, prange

from decoder_service.cpu_kernels import matmul_t  # also sets numba's OpenMP spin (see there)

from .config import EncoderConfig
from .packing import chunks
from .weights import EncoderWeights

CHUNK_TOKENS = 4096   # token rows per forward pass (activations ~ 60 KB a row)
# Chunks of fewer rows (a query) run on the calling thread alone: about 50 parallel regions per
# forward cost more than they save there (a 19-token query: 6.9 ms on one thread, 34 ms on two
# while other processes kept the 2 cores busy). The compiled code is the same either way, so are
# the bits.
SERIAL_ROWS = 64


@njit(fastmath=True, inline="always")
def _layer_norm_row(x, w, b, eps, out):
    """out = (x - mean) / sqrt(var + eps) * w + b for one row (out may be x)."""
    H = x.shape[0]
    s = np.float32(0)
    for c in range(H):
        s += x[c]
    mean = s / np.float32(H)
    v = np.float32(0)
    for c in range(H):
        d = x[c] - mean
        v += d * d
    inv = np.float32(1) / np.sqrt(v / np.float32(H) + np.float32(eps))
    for c in range(H):
        out[c] = (x[c] - mean) * inv * w[c] + b[c]


@njit(parallel=True, fastmath=True, cache=True)
def embed_norm(ids, positions, word, pos_emb, type0, w, b, eps, out):
    """out[r] = LayerNorm(word[ids[r]] + pos_emb[positions[r]] + type0)."""
    for r in prange(ids.shape[0]):
        row = out[r]
        row[:] = word[ids[r]] + pos_emb[positions[r]] + type0
        _layer_norm_row(row, w, b, eps, row)


@njit(parallel=True, fastmath=True, cache=True)
def add_norm(y, bias, resid, w, b, eps, out):
    """out = LayerNorm(y + bias + resid), row by row (y is overwritten; out may be resid)."""
    for r in prange(y.shape[0]):
        row = y[r]
        row += bias + resid[r]
        _layer_norm_row(row, w, b, eps, out[r])


@njit(parallel=True, fastmath=True, cache=True)
def bias_gelu(y, bias):
    """y = GELU(y + bias) in place, the exact erf form."""
    for r in prange(y.shape[0]):
        for c in range(y.shape[1]):
            v = y[r, c] + bias[c]
            y[r, c] = np.float32(0.5) * v * (np.float32(1) + math.erf(v * np.float32(0.7071067811865476)))


@njit(parallel=True, fastmath=True, cache=True)
def attention(qkv, starts, lens, num_heads, out):
    """out[rows of text t, head h] = softmax(q k^T / sqrt(d)) v over the text's own rows, keys in
    ascending order; one (text, head) per work item. qkv rows are query | key | value."""
    H = out.shape[1]
    d = H // num_heads
    scale = np.float32(1.0 / math.sqrt(d))
    for job in prange(starts.shape[0] * num_heads):
        t, h = job // num_heads, job % num_heads
        s0, L = starts[t], lens[t]
        q = qkv[s0:s0 + L, h * d:(h + 1) * d]
        k = qkv[s0:s0 + L, H + h * d:H + (h + 1) * d]
        v = qkv[s0:s0 + L, 2 * H + h * d:2 * H + (h + 1) * d]
        p = np.empty(L, np.float32)
        acc = np.empty(d, np.float32)
        for i in range(L):
            m = np.float32(-np.inf)
            for j in range(L):
                s = np.float32(0)
                for e in range(d):
                    s += q[i, e] * k[j, e]
                p[j] = s * scale
                m = max(m, p[j])
            total = np.float32(0)
            acc[:] = 0
            for j in range(L):
                e_j = np.exp(p[j] - m)
                total += e_j
                for e in range(d):
                    acc[e] += e_j * v[j, e]
            for e in range(d):
                out[s0 + i, h * d + e] = acc[e] / total


@njit(parallel=True, fastmath=True, cache=True)
def mean_pool_normalize(x, starts, lens, out):
    """out[t] = mean of text t's rows, divided by its L2 norm (at least 1e-12)."""
    for t in prange(starts.shape[0]):
        s0, L = starts[t], lens[t]
        acc = np.zeros(x.shape[1], np.float32)
        for r in range(s0, s0 + L):
            acc += x[r]
        acc /= np.float32(L)
        norm = np.float32(0)
        for c in range(acc.shape[0]):
            norm += acc[c] * acc[c]
        out[t] = acc / max(np.sqrt(norm), np.float32(1e-12))


class CpuEncoder:
    """embed(token id arrays) -> [n, H] float32 unit vectors."""

    def __init__(self, cfg: EncoderConfig, weights: EncoderWeights, chunk_tokens: int = CHUNK_TOKENS):
        self.cfg, self.w, self.chunk_tokens = cfg, weights, chunk_tokens

    def embed(self, seqs: list[np.ndarray]) -> np.ndarray:
        out = np.zeros((len(seqs), self.cfg.hidden_size), np.float32)
        for a, b in chunks(seqs, self.chunk_tokens):
            rows = sum(len(s) for s in seqs[a:b])
            threads = numba.get_num_threads()
            if rows < SERIAL_ROWS:
                numba.set_num_threads(1)
            try:
                out[a:b] = self._forward(seqs[a:b])
            finally:
                numba.set_num_threads(threads)
        return out

    def _forward(self, seqs: list[np.ndarray]) -> np.ndarray:
        cfg, w = self.cfg, self.w
        lens = np.array([len(s) for s in seqs], np.int64)
        starts = np.concatenate([[0], np.cumsum(lens)[:-1]]).astype(np.int64)
        ids = np.concatenate(seqs).astype(np.int64)
        positions = np.concatenate([np.arange(n) for n in lens]).astype(np.int64)
        M, H, I = len(ids), cfg.hidden_size, cfg.intermediate_size
        eps = np.float32(cfg.layer_norm_eps)
        x = np.empty((M, H), np.float32)
        qkv = np.empty((M, 3 * H), np.float32)
        ctx = np.empty((M, H), np.float32)
        y = np.empty((M, H), np.float32)
        inter = np.empty((M, I), np.float32)
        embed_norm(ids, positions, w.word, w.position, w.token_type, w.emb_norm_w, w.emb_norm_b, eps, x)
        for i in range(cfg.num_layers):
            matmul_t(x, w.wqkv[i], qkv)
            qkv += w.bqkv[i]
            attention(qkv, starts, lens, cfg.num_heads, ctx)
            matmul_t(ctx, w.wo[i], y)
            add_norm(y, w.bo[i], x, w.attn_norm_w[i], w.attn_norm_b[i], eps, x)
            matmul_t(x, w.w1[i], inter)
            bias_gelu(inter, w.b1[i])
            matmul_t(inter, w.w2[i], y)
            add_norm(y, w.b2[i], x, w.ffn_norm_w[i], w.ffn_norm_b[i], eps, x)
        out = np.empty((len(seqs), H), np.float32)
        mean_pool_normalize(x, starts, lens, out)
        return out
