"""Run a test script in a subprocess, with or without numba's CUDA simulator, and read its result.

numba reads NUMBA_ENABLE_CUDASIM once, at import, and the other test files use real numba: the
simulated kernels therefore run in a child process, which prints one line `RESULT {json}`.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_script(script: str, sim: bool, timeout: int = 900, env: dict | None = None) -> dict:
    """The RESULT line of `script` run in a subprocess (under the CUDA simulator if `sim`, with `env` added)."""
    env = {**{k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}, **(env or {})}
    if sim:
        env["NUMBA_ENABLE_CUDASIM"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "tests"), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, script], env=env, capture_output=True, text=True, timeout=timeout,
                          cwd=ROOT)
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    assert proc.returncode == 0 and line, proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads(line[-1][len("RESULT "):])
