"""`python -m bench chaos` for a few seconds with real processes and a tiny random model: no wrong answer, no
INTERNAL, no hung process, and every disturbance it exists for happened at least once."""
import argparse
import json

from bench.chaos import CORRECT, EXPECTED, chaos, chaos_arguments
from model_fixtures import make_serving_model


def test_a_short_chaos_run_reports_no_failure_and_each_cause(tmp_path, small_tokenizer_dir, monkeypatch):
    monkeypatch.setenv("TOOLTRIE_BACKEND", "cpu")
    model = make_serving_model(tmp_path / "model", small_tokenizer_dir)
    monkeypatch.setenv("TOOLTRIE_READER_DIR", str(model))   # the tiny model reads too (the real one: seconds a call)
    p = argparse.ArgumentParser()
    chaos_arguments(p)
    chaos(p.parse_args(["--seconds", "12", "--clients", "4", "--catalogs", "2", "--sigterm-tries", "2",
                        "--duplicates", "0.3", "--redis-down", "2", "--model", str(model), "--out", str(tmp_path)]))
    rec = json.loads((tmp_path / "chaos_cpu.json").read_text())
    assert rec["failures"] == {} and rec["sigterm"]["hung"] == 0 and len(rec["sigterm"]["tries"]) == 2
    outcomes = rec["outcomes"]["chaos"]
    assert outcomes.get(CORRECT, 0) > 0 and outcomes.get(EXPECTED["duplicate"], 0) > 0, outcomes
    assert rec["events"]["forged events sent"] > 0 and rec["events"]["Redis restarts"] == 1, rec["events"]
    assert len(rec["versions_answered"]) > 2, rec["versions_answered"]   # a hot swap served, beyond the two firsts
    sigterm = rec["outcomes"]["SIGTERM"]
    assert sigterm.get(CORRECT, 0) + sigterm.get(EXPECTED["stopping"], 0) > 0, sigterm
