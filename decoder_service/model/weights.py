"""Weights: read a safetensors checkpoint (single file or sharded) into per-layer stacked arrays.

The layout is the kernels', not the checkpoint's: tensors stacked over layers, projections that read the
same input fused (q|k|v, gate|up), bf16 kept as raw uint16 bits; everything checked from the file headers
before any array is allocated (docs/model_runtime_interface.md).
"""
from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from .config import ModelConfig, ModelError

# safetensors dtype tag -> numpy dtype of the raw data; "BF16" is read as uint16 bits.
_DISK_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16}
_DISK_NAMES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}
# Storage dtype name -> numpy dtype of the arrays held in Weights.
STORAGE_DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16}


def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    """bfloat16 bits (uint16) -> float32, exactly: bf16 is the top half of a float32."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits (uint16), rounding to nearest even (NaN stays NaN)."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = (u + (np.uint32(0x7FFF) + ((u >> 16) & 1))) >> 16
    return np.where(np.isnan(x), np.uint32(0x7FC0), rounded).astype(np.uint16)


def to_float32(a: np.ndarray, dtype: str) -> np.ndarray:
    """An array stored as `dtype` ("float32" | "float16" | "bfloat16") as float32."""
    return bf16_to_f32(a) if dtype == "bfloat16" else a.astype(np.float32, copy=False)


def _convert(raw: np.ndarray, disk: str, dtype: str) -> np.ndarray:
    """Raw disk data (tag `disk`) as storage dtype `dtype`."""
    if _DISK_NAMES[disk] == dtype:
        return raw
    f32 = to_float32(raw, _DISK_NAMES[disk])
    return f32_to_bf16(f32) if dtype == "bfloat16" else f32.astype(STORAGE_DTYPES[dtype])


def _place(target: np.ndarray, raw: np.ndarray, disk: str, dtype: str) -> None:
    """Raw disk data written into `target` (a view of a storage array), as float32 in one pass without the
    temporaries _convert makes (the CPU backend's float16 model took 2.6 s to load with them: most of a start)."""
    source = _DISK_NAMES[disk]
    if dtype == "float32" and source == "bfloat16":
        bits = target.view(np.uint32)
        bits[...] = raw
        bits <<= 16
    elif dtype in ("float32", source):
        target[...] = raw   # float16 -> float32 is exact
    else:
        target[...] = _convert(raw, disk, dtype)


@dataclass
class Weights:
    """All parameters of the model, stacked over layers, in one storage dtype."""

    dtype: str                  # storage dtype of every array: "float32" | "float16" | "bfloat16" (uint16 bits)
    source_dtype: str           # dtype(s) on disk, e.g. "bfloat16" or "bfloat16+float32"
    embed: np.ndarray           # [V, H]
    lm_head: np.ndarray         # [V, H]; the same object as `embed` when the head is tied
    final_norm: np.ndarray      # [H]
    attn_norm: np.ndarray       # [L, H]
    wqkv: np.ndarray            # [L, q_size + 2 * kv_size, H]: rows q, then k, then v
    bqkv: np.ndarray | None     # [L, q_size + 2 * kv_size] (Qwen2) or None
    q_norm: np.ndarray | None   # [L, head_dim] (Qwen3) or None
    k_norm: np.ndarray | None   # [L, head_dim] (Qwen3) or None
    wo: np.ndarray              # [L, H, q_size]
    mlp_norm: np.ndarray        # [L, H]
    w_gate_up: np.ndarray       # [L, 2 * I, H]: rows gate, then up
    w_down: np.ndarray          # [L, H, I]

    def nbytes(self) -> int:
        arrays = [a for a in vars(self).values() if isinstance(a, np.ndarray)]
        return sum(a.nbytes for a in {id(a): a for a in arrays}.values())


@dataclass(frozen=True)
class _TensorRef:
    file: Path
    disk: str                   # safetensors dtype tag
    shape: tuple[int, ...]
    start: int                  # absolute byte offsets in the file
    end: int


def _read_header(path: Path) -> dict[str, _TensorRef]:
    """The tensor directory of one safetensors file (8-byte little-endian length, JSON header)."""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ModelError(f"{path}: too short to be a safetensors file")
        (n,) = struct.unpack("<Q", head)
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ModelError(f"{path}: unreadable safetensors header ({e})") from e
    base = 8 + n
    return {name: _TensorRef(path, t["dtype"], tuple(t["shape"]),
                             base + t["data_offsets"][0], base + t["data_offsets"][1])
            for name, t in header.items() if name != "__metadata__"}


def _tensor_directory(model_dir: Path) -> dict[str, _TensorRef]:
    single, index = model_dir / "model.safetensors", model_dir / "model.safetensors.index.json"
    if single.is_file():
        return _read_header(single)
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        refs = {}
        for name in files:
            if not (model_dir / name).is_file():
                raise ModelError(f"{index}: shard {name} is missing from {model_dir}")
            refs.update(_read_header(model_dir / name))
        return refs
    raise ModelError(f"{model_dir}: neither model.safetensors nor model.safetensors.index.json")


def _check(refs: dict[str, _TensorRef], cfg: ModelConfig) -> None:
    """Refuse a checkpoint that disagrees with its config: missing tensor, wrong shape, dtype."""
    for name, shape in cfg.tensor_shapes().items():
        ref = refs.get(name)
        if ref is None:
            raise ModelError(f"{cfg.architecture} checkpoint: missing tensor {name!r}")
        where = f"{ref.file}: tensor {name!r}"
        if ref.disk not in _DISK_DTYPES:
            raise ModelError(f"{where}: unsupported dtype {ref.disk} (supported: BF16, F16, F32)")
        if ref.shape != shape:
            raise ModelError(f"{where}: shape {list(ref.shape)} disagrees with config.json, "
                             f"expected {list(shape)}")
        if ref.end - ref.start != np.dtype(_DISK_DTYPES[ref.disk]).itemsize * int(np.prod(shape)):
            raise ModelError(f"{where}: data size {ref.end - ref.start} bytes does not match its shape")


def available_host_memory() -> int:
    """Bytes of RAM the OS could give us now (MemAvailable), or all physical memory if unknown."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def load_weights(model_dir: str | Path, cfg: ModelConfig, dtype: str = "float32",
                 progress: bool = True) -> Weights:
    """Read, check and place every weight of `model_dir` as `dtype` (see module docstring)."""
    if dtype not in STORAGE_DTYPES:
        raise ModelError(f"unsupported weight dtype {dtype!r} (supported: {', '.join(STORAGE_DTYPES)})")
    model_dir = Path(model_dir)
    refs = _tensor_directory(model_dir)
    _check(refs, cfg)

    L, H, I = cfg.num_layers, cfg.hidden_size, cfg.intermediate_size
    q, kv, d, V = cfg.q_size, cfg.kv_size, cfg.head_dim, cfg.vocab_size
    shapes = {"embed": (V, H), "final_norm": (H,), "attn_norm": (L, H), "wqkv": (L, q + 2 * kv, H),
              "wo": (L, H, q), "mlp_norm": (L, H), "w_gate_up": (L, 2 * I, H), "w_down": (L, H, I)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head"] = (V, H)
    if cfg.qkv_bias:
        shapes["bqkv"] = (L, q + 2 * kv)
    if cfg.qk_norm:
        shapes["q_norm"] = shapes["k_norm"] = (L, d)
    np_dtype = STORAGE_DTYPES[dtype]
    need = sum(int(np.prod(s)) for s in shapes.values()) * np.dtype(np_dtype).itemsize
    if need > available_host_memory():
        raise ModelError(f"{model_dir}: weights need {need / 2**30:.2f} GiB as {dtype}, "
                         f"only {available_host_memory() / 2**30:.2f} GiB of RAM available")
    out = {k: np.empty(s, np_dtype) for k, s in shapes.items()}

    # HF tensor name -> where it goes: (array, layer or None, row slice of the fused matrix).
    places = {"model.embed_tokens.weight": ("embed", None, slice(None)),
              "model.norm.weight": ("final_norm", None, slice(None))}
    if not cfg.tie_word_embeddings:
        places["lm_head.weight"] = ("lm_head", None, slice(None))
    rows_q, rows_k, rows_v = slice(0, q), slice(q, q + kv), slice(q + kv, q + 2 * kv)
    for layer in range(L):
        p = f"model.layers.{layer}."
        places.update({
            p + "input_layernorm.weight": ("attn_norm", layer, slice(None)),
            p + "self_attn.q_proj.weight": ("wqkv", layer, rows_q),
            p + "self_attn.k_proj.weight": ("wqkv", layer, rows_k),
            p + "self_attn.v_proj.weight": ("wqkv", layer, rows_v),
            p + "self_attn.o_proj.weight": ("wo", layer, slice(None)),
            p + "post_attention_layernorm.weight": ("mlp_norm", layer, slice(None)),
            p + "mlp.gate_proj.weight": ("w_gate_up", layer, slice(0, I)),
            p + "mlp.up_proj.weight": ("w_gate_up", layer, slice(I, 2 * I)),
            p + "mlp.down_proj.weight": ("w_down", layer, slice(None)),
        })
        if cfg.qkv_bias:
            places.update({p + "self_attn.q_proj.bias": ("bqkv", layer, rows_q),
                           p + "self_attn.k_proj.bias": ("bqkv", layer, rows_k),
                           p + "self_attn.v_proj.bias": ("bqkv", layer, rows_v)})
        if cfg.qk_norm:
            places.update({p + "self_attn.q_norm.weight": ("q_norm", layer, slice(None)),
                           p + "self_attn.k_norm.weight": ("k_norm", layer, slice(None))})

    files = {ref.file: np.memmap(ref.file, dtype=np.uint8, mode="r") for ref in refs.values()}
    total = sum(refs[n].end - refs[n].start for n in places)
    with tqdm(total=total, unit="B", unit_scale=True, desc=f"loading {model_dir.name}",
              disable=not progress) as bar:
        for name, (key, layer, rows) in places.items():
            ref = refs[name]
            raw = files[ref.file][ref.start:ref.end].view(_DISK_DTYPES[ref.disk]).reshape(ref.shape)
            target = out[key] if layer is None else out[key][layer]
            _place(target[rows], raw, ref.disk, dtype)
            bar.update(ref.end - ref.start)

    source = "+".join(sorted({_DISK_NAMES[refs[n].disk] for n in places}))
    return Weights(dtype=dtype, source_dtype=source,
                   lm_head=out.pop("lm_head", out["embed"]),
                   bqkv=out.pop("bqkv", None), q_norm=out.pop("q_norm", None),
                   k_norm=out.pop("k_norm", None), **out)
