"""The generator in PyTorch: a Hugging Face-layout folder loaded into its transformers class, and saved back."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
import transformers
from safetensors.torch import load_file, save_file

from tune.merge import COPIED


def load(model_dir: Path, device: str) -> torch.nn.Module:
    """The model of `model_dir` (its config's architectures[0], weights from model.safetensors) in float32."""
    raw = json.loads((Path(model_dir) / "config.json").read_text())
    cls = getattr(transformers, raw["architectures"][0])
    config = cls.config_class(**{k: v for k, v in raw.items() if k not in ("architectures", "model_type")})
    config.architectures = raw["architectures"]
    config._attn_implementation = "sdpa"
    model = cls(config).float()
    state = {k: v.float() for k, v in load_file(str(Path(model_dir) / "model.safetensors")).items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    allowed = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if unexpected or set(missing) - allowed:
        raise ValueError(f"{model_dir}: missing {sorted(set(missing) - allowed)}, unexpected {sorted(unexpected)}")
    if config.tie_word_embeddings:
        model.tie_weights()
    return model.to(device)


def save(model: torch.nn.Module, base_dir: Path, out: Path, dtype: torch.dtype) -> None:
    """Write the model's weights as `out`/model.safetensors (checkpoint names, `dtype`), beside the base's
    config and tokenizer files: a folder the runtime loads."""
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to("cpu", dtype).contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    for name in COPIED:
        if (Path(base_dir) / name).is_file():
            shutil.copy(Path(base_dir) / name, out / name)
