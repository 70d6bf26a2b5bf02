"""The embedded model on the CPU backend, through the engine, on real MetaTool dev queries.

Whatever the model prefers, every answer must be exactly k distinct names of the catalog: the
language of the trie admits nothing else. Queries are submitted together, so they share batches.
"""
import json

import pytest

from compiler_service.compiler import compile_catalog
from decoder_service.engine.engine import DecodeEngine
from decoder_service.model.config import ModelConfig
from decoder_service.model.cpu import CpuBackend
from decoder_service.model.kv_pool import KVPoolSpec
from decoder_service.model.weights import load_weights
from engine_fixtures import answer
from shared.catalog import parse_registry
from shared.tokenizer import ModelTokenizer
from tokenizer_fixtures import catalog_path

pytestmark = pytest.mark.model


def test_metatool_dev_queries_get_exactly_k_distinct_catalog_names(model_dir):
    cfg = ModelConfig.from_dir(model_dir)
    spec = KVPoolSpec.from_tokens(16384)
    tok = ModelTokenizer(model_dir)
    engine = DecodeEngine(CpuBackend(cfg, load_weights(model_dir, cfg, "float32", progress=False), spec), tok,
                          spec.num_blocks, spec.block_size, cfg.max_position_embeddings)
    trie = compile_catalog(parse_registry(catalog_path("metatool").read_text()), tok)
    catalog = engine.load_catalog(trie)
    engine.run_until_idle()
    lines = (catalog_path("metatool").parent / "dev_queries.jsonl").read_text().splitlines()
    # k=1 first, k=2 at the end of the file: 12 requests of about 300 prompt tokens each (the CPU's time here is
    # their prefill), enough to share batches at both k
    queries = [json.loads(x) for x in lines[:6] + lines[-6:]]
    seqs = [engine.submit(catalog, q["query"], len(q["tools"])) for q in queries]
    engine.run_until_idle()
    names_in_catalog = set(trie.pointer_names)
    for q, seq in zip(queries, seqs):
        names, scores, _ = answer(seq)
        assert len(names) == len(set(names)) == len(q["tools"]) and set(names) <= names_in_catalog, (q, names)
        assert all(s <= 0 for s in scores)
    assert {len(q["tools"]) for q in queries} == {1, 2}
