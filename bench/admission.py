"""Admission under a burst: how many of N requests sent at once are answered before their deadline, refused
early, or left to expire, at each TOOLTRIE_MAX_SEQS, with and without the deadline check (expected_seconds).

    python -m bench admission [--requests 64] [--deadline 10] [--max-seqs 64,16,8,4,2] [--backend auto]

The served model (the tuned SmolLM2) and encoder on this machine's backend, MetaTool's demo registry (its
examples included, the catalog `make run` publishes), MetaTool's validation intents, each asked for its gold
k in MODE_DECODE (what a tuned catalog runs). After each burst a lone request is timed. Writes
bench/results/admission_<device>.json; docs/performance.md (A1) records the defaults chosen from it.
"""
from __future__ import annotations

import json
import statistics
import threading
import time
from dataclasses import replace

from bench.common import device_label, ints
from compiler_service.compiler import compile_catalog
from decoder_service.engine.engine import Expired, QueueFull
from decoder_service.engine.sequence import DoneEvent, FailedEvent
from decoder_service.retrieval.host import Retriever, bm25_index
from decoder_service.retrieval.vectors import computed_vectors
from devstack.stack import DEMO_REGISTRY
from shared import dataset
from shared.catalog import parse_registry
from shared.config import REPO_ROOT, Settings
from shared.tokenizer import ModelTokenizer


def admission_arguments(p) -> None:
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--deadline", type=float, default=10.0, help="seconds each request of the burst may take")
    p.add_argument("--max-seqs", type=ints, default=[64, 16, 8, 4, 2])
    p.add_argument("--backend", default="auto")


def burst(engine, rt, queries, deadline: float) -> dict:
    """Send every query at once (each with the deadline), wait for all; the outcome counts and answer times."""
    outcomes, seconds, lock = [], [], threading.Lock()

    def one(q):
        started = time.monotonic()
        try:
            seq = engine.submit(rt, q.text, len(q.tools), timeout=deadline)
        except (QueueFull, Expired):
            result = "refused"
        else:
            result = "lost"
            for event in seq:
                if isinstance(event, FailedEvent):
                    result = {"busy": "refused", "deadline": "expired"}.get(event.kind, event.kind)
                elif isinstance(event, DoneEvent):
                    result = "answered" if time.monotonic() - started <= deadline else "late"
        with lock:
            outcomes.append(result)
            if result == "answered":
                seconds.append(time.monotonic() - started)
    threads = [threading.Thread(target=one, args=(q,)) for q in queries]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    counts = {k: outcomes.count(k) for k in ("answered", "refused", "expired", "late")}
    return {**counts, "other": len(outcomes) - sum(counts.values()),
            "answered_p50_s": statistics.median(seconds) if seconds else None}


def admission(args) -> None:
    from decoder_service.server import build_engine
    queries = dataset.queries("metatool", "validation")[:args.requests]
    trie = compile_catalog(parse_registry(DEMO_REGISTRY.read_text()), ModelTokenizer(Settings().model_dir))
    trie.meta.update(name="metatool", version=1)
    rows, retriever = [], None
    for max_seqs in args.max_seqs:
        for check in (False, True):
            settings = replace(Settings(), backend=args.backend, max_seqs=max_seqs, max_waiting=4 * args.requests,
                               reader_dir="")
            engine, encoder, _, info = build_engine(settings)
            engine.config = replace(engine.config, admission=check)
            if retriever is None:
                vectors, _ = computed_vectors(trie, encoder)
                retriever = Retriever(bm25_index(trie), len(trie.pointer_names), vectors, encoder)
            rt = engine.load_catalog(trie, retriever)
            engine.start()
            try:
                assert rt.ready.wait(600), "the catalog's prefix did not warm"
                row = {"max_seqs": max_seqs, "admission": check, **burst(engine, rt, queries, args.deadline)}
                started = time.monotonic()
                list(engine.submit(rt, queries[0].text, len(queries[0].tools), timeout=60))
                row["lone_after_s"] = time.monotonic() - started
            finally:
                engine.stop()
            rows.append(row)
            print(row, flush=True)
    device = device_label(info["backend"])
    out = REPO_ROOT / "bench" / "results" / f"admission_{device}.json"
    out.write_text(json.dumps({"device": info["device"], "requests": len(queries), "deadline_s": args.deadline,
                               "rows": rows}, indent=2) + "\n")
    print(f"\n{len(queries)} requests at once, deadline {args.deadline:g} s, {info['device']} ({out.name})")
    print("| max_seqs | deadline check | answered in time | refused early | expired | late | p50 answered (s) | "
          "a lone request after (s) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        p50 = f"{r['answered_p50_s']:.2f}" if r["answered_p50_s"] is not None else "-"
        print(f"| {r['max_seqs']} | {'on' if r['admission'] else 'off'} | {r['answered']} | {r['refused']} | "
              f"{r['expired']} | {r['late']} | {p50} | {r['lone_after_s']:.2f} |")

