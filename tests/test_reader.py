"""The reader (decoder_service/reader.py): query likelihoods on the model runtime, and the rerank they give."""
from __future__ import annotations

import numpy as np
import pytest

from decoder_service.model.batch import StepBatch
from decoder_service.model.config import ModelConfig
from decoder_service.model.kv_pool import KVPoolSpec
from decoder_service.model.reference import ReferenceModel
from decoder_service.model.weights import load_weights
from decoder_service.reader import Reader, reader_score, reranked
from model_fixtures import make_chat_model

VOCAB = 512
TOOLS = [("weather", "Weather forecast of a city"), ("flights", "Search flights between two airports"),
         ("stocks", "The latest price of a stock ticker, and its history over a year"), ("translate", ""),
         ("calendar", "Create, move and delete events in a calendar")]
INTENT = "What will the weather be in Paris tomorrow, and then book a flight from Paris to Rome."


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_chat_model(tmp_path_factory.mktemp("reader"), VOCAB, seed=2)


def reference_likelihoods(model_dir, heads, parts) -> np.ndarray:
    """Each head + part computed whole, one sequence at a time, by the float64 reference."""
    cfg = ModelConfig.from_dir(model_dir)
    longest = max(len(h) for h in heads) + max(len(p) for p in parts)
    ref = ReferenceModel(cfg, load_weights(model_dir, cfg, "float32", progress=False),
                         KVPoolSpec(num_blocks=-(-longest // 16), block_size=16))
    table = np.arange(-(-longest // 16), dtype=np.int32)[None]
    out = np.zeros((len(parts), len(heads)))
    for p, part in enumerate(parts):
        for h, head in enumerate(heads):
            seq = head + part
            rows = np.arange(len(head) - 1, len(seq) - 1, dtype=np.int32)
            ref.forward(StepBatch(np.asarray(seq, np.int32), np.zeros(len(seq), np.int32),
                                  np.arange(len(seq), dtype=np.int32), table, rows))
            out[p, h] = ref.token_logprobs(np.asarray(part, np.int32)).sum()
    return out


def test_a_request_is_scored_after_each_tool_for_the_whole_request_and_each_clause(tiny):
    reader = Reader(tiny, "cpu")
    heads, parts = reader.tokens(TOOLS, INTENT)
    assert len(parts) == 3, "the request and its two clauses"
    got = reader.likelihoods(heads, parts)
    assert got.shape == (3, len(TOOLS))
    np.testing.assert_allclose(got, reference_likelihoods(tiny, heads, parts), rtol=1e-4)


def test_a_tools_score_does_not_depend_on_the_others_or_on_how_steps_are_cut(tiny):
    """Heads share no step with the parts that read them, and a small step splits the shortlist into groups:
    the same bits for a tool alone, in a full shortlist, and in steps of a few rows."""
    heads, parts = Reader(tiny, "cpu").tokens(TOOLS, INTENT)
    whole = Reader(tiny, "cpu").likelihoods(heads, parts)
    small = Reader(tiny, "cpu", step_rows=160)
    cut = small.likelihoods(heads, parts)
    alone = np.stack([small.likelihoods([h], parts)[:, 0] for h in heads], axis=1)
    assert np.array_equal(whole, cut) and np.array_equal(whole, alone)


def test_a_head_is_computed_once_and_kept_until_others_need_its_blocks(tiny):
    """The heads kept are the least recently read ones' first to go; kept or computed again, the same bits."""
    tools = [(f"{name}{i}", description) for i in range(3) for name, description in TOOLS]
    heads, parts = Reader(tiny, "cpu").tokens(tools, INTENT)
    other = Reader(tiny, "cpu").tokens(tools, "Translate this sentence into German")[1]
    roomy = Reader(tiny, "cpu")
    first = roomy.likelihoods(heads, parts)
    computed = []
    forward = roomy.model.forward
    roomy.model.forward = lambda batch: (computed.append(batch.num_rows), forward(batch))[1]
    again = roomy.likelihoods(heads, parts)
    assert np.array_equal(first, again)
    assert sum(computed) == len(tools) * sum(map(len, parts)), "a second read computes its parts' rows alone"
    tight = Reader(tiny, "cpu", step_rows=160, heads_kept=0)   # room for the longest head a model reads
    assert tight.heads.capacity < sum(-(-(len(h) - 1) // 16) for h in heads)
    for _ in range(2):
        assert np.array_equal(tight.likelihoods(heads, parts), first)
        assert np.array_equal(tight.likelihoods(heads, other), roomy.likelihoods(heads, other))
    assert sum(map(len, tight.heads.blocks.values())) + len(tight.heads.free) == tight.heads.capacity


def test_a_long_request_is_read_up_to_the_bound(tiny):
    from decoder_service.reader import PART_TOKENS, READ_TOKENS
    reader = Reader(tiny, "cpu")
    clause = "please look up the weather forecast for the city of paris in france for the next ten days"
    heads, parts = reader.tokens(TOOLS, ". ".join([" ".join([clause] * 3)] * 7))
    assert len(parts[0]) == PART_TOKENS, "the whole request, cut"
    assert all(len(p) <= PART_TOKENS for p in parts) and sum(map(len, parts)) <= READ_TOKENS
    assert 1 < len(parts) < 8, "clauses past the bound are not read"
    assert reader.likelihoods(heads, parts).shape == (len(parts), len(TOOLS))


def test_the_rerank_weighs_the_request_and_its_best_clause_and_keeps_retrieval_order_on_a_tie():
    # two tools, each favoured by one clause: the request as a whole decides between them ...
    assert list(reader_score([[1.0, 0.0], [0.0, 1.0], [1.0, 0.0]])) == [3.0, 1.0]
    # ... and where it favours neither, they stand level on the reader, so retrieval's order decides
    assert list(reader_score([[0.0, 0.0], [0.0, 1.0], [1.0, 0.0]])) == [2.0, 2.0]
    assert list(reranked(np.array([1.0, 0.0]), [[0.0, 0.0], [0.0, 1.0], [1.0, 0.0]], 1)) == [0]
    # a request without clauses is its own best clause; read strongly enough, it outweighs retrieval's order
    assert list(reader_score([[-9.0, -1.0]])) == [-3.0, 3.0]
    assert list(reranked(np.array([1.0, 0.0]), [[-9.0, -1.0]], 1)) == [1]
    assert list(reranked(np.array([1.0, 0.0]), [[-9.0, -1.0]], 1, weights=(0.1, 0.1))) == [0]
    # k distinct positions, best first
    order = reranked(np.array([3.0, 2.0, 1.0, 0.0]), [[0.0, 0.0, 5.0, 0.0]], 3)
    assert sorted(set(order.tolist())) == sorted(order.tolist()) and order[0] == 2


@pytest.fixture(scope="module")
def served(tmp_path_factory, tiny, small_tokenizer_dir, redis_url):
    """The decoder over real gRPC and a real Redis with the tiny reader, its tiny engine never tuned on the
    catalog (so MODE_AUTO reads where it has a choice)."""
    from decoder_service.server import Lazy
    from decoder_stack import TOOLS, DecoderStack, trie_of
    reader = Reader(tiny, "cpu")
    stack = DecoderStack(tmp_path_factory.mktemp("stack"), small_tokenizer_dir, redis_url, fusion_weight_unseen=1000.0,
                         reader=Lazy("the reader", lambda: reader))
    stack.store.publish("unseen", trie_of(stack.tok, TOOLS[:20]))
    stack.store.publish("examples", trie_of(stack.tok, [{**t, "examples": [f"use {t['name']}"]} for t in TOOLS[:20]]))
    stack.start()
    yield {"stub": stack.stub(), "engine": stack.engine, "catalogs": stack.catalogs, "reader": reader}
    stack.close()


def ask(stub, catalog="unseen", **kw):
    from shared.rpc import decoder_pb2 as pb
    events = list(stub.Discover(pb.DiscoverRequest(catalog=catalog, **kw), timeout=60))
    return [e.pointer for e in events[1:-1]], events[-1].done


def test_an_unseen_catalog_is_answered_by_the_reader_over_retrievals_shortlist(served):
    from shared.rpc import decoder_pb2 as pb
    intent = "translate this sentence to french and then check the weather in paris"
    pointers, done = ask(served["stub"], intent=intent, k=2)
    assert done.stage == "reader" and done.generated_tokens == 0 and done.prefill_ms > 0
    rt = served["catalogs"].acquire("unseen", 0)
    try:
        shortlist = served["engine"].retrieve(rt, intent, 2, prompt=False)
        expected = served["reader"].read(rt.trie, intent, shortlist, 2)
        assert [p.name for p in pointers] == [rt.trie.pointer_names[i] for i in expected.ids]
    finally:
        served["catalogs"].release(rt)
    assert len({p.name for p in pointers}) == 2
    # the same request gives the same answer; asked for retrieval, or with nothing to choose, retrieval answers
    assert [p.name for p in ask(served["stub"], intent=intent, k=2)[0]] == [p.name for p in pointers]
    assert ask(served["stub"], intent=intent, k=2, mode=pb.MODE_RETRIEVE)[1].stage == "retrieval"
    assert ask(served["stub"], intent=intent, k=3, shortlist=3)[1].stage == "retrieval"


def test_a_catalog_whose_tools_have_examples_is_answered_in_retrievals_order(served):
    """Examples on most tools make retrieval stronger than the reader (MetaTool: 0.800 against 0.730)."""
    from shared.rpc import decoder_pb2 as pb
    intent = "translate this sentence to french"
    pointers, done = ask(served["stub"], "examples", intent=intent, k=2)
    assert done.stage == "retrieval"
    retrieved, _ = ask(served["stub"], "examples", intent=intent, k=2, mode=pb.MODE_RETRIEVE)
    assert [p.name for p in pointers] == [p.name for p in retrieved]
