"""The encoder tuned for tools: its training data and splits, the carried base, the numpy merge of a delta against
the training side's LoRA (a tiny random BERT, on the CPU), and the leave-one-out choice of encoder."""
from __future__ import annotations

import json
import random
from types import SimpleNamespace

import numpy as np
import pytest
from safetensors.numpy import load_file

from decoder_service.encoder.tuned import TUNED_ENCODER, trained_on, without
from shared.errors import ModelError
from decoder_service.retrieval.vectors import tool_texts
from shared import dataset
from shared.config import REPO_ROOT as REPO
from test_encoder import write_tiny_model
from tune import encoder_data as data
from tune.encoder_carry import WORDS, pack, unpack
from tune.merge import base_fingerprint


def has_data() -> bool:
    try:
        dataset.data_dir()
        return True
    except SystemExit:
        return False


needs_data = pytest.mark.skipif(not has_data(), reason="no ../shared/data")


def test_tool_text_is_what_the_retriever_encodes():
    names, descriptions = ["get_weather", "pdf2text", "bare"], ["Get the forecast.", "Convert a PDF to text", ""]
    trie = SimpleNamespace(pointer_names=names, meta={"descriptions": descriptions})
    assert [data.tool_text(n, d) for n, d in zip(names, descriptions)] == tool_texts(trie)


@needs_data
def test_fit_pairs_never_hold_a_selection_or_validation_query():
    for name in dataset.SETS:
        fit = data.split_queries(name, "fit")
        texts = {q.text for q in fit}
        assert not texts & {q.text for q in dataset.queries(name, "selection")}
        assert not texts & {q.text for q in dataset.queries(name, "validation")}
        assert len(fit) + len(dataset.queries(name, "selection")) == len(dataset.queries(name, "train"))
        cat = data.catalog(name)
        pairs = data.pairs(cat, fit)
        assert len(pairs) == sum(len(q.tools) for q in fit)
        assert all(p.tool in p.gold and cat.names[p.tool] for p in pairs)


def test_an_epoch_uses_each_pair_once_and_caps_a_tool():
    pairs = [data.Pair("c", f"q{i}", i % 3, frozenset({i % 3})) for i in range(50)]
    batches = data.epoch(pairs, 8, random.Random(0))
    assert sorted(p.query for b in batches for p in b) == sorted(p.query for p in pairs)
    assert [len(b) for b in batches] == [8] * 6 + [2]
    capped = [p for b in data.epoch(pairs, 8, random.Random(0), per_tool=4) for p in b]
    assert sorted(p.tool for p in capped) == [0] * 4 + [1] * 4 + [2] * 4
    assert data.epoch(pairs, 8, random.Random(1)) == data.epoch(pairs, 8, random.Random(1))


@needs_data
def test_the_carried_base_has_the_base_layout_and_the_used_rows(tmp_path):
    base = write_tiny_model(tmp_path / "base")
    pack(base, tmp_path / "packed")
    unpack(tmp_path / "packed", tmp_path / "rebuilt")
    assert base_fingerprint(tmp_path / "rebuilt") == base_fingerprint(base)
    before = load_file(str(base / "model.safetensors"))
    after = load_file(str(tmp_path / "rebuilt" / "model.safetensors"))
    rows = load_file(str(tmp_path / "packed" / "model.safetensors"))["carried_rows"]
    kept = np.zeros(len(before[WORDS]), bool)
    kept[rows] = True
    assert np.array_equal(after[WORDS][kept], before[WORDS][kept].astype(np.float16).astype(np.float32))
    assert not after[WORDS][~kept].any()
    for k in set(before) - {WORDS}:
        np.testing.assert_array_equal(after[k], before[k].astype(np.float16).astype(np.float32))


def test_the_numpy_merge_gives_the_trained_encoder(tmp_path):
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from decoder_service.encoder import load_encoder
    from tune.encoder import TARGETS, SentenceEncoder, save_delta
    from tune.encoder_merge import merge_encoder
    from tune.lora import LoraLinear, adapter_tensors, add_lora

    base = write_tiny_model(tmp_path / "tiny")
    torch.manual_seed(0)
    model = SentenceEncoder(base, "cpu")
    add_lora(model.bert, 4, 8.0, TARGETS)
    wrapped = [m for m in model.bert.modules() if isinstance(m, LoraLinear)]
    assert len(wrapped) == 6 * 2   # q, k, v, attention output, intermediate, output in each of the two layers
    with torch.no_grad():   # a trained-looking delta, exactly representable in the fp16 file
        for m in wrapped:
            m.lora_A.copy_(m.lora_A.half().float())
            m.lora_B.copy_((torch.randn_like(m.lora_B) * 0.2).half().float())
    texts = ["get the weather forecast in rome", "convert a pdf to text", "book a hotel in paris"]
    want = model.encode(texts).numpy()
    save_delta(tmp_path / "tuned.safetensors", adapter_tensors(model.bert), {"rank": 4, "alpha": 8.0},
               base_fingerprint(base), ["metatool", "toolbench"])
    merge_encoder(base, tmp_path / "tuned.safetensors", tmp_path / "tiny-tuned")
    merged = load_file(str(tmp_path / "tiny-tuned" / "model.safetensors"))
    for name, m in model.bert.named_modules():
        if isinstance(m, LoraLinear):   # the training side's merge: W + scale * B @ A
            side = (m.base.weight + m.scale * m.lora_B @ m.lora_A).detach().numpy()
            np.testing.assert_allclose(merged[f"{name}.weight"], side, rtol=0, atol=1e-6)
    got = load_encoder(tmp_path / "tiny-tuned", "cpu").encode(texts)
    assert np.abs(got - want).max() < 1e-5
    assert np.abs(got - load_encoder(base, "cpu").encode(texts)).max() > 1e-3   # the delta changed the vectors
    assert trained_on(tmp_path / "tiny-tuned") == {"metatool", "toolbench"}


def test_a_delta_for_another_base_is_refused(tmp_path):
    pytest.importorskip("torch")
    from tune.encoder import save_delta
    from tune.encoder_merge import merge_encoder

    base = write_tiny_model(tmp_path / "tiny")
    save_delta(tmp_path / "d.safetensors", {}, {"rank": 4, "alpha": 8.0}, "another", ["metatool"])
    with pytest.raises(ValueError, match="fingerprint"):
        merge_encoder(base, tmp_path / "d.safetensors", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def _tuned(folder, sets):
    folder.mkdir(parents=True)
    (folder / TUNED_ENCODER).write_text(json.dumps({"trained_on": sets}))
    return folder


def test_the_unseen_rows_use_an_encoder_never_trained_on_the_set(tmp_path):
    base = tmp_path / "enc"
    base.mkdir()
    assert without(base, "metatool") == base                      # the base never saw any set
    tuned = _tuned(tmp_path / "enc-tuned", ["bigcatalog", "metatool", "toolbench"])
    with pytest.raises(ModelError, match="absent"):
        without(tuned, "metatool")
    _tuned(tmp_path / "enc-tuned-without-metatool", ["bigcatalog", "metatool"])
    with pytest.raises(ModelError, match="cannot stand"):
        without(tuned, "metatool")
    fold = _tuned(tmp_path / "enc-tuned-without-toolbench", ["bigcatalog", "metatool"])
    assert without(tuned, "toolbench") == fold
    assert without(fold, "toolbench") == fold
    assert without(_tuned(tmp_path / "two", ["metatool"]), "bigcatalog") == tmp_path / "two"


@needs_data
def test_an_unseen_catalog_is_published_without_examples():
    for name in dataset.SETS:
        tools = json.loads(dataset.catalog_path(name).read_text())
        published = json.loads(dataset.published(tools, []))
        assert [t["name"] for t in published] == [t["name"] for t in tools]
        assert not any(t["examples"] for t in published)


def test_the_committed_deltas_are_small_and_left_out_what_they_say():
    from tune.encoder_merge import read_delta

    deltas = REPO / "tune" / "encoder_deltas" / "all-minilm-l6-v2"
    files = sorted(deltas.glob("*.safetensors"))
    assert [f.name for f in files] == ["tuned-without-bigcatalog.safetensors", "tuned-without-metatool.safetensors",
                                       "tuned-without-toolbench.safetensors", "tuned.safetensors"]
    card = json.loads((deltas / "card.json").read_text())
    for f in files:
        assert f.stat().st_size < 2_000_000
        tensors, meta = read_delta(f)
        sets = set(meta["trained_on"].split(","))
        left_out = f.stem.removeprefix("tuned").removeprefix("-without-")
        assert sets == set(dataset.SETS) - {left_out}
        assert meta["base_fingerprint"] == card["base"]["fingerprint"]
        assert json.loads(meta["recipe"]) == card["trials"][card["chosen"]]["recipe"]
        assert len(tensors) == 6 * 6 * 2 and all(t.dtype == np.float16 for t in tensors.values())
    base = REPO / "models" / "all-MiniLM-L6-v2"
    if (base / "model.safetensors").is_file():
        assert base_fingerprint(base) == card["base"]["fingerprint"]
