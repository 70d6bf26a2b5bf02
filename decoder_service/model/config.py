"""Model configuration: a validated view of a Hugging Face config.json.

Everything the runtime cannot run is refused here, with a message that names what and where,
before a single weight byte is read: loading a 2 GB checkpoint only to fail on its rope scaling
would waste minutes and memory.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from shared.errors import ModelError


# HF architecture name -> (family, q/k/v projections carry a bias, per-head q/k RMSNorm).
ARCHITECTURES = {
    "LlamaForCausalLM": ("llama", False, False),
    "Qwen2ForCausalLM": ("qwen2", True, False),
    "Qwen3ForCausalLM": ("qwen3", False, True),
}


@dataclass(frozen=True)
class ModelConfig:
    """The shapes and constants of a Llama/Qwen2/Qwen3 decoder, as the kernels need them."""

    architecture: str          # HF name, e.g. "LlamaForCausalLM"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int              # Qwen3 sets it explicitly; otherwise hidden_size // num_heads
    rms_norm_eps: float
    rope_theta: float
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    max_position_embeddings: int
    torch_dtype: str           # the checkpoint's declared dtype ("bfloat16", ...), informative only
    bos_token_id: int | None = None
    eos_token_id: int | None = None

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "ModelConfig":
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ModelError(f"{path}: no config.json in the model directory")
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ModelError(f"{path}: not valid JSON ({e})") from e
        return cls.from_dict(raw, where=str(path))

    @classmethod
    def from_dict(cls, raw: dict, where: str = "config.json") -> "ModelConfig":
        archs = raw.get("architectures") or []
        if len(archs) != 1 or archs[0] not in ARCHITECTURES:
            raise ModelError(
                f"{where}: unsupported architecture {archs!r}; "
                f"supported: {', '.join(sorted(ARCHITECTURES))}")
        arch = archs[0]
        _, qkv_bias, qk_norm = ARCHITECTURES[arch]

        def need(key):
            if key not in raw:
                raise ModelError(f"{where}: missing required key {key!r} for {arch}")
            return raw[key]

        scaling = raw.get("rope_scaling")
        if scaling is not None:
            kind = scaling.get("rope_type", scaling.get("type")) if isinstance(scaling, dict) else scaling
            if kind != "default":
                raise ModelError(
                    f"{where}: unsupported rope_scaling type {kind!r} "
                    f"(only plain RoPE, rope_scaling null, is implemented)")
        act = raw.get("hidden_act", "silu")
        if act != "silu":
            raise ModelError(f"{where}: unsupported hidden_act {act!r} (only 'silu' / SwiGLU)")
        if raw.get("mlp_bias"):
            raise ModelError(f"{where}: unsupported mlp_bias=true for {arch}")
        if raw.get("attention_bias") and not qkv_bias:  # would also put a bias on o_proj
            raise ModelError(f"{where}: unsupported attention_bias=true for {arch}")
        if raw.get("use_sliding_window"):
            raise ModelError(f"{where}: unsupported use_sliding_window=true (full attention only)")

        hidden = int(need("hidden_size"))
        heads = int(need("num_attention_heads"))
        kv_heads = int(raw.get("num_key_value_heads") or heads)
        head_dim = raw.get("head_dim")
        head_dim = int(head_dim) if head_dim else hidden // heads
        if heads % kv_heads:
            raise ModelError(f"{where}: num_attention_heads={heads} is not a multiple of "
                             f"num_key_value_heads={kv_heads}")
        if head_dim % 2 or (raw.get("head_dim") is None and hidden % heads):
            raise ModelError(f"{where}: head_dim={head_dim} (hidden_size={hidden}, "
                             f"heads={heads}) must be even and divide hidden_size evenly")
        eos = raw.get("eos_token_id")
        return cls(
            architecture=arch,
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(need("intermediate_size")),
            num_layers=int(need("num_hidden_layers")),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=float(raw.get("rope_theta", 10000.0)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            qk_norm=qk_norm,
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            torch_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "float32"),  # newer HF: "dtype"
            bos_token_id=raw.get("bos_token_id"),
            eos_token_id=eos[0] if isinstance(eos, list) else eos,
        )

    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor the checkpoint must hold (HF names) and its shape."""
        h, q, kv, i, d = self.hidden_size, self.q_size, self.kv_size, self.intermediate_size, self.head_dim
        shapes = {"model.embed_tokens.weight": (self.vocab_size, h), "model.norm.weight": (h,)}
        if not self.tie_word_embeddings:
            shapes["lm_head.weight"] = (self.vocab_size, h)
        for layer in range(self.num_layers):
            p = f"model.layers.{layer}."
            shapes.update({
                p + "input_layernorm.weight": (h,),
                p + "self_attn.q_proj.weight": (q, h),
                p + "self_attn.k_proj.weight": (kv, h),
                p + "self_attn.v_proj.weight": (kv, h),
                p + "self_attn.o_proj.weight": (h, q),
                p + "post_attention_layernorm.weight": (h,),
                p + "mlp.gate_proj.weight": (i, h),
                p + "mlp.up_proj.weight": (i, h),
                p + "mlp.down_proj.weight": (h, i),
            })
            if self.qkv_bias:
                shapes.update({p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                               p + "self_attn.v_proj.bias": (kv,)})
            if self.qk_norm:
                shapes.update({p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,)})
        return shapes
