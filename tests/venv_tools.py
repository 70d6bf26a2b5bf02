"""Command-line tools the tests run, installed into the venv by pip (make setup)."""
from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest


def venv_tool(name: str, pip_package: str) -> str:
    """The tool next to this interpreter (the venv's), else on PATH; a clear failure if neither."""
    local = Path(sys.executable).parent / name
    found = str(local) if local.exists() else shutil.which(name)
    if not found:
        pytest.fail(f"{name} is missing: `pip install {pip_package}` (make setup does it)")
    return found
