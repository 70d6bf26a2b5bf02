"""The model backend for a device (chosen by decoder_service/gpu/device.py): its weights' dtype, the backend, the
device's name."""
from __future__ import annotations

import os

from ..gpu.device import resolve_backend
from .config import ModelConfig
from .kv_pool import KVPoolSpec
from .weights import Weights


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
