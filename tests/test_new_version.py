"""`python -m bench new-version` with real processes (redis-server, the compiler, the decoder on the CPU backend with
a tiny random model that speaks the small test tokenizer): each new version is timed to its own first answer."""
import argparse
import json

import pytest

from bench.version import new_version, new_version_arguments
from model_fixtures import make_serving_model


def args_for(tmp_path, *argv):
    p = argparse.ArgumentParser()
    new_version_arguments(p)
    return p.parse_args([*argv, "--out", str(tmp_path)])


@pytest.fixture
def tiny_model_env(tmp_path, small_tokenizer_dir, monkeypatch):
    model = make_serving_model(tmp_path / "model", small_tokenizer_dir)
    for name, value in {"TOOLTRIE_MODEL_DIR": str(model), "TOOLTRIE_READER_DIR": "", "TOOLTRIE_BACKEND": "cpu",
                        "TOOLTRIE_KV_TOKENS": "65536"}.items():
        monkeypatch.setenv(name, value)


def test_each_new_version_is_timed_to_its_own_first_answer(tmp_path, tiny_model_env):
    new_version(args_for(tmp_path, "--first", "metatool", "--catalog", "metatool", "--versions", "2", "--k", "2"))
    rec = json.loads((tmp_path / "new_version_cpu.json").read_text())
    runs = rec["runs"]
    assert rec["backend"] == "cpu" and len(runs) == 3
    assert [r["version"] for r in runs] == [1, 2, 3]          # each revision is a version of its own
    for r in runs:
        assert 0 < r["publish_s"] <= r["ready_s"] <= r["first_answer_s"]
        assert r["tools"] == 199 and len(set(r["names"])) == 2


def test_a_data_set_that_is_not_there_is_named_with_those_that_are(tmp_path):
    with pytest.raises(SystemExit, match="no data set 'toolbnch' under .*: one of bigcatalog, metatool, toolbench"):
        new_version(args_for(tmp_path, "--catalog", "toolbnch"))
