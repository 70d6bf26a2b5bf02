"""The engine's host side: where a concurrency-1 query's steps spend their wall clock, and the host's
time between two steps without a model.

    python3 -m bench engine-phases [--workload metatool] [--queries 40] [--shape smollm2-135m]
    python -m bench host-step [--rows 1,64,256]
    python3 -m bench swap [--swaps 5] [--steady 20]

engine-phases: a step plans, stages and enqueues the forward pass and the sampler (or takes the step
launched ahead), enqueues the next step ahead where it can (`ahead`: its forward and sampler), then waits
for this step's picks (`wait`, the host blocked on the device) and advances on the host. Queries run one
at a time on the calling thread (the CUDA backend on a GPU, the CPU backend elsewhere; SmolLM2's real
weights where present, random bf16 at the shape otherwise), the engine methods in PHASES timed by
wrappers; a step's host time is its wall clock less that wait. Prefill and decode steps are reported
apart (µs, the mean over the steps: an answer's last step also completes it).

host-step: before a step's first launch the host plans it, builds its block tables, checks the batch and
plans the CUDA backend's attention (which rows go to which kernel). Where the engine steps ahead (P54:
the same rows one token further) that overlaps the step before on the device; elsewhere (a
request's first step, a step after the batch changed) every microsecond here is one of wall clock. R
MetaTool requests are prefilled through a backend that computes nothing (its sparse head returns zeros:
every row takes its first legal token), then, with all R decoding, the median host time of the step's
parts is printed.
"""
from __future__ import annotations

import json
import statistics
import time
from collections import defaultdict

import numpy as np

from bench.common import BLOCK, MAX_SEQS, has_gpu, ints, make_backend, model_for
from bench.workload import load_workload
from decoder_service.engine.engine import DecodeEngine, EngineConfig
from decoder_service.engine.sequence import State
from decoder_service.model.batch import StepBatch
from decoder_service.model.kv_pool import KVPoolSpec
from shared.config import DEFAULT_MODEL_DIR
from shared.tokenizer import ModelTokenizer

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


def engine_phases_arguments(p) -> None:
    p.add_argument("--workload", default="metatool", choices=["metatool", "sealtools"])
    p.add_argument("--queries", type=int, default=40)
    p.add_argument("--shape", default="smollm2-135m", help="a bench shape (random weights but SmolLM2's)")


def engine_phases(args) -> None:
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
        from decoder_service.engine import device_trie
        from decoder_service.gpu.launcher import Graph
        clock.wrap(be, "stage", "stage")
        clock.wrap(Graph, "replay", "replay")
        clock.wrap(engine.sampler, "follow", "sampler")
        clock.wrap(device_trie, "event_wait_host", "wait")   # DeviceTrie.read waiting for the picks
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


NUM_BLOCKS = 40_000   # host-step's pool: every request's blocks, never a wait


class NullBackend:
    """The backend interface with no model: batches are validated like the real ones, logits are 0."""
    name = "null"
    max_rows, max_logit_rows = 1 << 20, 256

    def forward(self, batch) -> None:
        batch.validate(BLOCK, NUM_BLOCKS, 49152)

    def copy_kv(self, src_block: int, dst_block: int, count: int) -> None:
        """No pool: nothing to copy."""

    def place_kv(self, src: np.ndarray, dst: np.ndarray, shift: np.ndarray) -> None:
        """No pool: nothing to move."""

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


def host_step_arguments(p) -> None:
    p.add_argument("--rows", default="1,64,256")


def host_step(args) -> None:
    from decoder_service.model.cuda.attention import MMA_SPLIT, MQ, TP
    from decoder_service.model.cuda.plan import attention_plan
    # CudaBackend's prompt-tile plan for SmolLM2 (9 query heads on 3 KV heads: MQ // 3 rows a tile) on the
    # H200, where CudaBackend._most_splits gives 10 (P63)
    smollm2_tiles = (MQ // 3, MMA_SPLIT, 10, TP)
    tok = ModelTokenizer(DEFAULT_MODEL_DIR)
    trie, queries = load_workload("metatool", tok)
    print("| decoding rows | plan µs | block tables µs | batch check µs | attention plan µs |")
    print("| --- | --- | --- | --- | --- |")
    for rows in ints(args.rows):
        engine = DecodeEngine(NullBackend(), tok, NUM_BLOCKS, BLOCK, 8192,
                              EngineConfig(max_seqs=rows, max_step_tokens=1 << 20, chunk_size=1 << 20,
                                           finish_forced=False))   # one prefill step, then R rows decoding
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
        print(f"| {rows} | {median_us(engine.scheduler.plan):.0f} | "
              f"{median_us(lambda engine=engine, plan=plan: engine._batch(plan)):.0f} | "
              f"{median_us(lambda batch=batch: batch.validate(BLOCK, NUM_BLOCKS, 49152)):.0f} | "
              f"{median_us(lambda batch=batch, ctx=ctx: attention_plan(batch, ctx, 0, *smollm2_tiles)):.1f} |",
              flush=True)


def swap_arguments(p) -> None:
    p.add_argument("--swaps", type=int, default=5, help="version switches per variant")
    p.add_argument("--steady", type=int, default=20, help="requests after the first, for the steady median")
    p.add_argument("--shape", default="smollm2-135m")


def swap(args) -> None:
    """The first request after a catalog switch against the steady state (issue 30's target on the H200: within
    0.1 ms), with the version bound at the switch (`make_resident`, the service's way) and, for comparison,
    bound inside its first step (make_resident skipped: the way before the device trie's move); then the
    retrieval stage alone, a version's first query against its steady median (host work the first request
    would pay, measurable on the CPU too). MetaTool's tools in a new order make each new version. The request
    rows are a GPU measurement; on the CPU the forward pass drowns them."""
    from decoder_service.catalogs import CatalogManager, CatalogState
    from compiler_service.compiler import compile_catalog
    from shared.catalog import registry_from_entries
    from shared.dataset import catalog_path
    gpu = has_gpu()
    tok = ModelTokenizer(DEFAULT_MODEL_DIR)
    cfg, weights, what = model_for(args.shape, gpu)
    spec = KVPoolSpec.from_tokens(8192 + MAX_SEQS * 512, BLOCK)
    be = make_backend(cfg, weights, spec, gpu, max_table=MAX_SEQS * -(-cfg.max_position_embeddings // BLOCK))
    engine = DecodeEngine(be, tok, spec.num_blocks, spec.block_size, cfg.max_position_embeddings, EngineConfig())
    tools = json.loads(catalog_path("metatool").read_text())
    n = args.swaps + 1
    runtimes = {}
    for version in range(1, 3 * n + 1):
        rotated = tools[version % len(tools):] + tools[:version % len(tools)]
        trie = compile_catalog(registry_from_entries(rotated), tok)
        trie.meta.update(name="demo", version=version)
        runtimes[version] = engine.load_catalog(trie)
    engine.run_until_idle()
    manager = CatalogManager(None, engine)
    manager.load = lambda name, version, superseded=None: runtimes[version]
    bind = engine.make_resident

    intent = "what's the weather going to be like in Paris"

    def request() -> float:
        t = time.perf_counter()
        seq = engine.submit(manager.acquire("demo"), intent, 2)
        engine.run_until_idle()
        list(seq)
        return (time.perf_counter() - t) * 1e3

    def retrieval(rt) -> float:
        t = time.perf_counter()
        engine.retrieve(rt, intent, 2)
        return (time.perf_counter() - t) * 1e3
    print(f"{what} weights, {'CUDA' if gpu else 'CPU'} backend")
    for label, versions, hook in (("bound at the switch", range(1, n + 1), bind),
                                  ("bound in its first step", range(n + 1, 2 * n + 1), lambda rt, constant=True: None)):
        engine.make_resident = hook
        extra = []
        for version in versions:
            manager.catalog_states.setdefault("demo", CatalogState("demo")).wanted = version
            manager.make_default("demo", version)
            engine.run_until_idle()          # what the engine thread does at the switch
            first = request()
            extra.append(first - statistics.median(request() for _ in range(args.steady)))
        print(f"{label}: first request after a switch {statistics.median(extra[1:]):+.3f} ms over the steady "
              f"median ({len(extra) - 1} switches)")
    engine.make_resident = bind
    extra = [retrieval(runtimes[v]) - statistics.median(retrieval(runtimes[v]) for _ in range(args.steady))
             for v in range(2 * n + 1, 3 * n + 1)]
    print(f"retrieval alone: a version's first query {statistics.median(extra[1:]):+.3f} ms over its steady median "
          f"({len(extra) - 1} versions)")
