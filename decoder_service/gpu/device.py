"""Choosing the device: cuda where a real GPU is usable, cpu otherwise; either can be forced.

Every stage that has both a CPU and a CUDA pass (the generator's model, the encoder) asks here."""
from __future__ import annotations

from shared.errors import ModelError

BACKENDS = ("auto", "cpu", "cuda")


def cuda_unusable_reason() -> str | None:
    """Why the cuda backend cannot run here, or None when it can. numba's CUDA simulator reports a
    GPU that is not there, so it counts as none: it is for testing kernels, not for serving."""
    from numba import config

    if config.ENABLE_CUDASIM:
        return "numba's CUDA simulator is enabled (NUMBA_ENABLE_CUDASIM=1), there is no real GPU"
    try:
        from numba import cuda

        if not cuda.is_available():
            return "no usable CUDA GPU or driver was found (numba.cuda.is_available() is False)"
    except Exception as e:  # noqa: BLE001 - a broken CUDA install is still "no GPU" for auto, explained for cuda
        return f"numba.cuda failed to initialise: {e}"
    return None


def resolve_backend(name: str = "auto") -> str:
    """"cpu" or "cuda" for a requested "auto" | "cpu" | "cuda"; forcing cuda without a GPU is an error."""
    if name not in BACKENDS:
        raise ModelError(f"unknown backend {name!r} (choose from {', '.join(BACKENDS)})")
    if name == "cpu":
        return "cpu"
    reason = cuda_unusable_reason()
    if reason is None:
        return "cuda"
    if name == "cuda":
        raise ModelError(f"backend 'cuda' was requested but {reason}")
    return "cpu"
