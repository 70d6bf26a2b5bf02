"""k_gemm, the tensor-core GEMM for prompt rows, against float64, under numba's CUDA simulator.

Ragged shapes (K and N not multiples of the 32-wide chunk and block, M not a multiple of the 16-row
block), each epilogue (store + bias, residual accumulate, SwiGLU), with and without the fused RMSNorm:
the relative error must be at the level of x split into bf16 hi + lo (< 3e-5; x rounded to bf16 alone
would give ~2e-3), every output of the rows asked for written and no other row touched, and a row's
bits the same wherever it falls in its row block, on one register set (k_gemm_one) and in big tiles
(k_gemm_big: 32 x 64) as in small;
each in k_gemm (4 warps a block) and k_gemm_wide (8: K split twice as finely; CudaBackend's gemm_warps
picks one for every matrix, any other value refused). The simulator's mma twin rounds each output exactly, so
the fragment layout (which lane holds which row and k) is what this checks; on a GPU the `gpu`-marked test
runs the same cases and SmolLM2's four matrices on the tensor cores (`python -m bench gemm` times them against
the GEMV tiles).
"""
from __future__ import annotations

import math

import numpy as np
import pytest

from decoder_service.model.cuda.matmul import ACCUMULATE, STORE, SWIGLU
from sim_runner import run_script

EPS = 1e-5
TOLERANCE = 3e-5
# (K, N, M, mode, norm, bias)
SMOLLM2 = [(576, 960, 71, STORE, 1, 1), (576, 576, 71, ACCUMULATE, 0, 0), (576, 3072, 71, SWIGLU, 1, 0),
           (1536, 576, 71, ACCUMULATE, 0, 0), (576, 960, 1, STORE, 1, 0), (576, 3072, 300, SWIGLU, 1, 0)]
# K, N not multiples of 32
RAGGED = [(72, 40, 21, STORE, 1, 1), (72, 40, 21, ACCUMULATE, 0, 0), (40, 48, 17, SWIGLU, 1, 0)]


def _bf16_bits(rng, shape, scale):
    """Random bf16 bits of N(0, scale) values (round to nearest even)."""
    f = (rng.standard_normal(shape) * scale).astype(np.float32)
    u = f.view(np.uint32).astype(np.uint64)
    return (((u + 0x7FFF + ((u >> 16) & 1)) >> 16) & 0xFFFF).astype(np.uint16)


def reference(x, Wf, gamma, bias, base, K_, mode, use_norm, use_bias):
    """float64: the rows' outputs as k_gemm defines them (STORE + bias, ACCUMULATE, SWIGLU)."""
    x = x.astype(np.float64)
    if use_norm:
        x = x / np.sqrt((x[:, :K_] ** 2).mean(1, keepdims=True) + EPS) * gamma.astype(np.float64)
    y = x @ Wf.T
    if use_bias:
        y = y + bias
    if mode == ACCUMULATE:
        return base + y
    if mode == SWIGLU:
        a, b = y[:, 0::2], y[:, 1::2]
        return a / (1 + np.exp(-a)) * b
    return y


def check_gemm(rng, K_: int, N: int, M: int, mode: int, use_norm: int, use_bias: int, warps: int,
               first: int = 3) -> dict:
    """One k_gemm case, blocks of `warps` warps, over rows [first, first + M) of a (first + M + 2)-row
    buffer: its relative error, every row asked for written and no other, and a row's bits the same when
    it falls elsewhere in its row block (rows computed from `first` and from `first + 5`)."""
    from numba import cuda

    from decoder_service.gpu.intrinsics import MMA
    from decoder_service.model.cuda import kernels as K
    from decoder_service.model.cuda.matmul import GEMM_ROWS, GEMM_TILES, gemm_shared
    from decoder_service.model.weights import bf16_to_f32
    Kp = -(-K_ // 8) * 8
    rows = first + M + 2
    W = np.zeros((N, Kp), np.uint16)
    W[:, :K_] = _bf16_bits(rng, (N, K_), 1 / math.sqrt(K_))
    x = np.zeros((rows, Kp), np.float32)
    x[:, :K_] = rng.standard_normal((rows, K_)) * 3
    gamma = np.zeros(Kp, np.float32)
    gamma[:K_] = 1 + 0.1 * rng.standard_normal(K_)
    bias = rng.standard_normal(N).astype(np.float32)
    width = N // 2 if mode == SWIGLU else N
    base = rng.standard_normal((rows, width)).astype(np.float32)
    init = base if mode == ACCUMULATE else np.full((rows, width), np.nan, np.float32)
    end = first + M
    d_w, d_x, d_g, d_b = (cuda.to_device(a.reshape(-1)) for a in (W, x, gamma, bias))
    i32 = np.int32

    def run(lo, kind="small"):
        out = cuda.to_device(init.reshape(-1))
        name = K.GEMM_KERNELS[warps, kind]
        _, mt, nt = GEMM_TILES[name]
        K.model_kernel(name, "bfloat16").allow_dynamic_shared(gemm_shared(warps, mt, nt))   # over 48 KiB: opted into
        grid = (-(-N // (8 * nt)), -(-(end - lo) // (GEMM_ROWS * mt)))
        K.KERNELS[name][grid, warps * MMA, 0, gemm_shared(warps, mt, nt)](
            d_x, i32(Kp), d_g, np.float32(EPS), i32(use_norm), d_w, i32(Kp), i32(K_), i32(N), d_b, i32(use_bias),
            out, i32(width), i32(mode), i32(lo), i32(end))
        return out.copy_to_host().reshape(rows, width)

    shift = min(5, M - 1)                # rows from first + shift land elsewhere in their row block
    got, shifted = run(first), run(first + shift)
    small = K.GEMM_KERNELS[warps, "small"]     # and the other tiles of these warps (k_gemm_wide has no one-set twin)
    others = [run(first + shift, kind) for kind in K.GEMM_KINDS if K.GEMM_KERNELS[warps, kind] != small]
    ref = reference(x[first:end], bf16_to_f32(W), gamma, bias, base[first:end], K_, mode, use_norm, use_bias)
    out = got[first:end].astype(np.float64)
    untouched = np.array_equal(got[:first], init[:first], equal_nan=True) and \
        np.array_equal(got[end:], init[end:], equal_nan=True)
    return dict(K=K_, N=N, M=M, mode=mode, norm=use_norm, bias=use_bias, warps=warps,
                rel=float(np.linalg.norm(out - ref) / np.linalg.norm(ref)) if np.isfinite(out).all() else math.inf,
                written=bool(np.isfinite(out).all()), untouched=bool(untouched),
                row_bits_own=bool(np.array_equal(got[first + shift:end], shifted[first + shift:end])),
                tiles_same=all(np.array_equal(o, shifted, equal_nan=True) for o in others))


def correctness(rng, shapes) -> list[dict]:
    """Every shape at each warps a block of k_gemm and k_gemm_wide (CudaBackend's gemm_warps)."""
    from decoder_service.model.cuda.matmul import GEMM_MAX_WARPS, GEMM_WARPS
    return [check_gemm(rng, *s, warps) for s in shapes for warps in (GEMM_WARPS, GEMM_MAX_WARPS)]


def test_gemm_matches_float64_under_the_simulator():
    _assert(run_script(__file__, sim=True, timeout=600))


@pytest.mark.gpu
def test_gemm_matches_float64_on_the_gpu():
    from numba import cuda
    if not cuda.is_available():
        pytest.skip("no CUDA GPU")
    _assert(run_script(__file__, sim=False))


def _assert(result: dict) -> None:
    refused = result["refused"]
    assert len(refused) == 2, refused
    assert all("gemm_warps=" in m and "must be 4 (k_gemm) or 8 (k_gemm_wide)" in m for m in refused), refused
    assert {r["warps"] for r in result["cases"]} == {4, 8}
    assert len(result["cases"]) >= 6
    for r in result["cases"]:
        assert r["written"] and r["untouched"], r
        assert r["row_bits_own"], r
        assert r["tiles_same"], r
        assert r["rel"] < result["tolerance"], r


if __name__ == "__main__":
    import json
    import tempfile
    from pathlib import Path

    from decoder_service.gpu.intrinsics import SIM
    from model_fixtures import backend_refusals
    shapes = RAGGED if SIM else RAGGED + SMOLLM2
    with tempfile.TemporaryDirectory() as tmp:
        refused = backend_refusals(Path(tmp), "gemm_warps", (3, 16))
    print("RESULT " + json.dumps(dict(cases=correctness(np.random.default_rng(4), shapes), tolerance=TOLERANCE,
                                      refused=refused)))
