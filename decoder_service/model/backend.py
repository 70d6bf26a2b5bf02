"""Choosing a backend: cuda where a real GPU is usable, cpu otherwise; either can be forced."""
from __future__ import annotations

import os

from .config import ModelConfig, ModelError
from .kv_pool import KVPoolSpec
from .weights import Weights

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


def weights_dtype(backend: str, cfg: ModelConfig) -> str:
    """The storage dtype each backend wants its weights in: float32 on the CPU (numpy and numba have no
    fast half types there); bfloat16 on the GPU whatever the checkpoint's, because only bf16 prompt rows run
    on the tensor cores (k_gemm, k_attn_mma): a float16 checkpoint served as float16 took 30.4 ms a MetaTool
    query against 10.8 as bfloat16 (P82)."""
    return "float32" if backend == "cpu" else "bfloat16"


def make_backend(cfg: ModelConfig, weights: Weights, kv_spec: KVPoolSpec, backend: str = "auto",
                 **cuda_options):
    """A backend implementing docs/model_runtime_interface.md for these weights and KV pool.

    cuda_options size the GPU backend's fixed step buffers (max_rows, max_logit_rows, max_table, ...)."""
    if resolve_backend(backend) == "cpu":
        from .cpu import CpuBackend

        return CpuBackend(cfg, weights, kv_spec)
    from .cuda.backend import CudaBackend

    return CudaBackend(cfg, weights, kv_spec, **cuda_options)


def device_name(kind: str) -> str:
    """What GetInfo reports as the device: the GPU's name, or the CPU's core count."""
    if kind == "cuda":
        from numba import cuda
        name = cuda.get_current_device().name
        return name.decode() if isinstance(name, bytes) else str(name)
    return f"cpu ({os.cpu_count()} cores)"
