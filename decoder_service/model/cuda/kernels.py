"""The model's kernels by name, each compiled per storage dtype for the parameter types its family module
declares beside it (head, norm_rope, matmul, attention; decoder_service.gpu.intrinsics holds what they are
built from)."""
from __future__ import annotations

from typing import NamedTuple

from decoder_service.gpu.launcher import Kernel
from . import attention, head, matmul, norm_rope
from .attention import MMA_HDS
from .matmul import GEMM_MAX_WARPS, GEMM_WARPS

FAMILIES = (head, norm_rope, matmul, attention)
KERNELS = {name: getattr(family, name) for family in FAMILIES for name in family.SIGNATURES}
# the prompt GEMM by its warps and tiles: small (two register sets), small on one set (the wide kernel has no such
# twin: it keeps its two), big
GEMM_KERNELS = {(GEMM_WARPS, "small"): "k_gemm", (GEMM_WARPS, "one"): "k_gemm_one",
                (GEMM_WARPS, "big"): "k_gemm_big", (GEMM_MAX_WARPS, "small"): "k_gemm_wide",
                (GEMM_MAX_WARPS, "one"): "k_gemm_wide", (GEMM_MAX_WARPS, "big"): "k_gemm_wide_big"}
GEMM_KINDS = ("small", "one", "big")
MMA_ATTN_KERNELS = dict(zip(MMA_HDS, ("k_attn_mma", "k_attn_mma_wide")))   # prompt attention by head_dim bound


class ArgTypes(NamedTuple):
    """The kernels' parameter types for one storage dtype (each family module's SIGNATURES reads them): 1-D
    C-contiguous arrays f32, f64, ai (int32) and W (the storage: uint16 = bf16 bits, float16, float32),
    scalars i32, i64 and f (float32); bf16: whether the bf16-only kernels (mma) are compiled."""
    f32: object
    f64: object
    ai: object
    W: object
    i32: object
    i64: object
    f: object
    bf16: bool


def arg_types(storage: str) -> ArgTypes:
    from numba.cuda import types as t
    st = {"bfloat16": t.uint16, "float16": t.float16, "float32": t.float32}[storage]

    def arr(dt):
        return t.Array(dt, 1, "C")

    return ArgTypes(arr(t.float32), arr(t.float64), arr(t.int32), arr(st), t.int32, t.int64, t.float32,
                    storage == "bfloat16")


def signatures(storage: str) -> dict:
    """Argument types of each kernel compiled for weights/KV stored as `storage` ("bfloat16" | "float16" |
    "float32"), in its parameters' order (the launcher packs them in that order)."""
    t = arg_types(storage)
    sigs = {name: sig(t) for family in FAMILIES for name, sig in family.SIGNATURES.items()}
    return {name: sig for name, sig in sigs.items() if sig is not None}


def model_kernel(name: str, storage: str, dispatcher=None) -> Kernel:
    """A model kernel compiled for `storage` (dispatcher: another compilation of its body, for measurements);
    every model kernel starts with pdl_enter, so it launches with PDL."""
    return Kernel(name, KERNELS[name] if dispatcher is None else dispatcher, signatures(storage)[name], pdl=True)
