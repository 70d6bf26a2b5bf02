"""Check the encoder against the float64 reference, then time it: one query, a request's parts, 64 queries, requests
from several threads, a tool catalog, and requests beside a tool catalog.

    python -m bench encoder --backend cuda --model models/all-MiniLM-L6-v2 \
        --texts ../shared/data/bigcatalog/catalog.json --queries ../shared/data/bigcatalog/dev_queries.jsonl

The check runs first (fresh random token sequences of 2..max_seq_length tokens, against the reference
on the weights as the backend stores them; each vector alone against its batch, bit for bit); the
timings are host wall clock around encode(), tokenization included, medians after a warm-up; a request's parts
(the intent and its clauses, as retrieval encodes them: retrieval.host.intent_parts) are timed without tokenization,
per query of the first 150, split by one part or several (P94). The first 100 requests' parts are then encoded
from --clients threads, through encode() (requests that arrive together share a call: Batcher, P106) and each in
a call of its own, with the encoder calls counted; and, while the catalog's texts are encoded on one thread,
requests' parts on another, each waiting at most for the chunk under way (Turns, P104). On a GPU, last, one query's
pass and a request's of three parts or more launch by launch (each launch 20 times in one captured graph). A short
table is printed last.
"""
from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from decoder_service.encoder import load_encoder
from decoder_service.encoder.reference import ReferenceEncoder
from decoder_service.encoder.weights import load_weights


def read_texts(path: Path) -> list[str]:
    """Catalog tools as "name: description" lines, or the "query" of each JSON line."""
    if path.suffix == ".jsonl":
        return [json.loads(line)["query"] for line in path.read_text().splitlines() if line.strip()]
    return [f"{t['name']}: {t['description']}" if t.get("description") else t["name"]
            for t in json.loads(path.read_text())]


def median_s(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return float(np.median(times))


def parts_rows(enc, queries: list[str], repeat: int = 2) -> list[tuple[str, float, str]]:
    """Median seconds to tokenize a request's parts, over all the queries; to embed them, over the queries with one
    part and with several."""
    from decoder_service.retrieval.host import intent_parts
    parts = [intent_parts(q) for q in queries]
    requests = [enc.token_ids(p) for p in parts]
    for r in requests:
        enc.backend.embed(r)
    tokenizing = [median_s(lambda p=p: enc.token_ids(p), repeat) for p in parts]
    times = {True: [], False: []}
    for _ in range(repeat):
        for r in requests:
            t = time.perf_counter()
            enc.backend.embed(r)
            times[len(r) == 1].append(time.perf_counter() - t)
    return [(f"a request, tokenizing ({len(parts)})", float(np.median(tokenizing)), "its parts' token ids")] + [
        (f"a request, {what} ({len(times[one]) // repeat})", float(np.median(times[one])), "parts, no tokenizing")
        for one, what in ((True, "one part"), (False, "several parts")) if times[one]]


def graph_seconds(stream, enqueue, repeat: int, samples: int) -> float:
    """Seconds of one enqueue() as a captured graph of `repeat` of them runs it (the median of `samples` replays)."""
    from decoder_service.gpu.launcher import Graph
    g = Graph(stream, lambda: [enqueue() for _ in range(repeat)])
    return median_s(lambda: (g.replay(), stream.synchronize()), samples) / repeat


def launch_rows(backend, requests: list[list[np.ndarray]], repeat: int = 20,
                samples: int = 10) -> list[tuple[str, float, str]]:
    """The CUDA forward pass of each request (its token id arrays), launch by launch: each launch `repeat` times in
    one captured graph (seconds a launch, as the served graph runs it, the median of `samples` replays), a kernel and
    shape's launches summed over the layers, beside the whole pass in one graph."""
    rows = []
    for ids in requests:
        backend.embed(ids)                        # stages the request: its rows and inputs stay on the device
        M, B = backend.rows.value, len(ids)
        launches = backend.launches(M, B)
        each: dict[str, list[float]] = {}
        for name, f in launches:
            each.setdefault(name, []).append(graph_seconds(backend.stream, f, repeat, samples))
        whole = graph_seconds(backend.stream, lambda launches=launches: [f() for _, f in launches], 1, samples)
        rows.append((f"{M} rows, {B} texts: the pass in one graph", whole,
                     f"{len(launches)} launches, their sum {sum(map(sum, each.values())) * 1e6:,.1f} µs"))
        rows += [(f"  {name}", float(np.median(t)), f"{len(t)} a pass, {sum(t) * 1e6:,.1f} µs in all")
                 for name, t in each.items()]
    return rows


def timings(rows: list[tuple[str, float, str]]) -> dict[str, float]:
    """The rows' seconds by name, a launch row's ("  qkv") under its pass's ("16 rows, 1 texts: ... / qkv")."""
    out, head = {}, ""
    for name, s, _ in rows:
        if name.startswith("  "):
            name = f"{head} / {name.strip()}"
        else:
            head = name
        out[name] = s
    return out


def counted_calls(enc) -> list[int]:
    """The texts of each backend.embed call from now on (undone by `del enc.backend.embed`)."""
    embed, calls = enc.backend.embed, []

    def counted(seqs):
        calls.append(len(seqs))
        return embed(seqs)
    enc.backend.embed = counted
    return calls


def concurrent_rows(enc, queries: list[str], clients: int) -> list[tuple[str, float, str]]:
    """Seconds a request for the queries' parts encoded from `clients` threads: through encode() (shared calls)
    and each request in a call of its own."""
    from decoder_service.retrieval.host import intent_parts
    parts = [intent_parts(q) for q in queries]
    rows = []
    for what, fn in (("shared calls", enc.encode), ("a call each", lambda p: enc.backend.embed(enc.token_ids(p)))):
        calls = counted_calls(enc)
        t = time.perf_counter()
        with ThreadPoolExecutor(clients) as pool:
            list(pool.map(fn, parts))
        dt = time.perf_counter() - t
        del enc.backend.embed
        rows.append((f"{len(parts)} requests, {clients} threads, {what}", dt / len(parts),
                     f"{len(calls)} encoder calls, {len(parts) / dt:,.1f} requests/s"))
    return rows


def beside_rows(enc, queries: list[str], texts: list[str]) -> list[tuple[str, float, str]]:
    """Median seconds of a request's encode() while `texts` (a version's tool vectors) are encoded on another
    thread, with the slowest and the texts' own time."""
    from decoder_service.retrieval.host import intent_parts
    parts, spent, times = [intent_parts(q) for q in queries], [], []
    bulk = threading.Thread(target=lambda: spent.append(median_s(lambda: enc.encode(texts), 1)))
    bulk.start()
    while bulk.is_alive():
        for p in parts:
            t = time.perf_counter()
            enc.encode(p)
            times.append(time.perf_counter() - t)
            if not bulk.is_alive():
                break
    bulk.join()
    return [(f"a request beside {len(texts)} tool texts", float(np.median(times)),
             f"{len(times)} requests, the slowest {max(times) * 1e3:.1f} ms; the texts {spent[0]:.2f} s")]


def check(enc, model_dir: Path, n: int, seed: int) -> dict:
    weights = load_weights(model_dir, enc.cfg)
    if enc.backend_name == "cuda":
        from .cuda import stored_weights
        weights = stored_weights(weights)
    rng = np.random.default_rng(seed)
    lens = rng.integers(2, enc.cfg.max_seq_length + 1, n)
    lens[:2] = (2, enc.cfg.max_seq_length)
    seqs = [np.concatenate([[101], rng.integers(1000, enc.cfg.vocab_size, k - 2), [102]]).astype(np.int32)
            for k in lens]
    out = enc.backend.embed(seqs)
    ref = ReferenceEncoder(enc.cfg, weights)
    want = np.stack([ref.embed([s])[0] for s in seqs])
    rel = np.linalg.norm(out - want, axis=1) / np.linalg.norm(want, axis=1)
    alone = np.stack([enc.backend.embed([s])[0] for s in seqs[:8]])
    return {"texts": n, "rel_max": float(rel.max()), "finite": bool(np.isfinite(out).all()),
            "alone_equals_batch": bool(np.array_equal(alone, out[:8]))}


def encoder_arguments(p) -> None:
    p.add_argument("--model", type=Path, default=Path("models/all-MiniLM-L6-v2"))
    p.add_argument("--backend", default="auto")
    p.add_argument("--texts", type=Path, required=True, help="catalog.json (tools) to encode at once")
    p.add_argument("--queries", type=Path, required=True, help="dev_queries.jsonl: one query, then 64")
    p.add_argument("--check", type=int, default=32, help="random texts checked against the reference")
    p.add_argument("--repeat", type=int, default=50)
    p.add_argument("--clients", type=int, default=8, help="threads that send the first 100 requests at once")


def encoder(args) -> None:
    t = time.perf_counter()
    enc = load_encoder(args.model, args.backend)
    enc.encode(["warm up"])
    rows = [("load + first encode", time.perf_counter() - t, "")]
    result = {"backend": enc.backend_name, "digest": enc.digest, "check": check(enc, args.model, args.check, 0)}
    print(json.dumps(result["check"]), flush=True)
    texts, queries = read_texts(args.texts), read_texts(args.queries)
    one = queries[:1]
    enc.encode(one)
    n_one = len(enc.token_ids(one)[0])
    rows.append((f"1 query ({n_one} tokens)", median_s(lambda: enc.encode(one), args.repeat), ""))
    rows += parts_rows(enc, queries[:150])
    batch = queries[:64]
    enc.encode(batch)
    rows.append((f"{len(batch)} queries", median_s(lambda: enc.encode(batch), max(3, args.repeat // 5)), ""))
    rows += concurrent_rows(enc, queries[:100], args.clients)
    tokens = sum(len(i) for i in enc.token_ids(texts))
    enc.encode(texts[:256])
    dt = median_s(lambda: enc.encode(texts), 3)
    rows.append((f"{len(texts)} tool texts", dt, f"{tokens} tokens, {tokens / dt:,.0f} tokens/s"))
    rows += beside_rows(enc, queries[:150], texts)
    if enc.backend_name == "cuda":
        from decoder_service.retrieval.host import intent_parts
        several = next((p for p in map(intent_parts, queries) if len(p) >= 3), None)
        rows += launch_rows(enc.backend, [enc.token_ids(q) for q in (one, several) if q])
    result["timings_s"] = timings(rows)
    print("RESULT " + json.dumps(result), flush=True)
    print(f"\n{enc.name} on {enc.backend_name}: check rel_max {result['check']['rel_max']:.2e}, "
          f"alone == batch: {result['check']['alone_equals_batch']}")
    print(f"{'what':<42} {'median':>12}  note")
    for name, s, note in rows:
        print(f"{name:<42} {s * 1e3:>9.3f} ms  {note}")

