"""Learning from use: MetaTool published without examples, then its training requests replayed as feedback and
learned, answered on the validation split before and after.

    .venv/bin/python -m bench feedback [--sample 100] [--set metatool]

A redis-server and the compiler service (real gRPC, as `python -m compiler_service.server` builds it) are
started; the set's catalog is published with names and descriptions alone (v1); every request of the training
split is sent as Feedback (the tools its label names) for v1; Learn publishes v2. Each version's blob is read
back from the compiler and answered as `bench quality` answers (the fused retriever, and tooltrie through the
engine at the service's weight) on the validation split (the CPU sample `make quality` takes). Nothing of the
validation split is sent as feedback. Writes bench/results/feedback_<device>.json.
"""
from __future__ import annotations

import json
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import grpc

from bench.common import device_label
from bench.quality import Harness, groups, sample, score
from compiler_service.server import SERVICE, CompilerServicer, guard
from decoder_service.retrieval.config import SHORTLIST
from devstack.redis_server import LocalRedis, free_port
from shared import dataset
from shared.config import DEFAULT_MODEL_DIR, REPO_ROOT, Settings
from shared.rpc import compiler_pb2 as pb, compiler_pb2_grpc as pb_grpc
from shared.serving import make_server
from shared.store import CatalogStore
from shared.tokenizer import ModelTokenizer
from shared.trie import Trie


def answer(harness: Harness, trie: Trie, queries: list) -> dict:
    """The fused retriever's and tooltrie's rows (all, and per k) on one version's blob."""
    retriever, engine, rt = harness.served(trie)
    shortlists = [retriever.shortlist(q.text, max(SHORTLIST, len(q.tools))) for q in queries]
    names = trie.pointer_names
    answers = {"fused": [[names[i] for i in s.ids[:len(q.tools)]] for q, s in zip(queries, shortlists)],
               f"tooltrie w={rt.fusion_weight:g}": []}
    wave = engine.config.max_waiting
    for start in range(0, len(queries), wave):
        seqs = [engine.submit(rt, q.text, len(q.tools), shortlist=s)
                for q, s in zip(queries[start:start + wave], shortlists[start:start + wave])]
        engine.run_until_idle()
        answers[f"tooltrie w={rt.fusion_weight:g}"] += harness.answers(seqs)
    rows = {}
    for method, got in answers.items():
        by_k = defaultdict(list)
        for a, q in zip(got, queries):
            by_k[groups(q, frozenset())[0]].append((a, q))
        rows[method] = {"all": score(got, queries), **{k: {**score([a for a, _ in v], [q for _, q in v]),
                                                          "queries": len(v)} for k, v in sorted(by_k.items())}}
    return rows


def feedback_arguments(p) -> None:
    p.add_argument("--set", default="metatool", choices=list(dataset.SETS))
    p.add_argument("--sample", type=int, default=None, help="validation queries (default: 100 on the CPU, as make "
                   "quality; all on a GPU)")
    p.add_argument("--model", default=str(DEFAULT_MODEL_DIR))
    p.add_argument("--encoder", default=Settings().encoder_dir)
    p.add_argument("--backend", default="auto")
    p.add_argument("--out", type=Path, default=None)


def feedback(args) -> None:
    harness = Harness(args.model, args.encoder, args.backend)
    n = args.sample if args.sample is not None else (0 if harness.kind == "cuda" else 100)
    queries = sample(dataset.queries(args.set, "validation"), n)
    tools = json.loads(dataset.catalog_path(args.set).read_text(encoding="utf-8"))
    bare = json.dumps([{"name": t["name"], "description": t.get("description", "")} for t in tools])
    token = [("authorization", "Bearer bench")]
    settings = Settings(publish_token="bench")
    with tempfile.TemporaryDirectory() as tmp, LocalRedis(Path(tmp), appendonly=False) as redis:
        store = CatalogStore.from_url(redis.url, namespace="bench")
        servicer = CompilerServicer(ModelTokenizer(args.model), store, settings)
        addr = f"127.0.0.1:{free_port()}"
        server, _ = make_server(addr, lambda s: pb_grpc.add_CompilerServiceServicer_to_server(servicer, s),
                                [SERVICE], interceptors=[guard(settings)])
        server.start()
        with grpc.insecure_channel(addr) as channel:
            stub = pb_grpc.CompilerServiceStub(channel)
            v1 = stub.Publish(pb.PublishRequest(name=args.set, registry_json=bare), metadata=token).version.version
            started = time.perf_counter()
            train = dataset.queries(args.set, "train")
            for q in train:
                stub.Feedback(pb.FeedbackRequest(name=args.set, version=v1, intent=q.text, tools=list(q.tools)),
                              metadata=token)
            replay_s = time.perf_counter() - started
            learned = stub.Learn(pb.LearnRequest(name=args.set), metadata=token)
            blobs = {v: stub.GetCatalog(pb.GetCatalogRequest(name=args.set, version=v, include_blob=True),
                                        metadata=token).blob for v in (v1, learned.version.version)}
        server.stop(0)
    results = []
    for v, blob in blobs.items():
        trie = Trie.from_blob(blob)
        results.append({"version": v, "examples": sum(len(e) for e in trie.meta["examples"]),
                        "rows": answer(harness, trie, queries)})
        print(f"v{v}: answered", flush=True)
    device = device_label(harness.kind)
    out = args.out or REPO_ROOT / "bench" / "results" / f"feedback_{device}.json"
    out.write_text(json.dumps({"set": args.set, "model": Path(args.model).name, "validation_queries": len(queries),
                               "feedback_sent": len(train), "replay_s": round(replay_s, 1),
                               "examples_added": learned.examples_added, "results": results}, indent=1) + "\n")
    print(table(dataset.SETS[args.set], len(queries), results))


def table(label: str, n: int, results: list[dict]) -> str:
    lines = ["| data set | version | examples | method | k | queries | recall@k | exact-set |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in results:
        for method, row in r["rows"].items():
            for k, m in row.items():
                lines.append(f"| {label} | v{r['version']} | {r['examples']} | {method} | {k} | "
                             f"{m.get('queries', n)} | {m['recall']:.3f} | {m['exact']:.3f} |")
    return "\n".join(lines)
