"""The encoder's weights: a BERT safetensors file as float32 arrays stacked over layers, and its digest.

q, k and v are fused into one [3H, H] projection (one matrix product instead of three); every matrix
keeps the checkpoint's [out, in] layout. The digest names the weights *and* the tokenizer and
pooling settings, so it can key cached tool vectors: any change to what an embedding depends on
changes it.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from safetensors.numpy import load as load_safetensors

from shared.errors import ModelError

from .config import EncoderConfig

# The files an embedding depends on, hashed in this order into the digest.
DIGEST_FILES = ("config.json", "sentence_bert_config.json", "tokenizer.json", "model.safetensors")


@dataclass
class EncoderWeights:
    """All parameters as float32: embeddings, then per-layer tensors stacked as [L, ...]."""

    word: np.ndarray            # [V, H]
    position: np.ndarray        # [P, H]
    token_type: np.ndarray      # [H]: type 0, the only one a single text uses
    emb_norm_w: np.ndarray      # [H]
    emb_norm_b: np.ndarray
    wqkv: np.ndarray            # [L, 3H, H]: query | key | value rows
    bqkv: np.ndarray            # [L, 3H]
    wo: np.ndarray              # [L, H, H]
    bo: np.ndarray
    attn_norm_w: np.ndarray     # [L, H]: LayerNorm after attention + residual
    attn_norm_b: np.ndarray
    w1: np.ndarray              # [L, I, H]
    b1: np.ndarray              # [L, I]
    w2: np.ndarray              # [L, H, I]
    b2: np.ndarray
    ffn_norm_w: np.ndarray      # [L, H]: LayerNorm after the feed-forward + residual
    ffn_norm_b: np.ndarray


def digest(model_dir: str | Path) -> str:
    """sha256 over DIGEST_FILES (each as name, size, bytes)."""
    h = hashlib.sha256()
    for name in DIGEST_FILES:
        data = (Path(model_dir) / name).read_bytes()
        h.update(f"{name}\0{len(data)}\0".encode())
        h.update(data)
    return h.hexdigest()


def load_weights(model_dir: str | Path, cfg: EncoderConfig) -> EncoderWeights:
    """Read model.safetensors (float32 or float16; a leading "bert." in the names is accepted)."""
    path = Path(model_dir) / "model.safetensors"
    if not path.is_file():
        raise ModelError(f"{path}: missing (run `make model`)")
    try:
        raw = load_safetensors(path.read_bytes())
    except Exception as e:  # noqa: BLE001 - a truncated file, or a dtype numpy lacks (bfloat16): a ModelError
        raise ModelError(f"{path}: cannot be read as float32/float16 safetensors ({e})") from None
    tensors = {name.removeprefix("bert."): a for name, a in raw.items()}
    H, I, L = cfg.hidden_size, cfg.intermediate_size, cfg.num_layers

    def get(name: str, shape: tuple) -> np.ndarray:
        if name not in tensors:
            raise ModelError(f"{path}: tensor {name!r} is missing")
        a = tensors[name]
        if a.dtype not in (np.float32, np.float16):
            raise ModelError(f"{path}: {name} is {a.dtype}; float32 or float16 expected")
        if a.shape != shape:
            raise ModelError(f"{path}: {name} has shape {list(a.shape)}, config.json implies {list(shape)}")
        return a.astype(np.float32)

    def stack(suffix: str, shape: tuple) -> np.ndarray:
        return np.stack([get(f"encoder.layer.{i}.{suffix}", shape) for i in range(L)])

    def qkv(kind: str, shape: tuple) -> np.ndarray:
        return np.concatenate([stack(f"attention.self.{p}.{kind}", shape) for p in ("query", "key", "value")],
                              axis=1)

    return EncoderWeights(
        word=get("embeddings.word_embeddings.weight", (cfg.vocab_size, H)),
        position=get("embeddings.position_embeddings.weight", (cfg.max_position_embeddings, H)),
        token_type=get("embeddings.token_type_embeddings.weight", (cfg.type_vocab_size, H))[0],
        emb_norm_w=get("embeddings.LayerNorm.weight", (H,)),
        emb_norm_b=get("embeddings.LayerNorm.bias", (H,)),
        wqkv=qkv("weight", (H, H)), bqkv=qkv("bias", (H,)),
        wo=stack("attention.output.dense.weight", (H, H)), bo=stack("attention.output.dense.bias", (H,)),
        attn_norm_w=stack("attention.output.LayerNorm.weight", (H,)),
        attn_norm_b=stack("attention.output.LayerNorm.bias", (H,)),
        w1=stack("intermediate.dense.weight", (I, H)), b1=stack("intermediate.dense.bias", (I,)),
        w2=stack("output.dense.weight", (H, I)), b2=stack("output.dense.bias", (H,)),
        ffn_norm_w=stack("output.LayerNorm.weight", (H,)), ffn_norm_b=stack("output.LayerNorm.bias", (H,)),
    )
