"""Answer quality on a shared data set: recall of the gold tools among the k returned.

    .venv/bin/python -m bench.quality --set metatool --queries 100 [--prompt full|short|names] [--backend cpu]

Runs the engine in-process (no services), the catalog compiled with the default prompt template,
every dev query with k = its number of gold tools. --prompt lists each tool with its full description
(the default), with the description cut to 60 characters, or by name alone. Prints recall, the share of answers that are
exactly k distinct catalog names (must be 100%), and writes bench/results/quality_<set>.json.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

from bench.workload import data_dir
from compiler_service.compiler import compile_catalog
from decoder_service.engine.engine import DecodeEngine
from decoder_service.engine.sequence import DoneEvent, FailedEvent
from decoder_service.model.backend import make_backend, resolve_backend, weights_dtype
from decoder_service.model.config import ModelConfig
from decoder_service.model.kv_pool import KVPoolSpec
from decoder_service.model.weights import load_weights
from shared.catalog import Catalog, parse_registry
from shared.config import DEFAULT_MODEL_DIR, REPO_ROOT
from shared.tokenizer import ModelTokenizer

# How each tool's description appears in the catalog prompt.
PROMPTS = {"full": lambda d: d, "short": lambda d: d[:60], "names": lambda d: ""}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--set", default="metatool", choices=["metatool", "bigcatalog", "toolbench"])
    p.add_argument("--queries", type=int, default=100)
    p.add_argument("--model", default=str(DEFAULT_MODEL_DIR))
    p.add_argument("--backend", default="auto")
    p.add_argument("--prompt", choices=list(PROMPTS), default="full")
    args = p.parse_args()

    cfg = ModelConfig.from_dir(args.model)
    kind = resolve_backend(args.backend)
    spec = KVPoolSpec.from_tokens(cfg.max_position_embeddings * 4)
    backend = make_backend(cfg, load_weights(args.model, cfg, weights_dtype(kind, cfg)), spec, kind)
    tok = ModelTokenizer(args.model)
    engine = DecodeEngine(backend, tok, spec.num_blocks, spec.block_size, cfg.max_position_embeddings)
    catalog = parse_registry((data_dir() / args.set / "catalog.json").read_text())
    catalog = Catalog(tuple(dataclasses.replace(t, description=PROMPTS[args.prompt](t.description))
                            for t in catalog.tools))
    trie = compile_catalog(catalog, tok)
    started = time.perf_counter()
    runtime = engine.load_catalog(trie)
    engine.run_until_idle()
    warm_s = time.perf_counter() - started
    queries = [json.loads(line) for line in (data_dir() / args.set / "dev_queries.jsonl").open()][:args.queries]
    seqs = [engine.submit(runtime, q["query"], len(q["tools"])) for q in queries]
    started = time.perf_counter()
    engine.run_until_idle()
    decode_s = time.perf_counter() - started
    hits = gold = exact = 0
    for q, seq in zip(queries, seqs):
        events = list(seq)
        if isinstance(events[-1], FailedEvent):
            raise SystemExit(f"query failed: {events[-1].message}")
        names = [e.name for e in events if not isinstance(e, DoneEvent)]
        exact += len(names) == len(set(names)) == len(q["tools"]) and set(names) <= set(trie.pointer_names)
        hits += len(set(names) & set(q["tools"]))
        gold += len(q["tools"])
    result = {"set": args.set, "prompt": args.prompt, "queries": len(queries), "model": Path(args.model).name, "backend": kind,
              "recall": round(hits / gold, 4), "exactly_k_distinct": f"{exact}/{len(queries)}",
              "prefix_tokens": len(runtime.prefix_ids), "warm_s": round(warm_s, 1),
              "all_queries_s": round(decode_s, 1)}
    suffix = "" if args.prompt == "full" else f"_{args.prompt}"
    out = REPO_ROOT / "bench" / "results" / f"quality_{args.set}{suffix}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
