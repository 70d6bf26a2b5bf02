"""Determinism on the GPU: each request alone, then inside randomly composed, shuffled, staggered batches, through
the engine with the CUDA backend and the device sampler (skipped without a GPU or `make model`'s tokenizer).

The engine serves MetaTool's catalog (compiled with SmolLM2's tokenizer, under its real prompt template) on
random bf16 weights at the SmolLM2 shape; the requests are the last 24 MetaTool dev queries with k = gold + 1
(longer answers). BATCHES batches of 2-16 of them, arrivals staggered by 0-2 engine steps: no pointer name
or score may differ in any bit from the same request run alone. The CPU backend's twin is
tests/test_engine.py::test_bit_identical_alone_and_in_any_batch; `python -m bench` repeats the check for
--det-seconds on the served workload.
"""
from __future__ import annotations

import json
import random

import pytest

from sim_runner import run_script

pytestmark = [pytest.mark.gpu, pytest.mark.model]
BATCHES = 100
QUERIES = 24


@pytest.mark.parametrize("line_kv", ["0", "1"])
def test_an_answer_is_the_same_alone_and_in_any_batch_on_the_gpu(line_kv):
    """With line KV (TOOLTRIE_LINE_KV=1) the answers alone compute their lines, the batches find them kept."""
    from numba import cuda

    from shared.config import DEFAULT_MODEL_DIR
    if not cuda.is_available():
        pytest.skip("no CUDA GPU")
    if not (DEFAULT_MODEL_DIR / "tokenizer.json").is_file():
        pytest.skip("no tokenizer: run `make model`")
    r = run_script(__file__, sim=False, timeout=900, env={"TOOLTRIE_LINE_KV": line_kv})
    assert r["sampler"] != "HostSampler", r     # the device sampler, not the host fallback
    assert r["batches"] == BATCHES and r["requests"] >= 2 * BATCHES, r
    assert r["mismatches"] == 0, r


def answer(seq) -> tuple:
    from decoder_service.engine.sequence import DoneEvent, FailedEvent
    events = list(seq)
    assert not isinstance(events[-1], FailedEvent), events[-1].message
    return tuple((e.name, e.logprob) for e in events if not isinstance(e, DoneEvent))


def main() -> None:
    from bench.common import random_weights, shape_config
    from compiler_service.compiler import compile_catalog
    from decoder_service.engine.engine import DecodeEngine, EngineConfig
    from decoder_service.model.cuda.backend import CudaBackend
    from decoder_service.model.kv_pool import KVPoolSpec
    from shared.catalog import parse_registry
    from shared.config import DEFAULT_MODEL_DIR, Settings
    from shared.dataset import data_dir
    from shared.tokenizer import ModelTokenizer
    data = data_dir()
    tok = ModelTokenizer(DEFAULT_MODEL_DIR)
    trie = compile_catalog(parse_registry((data / "metatool" / "catalog.json").read_text()), tok)
    trie.meta.update(name="metatool", version=1)
    cfg = shape_config("smollm2-135m")
    spec = KVPoolSpec.from_tokens(6000 + 64 * 512)
    backend = CudaBackend(cfg, random_weights(cfg, seed=3), spec, max_rows=512, max_logit_rows=64,
                          max_candidates=256, max_table=64 * 512)
    engine = DecodeEngine(backend, tok, spec.num_blocks, spec.block_size, cfg.max_position_embeddings,
                          EngineConfig(line_kv=Settings().line_kv, warm_rows=0))
    catalog = engine.load_catalog(trie)
    engine.run_until_idle()
    queries = [json.loads(line) for line in (data / "metatool" / "dev_queries.jsonl").open()][-QUERIES:]
    requests = [(q["query"], len(q["tools"]) + 1) for q in queries]
    alone = {}
    for r in requests:
        seq = engine.submit(catalog, *r)
        engine.run_until_idle()
        alone[r] = answer(seq)
    rng = random.Random(11)
    checked = mismatches = 0
    for _ in range(BATCHES):
        seqs = []
        for r in rng.sample(requests, rng.randint(2, min(16, len(requests)))):
            seqs.append((r, engine.submit(catalog, *r)))
            for _ in range(rng.randint(0, 2)):     # staggered: some join while others are already decoding
                engine.step()
        engine.run_until_idle()
        for r, seq in seqs:
            mismatches += answer(seq) != alone[r]
            checked += 1
    print("RESULT " + json.dumps({"sampler": type(engine.sampler).__name__, "batches": BATCHES,
                                  "requests": checked, "mismatches": mismatches}))


if __name__ == "__main__":
    main()
