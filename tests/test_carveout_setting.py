"""TOOLTRIE_CARVEOUT, the launcher's A/B setting for the kernels' shared-memory carveout (perf log c1):
what it accepts, and the error a mistyped value gets before any kernel is loaded."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def import_launcher(value: str) -> subprocess.CompletedProcess:
    """Import the launcher (under numba's CUDA simulator: no driver needed) with the setting as given."""
    env = {**os.environ, "NUMBA_ENABLE_CUDASIM": "1", "TOOLTRIE_CARVEOUT": value, "PYTHONPATH": str(ROOT)}
    code = "from decoder_service.model.cuda import launcher; print(sorted(launcher.CARVEOUT.items()))"
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("value, parsed", [
    ("", "[]"),
    ("44", "[('*', 44)]"),
    ("k_attn_rows=28", "[('k_attn_rows', 28)]"),
    (" k_attn_rows=28, k_gemv=100 ", "[('k_attn_rows', 28), ('k_gemv', 100)]"),
])
def test_accepted_settings(value, parsed):
    out = import_launcher(value)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == parsed


@pytest.mark.parametrize("value", ["full", "101", "-1", "=28", "k_attn_rows=", "44,k_gemv=50", "28%"])
def test_a_mistyped_setting_is_refused_with_what_is_expected(value):
    out = import_launcher(value)
    assert out.returncode != 0
    assert f"TOOLTRIE_CARVEOUT={value!r}: expected one percent 0-100 for every kernel" in out.stderr
