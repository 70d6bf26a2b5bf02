"""The float64 reference encoder: the oracle the CPU and CUDA backends are checked against.

Written to be read, not to be fast, and on purpose in the other formulation: texts padded to the
batch's longest with an attention mask (as Hugging Face's BertModel and sentence-transformers run it),
where the backends pack texts end to end without padding.
"""
from __future__ import annotations

import math

import numpy as np
from numba import vectorize

from .config import EncoderConfig
from .weights import EncoderWeights


@vectorize(["float64(float64)"], cache=True)
def _erf(x):
    """math.erf (libm) elementwise: numpy has no erf, and a Python loop over it takes seconds."""
    return math.erf(x)


def layer_norm(x: np.ndarray, weight: np.ndarray, bias: np.ndarray, eps: float) -> np.ndarray:
    mean = x.mean(axis=-1, keepdims=True)
    var = ((x - mean) ** 2).mean(axis=-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * weight + bias


def gelu(x: np.ndarray) -> np.ndarray:
    """The exact (erf) GELU of BERT's `hidden_act: gelu`."""
    return 0.5 * x * (1.0 + _erf(x / math.sqrt(2.0)))


class ReferenceEncoder:
    """embed(token id arrays) -> [n, H] float64 unit vectors: mean of the last hidden states, normalised."""

    def __init__(self, cfg: EncoderConfig, weights: EncoderWeights):
        self.cfg = cfg
        self.w = {name: a.astype(np.float64) for name, a in vars(weights).items()}

    def hidden_states(self, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
        """Last hidden states [B, T, H] of padded ids [B, T] (mask 1 = token, 0 = padding)."""
        cfg, w = self.cfg, self.w
        B, T = ids.shape
        nh, d = cfg.num_heads, cfg.head_dim
        x = w["word"][ids] + w["position"][:T] + w["token_type"]
        x = layer_norm(x, w["emb_norm_w"], w["emb_norm_b"], cfg.layer_norm_eps)
        key_bias = np.where(mask[:, None, None, :] > 0, 0.0, -np.inf)             # [B, 1, 1, T]
        for i in range(cfg.num_layers):
            qkv = x @ w["wqkv"][i].T + w["bqkv"][i]                                 # [B, T, 3H]
            q, k, v = (a.reshape(B, T, nh, d) for a in np.split(qkv, 3, axis=-1))
            scores = np.einsum("bthd,bshd->bhts", q, k) / math.sqrt(d) + key_bias  # [B, nh, T, T]
            probs = np.exp(scores - scores.max(axis=-1, keepdims=True))
            probs /= probs.sum(axis=-1, keepdims=True)
            ctx = np.einsum("bhts,bshd->bthd", probs, v).reshape(B, T, nh * d)
            x = layer_norm(x + ctx @ w["wo"][i].T + w["bo"][i], w["attn_norm_w"][i], w["attn_norm_b"][i],
                           cfg.layer_norm_eps)
            h = gelu(x @ w["w1"][i].T + w["b1"][i])
            x = layer_norm(x + h @ w["w2"][i].T + w["b2"][i], w["ffn_norm_w"][i], w["ffn_norm_b"][i],
                           cfg.layer_norm_eps)
        return x

    def embed(self, seqs: list[np.ndarray]) -> np.ndarray:
        if not seqs:
            return np.zeros((0, self.cfg.hidden_size))
        T = max(len(s) for s in seqs)
        ids = np.zeros((len(seqs), T), np.int64)
        mask = np.zeros((len(seqs), T))
        for b, s in enumerate(seqs):
            ids[b, :len(s)] = s
            mask[b, :len(s)] = 1.0
        x = self.hidden_states(ids, mask)
        pooled = (x * mask[..., None]).sum(axis=1) / np.maximum(mask.sum(axis=1), 1e-9)[:, None]
        return pooled / np.maximum(np.linalg.norm(pooled, axis=1, keepdims=True), 1e-12)
