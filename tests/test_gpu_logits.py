"""The forward pass's fingerprint: sha256 of the dense logits of four fixed batches, against the hashes recorded in
docs/performance.md#recorded-fingerprints, on a GPU of compute capability 9.0 with 132 SMs (the H200 and the H100
SXM; skipped without a GPU; printed, not compared, on another).

Random bf16 weights (seed 1) at the SmolLM2 and Qwen3-1.7B shapes (the cases' positions SmolLM2's; Qwen3's
head_dim 128 takes the wide attention kernels), random K/V in the pool (seed 5), and every row of each batch
gets logits, so every GEMV, attention kernel and head output feeds the hash. Equal hashes say a change is
bit-identical to the path it replaces; a change meant to move bits records its new hashes here, with the
commit. The cases run in order on one pool: the K/V a prompt case writes is read by the cases after it. The
attention split rule depends on the SM count, hence one kind of device.
"""
from __future__ import annotations

import json
import os

import pytest

from sim_runner import run_script

pytestmark = pytest.mark.gpu
PREFIX = 4955   # MetaTool's catalog prefix with SmolLM2's tokenizer
CASES = [("prefill", 71, PREFIX), ("prefill", 96, 20), ("prefill", 3, PREFIX + 100), ("decode", 3, PREFIX)]
RECORDED = {   # recorded on an H100 at c8f141d, after P96 moved SmolLM2's first, third and fourth cases
    "smollm2-135m": ["59b072a1e81601d9", "995016ef63bc0ff5", "4c6f27dbf6fb6e11", "c62dd6d2d986cbc7"],
    "qwen3-1.7b": ["bbd4c6e14b36414d", "6cc4e1b21ba51230", "a5380bb720ac3074", "081e0ad5c4bd9d9a"],
}
DEVICE = ((9, 0), 132)   # compute capability, SMs


@pytest.mark.parametrize("shape", sorted(RECORDED))
def test_the_logits_fingerprint_is_the_recorded_one(shape, monkeypatch):
    from numba import cuda
    if not cuda.is_available():
        pytest.skip("no CUDA GPU")
    monkeypatch.setenv("TOOLTRIE_GPU_SHAPE", shape)
    r = run_script(__file__, sim=False, timeout=900)
    print(f"{shape} on {r['device']}: {r['hashes']}")
    if (tuple(r["capability"]), r["sms"]) != DEVICE:
        pytest.skip(f"hashes recorded for {DEVICE} (capability, SMs), not {r['device']}: {r['hashes']}")
    assert r["hashes"] == RECORDED[shape]


def main() -> None:
    import dataclasses
    import hashlib

    import numpy as np
    from numba import cuda

    from bench.common import case_batch, rand_bf16, shape_config, sized_backend
    cfg = shape_config(os.environ["TOOLTRIE_GPU_SHAPE"])
    max_r = max(r for _, r, _ in CASES)
    be, per_seq = sized_backend(cfg, max_r, PREFIX + 100 + max_r, spare=2)
    rng = np.random.default_rng(5)
    for pool in (be.kv_k, be.kv_v):
        pool.copy_to_device(rand_bf16(rng, (pool.size,), 1.0))
    hashes = []
    for case, rows, prefix in CASES:
        batch = dataclasses.replace(case_batch(case, rows, prefix, per_seq), logit_rows=np.arange(rows, dtype=np.int32))
        be.forward(batch)
        hashes.append(hashlib.sha256(be.dense_logits().tobytes()).hexdigest()[:16])
    dev = cuda.get_current_device()
    name = dev.name.decode() if isinstance(dev.name, bytes) else str(dev.name)
    print("RESULT " + json.dumps({"device": name, "capability": list(dev.compute_capability),
                                  "sms": dev.MULTIPROCESSOR_COUNT, "hashes": hashes}))


if __name__ == "__main__":
    main()
