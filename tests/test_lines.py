"""Tool-line KV (engine/lines.py): a line's K/V computed once after its version's prefix and copied into each request
that lists it, keys rotated into place. The answer is the masked prompt's computed whole in float64, the same bits
alone, in any batch, with its lines kept or computed again, and the pool's blocks are all accounted for."""
import random

import numpy as np
import pytest

from decoder_service.engine.sequence import State
from decoder_service.model.batch import StepBatch
from decoder_service.model.config import ModelConfig
from decoder_service.model.cpu import CpuBackend
from decoder_service.model.kv_pool import KVPoolSpec
from decoder_service.model.reference import ReferenceModel
from decoder_service.model.weights import load_weights
from engine_fixtures import BLOCK_SIZE, answer, make_engine, metatool_trie
from model_fixtures import make_tiny_model
from shared.tokenizer import ModelTokenizer

NUM_BLOCKS = 512
INTENTS = ["what's the weather in Paris tomorrow", "find me a cheap flight to Tokyo", "translate this pdf",
           "latest news about the stock market", "book a table for two tonight", "play some jazz music"]


class Recorder:
    """A CPU backend that keeps each forward step's batch and final hidden states."""

    def __init__(self, backend):
        self.backend, self.steps = backend, []

    def __getattr__(self, name):
        return getattr(self.backend, name)

    def forward(self, batch):
        self.backend.forward(batch)
        self.steps.append((batch, self.backend.hidden.copy()))


@pytest.fixture(scope="module")
def tok(small_tokenizer_dir):
    return ModelTokenizer(small_tokenizer_dir)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tok):
    return make_tiny_model(tmp_path_factory.mktemp("tiny"), "llama", "float32", tied=True, seed=0,
                           config_overrides={"vocab_size": tok.tokenizer.get_vocab_size(),
                                             "max_position_embeddings": 8192})


def backends(model_dir, num_blocks=NUM_BLOCKS):
    cfg = ModelConfig.from_dir(model_dir)
    weights = load_weights(model_dir, cfg, "float32")
    spec = KVPoolSpec(num_blocks, BLOCK_SIZE)
    return CpuBackend(cfg, weights, spec), ReferenceModel(cfg, weights, spec)


def engine_with_catalog(backend, tok, num_blocks=NUM_BLOCKS, warm_rows=0, **config):
    """An engine with line KV and a 40-tool catalog loaded (warm_rows 0: lines computed only for the requests)."""
    engine = make_engine(backend, tok, num_blocks, line_kv=True, chunk_size=256, warm_rows=warm_rows, **config)
    rt = engine.load_catalog(metatool_trie(tok, first=40))
    engine.run_until_idle()
    return engine, rt


@pytest.mark.parametrize("which", ["cpu", "reference"])
def test_a_moved_key_is_the_key_computed_there(model_dir, which):
    """Layer 0's K of a token depends only on the token and its position: computed at p and moved by d, it is the K
    computed at p + d (to float32's rounding on the CPU); V moves unchanged."""
    backend = dict(zip(["cpu", "reference"], backends(model_dir)))[which]
    tokens = np.asarray([5, 17, 99, 3, 250, 41, 7], np.int32)
    tables = np.asarray([[0, 1, 2, 3], [4, 5, 6, 7]], np.int32)
    for slot, start in ((0, 3), (1, 40)):
        backend.forward(StepBatch.from_chunks([(slot, tokens, start)], tables))
    at = np.arange(len(tokens))
    src = (tables[0][(3 + at) // BLOCK_SIZE] * BLOCK_SIZE + (3 + at) % BLOCK_SIZE).astype(np.int32)
    dst = (np.int32(20) * BLOCK_SIZE + at).astype(np.int32)     # a block no step wrote
    backend.place_kv(src, dst, np.full(len(at), 37, np.int32))
    k, v = backend.pool.k[0], backend.pool.v[0]
    computed = (tables[1][(40 + at) // BLOCK_SIZE] * BLOCK_SIZE + (40 + at) % BLOCK_SIZE)
    flat = k.reshape(-1, *k.shape[2:])
    tolerance = 1e-12 if which == "reference" else 1e-5
    assert np.abs(flat[dst] - flat[computed]).max() <= tolerance * np.abs(flat[computed]).max()
    assert np.array_equal(v.reshape(-1, *v.shape[2:])[dst], v.reshape(-1, *v.shape[2:])[src])


def masked_prompt_hidden(ref, rt, tools, intent, k) -> np.ndarray:
    """The final hidden state of a request's prompt whose lines attend to the prefix and themselves only, computed
    whole in float64: each line after the prefix at its canonical place, moved to where the prompt lists it, then
    the rest of the prompt."""
    prefix = rt.prefix_ids
    prompt = prefix + rt.request_ids(tools, intent, k)
    keys, rows = rt.line_keys(tools, k)
    blocks = iter(range(ref.pool.spec.num_blocks))
    per = -(-(len(prompt) + 1) // BLOCK_SIZE)
    table = np.asarray([[next(blocks) for _ in range(per)]], np.int32)

    def slot_of(row, p):
        return row[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE

    at, src, dst, shift = len(prefix), [], [], []
    for key in keys:
        line_table = np.asarray([[next(blocks) for _ in range(per)]], np.int32)
        ref.forward(StepBatch.from_chunks([(0, prefix + list(key[1]), 0)], line_table))
        n = min(len(key[1]), len(prefix) + rows - at)
        src += [slot_of(line_table[0], len(prefix) + j) for j in range(n)]
        dst += [slot_of(table[0], at + j) for j in range(n)]
        shift += [at - len(prefix)] * n
        at += n
    ref.forward(StepBatch.from_chunks([(0, prefix, 0)], table))
    ref.place_kv(*(np.asarray(a, np.int32) for a in (src, dst, shift)))
    ref.forward(StepBatch.from_chunks([(0, prompt[at:], at)], table))
    return ref.hidden[-1]


def test_the_prompt_is_the_masked_prompt_computed_whole(model_dir, tok):
    """The engine's prompt, lines copied in from their jobs, ends in the hidden state the masked prompt has computed
    whole in float64 (a float32 backend's rounding apart)."""
    cpu, ref = backends(model_dir)
    recorder = Recorder(cpu)
    engine, rt = engine_with_catalog(recorder, tok)
    for intent in INTENTS[:3]:
        recorder.steps.clear()
        seq = engine.submit(rt, intent, 2)
        engine.run_until_idle()
        answer(seq)
        # the step whose last row is the prompt's: its logit row is the first answer token's
        batch, hidden = next((b, h) for b, h in recorder.steps if b.positions[-1] == len(seq.prompt_ids) - 1)
        expected = masked_prompt_hidden(ref, rt, engine.retrieve(rt, intent, 2).ids, intent, 2)
        np.testing.assert_allclose(hidden[-1], expected, rtol=0, atol=2e-4 * np.abs(expected).max())


def test_a_step_fits_the_backends_block_tables(model_dir, tok):
    """Line jobs have no slot, so a step may hold more chunks than requests run at once; never more block-table
    entries than a GPU backend's buffer holds."""
    recorder = Recorder(backends(model_dir)[0])
    recorder.max_table = 160
    engine, rt = engine_with_catalog(recorder, tok, max_seqs=2)
    seqs = [engine.submit(rt, intent, 2) for intent in INTENTS]
    engine.run_until_idle()
    assert all(len(answer(seq)[0]) == 2 for seq in seqs)
    assert max(b.block_tables.size for b, _ in recorder.steps) <= 160
    assert max(len(b.block_tables) for b, _ in recorder.steps) > engine.config.max_seqs


def test_the_same_bits_alone_in_a_batch_kept_or_computed_again(model_dir, tok):
    """An answer's names and scores are the same whether its lines were kept or computed for it, and whatever
    requests share its steps."""
    alone = {}
    for intent in INTENTS:   # a fresh engine each: every line computed for this request
        engine, rt = engine_with_catalog(backends(model_dir)[0], tok)
        seq = engine.submit(rt, intent, 3)
        engine.run_until_idle()
        alone[intent] = answer(seq)[:2]
    engine, rt = engine_with_catalog(backends(model_dir)[0], tok)
    for round_ in range(2):   # the second round finds every line kept
        order = INTENTS[:]
        random.Random(round_).shuffle(order)
        seqs = {intent: engine.submit(rt, intent, 3) for intent in order}
        engine.run_until_idle()
        assert {intent: answer(seq)[:2] for intent, seq in seqs.items()} == alone
    assert len(engine.lines.kept) == len({key for i in INTENTS for key in rt.line_keys(
        engine.retrieve(rt, i, 3).ids, 3)[0]})


def test_a_new_version_computes_its_lines_after_the_requests_that_wait(model_dir, tok):
    """With warm_rows, a version computes every tool's line once its prefix is warm, a few a step and after the
    requests: one submitted meanwhile is answered before the last line, as an engine without warm-up answers it;
    then requests find every line kept. In a small pool it computes those that leave half the pool free."""
    cold, rt = engine_with_catalog(backends(model_dir)[0], tok)
    expected = {}
    for intent in INTENTS[:3]:
        seq = cold.submit(rt, intent, 2)
        cold.run_until_idle()
        expected[intent] = answer(seq)[:2]
    recorder = Recorder(backends(model_dir)[0])
    engine = make_engine(recorder, tok, NUM_BLOCKS, line_kv=True, chunk_size=256, warm_rows=64)
    rt = engine.load_catalog(metatool_trie(tok, first=40))
    while not rt.ready.is_set():
        engine.step()
    first = engine.submit(rt, INTENTS[0], 2)
    engine.run_until_idle()
    assert answer(first)[:2] == expected[INTENTS[0]]
    steps = [b for b, _ in recorder.steps]
    answered = next(i for i, b in enumerate(steps) if len(first.prompt_ids) - 1 in b.positions)
    assert answered < len(steps) - 1 and max(b.num_rows - b.decode_rows for b in steps[answered + 1:]) <= 64
    assert len(engine.lines.kept) == 40 and rt.lines_seconds > 0
    kept = {key: line.blocks for key, line in engine.lines.kept.items()}
    for intent in INTENTS[1:3]:
        seq = engine.submit(rt, intent, 2)
        engine.run_until_idle()
        assert answer(seq)[:2] == expected[intent]
    assert {key: line.blocks for key, line in engine.lines.kept.items()} == kept   # none computed again
    small = make_engine(backends(model_dir, 160)[0], tok, 160, line_kv=True, chunk_size=256, warm_rows=64)
    rt = small.load_catalog(metatool_trie(tok, first=40))
    small.run_until_idle()   # the warm-up ends where a line would leave under half the pool free
    assert rt.lines_ready.is_set() and 0 < len(small.lines.kept) < 40 and small.blocks.num_free >= 80


def test_lines_give_way_to_requests_and_every_block_is_accounted_for(model_dir, tok):
    """With a pool too small to keep every line, lines are dropped for the requests that need the blocks; each
    request is answered as with room to spare, and no block is lost."""
    roomy, rt = engine_with_catalog(backends(model_dir)[0], tok)
    expected = []
    for intent in INTENTS:
        seq = roomy.submit(rt, intent, 2)
        roomy.run_until_idle()
        expected.append(answer(seq)[:2])
    blocks = 80   # a request and its line jobs fit, not the lines of every request
    tight, rt = engine_with_catalog(backends(model_dir, blocks)[0], tok, num_blocks=blocks)
    got = []
    for intent in INTENTS:
        seq = tight.submit(rt, intent, 2)
        tight.run_until_idle()
        got.append(answer(seq)[:2])
        assert tight.blocks.consistent()
    assert got == expected
    held = sum(len(line.blocks) for line in tight.lines.kept.values())
    assert tight.blocks.num_free == blocks - len(rt.held_blocks()) - held
    assert 0 < held and all(not line.pins for line in tight.lines.kept.values())
    listed = {key for i in INTENTS for key in rt.line_keys(tight.retrieve(rt, i, 2).ids, 2)[0]}
    assert len(tight.lines.kept) < len(listed)


def test_a_request_cancelled_before_its_lines_are_copied(model_dir, tok):
    """Cancelled once its lines were computed and before they were copied in, a request lets go of them; they are
    kept all the same, and the next request that lists them copies them."""
    engine, rt = engine_with_catalog(backends(model_dir)[0], tok)
    seq = engine.submit(rt, INTENTS[0], 2)
    engine.step()   # admitted, its line jobs run
    assert seq.state == State.PREFILL and seq.computed == len(rt.prefix_ids)
    assert seq.lines and all(line.ready and line.pins == 1 for line in seq.lines)
    engine.cancel(seq)
    engine.run_until_idle()
    assert [type(e).__name__ for e in seq] == ["FailedEvent"]
    assert engine.lines.kept and all(line.ready and not line.pins for line in engine.lines.kept.values())
    again = engine.submit(rt, INTENTS[0], 2)
    engine.run_until_idle()
    names, _, done = answer(again)
    assert len(names) == 2 and done.prompt_tokens == len(again.prompt_ids)
    assert engine.blocks.consistent()


def test_training_computes_the_prompt_as_served(model_dir, tok):
    """tune.lines, the selector's training with line KV in PyTorch, ends a prompt in the hidden state the service's
    float64 reference computes for it."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from tune import lines as tune_lines
    from tune.model import load
    ref = backends(model_dir)[1]
    engine, rt = engine_with_catalog(backends(model_dir)[0], tok)
    model = load(model_dir, "cpu")
    for intent, k in ((INTENTS[1], 1), (INTENTS[4], 3)):
        tools = engine.retrieve(rt, intent, k).ids
        keys, rows = rt.line_keys(tools, k)
        prompt = rt.prefix_ids + rt.request_ids(tools, intent, k)
        parts = tune_lines.Parts(rt.prefix_ids, [list(key[1]) for key in keys], rows,
                                 prompt[len(rt.prefix_ids) + rows:])
        with torch.no_grad():
            states, _ = tune_lines.hidden(model, [parts], [[]], "cpu")
        expected = masked_prompt_hidden(ref, rt, tools, intent, k)
        got = states[0, len(parts.rest) - 1].double().numpy()
        np.testing.assert_allclose(got, expected, rtol=0, atol=2e-4 * np.abs(expected).max())


def test_served_over_grpc_and_swapped_to_a_new_version(tmp_path, small_tokenizer_dir, redis_url):
    """A decoder with line KV over real gRPC and Redis answers k distinct names of the version, the same bits again
    once its lines are kept; a new version whose tool describes itself otherwise computes that line anew (its
    warm-up) and answers with its own names."""
    from decoder_stack import TOOLS, DecoderStack, discover, trie_of, wait_until
    from shared.rpc import decoder_pb2 as pb
    stack = DecoderStack(tmp_path, small_tokenizer_dir, redis_url, line_kv=True)
    try:
        stack.store.publish("lines", trie_of(stack.tok, TOOLS))
        stack.start()
        request = dict(catalog="lines", intent=INTENTS[0], k=3, mode=pb.MODE_DECODE)
        accepted, pointers = discover(stack.stub(), **request)
        assert len({p.name for p in pointers}) == 3 and {p.name for p in pointers} <= {t["name"] for t in TOOLS}
        assert discover(stack.stub(), **request)[1] == pointers
        changed = [dict(t, description="converts currencies at today's rate") if t["name"] == pointers[0].name else t
                   for t in TOOLS]
        kept = set(stack.engine.lines.kept)
        stack.store.publish("lines", trie_of(stack.tok, changed))
        wait_until(lambda: discover(stack.stub(), **request)[0].version == accepted.version + 1, 60, "version 2")
        assert len({p.name for p in discover(stack.stub(), **request)[1]}) == 3
        wait_until(lambda: any("currencies" in stack.tok.decode(list(key[1]))
                               for key in set(stack.engine.lines.kept) - kept), 60, "the changed line computed")
    finally:
        stack.close()
