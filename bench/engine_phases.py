"""Where a concurrency-1 query's steps spend their wall clock: the host's parts and the device wait.

    python3 bench/engine_phases.py [--workload metatool] [--queries 40] [--shape smollm2-135m]

A step plans, stages and enqueues the forward pass and the sampler (or takes the step launched ahead),
enqueues the next step ahead where it can (`ahead`: its forward and sampler), then waits for this
step's picks (`wait`, the host blocked on the device) and advances on the host. Queries run one at a
time on the calling thread (the CUDA backend on a GPU, the CPU backend elsewhere; SmolLM2's real
weights where present, random bf16 at the shape otherwise), the engine methods in PHASES timed by
wrappers; a step's host time is its wall clock less that wait. Prefill and decode steps are reported
apart (µs, the mean over the steps: an answer's last step also completes it).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.__main__ import BLOCK, MAX_SEQS, has_gpu, make_backend, model_for  # noqa: E402
from bench.workload import load_workload  # noqa: E402
from decoder_service.engine.engine import DecodeEngine, EngineConfig  # noqa: E402
from decoder_service.engine.sequence import State  # noqa: E402
from decoder_service.model.batch import StepBatch  # noqa: E402
from decoder_service.model.kv_pool import KVPoolSpec  # noqa: E402
from shared.config import DEFAULT_MODEL_DIR  # noqa: E402
from shared.tokenizer import ModelTokenizer  # noqa: E402

# Nested: forward holds validate, stage and replay; ahead holds a forward and a sampler; advance holds
# complete (and that, release).
PHASES = ("plan", "batch", "forward", "validate", "stage", "replay", "sampler", "ahead", "wait", "advance",
          "complete", "release")


class Clock:
    """Per-step sums of the wrapped calls' durations; a call inside a call of its own phase (the
    advance through a forced name recurses) counts once, in the outer one."""

    def __init__(self):
        self.step = defaultdict(float)
        self.depth = defaultdict(int)

    def wrap(self, obj, attr: str, phase: str) -> None:
        fn = getattr(obj, attr)

        def timed(*a, **kw):
            t = time.perf_counter()
            self.depth[phase] += 1
            try:
                return fn(*a, **kw)
            finally:
                self.depth[phase] -= 1
                if not self.depth[phase]:
                    self.step[phase] += time.perf_counter() - t
        setattr(obj, attr, timed)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workload", default="metatool")
    p.add_argument("--queries", type=int, default=40)
    p.add_argument("--shape", default="smollm2-135m", help="a bench shape (random weights but SmolLM2's)")
    args = p.parse_args()
    gpu = has_gpu()
    tok = ModelTokenizer(DEFAULT_MODEL_DIR)
    trie, queries = load_workload(args.workload, tok, args.queries)
    cfg, weights, what = model_for(args.shape, gpu)
    spec = KVPoolSpec.from_tokens(8192 + MAX_SEQS * 512, BLOCK)
    be = make_backend(cfg, weights, spec, gpu, max_table=MAX_SEQS * -(-cfg.max_position_embeddings // BLOCK))
    engine = DecodeEngine(be, tok, spec.num_blocks, spec.block_size, cfg.max_position_embeddings,
                          EngineConfig(max_seqs=MAX_SEQS))
    rt = engine.load_catalog(trie)
    engine.run_until_idle()
    clock = Clock()
    prompt_rows = []   # rows a query prefills: prompt rows of every forward call (its suffix, after the prefix)
    forward = be.forward

    def counted(batch, *a, **kw):
        prompt_rows[-1] += batch.num_rows - batch.decode_rows
        return forward(batch, *a, **kw)
    be.forward = counted
    for obj, attr, phase in ((engine.scheduler, "plan", "plan"), (engine, "_batch", "batch"),
                             (be, "forward", "forward"), (engine.sampler, "start", "sampler"),
                             (engine, "_launch_ahead", "ahead"), (engine, "_advance", "advance"),
                             (engine, "_complete", "complete"), (engine.scheduler, "release", "release"),
                             (StepBatch, "validate", "validate")):
        clock.wrap(obj, attr, phase)
    if gpu:                                 # the CUDA backend's staging, graph replay, and the wait
        from decoder_service.engine import cuda_sampler
        from decoder_service.model.cuda.launcher import Graph
        clock.wrap(be, "stage", "stage")
        clock.wrap(Graph, "replay", "replay")
        clock.wrap(engine.sampler, "follow", "sampler")
        clock.wrap(cuda_sampler, "event_wait_host", "wait")
    rows = {"prefill": defaultdict(list), "decode": defaultdict(list)}
    for q in queries:
        seq = engine.submit(rt, q.intent, q.k)
        prompt_rows.append(0)
        while seq.state != State.FINISHED:
            kind = "decode" if seq.state == State.DECODE else "prefill"
            clock.step.clear()
            t = time.perf_counter()
            engine.step()
            total = time.perf_counter() - t
            for ph in PHASES:
                rows[kind][ph].append(clock.step[ph])
            rows[kind]["step"].append(total)
            rows[kind]["host"].append(total - clock.step["wait"])
    print(f"{args.shape}, {args.workload}, {len(queries)} queries one at a time, {'CUDA' if gpu else 'CPU'} backend "
          f"({what} weights), {engine.steps_ahead} steps launched ahead ({engine.steps_dropped} dropped unread), "
          f"{engine.tokens_forced} tokens taken without a step: µs a step, mean (forward is its "
          f"host call; phases nest as PHASES says); prompt rows a query: mean {statistics.fmean(prompt_rows):.1f}, "
          f"median {statistics.median(prompt_rows):g}")
    cols = ("step", "host", *PHASES)
    print("| step | n | " + " | ".join(cols) + " |")
    print("| --- | --- | " + " | ".join("---" for _ in cols) + " |")
    for kind, r in rows.items():
        if r["step"]:
            print(f"| {kind} | {len(r['step'])} | "
                  + " | ".join(f"{statistics.fmean(r[c]) * 1e6:.0f}" for c in cols) + " |")


if __name__ == "__main__":
    main()
