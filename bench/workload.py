"""The benchmark's workloads and how tooltrie serves them: queries, catalogs, and the engine driver.

Both under the product's prompt (each request lists its retrieved shortlist, then the intent).
MetaTool: the 199-tool catalog and 469 dev queries: the first 279 with k=1 and all 190 with k=2, in file
order. Seal-Tools: 4,076 tools, a trie too big for constant memory (the global-memory path); the first 469
dev queries. `large_catalog(n)`: n tools made of the three data sets' tools (names suffixed past the
first copy), for the retrieval stage at 100,000 tools.
"""
from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from compiler_service.compiler import compile_catalog
from shared.dataset import data_dir
from decoder_service.engine.sequence import DoneEvent, FailedEvent, PointerEvent
from shared.catalog import parse_registry

ROOT = Path(__file__).resolve().parents[1]
N_QUERIES = 469


@dataclass(frozen=True)
class Query:
    intent: str
    k: int


def metatool_queries(lines: list[dict], n_single: int = 279) -> list[Query]:
    """The first n_single k=1 queries and every k=2 query, in file order."""
    out, singles = [], 0
    for q in lines:
        k = len(q["tools"])
        if k == 1 and singles < n_single:
            singles += 1
            out.append(Query(q["query"], 1))
        elif k == 2:
            out.append(Query(q["query"], 2))
    return out


def large_catalog(n: int) -> list[dict]:
    """n distinct tools from the three data sets' catalogs, repeated with suffixed names past the first copy."""
    base = [t for name in ("metatool", "toolbench", "bigcatalog")
            for t in json.loads((data_dir() / name / "catalog.json").read_text())]
    tools, seen, copy = [], set(), 0
    while len(tools) < n:
        for t in base:
            name = t["name"] if copy == 0 else f"{t['name']}_{copy}"
            if name.casefold() not in seen and len(tools) < n:
                seen.add(name.casefold())
                tools.append({"name": name, "description": t.get("description", "")})
        copy += 1
    return tools


def load_workload(name: str, tok, n: int = N_QUERIES):
    """(trie, queries) for "metatool" or "sealtools"."""
    d = data_dir()
    folder = {"metatool": "metatool", "sealtools": "bigcatalog"}[name]
    catalog = parse_registry((d / folder / "catalog.json").read_text())
    lines = [json.loads(line) for line in (d / folder / "dev_queries.jsonl").open()]
    trie = compile_catalog(catalog, tok)
    if name == "metatool":
        queries = metatool_queries(lines)[:n]
    else:
        queries = [Query(q["query"], len(q["tools"])) for q in lines[:n]]
    trie.meta.update(name=name, version=1)
    return trie, queries


class EngineDriver:
    """Runs a DecodeEngine on its own thread (as the service does) and times requests from outside."""

    def __init__(self, engine):
        self.engine = engine
        engine.start()

    def close(self):
        self.engine.stop()

    def warm(self, trie, retriever):
        """(the version, seconds to its prefix warm); with line KV, it returns once its tool lines are computed too
        (their seconds: rt.lines_seconds)."""
        started = time.perf_counter()
        rt = self.engine.load_catalog(trie, retriever)
        rt.ready.wait()
        warm = time.perf_counter() - started
        if self.engine.lines and self.engine.config.warm_rows:
            rt.lines_ready.wait()
        return rt, warm

    def collect(self, seq, t0):
        ttfp, names, logprobs = None, [], []
        for ev in seq:
            if isinstance(ev, PointerEvent):
                if ttfp is None:
                    ttfp = time.perf_counter() - t0
                names.append(ev.name)
                logprobs.append(ev.logprob)
            elif isinstance(ev, FailedEvent):
                raise RuntimeError(f"request failed: {ev.message}")
            elif isinstance(ev, DoneEvent):
                return {"wall_s": time.perf_counter() - t0, "ttfp_s": ttfp, "names": names,
                        "logprobs": logprobs, "tokens": ev.generated_tokens, "prompt_tokens": ev.prompt_tokens,
                        "queue_ms": ev.queue_ms,
                        "prefill_ms": ev.prefill_ms, "decode_ms": ev.decode_ms}

    def one_by_one(self, rt, queries):
        """Concurrency 1: each query submitted after the previous one finished, with the time its retrieval and
        its submission (the prompt's tokens) took before the engine saw it."""
        out = []
        for q in queries:
            t0 = time.perf_counter()
            shortlist = self.engine.retrieve(rt, q.intent, q.k)
            t1 = time.perf_counter()
            seq = self.engine.submit(rt, q.intent, q.k, shortlist=shortlist)
            t2 = time.perf_counter()
            out.append({**self.collect(seq, t0), "retrieval_ms": (t1 - t0) * 1e3, "submit_ms": (t2 - t1) * 1e3})
        return out

    def all_at_once(self, rt, queries, clients: int = 1):
        """Every query submitted at once: one thread retrieves and submits them in turn, or `clients` threads share
        them (as the server's threads do concurrent calls, each retrieving its own); (results, seconds until the
        last one finished, seconds until the last one was submitted)."""
        t0 = time.perf_counter()
        if clients == 1:
            seqs = [self.engine.submit(rt, q.intent, q.k) for q in queries]
        else:
            with ThreadPoolExecutor(clients) as pool:
                seqs = list(pool.map(lambda q: self.engine.submit(rt, q.intent, q.k), queries))
        submitted = time.perf_counter() - t0
        results = [None] * len(seqs)

        def collect(i):
            results[i] = self.collect(seqs[i], t0)
        threads = [threading.Thread(target=collect, args=(i,)) for i in range(len(seqs))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return results, time.perf_counter() - t0, submitted
