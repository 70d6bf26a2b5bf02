"""A tuned encoder's record: which data sets it was trained on, and its sibling trained without one of them."""
from __future__ import annotations

import json
from pathlib import Path

from shared.errors import ModelError

TUNED_ENCODER = "tune_encoder.json"   # written into a merged folder by tune/encoder_merge.py


def trained_on(model_dir: str | Path) -> frozenset[str]:
    """The data sets an encoder folder was fine-tuned on (none for a folder no delta was merged into)."""
    path = Path(model_dir) / TUNED_ENCODER
    return frozenset(json.loads(path.read_text())["trained_on"]) if path.is_file() else frozenset()


def without(model_dir: str | Path, name: str) -> Path:
    """The encoder that stands for `model_dir` on data set `name` as an unseen catalog (leave one data set out):
    the folder itself if it was never trained on `name`, else its sibling `<folder>-without-<name>` (make model),
    which must exist and must not have been trained on `name` either."""
    model_dir = Path(model_dir)
    if name not in trained_on(model_dir):
        return model_dir
    sibling = model_dir.with_name(f"{model_dir.name}-without-{name}")
    if not (sibling / TUNED_ENCODER).is_file():
        raise ModelError(f"{model_dir} was trained on {name} and {sibling} is absent (run `make model`)")
    if name in trained_on(sibling):
        raise ModelError(f"{sibling} was trained on {name}: it cannot stand for an unseen {name}")
    return sibling
