"""k_gemm (prompt rows on the tensor cores) against float64, and timed against the GEMV row tiles.

    python3 bench/gemm_check.py [--rows 16,71,256,512]

Checks, on fresh random inputs per case (SmolLM2's four matrices, then ragged shapes): the relative
error against float64 (bf16 weights exact, x as bf16 hi + lo: ~1e-5; x rounded to bf16 alone would
give ~2e-3), every output of rows [first, end) written and no other, and the bits of a row unchanged
when it falls elsewhere in its row block (rows computed from `first` and from `first + 5`). Then, at
the SmolLM2 shape and random bf16 weights, µs per layer of each matrix for M prompt rows: the
backend's GEMV row tiles against k_gemm (graphs of 30 launches, L2 warm as in a real step).
tests/test_gemm.py runs check_gemm under the simulator.
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from decoder_service.model.cuda import kernels as K  # noqa: E402
from decoder_service.model.weights import bf16_to_f32  # noqa: E402

EPS = 1e-5
MODES = {0: "store + bias", 1: "accumulate", 2: "SwiGLU"}


def _bf16_bits(rng, shape, scale):
    """Random bf16 bits of N(0, scale) values (round to nearest even)."""
    f = (rng.standard_normal(shape) * scale).astype(np.float32)
    u = f.view(np.uint32).astype(np.uint64)
    return (((u + 0x7FFF + ((u >> 16) & 1)) >> 16) & 0xFFFF).astype(np.uint16)


def reference(x, Wf, gamma, bias, base, K_, mode, use_norm, use_bias):
    """float64: the rows' outputs as k_gemm defines them."""
    x = x.astype(np.float64)
    if use_norm:
        x = x / np.sqrt((x[:, :K_] ** 2).mean(1, keepdims=True) + EPS) * gamma.astype(np.float64)
    y = x @ Wf.T
    if use_bias:
        y = y + bias
    if mode == 1:
        return base + y
    if mode == 2:
        a, b = y[:, 0::2], y[:, 1::2]
        return a / (1 + np.exp(-a)) * b
    return y


def check_gemm(rng, K_: int, N: int, M: int, mode: int, use_norm: int, use_bias: int, warps: int,
               first: int = 3) -> dict:
    """One k_gemm case, blocks of `warps` warps, over rows [first, first + M) of a (first + M + 2)-row
    buffer."""
    from numba import cuda
    Kp = -(-K_ // 8) * 8
    rows = first + M + 2
    W = np.zeros((N, Kp), np.uint16)
    W[:, :K_] = _bf16_bits(rng, (N, K_), 1 / math.sqrt(K_))
    x = np.zeros((rows, Kp), np.float32)
    x[:, :K_] = rng.standard_normal((rows, K_)) * 3
    gamma = np.zeros(Kp, np.float32)
    gamma[:K_] = 1 + 0.1 * rng.standard_normal(K_)
    bias = rng.standard_normal(N).astype(np.float32)
    width = N // 2 if mode == 2 else N
    base = rng.standard_normal((rows, width)).astype(np.float32)
    init = base if mode == 1 else np.full((rows, width), np.nan, np.float32)
    end = first + M
    d_w, d_x, d_g, d_b = (cuda.to_device(a.reshape(-1)) for a in (W, x, gamma, bias))
    i32 = np.int32

    def run(lo):
        out = cuda.to_device(init.reshape(-1))
        grid = (-(-N // K.GEMM_COLS), -(-(end - lo) // K.GEMM_ROWS))
        K.KERNELS[K.GEMM_KERNELS[warps]][grid, warps * K.MMA](
            d_x, i32(Kp), d_g, np.float32(EPS), i32(use_norm), d_w, i32(Kp), i32(K_), i32(N), d_b, i32(use_bias),
            out, i32(width), i32(mode), i32(lo), i32(end))
        return out.copy_to_host().reshape(rows, width)

    shift = min(5, M - 1)                # rows from first + shift land elsewhere in their row block
    got, shifted = run(first), run(first + shift)
    ref = reference(x[first:end], bf16_to_f32(W), gamma, bias, base[first:end], K_, mode, use_norm, use_bias)
    out = got[first:end].astype(np.float64)
    untouched = np.array_equal(got[:first], init[:first], equal_nan=True) and \
        np.array_equal(got[end:], init[end:], equal_nan=True)
    return dict(K=K_, N=N, M=M, mode=mode, norm=use_norm, bias=use_bias, warps=warps,
                rel=float(np.linalg.norm(out - ref) / np.linalg.norm(ref)) if np.isfinite(out).all() else math.inf,
                written=bool(np.isfinite(out).all()), untouched=bool(untouched),
                row_bits_own=bool(np.array_equal(got[first + shift:end], shifted[first + shift:end])))


def correctness(rng, shapes) -> list[dict]:
    """Every shape at each of WARPS warps a block."""
    return [check_gemm(rng, *s, warps) for s in shapes for warps in WARPS]


SMOLLM2 = [(576, 960, 71, 0, 1, 1), (576, 576, 71, 1, 0, 0), (576, 3072, 71, 2, 1, 0), (1536, 576, 71, 1, 0, 0),
           (576, 960, 1, 0, 1, 0), (576, 3072, 300, 2, 1, 0)]
RAGGED = [(72, 40, 21, 0, 1, 1), (72, 40, 21, 1, 0, 0), (40, 48, 17, 2, 1, 0)]   # K, N not multiples of 32
TOLERANCE = 3e-5
WARPS = tuple(K.GEMM_KERNELS)     # k_gemm's and k_gemm_wide's warps a block (CudaBackend's gemm_warps)


def timing(rows: list[int]) -> list[tuple]:
    """µs per layer, GEMV row tiles against k_gemm, for each matrix and row count (SmolLM2 shape)."""
    from bench.gpu_model_check import MODELS, Timer, random_weights
    from decoder_service.model.config import ModelConfig
    from decoder_service.model.cuda.backend import CudaBackend
    from decoder_service.model.kv_pool import KVPoolSpec
    cfg = ModelConfig.from_dict(MODELS["smollm2-135m"], "smollm2-135m")
    be = CudaBackend(cfg, random_weights(cfg, seed=1), KVPoolSpec(64, 16), max_rows=max(rows))
    rng = np.random.default_rng(2)
    for buf in (be.x, be.att, be.act):
        buf.copy_to_device(rng.standard_normal(buf.size).astype(np.float32))
    timer = Timer(be)
    table = []
    for R in rows:
        be.n_rows.value = R
        be.gemm_rows[0].value, be.gemm_rows[1].value = 0, R
        for key in ("qkv", "o", "gate_up", "down"):
            tiles = -(-R // K.TILE_ROWS)
            t_ms, _ = timer.graph_ms(lambda key=key: [be.launch_tiles(ly[key + "/tile"], tiles) for ly in be.layers])
            g_ms, _ = timer.graph_ms(lambda key=key: [ly[key + "/gemm"][0].launch(ly[key + "/gemm"][1], -(-R // K.GEMM_ROWS))
                                                      for ly in be.layers])
            n = len(be.layers)
            table.append((R, key, t_ms * 1e3 / n, g_ms * 1e3 / n))
    return table


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="16,71,256,512")
    args = ap.parse_args()
    rng = np.random.default_rng(11)
    bad = 0
    for r in correctness(rng, SMOLLM2 + RAGGED):
        ok = r["rel"] < TOLERANCE and r["written"] and r["untouched"] and r["row_bits_own"]
        bad += not ok
        print(f"K {r['K']:5d} N {r['N']:5d} M {r['M']:4d} {MODES[r['mode']]:13s} norm {r['norm']} bias {r['bias']} "
              f"warps {r['warps']}: "
              f"rel {r['rel']:.2e}  written {r['written']}  others untouched {r['untouched']}  "
              f"row bits its own {r['row_bits_own']}  {'OK' if ok else 'FAIL'}", flush=True)
    rows = [int(v) for v in args.rows.split(",")]
    table = timing(rows)
    print("\n| rows | matrix | GEMV tiles (µs/layer) | k_gemm (µs/layer) | ratio |\n| --- | --- | --- | --- | --- |")
    for R, key, t, g in table:
        print(f"| {R} | {key} | {t:.1f} | {g:.1f} | {t / g:.2f}× |")
    print(f"\ncorrectness: {bad} failing case(s)")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
