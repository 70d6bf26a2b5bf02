"""Merge an encoder delta (tune/encoder.py) into the base sentence encoder with numpy alone (`make model`, no torch).

    python -m tune.encoder_merge --base models/all-MiniLM-L6-v2 \
        --delta tune/encoder_deltas/all-minilm-l6-v2/tuned.safetensors --out models/all-MiniLM-L6-v2-tuned

The output is the base folder with W + alpha / rank * B @ A in every adapted linear layer (float32, as the base),
and tune_encoder.json (the data sets the delta was trained on, its recipe and digest): a folder the encoder runtime
loads like the base, whose digest (decoder_service.encoder.weights) keys the tool vectors stored with a version.
"""
from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from safetensors import safe_open
from safetensors.numpy import load_file, save_file

from decoder_service.encoder.tuned import TUNED_ENCODER
from tune.merge import base_fingerprint, file_sha256, merged_tensors, whole_folder


def read_delta(path: Path) -> tuple[dict, dict[str, str]]:
    """(the delta's tensors, its metadata)."""
    with safe_open(str(path), "np") as f:
        meta = f.metadata() or {}
    return load_file(str(path)), meta


def merge_encoder(base_dir: Path, delta: Path, out: Path) -> None:
    """Write `out`: the base folder with its weights merged with the delta, refused unless the base is the one the
    delta was trained on (tune.merge.base_fingerprint); `out` appears whole or not at all."""
    tensors, meta = read_delta(delta)
    fingerprint = base_fingerprint(base_dir)
    if fingerprint != meta.get("base_fingerprint"):
        raise ValueError(f"{base_dir} has fingerprint {fingerprint}; {delta} was trained on "
                         f"{meta.get('base_fingerprint')}")
    merged = merged_tensors(load_file(str(base_dir / "model.safetensors")), tensors,
                            float(meta["alpha"]) / int(meta["rank"]))
    with whole_folder(out) as partial:
        shutil.copytree(base_dir, partial, ignore=shutil.ignore_patterns("model.safetensors", TUNED_ENCODER),
                        dirs_exist_ok=True)
        save_file(merged, str(partial / "model.safetensors"), metadata={"format": "pt"})
        (partial / TUNED_ENCODER).write_text(json.dumps({
            "base": base_dir.resolve().name, "trained_on": sorted(filter(None, meta["trained_on"].split(","))),
            "delta": delta.name, "delta_sha256": file_sha256(delta), "recipe": json.loads(meta["recipe"])},
            indent=1) + "\n")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base", type=Path, required=True, help="the base sentence-transformers folder")
    parser.add_argument("--delta", type=Path, required=True, help="a delta written by tune/encoder.py")
    parser.add_argument("--out", type=Path, required=True, help="the merged encoder folder to write")
    args = parser.parse_args(argv)
    merge_encoder(args.base, args.delta, args.out)
    print(f"{args.out}: merged {args.delta} into {args.base}")


if __name__ == "__main__":
    main()
