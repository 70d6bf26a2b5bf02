"""TOOLTRIE_CARVEOUT, the launcher's A/B setting for the kernels' shared-memory carveout (P52):
what it accepts, and the error a mistyped value gets before any kernel is loaded."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from decoder_service.gpu.launcher import parse_carveout

ROOT = Path(__file__).resolve().parents[1]
BAD = ["full", "101", "-1", "=28", "k_attn_rows=", "44,k_gemv=50", "28%"]


def import_launcher(value: str) -> subprocess.CompletedProcess:
    """Import the launcher in a child (the setting is read once, at import) with the setting as given."""
    env = {**os.environ, "TOOLTRIE_CARVEOUT": value, "PYTHONPATH": str(ROOT)}
    code = "from decoder_service.gpu import launcher; print(sorted(launcher.CARVEOUT.items()))"
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("value, parsed", [
    ("", {}),
    ("44", {"*": 44}),
    ("k_attn_rows=28", {"k_attn_rows": 28}),
    (" k_attn_rows=28, k_gemv=100 ", {"k_attn_rows": 28, "k_gemv": 100}),
])
def test_accepted_settings(value, parsed):
    assert parse_carveout(value) == parsed


@pytest.mark.parametrize("value", BAD)
def test_a_mistyped_setting_is_refused_with_what_is_expected(value):
    with pytest.raises(ValueError, match=f"TOOLTRIE_CARVEOUT='{value}': expected one percent 0-100 for every kernel"):
        parse_carveout(value)


def test_the_environment_setting_is_what_the_launcher_applies_and_a_bad_one_stops_its_import():
    good = import_launcher(" k_attn_rows=28, k_gemv=100 ")
    assert good.returncode == 0, good.stderr[-2000:]
    assert good.stdout.strip().splitlines()[-1] == "[('k_attn_rows', 28), ('k_gemv', 100)]"
    bad = import_launcher("28%")
    assert bad.returncode != 0
    assert "TOOLTRIE_CARVEOUT='28%': expected one percent 0-100 for every kernel" in bad.stderr
