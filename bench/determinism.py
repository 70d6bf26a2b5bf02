"""Determinism: each request alone, then inside randomly composed, shuffled, staggered batches.

    python3 bench/determinism.py --backend cuda --seconds 120     (H200: random weights, SmolLM2 shape)
    .venv/bin/python -m bench.determinism --backend cpu --seconds 60

Counts the batched runs whose pointers or scores differ in any bit from the same request run alone
(must be 0), and prints how many batches and requests were checked. The engine runs the MetaTool
catalog (compiled with SmolLM2's tokenizer) under its real prompt template and the first MetaTool
dev queries; on cuda the device sampler is used.
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT)]

from bench.gpu_model_check import MODELS, random_weights  # noqa: E402
from bench.workload import data_dir  # noqa: E402
from compiler_service.compiler import compile_catalog  # noqa: E402
from decoder_service.engine.engine import DecodeEngine  # noqa: E402
from decoder_service.engine.sequence import DoneEvent, FailedEvent  # noqa: E402
from decoder_service.model.config import ModelConfig  # noqa: E402
from decoder_service.model.kv_pool import KVPoolSpec  # noqa: E402
from shared.catalog import parse_registry  # noqa: E402
from shared.config import DEFAULT_MODEL_DIR  # noqa: E402
from shared.tokenizer import ModelTokenizer  # noqa: E402


def answer(seq):
    events = list(seq)
    if isinstance(events[-1], FailedEvent):
        raise SystemExit(f"request failed: {events[-1].message}")
    return tuple((e.name, e.logprob) for e in events if not isinstance(e, DoneEvent))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--queries", type=int, default=24)
    p.add_argument("--seconds", type=float, default=120)
    p.add_argument("--tokenizer", default=str(DEFAULT_MODEL_DIR))
    args = p.parse_args()
    data = data_dir()
    tok = ModelTokenizer(args.tokenizer)
    trie = compile_catalog(parse_registry((data / "metatool" / "catalog.json").read_text()), tok)
    trie.meta.update(name="metatool", version=1)
    cfg = ModelConfig.from_dict(MODELS["smollm2-135m"], "smollm2-135m")
    spec = KVPoolSpec.from_tokens(6000 + 64 * 512)
    weights = random_weights(cfg, seed=3)
    if args.backend == "cuda":
        from decoder_service.model.cuda.backend import CudaBackend
        backend = CudaBackend(cfg, weights, spec, max_rows=512, max_logit_rows=64, max_candidates=256,
                              max_table=64 * 512)
    else:
        from decoder_service.model.cpu import CpuBackend
        backend = CpuBackend(cfg, weights, spec)
    engine = DecodeEngine(backend, tok, spec.num_blocks, spec.block_size, cfg.max_position_embeddings)
    started = time.perf_counter()
    catalog = engine.load_catalog(trie)
    engine.run_until_idle()
    print(f"{type(engine.sampler).__name__} on {args.backend}; prefix {len(catalog.prefix_ids)} tokens warm in "
          f"{time.perf_counter() - started:.1f} s", flush=True)
    queries = [json.loads(line) for line in (data / "metatool" / "dev_queries.jsonl").open()][-args.queries:]
    requests = [(q["query"], len(q["tools"]) + 1) for q in queries]  # k = gold + 1: longer answers
    alone = {}
    for r in requests:
        seq = engine.submit(catalog, *r)
        engine.run_until_idle()
        alone[r] = answer(seq)
    rng = random.Random(11)
    batches = checked = mismatches = 0
    deadline = time.perf_counter() + args.seconds
    while time.perf_counter() < deadline:
        batch = rng.sample(requests, rng.randint(2, min(16, len(requests))))
        seqs = []
        for r in batch:  # staggered: some join while others are already decoding
            seqs.append((r, engine.submit(catalog, *r)))
            for _ in range(rng.randint(0, 2)):
                engine.step()
        engine.run_until_idle()
        for r, seq in seqs:
            mismatches += answer(seq) != alone[r]
            checked += 1
        batches += 1
    print(f"| backend | batches | requests checked | mismatches |\n| --- | --- | --- | --- |\n"
          f"| {args.backend} | {batches} | {checked} | {mismatches} |")


if __name__ == "__main__":
    main()
