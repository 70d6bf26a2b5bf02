"""The headline run (`make bench`, `python -m bench` with no command): tooltrie against the best PyTorch
peer, in one run, on whatever device is here.

    python -m bench                        (this machine: the CPU backend where there is no GPU)
    python3 -m bench --queries 40 --det-seconds 20      (a quick look)
    python3 -m bench --shapes smollm2-135m --no-peer --rows 1 --det-seconds 0 --count-graphs

For each model shape (SmolLM2-135M: the real weights where they exist, random otherwise; Qwen3-1.7B:
random weights) it measures, in this order:
  floor         bytes of weights per decode step / device-to-device copy bandwidth measured now
  step          one decode step at batch 1/16/64/256, constrained (k_mask, sparse head, k_select)
                and unconstrained (dense head), each a captured graph (GPU only)
  retrieval     the first stage alone (encode the intent, BM25, fused top N) over MetaTool's queries on a
                catalog of --retrieval-tools tools (100,000), and the time to compute its tool vectors; apart,
                encoding the intent, its parts, and (GPU) the device scorer with its inputs ready, and each
                of its steps on the device (the encoder pass, the scorer's kernels)
  workloads     MetaTool (199 tools, 469 queries) and Seal-Tools (4,076 tools, global-memory trie):
                tool vectors and prefix warm-up; per-query wall clock (retrieval, shortlist prompt, decode)
                and time to first pointer at concurrency 1; every query submitted at once, twice (queries per
                second: the second burst; the first, which captures the graphs of its step shapes, beside it),
                by one thread or by --clients threads that each retrieve their own
  peer          the same prompts (each query's shortlist listed) through bench/peer.py (gpt-fast recipe +
                XGrammar over the whole catalog), at concurrency 1 and in batches of --peer-rows; how often it
                repeats a name
  determinism   (first shape, MetaTool) random shuffled batches of the 469 queries, each answer
                compared bit for bit with the same query run alone
Writes bench/results/bench_<device>.json, .md and .png; the markdown table is printed last. With
--count-graphs (GPU) it also prints how many decode graphs CudaBackend.forward captured for how many
distinct keys (`graph_key`): captures above the keys are graphs evicted and captured again (P72).
"""
from __future__ import annotations

import gc
import json
import platform
import random
import statistics
import time
from pathlib import Path

import numpy as np

from bench import report
from bench.common import (BLOCK, MAX_SEQS, RESULTS, copy_bandwidth, device_label, has_gpu, host_copy_bandwidth,
                          log, make_backend, model_for)
from bench.workload import EngineDriver, large_catalog, load_workload
from decoder_service.encoder import load_encoder
from decoder_service.engine.engine import DecodeEngine, EngineConfig
from decoder_service.model.backend import device_name
from decoder_service.model.kv_pool import KVPoolSpec, bytes_per_token
from decoder_service.retrieval.config import SHORTLIST
from decoder_service.retrieval.host import Retriever, bm25_index, intent_parts
from decoder_service.retrieval.vectors import computed_vectors
from shared.config import DEFAULT_MODEL_DIR, Settings
from shared.tokenizer import ModelTokenizer


STEP_QUERIES = 30   # the queries whose device retrieval the retrieval table times step by step


def percentiles(xs) -> dict:
    a = np.asarray(xs, np.float64) * 1e3
    return {"p50_ms": round(float(np.percentile(a, 50)), 3), "p90_ms": round(float(np.percentile(a, 90)), 3),
            "p99_ms": round(float(np.percentile(a, 99)), 3), "mean_ms": round(float(a.mean()), 3)}


def step_table(be, trie, rows_list) -> list[dict]:
    from bench.sampler import cuda_sides
    out = []
    for rows in rows_list:
        u, c, un, cn = cuda_sides(be, trie, rows)
        out.append({"rows": rows, "unconstrained_us": round(u * 1e3, 1), "constrained_us": round(c * 1e3, 1),
                    "graph_nodes": [un, cn]})
        log(f"  step batch {rows}: unconstrained {u * 1e3:.0f} µs, constrained {c * 1e3:.0f} µs")
    return out


def answer_key(r: dict) -> tuple:
    return tuple(r["names"]), tuple(np.float64(x).tobytes() for x in r["logprobs"])


def determinism(driver, rt, queries, solo, seconds: float, seed: int = 11) -> dict:
    """Random, shuffled, staggered batches; every answer compared with the query run alone."""
    rng = random.Random(seed)
    alone = {i: answer_key(r) for i, r in enumerate(solo)}
    batches = checked = mismatches = 0
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        picked = rng.sample(range(len(queries)), rng.randint(2, min(16, len(queries))))
        seqs = []
        for i in picked:
            seqs.append((i, driver.engine.submit(rt, queries[i].intent, queries[i].k)))
            if rng.random() < 0.3:
                time.sleep(0.002 * rng.random())  # some join while others are already decoding
        for i, seq in seqs:
            mismatches += answer_key(driver.collect(seq, 0.0)) != alone[i]
            checked += 1
        batches += 1
    return {"batches": batches, "requests": checked, "mismatches": mismatches, "seconds": seconds}


def retriever_for(trie, encoder) -> tuple[Retriever, float]:
    """The version's retriever with its tool vectors computed now, and the seconds that took."""
    started = time.perf_counter()
    vectors, _ = computed_vectors(trie, encoder)
    return Retriever(bm25_index(trie), len(trie.pointer_names), vectors, encoder), time.perf_counter() - started


def retrieval_table(tok, encoder, queries, n_tools: int, size: int) -> dict:
    """The first stage alone on a catalog of n_tools tools: its tool vectors' time, then each query's
    shortlist of `size` (encode, BM25, fused top size) at concurrency 1."""
    from compiler_service.compiler import compile_catalog
    from shared.catalog import registry_from_entries
    started = time.perf_counter()
    trie = compile_catalog(registry_from_entries(large_catalog(n_tools)), tok)
    compile_s = time.perf_counter() - started
    retriever, vectors_s = retriever_for(trie, encoder)
    for q in queries[:5]:
        retriever.shortlist(q.intent, size)
    times = [retriever.shortlist(q.intent, size).seconds for q in queries]
    out = {"tools": n_tools, "size": size, "compile_s": round(compile_s, 2), "tool_vectors_s": round(vectors_s, 2),
           "shortlist": percentiles(times),
           "encode_intent": percentiles([seconds(lambda q=q: encoder.encode([q.intent])) for q in queries]),
           "encode_parts": percentiles([seconds(lambda q=q: encoder.encode(intent_parts(q.intent))) for q in queries]),
           "token_ids": percentiles([seconds(lambda q=q: encoder.token_ids(intent_parts(q.intent))) for q in queries])}
    if retriever.device is not None:      # the device scorer alone, its inputs computed beforehand (the dense
        args = []                         # term unstandardised: the same launches, the same time)
        for q in queries:
            ids, values, c, shift = retriever.lexical(q.intent)
            args.append((encoder.encode(intent_parts(q.intent)), 1.0, -shift, (ids, values), c, size,
                         retriever.vote_weight))
        out["device_score"] = percentiles([seconds(lambda a=a: retriever.device.shortlist(*a)) for a in args])
        out["device_steps_us"] = device_steps(retriever, queries[:STEP_QUERIES], size)
    log(f"  retrieval over {n_tools} tools: vectors {vectors_s:.1f} s, "
        f"shortlist p50 {out['shortlist']['p50_ms']:.3f} ms (encoding the intent {out['encode_intent']['p50_ms']:.3f} "
        f"ms, its parts {out['encode_parts']['p50_ms']:.3f} ms)")
    return out


def device_steps(retriever, queries, size: int, repeat: int = 20, samples: int = 5) -> dict[str, float]:
    """µs of each of a device retrieval's steps in stream order (the intent's encoder pass, k_moments, then the
    scorer's launches), each repeated in one captured graph on the inputs that the query's own shortlist left on the
    device (so it runs as it does there, less the gaps between steps), the median over the queries."""
    from bench.encoder import graph_seconds
    scorer, backend = retriever.device, retriever.encoder.backend
    steps: dict[str, list[float]] = {}
    for q in queries:
        retriever.shortlist(q.intent, size)
        M, B = backend.rows.value, scorer.parts
        named = [("encoder pass", lambda M=M, B=B: [f() for _, f in backend.launches(M, B)]),
                 ("k_moments", lambda: scorer.moments.launch(scorer.moment_blocks))]
        named += scorer.launches()
        for name, f in named:
            steps.setdefault(name, []).append(graph_seconds(backend.stream, f, repeat, samples))
    return {name: round(float(np.median(t)) * 1e6, 1) for name, t in steps.items()}


def seconds(fn) -> float:
    """The wall time of one call of fn."""
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def engine_settings(pairs: list[str]) -> dict:
    """EngineConfig settings from --engine's NAME=V pairs, each V read as its setting's type (a bool as 0 or 1)."""
    defaults = EngineConfig()
    out = {}
    for pair in pairs:
        name, _, value = pair.partition("=")
        kind = type(getattr(defaults, name, None))      # NoneType for no setting, or one without a plain default
        if kind not in (bool, int, float, str):
            raise SystemExit(f"--engine {pair}: EngineConfig has no setting {name!r} of a plain type")
        try:
            out[name] = {"0": False, "1": True}[value] if kind is bool else kind(value)
        except (KeyError, ValueError):
            raise SystemExit(f"--engine {pair}: {value!r} is not a {kind.__name__}"
                             f"{' (0 or 1)' if kind is bool else ''}") from None
    return out


def run_tooltrie(be, cfg, spec, tok, trie, encoder, queries, det_seconds: float, settings: dict,
                 clients: int = 1) -> dict:
    """tooltrie's side of a workload, its engine run with `settings` (EngineConfig fields) over the bench's own, its
    all-at-once bursts submitted by `clients` threads."""
    engine = DecodeEngine(be, tok, spec.num_blocks, spec.block_size, cfg.max_position_embeddings,
                          EngineConfig(**{"max_seqs": MAX_SEQS, "max_waiting": 4 * len(queries),
                                          "fusion_weight": Settings().fusion_weight, **settings}))
    driver = EngineDriver(engine)
    try:
        retriever, vectors_s = retriever_for(trie, encoder)
        rt, warm = driver.warm(trie, retriever)
        log(f"  tooltrie: {len(trie.pointer_names)} tool vectors in {vectors_s:.2f} s")
        log(f"  tooltrie: prefix {len(rt.prefix_ids)} tokens warm in {warm:.2f} s; sampler "
            f"{type(engine.sampler).__name__}" + (f"; tool lines in {rt.lines_seconds:.2f} s" if engine.lines else ""))
        solo = driver.one_by_one(rt, queries)
        log(f"  tooltrie concurrency 1: p50 {statistics.median(r['wall_s'] for r in solo) * 1e3:.1f} ms")
        # the first burst captures the graphs of the step shapes a burst makes (as the peer's first runs compile);
        # the second is the rate a running server keeps
        first, first_s, _ = driver.all_at_once(rt, queries, clients)
        together, elapsed, submitted = driver.all_at_once(rt, queries, clients)
        log(f"  tooltrie all at once: {len(queries) / elapsed:.1f} queries/s (the first burst "
            f"{len(queries) / first_s:.1f})")
        out = {
            "prefix_tokens": len(rt.prefix_ids), "warmup_s": round(warm, 3), "tool_vectors_s": round(vectors_s, 3),
            **(lines_memory(engine, rt, cfg, be) if engine.lines else {"line_kv": False}),
            "sampler": type(engine.sampler).__name__,
            "launches_per_step": be.launches_per_step() + 3 if hasattr(be, "launches_per_step") else None,
            "concurrency_1": {**percentiles([r["wall_s"] for r in solo]),
                              "ttfp": percentiles([r["ttfp_s"] for r in solo]),
                              "tokens_per_answer": round(float(np.mean([r["tokens"] for r in solo])), 2),
                              "prompt_tokens": round(float(np.mean([r["prompt_tokens"] for r in solo])), 1),
                              **{f"{name}_{part}": round(float(stat([r[part] for r in solo])), 3)
                                 for name, stat in (("mean", np.mean), ("max", np.max))
                                 for part in ("retrieval_ms", "submit_ms", "queue_ms", "prefill_ms", "decode_ms")}},
            "all_at_once": {"seconds": round(elapsed, 3), "qps": round(len(queries) / elapsed, 2),
                            "first_burst_qps": round(len(queries) / first_s, 2), "submitted_s": round(submitted, 3),
                            **percentiles([r["wall_s"] for r in together]),
                            "same_as_alone": sum(answer_key(a) == answer_key(b) == answer_key(c)
                                                 for a, b, c in zip(solo, first, together))},
            "exactly_k": sum(len(set(r["names"])) == len(r["names"]) == q.k for r, q in zip(solo, queries)),
        }
        if det_seconds > 0:
            out["determinism"] = determinism(driver, rt, queries, solo, det_seconds)
            log(f"  determinism: {out['determinism']}")
        engine.release_catalog(rt)
        prompt = (rt.prefix_ids, [(rt.request_ids(engine.retrieve(rt, q.intent, q.k).ids, q.intent, q.k), q.k)
                                  for q in queries])
        return out, [r["names"] for r in solo], prompt
    finally:
        driver.close()


def lines_memory(engine, rt, cfg, be) -> dict:
    """Line KV after a version's warm-up: its seconds, the lines kept and the pool memory they hold per 1,000 tools."""
    kept = engine.lines.kept.values()
    blocks = sum(len(line.blocks) for line in kept)
    dtype = getattr(be, "np_dtype", np.float32)    # the pool's storage: the CUDA backend's, float32 on the CPU
    block_bytes = engine.block_size * bytes_per_token(cfg, dtype)
    return {"line_kv": True, "lines_s": round(rt.lines_seconds, 3), "lines_kept": len(kept), "line_blocks": blocks,
            "lines_mib_per_1000_tools": round(blocks * block_bytes / max(1, len(kept)) * 1000 / 2**20, 1)}


def run_peer(cfg, weights, tok, runs: dict, peer_rows: int, saved=lambda out: None) -> dict:
    """The peer on the same prompt tokens as tooltrie's runs: {workload: (trie, prompt, tooltrie's names)}
    with prompt = (prefix_ids, [(request_ids, k)]). One compiled peer per row count serves every workload;
    `saved(results so far)` after each (a run cut short keeps the concurrency-1 figures)."""
    import torch

    from bench.peer import Peer, round_len
    from decoder_service.engine.catalog_runtime import CatalogRuntime
    max_len = 0
    for trie, (prefix_ids, suffixes), _ in runs.values():
        per_pointer = CatalogRuntime.from_trie(trie, None, tok, BLOCK).max_output_tokens_per_pointer + 8
        max_len = max(max_len, round_len(len(prefix_ids) + max(len(s) + k * per_pointer for s, k in suffixes)))
    out = {name: {"max_len": max_len} for name in runs}
    for rows in (1, peer_rows):
        started = time.perf_counter()
        peer = Peer(cfg, weights, rows, max_len)
        for name, (trie, (prefix_ids, suffixes), ours) in runs.items():
            template = CatalogRuntime.from_trie(trie, None, tok, BLOCK).template
            stop_id = tok.single_token(template.stop_token, "stop token")
            warm = peer.load_catalog(tok.tokenizer, trie.pointer_names, template.separator, stop_id, prefix_ids)
            t_warm = time.perf_counter()
            peer.run(suffixes[:rows])  # the first workload compiles: graphs for this row count, prefill
            peer.run(suffixes[rows:2 * rows] or suffixes[:rows])
            warm_runs = time.perf_counter() - t_warm
            results, walls, ttfps = [], [], []
            t_all = time.perf_counter()
            for b in range(0, len(suffixes), rows):
                t0 = time.perf_counter()
                first = {}
                chunk = suffixes[b:b + rows]
                answers = peer.run(chunk, on_pointer=lambda i, first=first, t0=t0:
                                   first.setdefault(i, time.perf_counter() - t0))
                wall = time.perf_counter() - t0
                results += answers
                walls += [wall] * len(chunk)
                ttfps += [first.get(i, wall) for i in range(len(chunk))]
            elapsed = time.perf_counter() - t_all
            step_us = peer_step_us(peer, rows)
            entry = {"warmup_s": round(warm, 3), "first_runs_s": round(warm_runs, 1),
                     "decode_step_us": round(step_us, 1), **percentiles(walls), "ttfp": percentiles(ttfps),
                     "qps": round(len(suffixes) / elapsed, 2), "seconds": round(elapsed, 3),
                     "tokens_per_answer": round(float(np.mean([a["tokens"] for a in results])), 2),
                     "repeats": sum(a["repeat"] for a in results),
                     "same_names_as_tooltrie": sum(a["names"] == o for a, o in zip(results, ours))}
            out[name]["concurrency_1" if rows == 1 else f"batch_{rows}"] = entry
            log(f"  peer {name}, rows {rows}: p50 {entry['p50_ms']:.1f} ms, {entry['qps']:.1f} queries/s, decode "
                f"step {step_us:.0f} µs, repeats {entry['repeats']}, first runs (compile) {warm_runs:.0f} s")
        log(f"  peer rows {rows}: {time.perf_counter() - started:.0f} s in all")
        saved(out)
        del peer
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return out


def peer_step_us(peer, rows: int, reps: int = 50) -> float:
    """The peer's compiled decode step alone (no mask, no host sync in between), median µs."""
    import torch
    dev = peer.device
    tokens = torch.zeros((rows, 1), dtype=torch.long, device=dev)
    pos = torch.full((rows, 1), peer.prefix_len, dtype=torch.long, device=dev)
    r = torch.arange(rows, device=dev)
    with torch.inference_mode():
        for _ in range(3):
            peer.decode(tokens, pos, r)
        peer._sync()
        t = time.perf_counter()
        for _ in range(reps):
            peer.decode(tokens, pos, r)
        peer._sync()
    return (time.perf_counter() - t) / reps * 1e6


def kept_workloads(earlier: dict | None, measured: dict) -> dict:
    """The workloads of an earlier run's shape entry (--merge) that this run does not measure, each with the
    run (started, args) it came from."""
    if not earlier:
        return {}
    run = {"started": earlier.get("started"), "args": earlier.get("args")}
    return {name: {**w, "run": w.get("run", run)} for name, w in earlier["workloads"].items() if name not in measured}


def count_graphs():
    """Counts CudaBackend.forward's graph captures and distinct keys from now on (P72: gated and
    ungated steps of one shape are two graphs); returns the report line's maker."""
    from decoder_service.model.cuda.backend import CudaBackend
    keys, captures, held, inside = set(), [0], [0], [False]
    forward, capture = CudaBackend.forward, CudaBackend.capture

    def counted_capture(self, fn, gate=None):
        captures[0] += inside[0]      # forward's captures only (the step table captures its own)
        return capture(self, fn, gate)

    def counted_forward(self, batch, device_tokens=None, skip_if_done=None):
        inside[0] = True
        try:
            forward(self, batch, device_tokens, skip_if_done)
        finally:
            inside[0] = False
        if batch.decode_rows == batch.num_rows <= self.graph_rows:
            keys.add(self.graph_key(batch.num_rows, len(batch.logit_rows), skip_if_done))
        held[0] = max(held[0], self.num_graphs)

    CudaBackend.forward, CudaBackend.capture = counted_forward, counted_capture
    return lambda: f"decode graphs: {captures[0]} captured for {len(keys)} distinct keys, at most {held[0]} held"


def serve_arguments(p) -> None:
    p.add_argument("--shapes", default="smollm2-135m,qwen3-1.7b")
    p.add_argument("--workloads", default="metatool,sealtools")
    p.add_argument("--queries", type=int, default=469)
    p.add_argument("--rows", default="1,16,64,256", help="batch sizes of the decode-step table")
    p.add_argument("--det-seconds", type=float, default=150)
    p.add_argument("--peer-rows", type=int, default=32)
    p.add_argument("--retrieval-tools", type=int, default=100_000, help="catalog size of the retrieval table (0: none)")
    p.add_argument("--no-peer", action="store_true")
    p.add_argument("--shortlist", type=int, default=SHORTLIST, help="tools in each prompt (the service's default; "
                   "another size to time it against)")
    p.add_argument("--clients", type=int, default=1, help="threads that submit the all-at-once bursts (1: one thread "
                   "in turn; more: concurrent calls, each retrieving its own, as the server's threads take them)")
    p.add_argument("--out", default=str(RESULTS))
    p.add_argument("--merge", action="store_true",
                   help="keep the other shapes and workloads of an earlier run's JSON (a shape or a workload "
                        "per command where a command's time is limited)")
    p.add_argument("--option", action="append", default=[], metavar="NAME=V",
                   help="build the GPU backend with CudaBackend option NAME=V (e.g. attn_tile_from=0); repeatable")
    p.add_argument("--engine", action="append", default=[], metavar="NAME=V",
                   help="run the engine with EngineConfig setting NAME=V (e.g. forced_runs=0); repeatable")
    p.add_argument("--count-graphs", action="store_true",
                   help="count the decode graphs forward() captured against their distinct keys (GPU)")


def serve(args) -> None:
    counted = count_graphs() if args.count_graphs else None
    try:
        _serve(args)
    finally:
        if counted:
            log(counted())


def _serve(args) -> None:
    if args.clients < 1:
        raise SystemExit(f"--clients {args.clients}: at least one thread submits")
    run_args = {k: v for k, v in vars(args).items() if k not in ("command", "count_graphs")}  # as recorded
    gpu = has_gpu()
    kind = "cuda" if gpu else "cpu"
    device = device_label(kind)
    tok = ModelTokenizer(DEFAULT_MODEL_DIR)
    res = {"device": device_name(kind), "python": platform.python_version(), "args": run_args,
           "started": time.strftime("%Y-%m-%d %H:%M:%S"), "shapes": {}}
    earlier = Path(args.out) / f"bench_{device}.json"
    if args.merge and earlier.exists():
        res["shapes"] = json.loads(earlier.read_text())["shapes"]
    if not gpu:
        log("no GPU here: this run measures the CPU backend (and the peer on the CPU, eager)")
    bw = copy_bandwidth()[0] if gpu else host_copy_bandwidth()
    res["copy_bandwidth_gbs"] = round(bw, 1)
    log(f"device {res['device']}; copy bandwidth {bw:.0f} GB/s")
    peer_ok = not args.no_peer and report.peer_available()
    if not args.no_peer and not peer_ok:
        log("the peer needs torch and xgrammar (pip install '.[bench]'): skipped")
    rows_list = [int(r) for r in args.rows.split(",")]
    options = {name: int(v) for name, v in (o.split("=", 1) for o in args.option)}
    settings = {"shortlist": args.shortlist, **engine_settings(args.engine)}
    workloads = {name: load_workload(name, tok, args.queries) for name in args.workloads.split(",")}
    encoder = load_encoder(Settings().encoder_dir, "cuda" if gpu else "cpu")
    if args.retrieval_tools:
        res["retrieval"] = retrieval_table(tok, encoder, next(iter(workloads.values()))[1], args.retrieval_tools,
                                           args.shortlist)
    for si, shape in enumerate(args.shapes.split(",")):
        cfg, weights, what = model_for(shape, gpu)
        entry = {"args": run_args, "started": res["started"], "weights": what, "weight_bytes": weights.nbytes(),
                 "floor_us": round(weights.nbytes() / (bw * 1e9) * 1e6, 1),
                 "workloads": kept_workloads(res["shapes"].get(shape), workloads)}
        log(f"{shape} ({what} weights, {weights.nbytes() / 1e6:.0f} MB): floor {entry['floor_us']:.0f} µs")
        ctx_blocks = -(-cfg.max_position_embeddings // BLOCK)
        step_tokens = max(rows_list) * 1024 if gpu else 0
        spec = KVPoolSpec.from_tokens(max(step_tokens, 8192 + MAX_SEQS * 512), BLOCK)
        be = make_backend(cfg, weights, spec, gpu, max_table=max(MAX_SEQS * ctx_blocks, max(rows_list) * 64),
                          **options)
        if gpu and "metatool" in workloads:          # the decode-step table is measured at the MetaTool root
            entry["step"] = step_table(be, workloads["metatool"][0], rows_list)
        elif args.merge and "step" in res["shapes"].get(shape, {}):
            entry["step"] = res["shapes"][shape]["step"]
        runs = {}
        for wi, (name, (trie, queries)) in enumerate(workloads.items()):
            log(f" {shape} / {name}: {len(trie.pointer_names)} tools, {len(queries)} queries")
            det = args.det_seconds if si == 0 and wi == 0 else 0
            ours, names, prompt = run_tooltrie(be, cfg, spec, tok, trie, encoder, queries, det, settings, args.clients)
            entry["workloads"][name] = {"tools": len(trie.pointer_names), "queries": len(queries),
                                        "trie_bytes": trie.nbytes, "tooltrie": ours,
                                        "run": {"started": res["started"], "args": run_args}}
            runs[name] = (trie, prompt, names)
            res["shapes"][shape] = entry
            report.write(res, Path(args.out), device)  # partial results survive a run cut short
        if peer_ok:
            def saved(peers, entry=entry):
                for name, peer in peers.items():
                    entry["workloads"][name]["peer"] = peer
                report.write(res, Path(args.out), device)
            run_peer(cfg, weights, tok, runs, args.peer_rows, saved)
        if gpu:
            from numba import cuda
            free, total = cuda.current_context().get_memory_info()
            entry["device_memory_used_gib"] = round((total - free) / 2**30, 2)
        del be
        gc.collect()
        res["shapes"][shape] = entry
        report.write(res, Path(args.out), device)  # after each shape: a partial run still leaves results
    log(report.write(res, Path(args.out), device))

