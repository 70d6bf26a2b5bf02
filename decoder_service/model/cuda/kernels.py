"""The model's kernels by name, each compiled per storage dtype for the parameter types its family module
declares beside it (head, norm_rope, matmul, attention; intrinsics holds what they are built from)."""
from __future__ import annotations

from . import attention, head, matmul, norm_rope
from .attention import MMA_HDS
from .intrinsics import arg_types
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


def signatures(storage: str) -> dict:
    """Argument types of each kernel compiled for weights/KV stored as `storage` ("bfloat16" | "float16" |
    "float32"), in its parameters' order (the launcher packs them in that order)."""
    t = arg_types(storage)
    sigs = {name: sig(t) for family in FAMILIES for name, sig in family.SIGNATURES.items()}
    return {name: sig for name, sig in sigs.items() if sig is not None}

