"""The engine's host time per step, without a model: what the GPU waits for between two steps.

    .venv/bin/python -m bench.host_step [--rows 1,64,256]

Before a step's first launch the host plans it, builds its block tables, checks the batch and plans
the CUDA backend's attention (which rows go to which kernel). Where the engine steps ahead (perf log
h3: the same rows one token further) that overlaps the step before on the device; elsewhere (a
request's first step, a step after the batch changed) every microsecond here is one of wall clock.
R MetaTool requests are prefilled through a backend that
computes nothing (its sparse head returns zeros: every row takes its first legal token), then, with
all R decoding, the median host time of the step's parts is printed.
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from bench.workload import load_workload
from decoder_service.engine.engine import DecodeEngine, EngineConfig
from decoder_service.engine.sequence import State
from decoder_service.model.cuda.backend import attention_plan
from decoder_service.model.cuda.kernels import MMA_SPLIT, MQ, TP
from shared.config import DEFAULT_MODEL_DIR
from shared.tokenizer import ModelTokenizer

BLOCK, NUM_BLOCKS = 16, 40_000
# CudaBackend's prompt-tile plan for SmolLM2 (9 query heads on 3 KV heads: MQ // 3 rows a tile) on the H200,
# where CudaBackend._most_splits gives 10 (perf log s1)
SMOLLM2_TILES = (MQ // 3, MMA_SPLIT, 10, TP)


class NullBackend:
    """The backend interface with no model: batches are validated like the real ones, logits are 0."""
    name = "null"
    max_rows, max_logit_rows = 1 << 20, 256

    def forward(self, batch) -> None:
        batch.validate(BLOCK, NUM_BLOCKS, 49152)

    def copy_kv(self, src_block: int, dst_block: int, count: int) -> None:
        """No pool: nothing to copy."""

    def sparse_logits(self, cand: np.ndarray, n: np.ndarray) -> np.ndarray:
        return np.zeros(cand.shape, np.float32)


def median_us(fn, reps: int = 30) -> float:
    fn()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts) * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="1,64,256")
    args = p.parse_args()
    tok = ModelTokenizer(DEFAULT_MODEL_DIR)
    trie, queries = load_workload("metatool", tok)
    print("| decoding rows | plan µs | block tables µs | batch check µs | attention plan µs |")
    print("| --- | --- | --- | --- | --- |")
    for rows in (int(r) for r in args.rows.split(",")):
        engine = DecodeEngine(NullBackend(), tok, NUM_BLOCKS, BLOCK, 8192,
                              EngineConfig(max_seqs=rows, max_step_tokens=1 << 20))   # one prefill step
        rt = engine.load_catalog(trie)
        engine.run_until_idle()
        for q in queries[:rows]:
            engine.submit(rt, q.intent, q.k)
        engine.step()
        assert len(engine.scheduler.running) == rows
        assert all(s.state == State.DECODE for s in engine.scheduler.running)
        plan = engine.scheduler.plan()
        batch = engine._batch(plan)
        ctx = int(batch.positions.max()) + 1
        print(f"| {rows} | {median_us(engine.scheduler.plan):.0f} | {median_us(lambda: engine._batch(plan)):.0f} | "
              f"{median_us(lambda: batch.validate(BLOCK, NUM_BLOCKS, 49152)):.0f} | "
              f"{median_us(lambda: attention_plan(batch, ctx, 2048, *SMOLLM2_TILES)):.1f} |", flush=True)


if __name__ == "__main__":
    main()
