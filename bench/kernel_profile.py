"""Forward steps between cudaProfilerStart and cudaProfilerStop, so that Nsight Compute profiles
exactly them (CUDA only; random bf16 weights at a model's real shapes).

    ncu --profile-from-start off --clock-control none --cache-control none \\
        --metrics gpu__time_duration.sum --csv python3 bench/kernel_profile.py decode:1@4955 prefill:71@4955
    ncu --profile-from-start off --clock-control none --set full --kernel-name regex:k_attn \\
        python3 bench/kernel_profile.py decode:1@4955

Each case (`decode:R@P`: R sequences decoding one row at position P over a shared P-token prefix;
`prefill:R@P`: one sequence prefilling R rows after it, step_profile's shapes) runs once unprofiled
(compiles, warms L2) and once profiled, launch by launch (no graph), so ncu's per-kernel durations
add up to the step's device time without the launch gaps a graph replay would still have.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.gpu_model_check import MODELS  # noqa: E402
from bench.step_profile import decode_batch, parse_case, prefill_batch, sized_backend  # noqa: E402
from decoder_service.model.config import ModelConfig  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("cases", nargs="+", help="decode:R@P or prefill:R@P")
    p.add_argument("--shape", default="smollm2-135m")
    args = p.parse_args()
    from numba import cuda

    cases = [parse_case(c) for c in args.cases]
    cfg = ModelConfig.from_dict(MODELS[args.shape], args.shape)
    be, per_seq = sized_backend(cfg, max(r for _, r, _ in cases), max(p + r for _, r, p in cases), graph_rows=0)
    for kind, rows, prefix in cases:
        batch = (prefill_batch if kind == "prefill" else decode_batch)(rows, prefix, per_seq)
        be.forward(batch)
        be.synchronize()
        cuda.profile_start()
        be.forward(batch)
        be.synchronize()
        cuda.profile_stop()
        print(f"profiled {kind} {rows} rows at position {prefix}", flush=True)


if __name__ == "__main__":
    main()
