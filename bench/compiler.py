"""Compiler benchmark: compile and publish MetaTool, Seal-Tools and a generated 100,000-tool catalog.

`make bench-compiler` (`python -m bench compiler --model DIR`) writes bench/results/compiler.json. Each catalog is
compiled in a fresh process so its peak resident memory (ru_maxrss) is its own; publishing goes to a real
redis-server.
"""
from __future__ import annotations

import argparse
import itertools
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

from shared.config import REPO_ROOT

DATA = REPO_ROOT.parent / "shared" / "data"
VERBS = ["get", "list", "create", "update", "delete", "search", "fetch", "compute", "validate", "send", "track",
         "convert", "analyze", "schedule", "export", "import", "sync", "predict", "estimate", "monitor"]
NOUNS = ["Weather", "Invoice", "Flight", "Hotel", "Stock", "Recipe", "Playlist", "Patient", "Shipment", "Ticket",
         "Course", "Vehicle", "Sensor", "Contract", "Order", "Review", "Podcast", "Satellite", "Crop", "Wallet",
         "Employee", "Lease", "Molecule", "Tournament", "Parcel"]
QUALIFIERS = ["", "History", "Status", "Summary", "Forecast", "Details", "Report", "Alerts", "Trends", "Score",
              "Metrics", "ById", "ByDate", "ForUser", "InRegion", "V2"]


def generated_catalog(n: int) -> list[dict]:
    """n distinct, realistic-looking API names (verb + noun + qualifier + a numbered domain)."""
    tools = []
    for i, (domain, verb, noun, q) in enumerate(itertools.product(range(10**6), VERBS, NOUNS, QUALIFIERS)):
        if i == n:
            break
        name = f"{verb}{noun}{q}" + (f"_d{domain}" if domain else "")
        tools.append({"name": name, "description": f"{verb} the {noun.lower()} {q.lower()} of domain {domain}"})
    return tools


def compile_one(registry: Path, model: Path, redis_url: str, name: str) -> dict:
    """Runs in its own process: compile, publish, report times and peak memory."""
    from compiler_service.compiler import compile_catalog
    from shared.catalog import parse_registry
    from shared.store import CatalogStore
    from shared.tokenizer import ModelTokenizer
    tok = ModelTokenizer(model)
    text = registry.read_text()
    started = time.perf_counter()
    catalog = parse_registry(text)
    trie = compile_catalog(catalog, tok)
    compile_s = time.perf_counter() - started
    store = CatalogStore.from_url(redis_url, namespace="bench")
    started = time.perf_counter()
    info, _ = store.publish(name, trie)
    publish_s = time.perf_counter() - started
    return {"catalog": name, **trie.stats(), "parse_and_compile_ms": round(compile_s * 1e3, 1),
            "publish_ms": round(publish_s * 1e3, 1), "blob_bytes": len(trie.to_blob()), "version": info.version,
            "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)}


def compiler_arguments(p) -> None:
    p.add_argument("--model", required=True)
    p.add_argument("--out", default="bench/results/compiler.json")
    p.add_argument("--one", nargs=3, metavar=("REGISTRY", "REDIS_URL", "NAME"), help=argparse.SUPPRESS)


def compiler(args) -> None:
    if args.one:
        print(json.dumps(compile_one(Path(args.one[0]), Path(args.model), args.one[1], args.one[2])))
        return
    from devstack.redis_server import LocalRedis
    work = REPO_ROOT / "var" / "bench"
    work.mkdir(parents=True, exist_ok=True)
    generated = work / "generated_100k.json"
    generated.write_text(json.dumps(generated_catalog(100_000)))
    catalogs = {"metatool": DATA / "metatool" / "catalog.json", "sealtools": DATA / "bigcatalog" / "catalog.json",
                "toolbench": DATA / "toolbench" / "catalog.json", "generated-100k": generated}
    results = []
    with LocalRedis(work / "redis", appendonly=False) as redis_server:
        for name, path in catalogs.items():
            out = subprocess.run([sys.executable, "-m", "bench", "compiler", "--model", args.model,
                                  "--one", str(path), redis_server.url, name],
                                 check=True, capture_output=True, text=True).stdout
            results.append(json.loads(out.strip().splitlines()[-1]))
            r = results[-1]
            print(f"{name:15s} tools={r['tools']:6d} nodes={r['nodes']:7d} compile={r['parse_and_compile_ms']:8.1f} ms "
                  f"publish={r['publish_ms']:6.1f} ms peak={r['peak_rss_mb']:6.1f} MB "
                  f"const={r['fits_constant_memory']}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"results": results}, indent=2) + "\n")
    print(f"wrote {args.out}")

