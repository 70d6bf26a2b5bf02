"""The CUDA backend at the served shapes (SmolLM2-135M, Qwen3-1.7B; random bf16 weights) against the float64
reference, on a GPU (skipped where there is none).

A 12-token prefill, three decodes and a mixed batch (a decode row beside two prefills) in non-contiguous,
unordered KV blocks: the logits within 2e-2 relative error of float64, the same argmax, and the sparse head
equal to the dense head's logits at the candidates, bit for bit. The decode row recomputed alone is
bit-identical to itself inside the mixed batch, and a captured graph's replay to the direct launches.
SmolLM2 also prefills a 1,023-token prompt in chunks of 256 rows and decodes at context 1,024 (the split
attention) against float64. The tiny shapes of tests/test_model_cuda_sim.py run the same kind of checks
under the simulator; these shapes are too large for it. `python -m bench model` times these kernels.
"""
from __future__ import annotations

import json
import os

import numpy as np
import pytest

from sim_runner import run_script

pytestmark = pytest.mark.gpu
TOLERANCE = 2e-2


def _run(shape: str, monkeypatch) -> dict:
    from numba import cuda
    if not cuda.is_available():
        pytest.skip("no CUDA GPU")
    monkeypatch.setenv("TOOLTRIE_GPU_SHAPE", shape)
    return run_script(__file__, sim=False, timeout=900)


@pytest.mark.parametrize("shape", ["smollm2-135m", "qwen3-1.7b"])
def test_the_model_matches_float64_at_the_served_shapes(shape, monkeypatch):
    r = _run(shape, monkeypatch)
    assert len(r["checks"]) == 5
    for c in r["checks"]:
        assert c["finite"] and c["rel"] < TOLERANCE, c
        assert c["argmax_gpu"] == c["argmax_ref"], c
        assert c["sparse_eq_dense"], c
    assert r["alone_eq_mixed"], "a decode row alone differs from itself inside a mixed batch"
    assert r["graph_eq_direct"], "a graph replay differs from the direct launches"
    if shape == "smollm2-135m":
        long = r["long"]
        assert long["rel"] < TOLERANCE and long["argmax_gpu"] == long["argmax_ref"], long


def rel(a, b) -> float:
    return float(np.linalg.norm(a.astype(np.float64) - b) / np.linalg.norm(b))


def main() -> None:
    from bench.common import random_weights, shape_config
    from decoder_service.model.batch import StepBatch
    from decoder_service.model.cuda.backend import CudaBackend
    from decoder_service.model.kv_pool import KVPoolSpec
    from decoder_service.model.reference import ReferenceModel
    shape = os.environ["TOOLTRIE_GPU_SHAPE"]
    cfg = shape_config(shape)
    w = random_weights(cfg, seed=11)
    spec = KVPoolSpec(num_blocks=256, block_size=16)
    be = CudaBackend(cfg, w, spec, max_rows=256, max_logit_rows=32, max_candidates=256)
    ref = ReferenceModel(cfg, w, spec)
    rng = np.random.default_rng(5)
    bt = rng.permutation(spec.num_blocks).astype(np.int32)[:64].reshape(4, 16)   # non-contiguous, unordered
    checks = []

    def compare(tag, batch, cand_n=24):
        be.forward(batch)
        ref.forward(batch)
        lg, lr = be.dense_logits(), ref.dense_logits()
        n_rows = len(batch.logit_rows)
        cand = np.stack([np.argsort(-lr[i])[:cand_n] for i in range(n_rows)]).astype(np.int32)
        cand[:, ::2] = rng.integers(0, cfg.vocab_size, (n_rows, (cand_n + 1) // 2))  # mix in random ids
        sparse = be.sparse_logits(cand, np.full(n_rows, cand_n, np.int32))
        checks.append(dict(tag=tag, rel=rel(lg, lr), finite=bool(np.isfinite(lg).all()),
                           argmax_gpu=[int(a) for a in lg.argmax(1)], argmax_ref=[int(a) for a in lr.argmax(1)],
                           sparse_eq_dense=bool(np.array_equal(sparse, np.take_along_axis(lg, cand, 1)))))
        return lg, lr

    prompt = rng.integers(3, cfg.vocab_size, 12).tolist()
    _, lr = compare("prefill 12 tokens (slot 0)", StepBatch.from_chunks([(0, prompt, 0)], bt))
    pos, nxt = len(prompt), int(lr[0].argmax())
    for _ in range(3):
        _, lr = compare(f"decode pos {pos}", StepBatch.from_chunks([(0, [nxt], pos)], bt, decode_rows=1))
        nxt, pos = int(lr[0].argmax()), pos + 1
    p2 = rng.integers(3, cfg.vocab_size, 7).tolist()
    mixed = StepBatch.from_chunks([(0, [nxt], pos), (1, p2, 0), (2, p2[:3], 0)], bt, decode_rows=1)
    lg_mixed, _ = compare("mixed: decode + prefill 7 + prefill 3", mixed)
    decode = StepBatch.from_chunks([(0, [nxt], pos)], bt, decode_rows=1)
    be.forward(decode)                       # the same position over the same KV, alone
    alone = be.dense_logits()[0]
    be.stage(decode)
    graph = be.capture(lambda: (be.launch_forward(1, 1), be.launch_dense(1)))
    graph.replay()
    replayed = np.empty(cfg.vocab_size, np.float32)
    be.stream.d2h(replayed, be.logits, cfg.vocab_size)
    be.synchronize()
    result = dict(shape=shape, checks=checks, alone_eq_mixed=bool(np.array_equal(alone, lg_mixed[0])),
                  graph_eq_direct=bool(np.array_equal(replayed, alone)))
    if shape == "smollm2-135m":
        result["long"] = long_context(be, ref, cfg, rng)
    print("RESULT " + json.dumps(result))


def long_context(be, ref, cfg, rng, n_prompt: int = 1023) -> dict:
    """A 1,023-token prompt prefilled in chunks of 256 rows in blocks 192..255 (reversed), then a decode at
    context 1,024: its logits against float64."""
    from decoder_service.model.batch import StepBatch
    table = np.arange(192, 256, dtype=np.int32)[::-1][None].copy()
    prompt = rng.integers(3, cfg.vocab_size, n_prompt).tolist()
    for i in range(0, n_prompt, 256):
        chunk = StepBatch.from_chunks([(0, prompt[i:i + 256], i)], table)
        be.forward(chunk)
        ref.forward(chunk)
    dec = StepBatch.from_chunks([(0, [int(rng.integers(3, cfg.vocab_size))], n_prompt)], table, decode_rows=1)
    be.forward(dec)
    ref.forward(dec)
    lg, lr = be.dense_logits(), ref.dense_logits()
    return dict(rel=rel(lg, lr), argmax_gpu=int(lg.argmax()), argmax_ref=int(lr.argmax()))


if __name__ == "__main__":
    main()
