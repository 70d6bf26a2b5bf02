"""k_gemm, the tensor-core GEMM for prompt rows, against float64, under numba's CUDA simulator.

Ragged shapes (K and N not multiples of the 32-wide chunk and block, M not a multiple of the 16-row
block), each epilogue (store + bias, residual accumulate, SwiGLU), with and without the fused RMSNorm:
the relative error must be at the level of x split into bf16 hi + lo (< 3e-5; x rounded to bf16 alone
would give ~2e-3), every output of the rows asked for written and no other row touched, and a row's
bits the same wherever it falls in its row block; each in k_gemm (4 warps a block) and k_gemm_wide (8:
K split twice as finely; CudaBackend's gemm_warps picks one for every matrix, any other value
refused). The simulator's mma twin rounds each output exactly, so the fragment layout (which lane
holds which row and k) is what this checks; on a GPU the `gpu`-marked test runs the same cases and
SmolLM2's shapes on the tensor cores (bench/gemm_check.py).
"""
from __future__ import annotations

import numpy as np
import pytest

from sim_runner import run_script


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
        assert r["rel"] < result["tolerance"], r


if __name__ == "__main__":
    import json
    import tempfile
    from pathlib import Path

    from bench.gemm_check import RAGGED, SMOLLM2, TOLERANCE, correctness
    from decoder_service.model.cuda.kernels import SIM
    from model_fixtures import backend_refusals
    shapes = RAGGED if SIM else RAGGED + SMOLLM2
    with tempfile.TemporaryDirectory() as tmp:
        refused = backend_refusals(Path(tmp), "gemm_warps", (3, 16))
    print("RESULT " + json.dumps(dict(cases=correctness(np.random.default_rng(4), shapes), tolerance=TOLERANCE,
                                      refused=refused)))
