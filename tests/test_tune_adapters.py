"""The committed adapters (no torch needed): within the size limits, consistent with their config, and merged by
`make model` into a tuned model that the runtime loads, changed exactly where an adapter applies."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
from safetensors import safe_open

from decoder_service.engine.fusion import tuned_tools
from decoder_service.model.config import ModelConfig
from decoder_service.model.weights import load_weights
from shared.catalog import parse_registry
from shared.config import REPO_ROOT
from shared.dataset import data_dir
from tune.merge import base_fingerprint, merge

ADAPTERS = REPO_ROOT / "tune" / "adapters" / "smollm2-135m"


def test_committed_adapters_are_within_the_limits_and_match_their_config():
    config = json.loads((ADAPTERS / "adapter_config.json").read_text())
    files = [ADAPTERS / f for f in config["files"]]
    assert sorted(files) == sorted(ADAPTERS.glob("*.safetensors"))
    assert all(f.stat().st_size <= 5_000_000 for f in files)
    assert sum(f.stat().st_size for f in files) <= 25_000_000
    shapes = {}
    for f in files:
        with safe_open(str(f), "np") as st:
            shapes.update({k: st.get_slice(k).get_shape() for k in st.keys()})
    modules = {k.rsplit(".", 1)[0] for k in shapes}
    assert len(modules) == 30 * 7 and len(shapes) == 2 * len(modules)
    assert all(shapes[f"{m}.lora_A"][0] == config["rank"] == shapes[f"{m}.lora_B"][1] for m in modules)
    card = json.loads((ADAPTERS / "card.json").read_text())
    assert card["hyperparameters"]["seed"] == 0 and card["hyperparameters"]["rank"] == config["rank"]


def test_committed_tuned_tools_are_the_tools_of_the_registries_trained_on():
    card = json.loads((ADAPTERS / "card.json").read_text())
    names = set()
    for name, data in card["data"].items():
        raw = (data_dir() / name / "catalog.json").read_bytes()
        assert hashlib.sha256(raw).hexdigest() == data["registry_sha256"], name
        names.update(t.name for t in parse_registry(raw).tools)
    assert tuned_tools(ADAPTERS) == names


@pytest.mark.model
def test_merged_tuned_model_loads_in_the_runtime(model_dir: Path, tmp_path):
    config = json.loads((ADAPTERS / "adapter_config.json").read_text())
    assert base_fingerprint(model_dir) == config["base"]["fingerprint"]
    merge(model_dir, ADAPTERS, tmp_path / "tuned")
    assert tuned_tools(tmp_path / "tuned") == tuned_tools(ADAPTERS)   # the catalogs it knows go with it
    cfg = ModelConfig.from_dir(tmp_path / "tuned")
    base = load_weights(model_dir, cfg, "float16", progress=False)
    tuned = load_weights(tmp_path / "tuned", cfg, "float16", progress=False)
    assert np.array_equal(base.embed, tuned.embed)
    assert not np.array_equal(base.wqkv, tuned.wqkv) and not np.array_equal(base.w_down, tuned.w_down)
