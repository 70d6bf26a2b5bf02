"""Tiny random models in Hugging Face layout (config.json + safetensors), for model runtime tests.

`make_tiny_model(tmp_path, arch, dtype, tied, seed)` writes one and returns its directory. The shapes
are small enough for a float64 reference to run in milliseconds, yet exercise what differs between the
families: GQA (4 query heads over 2 KV heads), Qwen2's q/k/v bias, Qwen3's q/k norm with a head_dim
that is not hidden_size / num_heads, and tied or untied heads.
"""
from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import numpy as np

from decoder_service.model.config import ModelConfig
from decoder_service.model.weights import f32_to_bf16

ARCHS = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
_TAGS = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}


def tiny_config(arch: str, tied: bool) -> dict:
    cfg = {
        "architectures": [ARCHS[arch]],
        "vocab_size": 96,
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "max_position_embeddings": 512,
        "tie_word_embeddings": tied,
        "hidden_act": "silu",
        "rope_scaling": None,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    if arch == "qwen3":
        cfg["head_dim"] = 16  # != hidden_size / num_attention_heads = 8
    return cfg


def write_safetensors(path: Path, tensors: dict[str, np.ndarray], dtype: str) -> None:
    """Write float32 `tensors` as `dtype` (bf16 by hand: numpy, hence safetensors.numpy, lacks it)."""
    header, blobs, offset = {}, [], 0
    for name, a in sorted(tensors.items()):
        data = f32_to_bf16(a) if dtype == "bfloat16" else a.astype(dtype)
        blob = np.ascontiguousarray(data).tobytes()
        header[name] = {"dtype": _TAGS[dtype], "shape": list(a.shape),
                        "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw + b"".join(blobs))


def make_tiny_model(tmp_path: Path, arch: str = "llama", dtype: str = "float32", tied: bool = True,
                    seed: int = 0, shards: int = 1, config_overrides: dict | None = None) -> Path:
    """A random model directory; `shards` > 1 writes a sharded checkpoint with its index."""
    raw = {**tiny_config(arch, tied), **(config_overrides or {})}
    out = Path(tmp_path) / f"tiny-{arch}-{dtype}-{'tied' if tied else 'untied'}-{seed}-{shards}"
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(raw, indent=1))

    rng = np.random.default_rng(seed)
    tensors = {}
    for name, shape in ModelConfig.from_dict(raw).tensor_shapes().items():
        if name.endswith("norm.weight"):
            a = 1.0 + 0.1 * rng.standard_normal(shape)
        elif name.endswith(".bias"):
            a = 0.1 * rng.standard_normal(shape)
        elif name in ("model.embed_tokens.weight", "lm_head.weight"):
            a = rng.standard_normal(shape)
        else:
            a = rng.standard_normal(shape) / np.sqrt(shape[1])
        tensors[name] = a.astype(np.float32)

    if shards == 1:
        write_safetensors(out / "model.safetensors", tensors, dtype)
        return out
    names = sorted(tensors)
    weight_map = {}
    for i in range(shards):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = names[i::shards]
        write_safetensors(out / file, {n: tensors[n] for n in part}, dtype)
        weight_map.update({n: file for n in part})
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return out


def make_serving_model(tmp_path: Path, tokenizer_dir: Path) -> Path:
    """A tiny random float16 llama that speaks the tokenizer in tokenizer_dir (its vocabulary, its files copied in),
    with 4,096 positions: what the services load in end-to-end tests, so that they start in seconds."""
    from shared.tokenizer import ModelTokenizer
    vocab = ModelTokenizer(tokenizer_dir).tokenizer.get_vocab_size()
    out = make_tiny_model(tmp_path, "llama", "float16", tied=True, seed=3,
                          config_overrides={"vocab_size": vocab, "max_position_embeddings": 4096})
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(tokenizer_dir) / f, out / f)
    return out

def make_chat_model(tmp_path: Path, vocab: int, seed: int) -> Path:
    """A tiny random float32 llama with a tokenizer of its own (tokenizer_fixtures) in the model's chat format and
    2,048 positions: what the writer and the reader read and write with in tests."""
    from tokenizer_fixtures import make_tokenizer_dir
    out = make_tiny_model(tmp_path, "llama", "float32", tied=True, seed=seed,
                          config_overrides={"vocab_size": vocab, "max_position_embeddings": 2048})
    make_tokenizer_dir(out, vocab_size=vocab)
    return out


def backend_refusals(tmp_path: Path, option: str, values) -> list[str]:
    """The ModelError messages of a CudaBackend (a tiny bf16 llama) built with `option` set to each of
    `values`: what a user asking for a launch setting out of range reads."""
    from decoder_service.model.config import ModelError
    from decoder_service.model.cuda.backend import CudaBackend
    from decoder_service.model.kv_pool import KVPoolSpec
    from decoder_service.model.weights import load_weights

    d = make_tiny_model(tmp_path, arch="llama", dtype="bfloat16", seed=5)
    cfg = ModelConfig.from_dir(d)
    weights = load_weights(d, cfg, dtype="bfloat16", progress=False)
    out = []
    for value in values:
        try:
            CudaBackend(cfg, weights, KVPoolSpec(12, 16), max_rows=16, **{option: value})
        except ModelError as e:
            out.append(str(e))
    return out
