"""Merge committed LoRA adapters into a base model folder with numpy alone (`make model` runs it, no torch)."""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import shutil
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file, save_file

from decoder_service.engine.fusion import TUNED_TOOLS

CONFIG = "adapter_config.json"
COPIED = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json")


def file_sha256(path: Path) -> str:
    """sha256 of a file, read in 1 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def base_fingerprint(model_dir: Path) -> str:
    """sha256 of the model's canonical config.json and its checkpoint's tensor names, dtypes and shapes: the same
    for two conversions of one base whose bytes differ in rounding (the GGUF is dequantized by each machine's numpy)."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    with open(Path(model_dir) / "model.safetensors", "rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    layout = sorted((k, v["dtype"], v["shape"]) for k, v in header.items() if k != "__metadata__")
    return hashlib.sha256(json.dumps([config, layout], sort_keys=True).encode()).hexdigest()


def merged_tensors(base: dict[str, np.ndarray], adapters: dict[str, np.ndarray], scale: float) -> dict[str, np.ndarray]:
    """The base tensors with W + scale * B @ A added where an adapter exists, in float32, cast back to W's dtype."""
    out = dict(base)
    modules = {n.rsplit(".", 1)[0] for n in adapters}
    for m in sorted(modules):
        key = f"{m}.weight"
        if key not in base:
            raise ValueError(f"adapter {m} has no base tensor {key}")
        a, b = adapters[f"{m}.lora_A"].astype(np.float32), adapters[f"{m}.lora_B"].astype(np.float32)
        w = base[key]
        if (b.shape[0], a.shape[1]) != w.shape:
            raise ValueError(f"adapter {m}: B @ A is {(b.shape[0], a.shape[1])}, the base weight {w.shape}")
        out[key] = (w.astype(np.float32) + scale * (b @ a)).astype(w.dtype)
    return out


def merge(base_dir: Path, adapter_dir: Path, out: Path) -> None:
    """Write `out`: the base folder's files with its model.safetensors merged with the adapters. The base's
    fingerprint must be the one the adapters were trained on; `out` appears whole or not at all. The adapters'
    tuned tools (which catalogs the selector knows: decoder_service.engine.fusion) go with it."""
    config = json.loads((adapter_dir / CONFIG).read_text())
    base_file = base_dir / "model.safetensors"
    fingerprint = base_fingerprint(base_dir)
    if fingerprint != config["base"]["fingerprint"]:
        raise ValueError(f"{base_dir} has fingerprint {fingerprint}; the adapters in {adapter_dir} were trained on "
                         f"{config['base']['fingerprint']}")
    adapters: dict[str, np.ndarray] = {}
    for name in config["files"]:
        adapters.update(load_file(str(adapter_dir / name)))
    tensors = merged_tensors(load_file(str(base_file)), adapters, config["alpha"] / config["rank"])
    with whole_folder(out) as partial:
        save_file(tensors, str(partial / "model.safetensors"), metadata={"format": "pt"})
        for name in COPIED:
            if (base_dir / name).is_file():
                shutil.copy(base_dir / name, partial / name)
        shutil.copy(adapter_dir / CONFIG, partial / "tune_adapter_config.json")
        if (adapter_dir / TUNED_TOOLS).is_file():
            shutil.copy(adapter_dir / TUNED_TOOLS, partial / TUNED_TOOLS)
        for path in partial.iterdir():
            path.chmod(0o644)


@contextlib.contextmanager
def whole_folder(out: Path):
    """A fresh folder to fill that becomes `out` only when the block ends without an error: `out` appears whole or
    not at all (a merge cut short leaves the previous one, or nothing)."""
    partial = out.with_name(f".{out.name}.partial-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    try:
        yield partial
        if out.exists():
            shutil.rmtree(out)
        os.replace(partial, out)
    finally:
        shutil.rmtree(partial, ignore_errors=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base", type=Path, required=True, help="base model folder (Hugging Face layout)")
    parser.add_argument("--adapters", type=Path, required=True, help="folder with adapter_config.json")
    parser.add_argument("--out", type=Path, required=True, help="the merged model folder to write")
    args = parser.parse_args(argv)
    merge(args.base, args.adapters, args.out)
    print(f"{args.out}: merged {args.adapters} into {args.base}")


if __name__ == "__main__":
    main()
