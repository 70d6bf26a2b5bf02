"""LoRA: low-rank adapters on a model's linear layers, and their safetensors files."""
from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from tune.merge import CONFIG

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FILE_BYTES = 4_500_000   # each adapter file stays under the 5 MB limit


class LoraLinear(nn.Module):
    """A frozen linear layer plus scale * B @ A, with A [rank, in] random and B [out, rank] zero at the start."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float):
        super().__init__()
        self.base = base
        self.scale = alpha / rank
        self.lora_A = nn.Parameter(torch.empty(rank, base.in_features, device=base.weight.device))
        self.lora_B = nn.Parameter(torch.zeros(base.out_features, rank, device=base.weight.device))
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (x @ self.lora_A.t().to(x.dtype)) @ self.lora_B.t().to(x.dtype) * self.scale


def add_lora(model: nn.Module, rank: int, alpha: float, targets: tuple[str, ...] = TARGETS) -> list[str]:
    """Freeze the model and wrap each target linear layer in a LoraLinear; returns the wrapped module names."""
    for p in model.parameters():
        p.requires_grad_(False)
    wrapped = []
    for name, module in list(model.named_modules()):
        for child, sub in list(module.named_children()):
            if child in targets and isinstance(sub, nn.Linear):
                setattr(module, child, LoraLinear(sub, rank, alpha))
                wrapped.append(f"{name}.{child}" if name else child)
    if not wrapped:
        raise ValueError(f"no linear layer named any of {targets}")
    return wrapped


def adapter_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every adapter's A and B as float16 on the CPU, named `<module>.lora_A` / `<module>.lora_B`."""
    out = {}
    for name, module in model.named_modules():
        if isinstance(module, LoraLinear):
            out[f"{name}.lora_A"] = module.lora_A.detach().to("cpu", torch.float16).contiguous()
            out[f"{name}.lora_B"] = module.lora_B.detach().to("cpu", torch.float16).contiguous()
    return out


def save_adapters(model: nn.Module, out: Path, rank: int, alpha: float, base: dict) -> list[Path]:
    """Write the adapters as safetensors files of at most FILE_BYTES each plus adapter_config.json
    (rank, alpha, the files, and `base`: what the base model was, so a merge can refuse another)."""
    out.mkdir(parents=True, exist_ok=True)
    tensors = adapter_tensors(model)
    groups: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name in sorted(tensors, key=_natural):
        nbytes = tensors[name].numel() * 2
        if groups[-1] and size + nbytes > FILE_BYTES:
            groups.append({})
            size = 0
        groups[-1][name] = tensors[name]
        size += nbytes
    files = []
    for i, group in enumerate(groups):
        path = out / f"adapter-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        save_file(group, str(path))
        files.append(path)
    (out / CONFIG).write_text(json.dumps({"rank": rank, "alpha": alpha, "files": [p.name for p in files],
                                          "base": base}, indent=1) + "\n")
    return files


def _natural(name: str) -> tuple:
    """Sort key that orders model.layers.10 after model.layers.9."""
    return tuple(int(p) if p.isdigit() else p for p in name.split("."))
