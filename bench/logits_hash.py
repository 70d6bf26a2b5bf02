"""A fingerprint of the CUDA forward pass: sha256 of the dense logits of fixed batches (CUDA only).

    python3 bench/logits_hash.py [--shape qwen3-1.7b]

Random bf16 weights (seed 1) at the SmolLM2 shape (or --shape's; the cases' positions stay SmolLM2's),
random K/V in the pool (seed 5), and every row of each batch gets logits, so every GEMV, attention kernel
and head output feeds the hash. Run it on two checkouts: equal hashes say a kernel change is bit-identical
to the path it replaces (perf log g1, a3, q2).
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.gpu_model_check import MODELS, rand_bf16  # noqa: E402
from bench.step_profile import decode_batch, prefill_batch, sized_backend  # noqa: E402
from decoder_service.model.config import ModelConfig  # noqa: E402

PREFIX = 4955   # MetaTool's catalog prefix with SmolLM2's tokenizer
CASES = [("prefill", 71, PREFIX), ("prefill", 96, 20), ("prefill", 3, PREFIX + 100), ("decode", 3, PREFIX)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="smollm2-135m", choices=sorted(MODELS),
                    help="model shape; Qwen3-1.7B's head_dim 128 takes the wide attention kernels")
    shape = ap.parse_args().shape
    cfg = ModelConfig.from_dict(MODELS[shape], shape)
    max_r = max(r for _, r, _ in CASES)
    be, per_seq = sized_backend(cfg, max_r, PREFIX + 100 + max_r, spare=2)
    rng = np.random.default_rng(5)
    for pool in (be.kv_k, be.kv_v):
        pool.copy_to_device(rand_bf16(rng, (pool.size,), 1.0))
    for case, R, prefix in CASES:
        batch = (prefill_batch if case == "prefill" else decode_batch)(R, prefix, per_seq)
        batch = dataclasses.replace(batch, logit_rows=np.arange(R, dtype=np.int32))
        be.forward(batch)
        logits = be.dense_logits()
        print(f"{case} {R}@{prefix}: {hashlib.sha256(logits.tobytes()).hexdigest()[:16]}", flush=True)


if __name__ == "__main__":
    main()
