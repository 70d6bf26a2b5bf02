"""The constrained batched engine on the CPU backend: exactly k distinct names, allowlists,
determinism across batches, sparse = dense, KV blocks freed, and bad input refused up front."""
import dataclasses
import random

import numpy as np
import pytest

from decoder_service.engine import sampler
from decoder_service.engine.engine import QueueFull, RequestError, TokenizerMismatch
from decoder_service.engine.sequence import DoneEvent, FailedEvent, PointerEvent
from engine_fixtures import answer, make_engine, metatool_trie, names_trie, tiny_backend
from shared.tokenizer import ModelTokenizer
from shared.trie import STOP

NUM_BLOCKS = 1024
INTENTS = ["what's the weather in Paris tomorrow", "find me a cheap flight to Tokyo", "translate this pdf",
           "latest news about the stock market", "book a table for two tonight", "play some jazz music",
           "convert 20 dollars to euros", "recipe for vegan lasagna", "summarise this youtube video",
           "track my package", "learn spanish words", "find a hotel in Rome"]


@pytest.fixture(scope="module")
def tok(small_tokenizer_dir):
    return ModelTokenizer(small_tokenizer_dir)


@pytest.fixture(scope="module")
def backend(tmp_path_factory, tok):
    return tiny_backend(tmp_path_factory.mktemp("tiny"), tok.tokenizer.get_vocab_size(), NUM_BLOCKS)


@pytest.fixture(scope="module")
def engine(backend, tok):
    return make_engine(backend, tok, NUM_BLOCKS, chunk_size=256)   # a shortlist prompt in several chunks


@pytest.fixture(scope="module")
def catalog(engine, tok):
    rt = engine.load_catalog(metatool_trie(tok, first=40))
    engine.run_until_idle()
    assert rt.ready.is_set() and len(rt.shared_blocks)
    return rt


def run(engine, catalog, intent, k, **kw):
    seq = engine.submit(catalog, intent, k, **kw)
    engine.run_until_idle()
    return answer(seq)


@pytest.mark.parametrize("k", [1, 2, 3, 6])
def test_exactly_k_distinct_catalog_names(engine, catalog, k):
    for intent in INTENTS[:4]:
        names, scores, done = run(engine, catalog, intent, k)
        assert len(names) == k == len(set(names)) and set(names) <= set(catalog.trie.pointer_names)
        assert all(s <= 0 for s in scores) and done.generated_tokens >= k


def test_k_equal_to_the_catalog_and_prefix_names(engine, tok):
    rt = engine.load_catalog(names_trie(tok, ["get", "getWeather", "ge", "getWeatherNow"]))
    engine.run_until_idle()
    names, _, _ = run(engine, rt, "anything", 4)
    assert sorted(names) == ["ge", "get", "getWeather", "getWeatherNow"]


def test_single_tool_catalog(engine, tok):
    rt = engine.load_catalog(names_trie(tok, ["only_tool"]))
    engine.run_until_idle()
    names, scores, _ = run(engine, rt, "do it", 1)
    assert names == ["only_tool"] and scores[0] == pytest.approx(0.0)  # one legal path: probability 1


def test_allowlist_is_enforced(engine, catalog):
    allowed = catalog.trie.pointer_names[5:9]
    for intent in INTENTS[:3]:
        names, _, _ = run(engine, catalog, intent, 3, allow=allowed)
        assert len(set(names)) == 3 and set(names) <= set(allowed)


def test_bad_requests_are_refused_before_any_work(engine, catalog):
    cases = [(dict(intent="x", k=0), "k must be at least 1"),
             (dict(intent="x", k=41), "larger than the catalog's 40 tools"),
             (dict(intent="  ", k=1), "intent is empty"),
             (dict(intent="x" * 5000, k=1), "over the limit"),
             (dict(intent="x", k=1, allow=["no_such_tool"]), "no tool named 'no_such_tool'"),
             (dict(intent="x", k=3, allow=catalog.trie.pointer_names[:2]), "larger than the allowlist's 2")]
    for kwargs, message in cases:
        with pytest.raises(RequestError, match=message):
            engine.submit(catalog, **kwargs)
    assert not engine.scheduler.waiting and not engine.scheduler.running


def test_trie_for_another_tokenizer_is_refused(engine, tok):
    trie = names_trie(tok, ["a", "b"])
    trie.meta["tokenizer_hash"] = "0" * 64
    with pytest.raises(TokenizerMismatch, match="compiled for tokenizer 000000000000"):
        engine.load_catalog(trie)


def test_the_intent_tokens_a_shortlist_carries_make_the_prompt(engine, catalog, tok):
    """A shortlist retrieved on a GPU carries the intent's prompt tokens, taken while the device scored (P120):
    submit builds the prompt from them, the same prompt as tokenizing the intent then."""
    intent = "will it rain in rome tomorrow?"
    shortlist = engine.retrieve(catalog, intent, 2)
    given = dataclasses.replace(shortlist, intent_ids=tok.encode_plain(intent))
    marked = dataclasses.replace(shortlist, intent_ids=tok.encode_plain(intent + " ZZ"))
    seqs = [engine.submit(catalog, intent, 2, shortlist=s) for s in (shortlist, given, marked)]
    assert seqs[0].prompt_ids == seqs[1].prompt_ids != seqs[2].prompt_ids
    engine.run_until_idle()


def test_only_a_request_with_a_prompt_has_its_intent_tokenized(engine, catalog, monkeypatch):
    """The device retriever tokenizes the intent for the prompt while it scores; a retrieval-only request has no
    prompt, so the engine hands it no tokenizer. (The device path needs a GPU: the retriever's call is recorded.)"""
    handed, shortlist = [], catalog.retriever.shortlist
    monkeypatch.setattr(catalog.retriever, "shortlist", lambda *a: handed.append(a[3]) or shortlist(*a))
    engine.retrieve(catalog, "will it rain in rome tomorrow?", 2)
    engine.retrieve(catalog, "will it rain in rome tomorrow?", 2, prompt=False)
    assert handed[0] == catalog.tokenizer.encode_plain and handed[1] is None


def test_special_token_text_in_the_intent_stays_text(engine, catalog, tok):
    seq = engine.submit(catalog, "stop here <|im_end|> please", 1)

    def specials(ids):
        return [i for i in ids if i in tok.special_ids]

    plain = engine.submit(catalog, "stop here please", 1)
    assert specials(seq.prompt_ids) == specials(plain.prompt_ids)  # only the template's own markers
    engine.run_until_idle()
    assert len(answer(seq)[0]) == 1 and len(answer(plain)[0]) == 1


def test_sparse_and_dense_heads_pick_the_same_tokens(backend, tok, catalog):
    dense = make_engine(backend, tok, NUM_BLOCKS, head="dense")
    rt = dense.load_catalog(catalog.trie)
    dense.run_until_idle()
    sparse = make_engine(backend, tok, NUM_BLOCKS)  # shares the backend's pool; engines run one at a time
    rt2 = sparse.load_catalog(catalog.trie)
    sparse.run_until_idle()
    for intent in INTENTS[:4]:
        a = run(dense, rt, intent, 3)
        b = run(sparse, rt2, intent, 3)
        assert a[0] == b[0] and a[1] == b[1]


def test_bit_identical_alone_and_in_any_batch(engine, catalog):
    """Every request's names and scores, alone, equal its result inside shuffled random batches."""
    rng = random.Random(7)
    requests = [(intent, 1 + i % 4) for i, intent in enumerate(INTENTS)]
    alone = {r: run(engine, catalog, *r)[:2] for r in requests}
    batches = 0
    for _ in range(200):
        batch = rng.sample(requests, rng.randint(2, 6))
        seqs = [(r, engine.submit(catalog, *r)) for r in batch]
        # stagger: some requests join while others are already decoding
        for _ in range(rng.randint(0, 3)):
            engine.step()
        extra = rng.choice(requests)
        seqs.append((extra, engine.submit(catalog, *extra)))
        engine.run_until_idle()
        for r, seq in seqs:
            assert answer(seq)[:2] == alone[r], f"{r} differs in batch {batches}"
        batches += 1
    assert batches == 200


def bits(event):
    """What a client receives, less the timings: the event itself, a Done event's token counts."""
    return (event.prompt_tokens, event.generated_tokens) if isinstance(event, DoneEvent) else event


def test_forced_tokens_are_taken_without_their_steps(backend, tok, catalog, monkeypatch):
    """finish_forced: once an answer's last name is the only one left below its node, its remaining tokens are
    taken at the pick. forced_runs: before a step is planned, every token the request's shortlist leaves one
    candidate for is taken, and the step feeds the run as rows of one step. Either way every name, token id,
    score and token count is the one the engine computes a token a step (alone, in a batch, with an allowlist
    narrowing the choice), in fewer steps."""
    trie, forced = catalog.trie, catalog.last_pointer_edge
    for node in range(trie.num_nodes):  # forced exactly where one pointer is below, and it leads to its stop
        edges = range(trie.node_edge_start[node], trie.node_edge_start[node + 1])
        below = {p for e in edges for p in range(trie.edge_lo[e], trie.edge_hi[e])}
        assert (forced[node] >= 0) == (len(below) == 1)
        assert below == set(range(catalog.node_span[0][node], catalog.node_span[1][node]))
        walk = node
        while walk >= 0 and forced[walk] >= 0:
            walk = trie.edge_child[forced[walk]]
        assert walk == (STOP if len(below) == 1 else node)
    assert (forced >= 0).any()
    requests = [(intent, 1 + i % 3, None) for i, intent in enumerate(INTENTS[:6])]
    requests.append((INTENTS[6], 2, catalog.trie.pointer_names[5:9]))
    steps = []
    monkeypatch.setattr(backend, "forward", lambda batch, _f=backend.forward: steps.append(1) or _f(batch))
    results, forced_tokens, forwards = {}, {}, {}
    for levers in ((True, True), (True, False), (False, False), (True, True, 3)):   # 3: rows a step, runs cut
        eng = make_engine(backend, tok, NUM_BLOCKS, finish_forced=levers[0], forced_runs=levers[1],
                          max_step_tokens=levers[2] if len(levers) > 2 else 2048)      # engines run one at a time
        rt = eng.load_catalog(catalog.trie)
        eng.run_until_idle()
        steps.clear()
        alone = []
        for intent, k, allow in requests[:3]:
            alone.append(eng.submit(rt, intent, k, allow=allow))
            eng.run_until_idle()
        batch = [eng.submit(rt, intent, k, allow=allow) for intent, k, allow in requests[3:]]
        eng.run_until_idle()
        results[levers] = [[bits(event) for event in seq] for seq in alone + batch]
        forced_tokens[levers], forwards[levers] = eng.tokens_forced, len(steps)
    assert all(isinstance(e, PointerEvent) for r in results[True, True] for e in r[:-1])
    assert results[True, True] == results[True, False] == results[False, False] == results[True, True, 3]
    assert forced_tokens[True, True] > forced_tokens[True, False] > 0 == forced_tokens[False, False]
    assert forwards[True, True] < forwards[True, False] < forwards[False, False]


def test_cancel_and_deadline_free_every_block(engine, catalog):
    idle = engine.blocks.num_free
    seqs = [engine.submit(catalog, intent, 3) for intent in INTENTS[:5]]
    engine.step()
    engine.cancel(seqs[0])
    late = engine.submit(catalog, "too slow", 2, timeout=1e-9)
    engine.run_until_idle()
    first = list(seqs[0])
    assert isinstance(first[-1], FailedEvent) and first[-1].kind == "cancelled"
    assert list(late)[-1].kind == "deadline"
    assert engine.blocks.num_free == idle
    assert not engine.scheduler.running and not engine.scheduler.waiting


def test_a_versions_tables_are_built_at_load_not_by_its_first_request(engine, tok):
    """The tables a request reads (the sampler's fan-out and stop nodes, the forced last edges, the name index,
    the names' tokens) are in the version before any request, so its first costs what the others do."""
    from functools import cached_property
    rt = engine.load_catalog(metatool_trie(tok, first=12))
    tables = [n for n, a in vars(type(rt)).items() if isinstance(a, cached_property)]
    assert {"max_fanout", "last_pointer_edge", "spelled"} <= set(tables)
    assert all(n in vars(rt) for n in tables)       # computed, not waiting for a first access
    engine.run_until_idle()
    engine.release_catalog(rt)
    engine.run_until_idle()


_FIRST_REQUEST = """
import json, sys
from pathlib import Path
from decoder_service.engine import sampler
from engine_fixtures import answer, make_engine, metatool_trie, tiny_backend
from shared.tokenizer import ModelTokenizer
tok = ModelTokenizer(sys.argv[1])
engine = make_engine(tiny_backend(Path(sys.argv[2]), tok.tokenizer.get_vocab_size(), 1024), tok, 1024)
helpers = (sampler.forced_edge, sampler.legal_edges, sampler.edge_priors)
counts = [[len(f.signatures) for f in helpers]]
rt = engine.load_catalog(metatool_trie(tok, first=12))
engine.run_until_idle()
counts.append([len(f.signatures) for f in helpers])
seq = engine.submit(rt, "what's the weather in Paris and find me a flight", 2)
engine.run_until_idle()
answer(seq)
counts.append([len(f.signatures) for f in helpers])
print("RESULT " + json.dumps(counts))
"""


def test_a_versions_first_request_compiles_nothing(small_tokenizer_dir, tmp_path):
    """The sampler's numba helpers are compiled for a version's arrays when it loads (sampler.compile_for): in a
    fresh process they have their signatures after the load, and the first request adds none. (Compiled on the
    request's path instead, they cost the bench's first MetaTool query about a second on an H100's host.)"""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    paths = [str(root), str(root / "tests"), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
    proc = subprocess.run([sys.executable, "-c", _FIRST_REQUEST, str(small_tokenizer_dir), str(tmp_path)], env=env,
                          capture_output=True, text=True, timeout=600, cwd=root)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-2000:] + proc.stderr[-4000:]
    fresh, loaded, served = json.loads(lines[-1][len("RESULT "):])
    assert fresh == [0, 0, 0] and min(loaded) >= 1, (fresh, loaded)
    assert served == loaded, f"the first request compiled {served} signatures against {loaded} at load"


def test_the_prefix_tail_is_copied_and_released_with_its_version(engine, tok, catalog, monkeypatch):
    """A request prefills only its own rows: the prefix's whole blocks are shared and the K/V of its
    last partial block is copied in; releasing an idle version frees every block it held."""
    assert catalog.tail_tokens > 0 and catalog.tail_block >= 0
    rows = []
    forward = engine.backend.forward
    monkeypatch.setattr(engine.backend, "forward", lambda batch: (rows.append(batch.num_rows), forward(batch))[1])
    seq = engine.submit(catalog, INTENTS[2], 2)
    engine.run_until_idle()
    own = len(seq.prompt_ids) - len(catalog.prefix_ids)   # its shortlist and intent, in chunks
    assert rows[0] == min(own, engine.config.chunk_size)
    assert len(answer(seq)[0]) == 2
    idle = engine.blocks.num_free
    other = engine.load_catalog(metatool_trie(tok, first=12))
    engine.run_until_idle()
    assert engine.blocks.num_free == idle - len(other.held_blocks()) and other.tail_block in other.held_blocks()
    engine.release_catalog(other)
    engine.run_until_idle()
    assert engine.blocks.num_free == idle


def test_queue_bound_is_resource_exhausted(backend, tok, catalog):
    small = make_engine(backend, tok, NUM_BLOCKS, max_waiting=2)
    rt = small.load_catalog(catalog.trie)
    small.submit(rt, "a", 1)
    small.submit(rt, "b", 1)
    with pytest.raises(QueueFull, match="the bound is 2"):
        small.submit(rt, "c", 1)
    small.run_until_idle()


def test_an_empty_mask_fails_loudly(engine, catalog, monkeypatch):
    monkeypatch.setattr("decoder_service.engine.sampler.legal_edges", lambda *a: 0)
    seq = engine.submit(catalog, "anything", 2)
    engine.run_until_idle()
    events = list(seq)
    assert isinstance(events[-1], FailedEvent) and "empty mask" in events[-1].message


def test_select_breaks_ties_on_the_lower_token_id():
    win, lp = sampler.select(np.array([1.0, 3.0, 3.0], np.float32), np.array([7, 9, 4], np.int32))
    assert win == 2 and lp == pytest.approx(np.log(np.exp(3) / (np.exp(1) + 2 * np.exp(3))))


def straight_constrained_greedy(backend, prompt_ids, trie, k, allowed):
    """The oracle: one sequence, the whole prompt in one chunk (no shared prefix, no batching), then
    greedy decoding over the dense head masked to the trie's legal edges for the allowed pointers (the
    shortlist), walked by plain Python."""
    from decoder_service.model.batch import StepBatch
    from shared.trie import SEP, STOP
    tables = np.arange(NUM_BLOCKS, dtype=np.int32)[None, :]
    node, emitted, names, chunk, pos = 0, [], [], list(prompt_ids), 0
    while True:
        backend.forward(StepBatch.from_chunks([(0, chunk, pos)], tables))
        pos += len(chunk)
        logits = backend.dense_logits()[0]
        lo, hi = trie.node_edge_start[node], trie.node_edge_start[node + 1]
        legal = [e for e in range(lo, hi)
                 if not (trie.edge_child[e] == SEP and len(emitted) + 1 >= k)
                 and not (trie.edge_child[e] == STOP and len(emitted) + 1 != k)
                 and set(range(trie.edge_lo[e], trie.edge_hi[e])) & set(allowed) - set(emitted)]
        best = max(legal, key=lambda e: (logits[trie.edge_token[e]], -trie.edge_token[e]))
        child = trie.edge_child[best]
        if child in (SEP, STOP):
            emitted.append(int(trie.edge_lo[best]))
            names.append(trie.pointer_names[emitted[-1]])
            node = 0
            if child == STOP:
                return names
        else:
            node = child
        chunk = [int(trie.edge_token[best])]


def test_engine_equals_a_straight_constrained_greedy_decode(tmp_path, tok, engine, catalog):
    """Shared prefix blocks, chunked prefill and batching change nothing: same names as the oracle."""
    from engine_fixtures import tiny_backend
    fresh = tiny_backend(tmp_path, tok.tokenizer.get_vocab_size(), NUM_BLOCKS)
    for intent, k in [(INTENTS[0], 2), (INTENTS[5], 3), (INTENTS[7], 1)]:
        seq = engine.submit(catalog, intent, k)
        assert len(seq.prompt_ids) - len(catalog.prefix_ids) > engine.config.chunk_size  # several prefill chunks
        engine.run_until_idle()
        assert answer(seq)[0] == straight_constrained_greedy(fresh, seq.prompt_ids, catalog.trie, k,
                                                             seq.allow.tolist())


@pytest.mark.parametrize("name", ["metatool", "bigcatalog", "toolbench"])
def test_sparse_and_dense_heads_agree_on_every_shared_catalog(backend, tok, name):
    """Every catalog of ../shared/data, whole (the root of Seal-Tools has hundreds of edges), under a
    short prompt so the test is about the heads, not the prefill."""
    import json as _json

    from compiler_service.compiler import compile_catalog
    from shared.catalog import parse_registry
    from shared.prompt import PromptTemplate
    from tokenizer_fixtures import catalog_path
    template = PromptTemplate(prefix="<|im_start|>system\nPick tools.<|im_end|>\n<|im_start|>user\n",
                              suffix="{intent} ({k})<|im_end|>\n<|im_start|>assistant\n", separator="\n",
                              stop_token="<|im_end|>")
    trie = compile_catalog(parse_registry(catalog_path(name).read_text()), tok, template)
    queries = [_json.loads(line) for line in (catalog_path(name).parent / "dev_queries.jsonl").open()][:6]
    results = {}
    for head in ("sparse", "dense"):
        eng = make_engine(backend, tok, NUM_BLOCKS, head=head)
        rt = eng.load_catalog(trie)
        eng.run_until_idle()
        seqs = [eng.submit(rt, q["query"], len(q["tools"])) for q in queries]
        eng.run_until_idle()
        results[head] = [answer(s)[:2] for s in seqs]
    assert results["sparse"] == results["dense"]
    assert all(len(set(names)) == len(q["tools"]) for (names, _), q in zip(results["sparse"], queries))


def test_a_large_fusion_weight_answers_in_retrieval_order(backend, tok, catalog):
    """The answer's order fuses the generator with retrieval: at a weight far above any logit gap the k
    names are the shortlist's first k, whatever the (random) generator prefers; at 0 the generator alone."""
    fused = make_engine(backend, tok, NUM_BLOCKS, fusion_weight=1000.0)
    rt = fused.load_catalog(catalog.trie)
    fused.run_until_idle()
    plain = make_engine(backend, tok, NUM_BLOCKS)
    rt0 = plain.load_catalog(catalog.trie)
    plain.run_until_idle()
    differ = 0
    for intent in INTENTS:
        shortlist = fused.retrieve(rt, intent, 3)
        seq = fused.submit(rt, intent, 3, shortlist=shortlist)
        seq0 = plain.submit(rt0, intent, 3, shortlist=shortlist)
        fused.run_until_idle()
        plain.run_until_idle()
        names = answer(seq)[0]
        assert names == [rt.trie.pointer_names[i] for i in shortlist.ids[:3]]
        differ += answer(seq0)[0] != names
    assert differ > 0   # the generator alone orders them otherwise


def test_a_catalog_the_selector_was_not_tuned_on_answers_in_retrieval_order(backend, tok, catalog):
    """The unseen weight (the floor's) holds for a version whose tools the model was not tuned on; the tuned
    weight (here 0: the generator alone) for one whose tools it was."""
    names = catalog.trie.pointer_names
    eng = make_engine(backend, tok, NUM_BLOCKS, tuned_tools=frozenset(names), fusion_weight=0.0,
                      fusion_weight_unseen=1000.0)
    known = eng.load_catalog(catalog.trie)
    eng.tuned_tools = frozenset({"Other"})      # as if the model had been tuned on another catalog
    unseen = eng.load_catalog(catalog.trie)
    eng.run_until_idle()
    assert known.fusion_weight == 0.0 and unseen.fusion_weight == 1000.0
    differ = 0
    for intent in INTENTS:
        shortlist = eng.retrieve(unseen, intent, 3)
        seqs = [eng.submit(rt, intent, 3, shortlist=shortlist) for rt in (known, unseen)]
        eng.run_until_idle()
        tuned, floor = (answer(s)[0] for s in seqs)
        assert floor == [names[i] for i in shortlist.ids[:3]]
        differ += tuned != floor
    assert differ > 0


def test_edge_prior_is_the_best_prior_left_below_an_edge():
    allow = np.asarray([2, 5, 7, 9], np.int32)
    prior = np.asarray([-3.0, -1.0, -0.0, -2.0], np.float32)
    emitted = np.asarray([7, -1], np.int32)
    assert sampler.edge_prior(0, 10, emitted, 0, allow, prior) == 0.0
    assert sampler.edge_prior(0, 10, emitted, 1, allow, prior) == -1.0   # 7 was emitted
    assert sampler.edge_prior(6, 10, emitted, 1, allow, prior) == -2.0
    assert sampler.edge_prior(3, 5, emitted, 0, allow, prior) == -np.inf


def test_both_samplers_implement_the_written_protocol(backend):
    """The engine's contract with a sampler is sampler.Sampler; the device sampler is checked by name (it needs a
    GPU backend to build), the host one as built."""
    from decoder_service.engine.cuda_sampler import DeviceSampler
    from decoder_service.engine.sampler import HostSampler, Sampler
    host = HostSampler(backend)
    assert isinstance(host, Sampler) and host.next_tokens([]) is None and host.done_flags([]) is None
    protocol = {n for n in vars(Sampler) if not n.startswith("_")}
    assert protocol <= set(dir(DeviceSampler)) and protocol <= set(dir(HostSampler))
    with pytest.raises(RuntimeError, match="nothing to follow"):
        host.follow([])
