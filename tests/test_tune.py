"""tune on a tiny random Llama (CPU): the loss falls, and the merged adapters load in the project's runtime
with the logits the trained PyTorch model gives. Skipped where torch or transformers is not installed."""
from __future__ import annotations

import json
import random

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

import torch

from decoder_service.model.batch import StepBatch
from decoder_service.model.config import ModelConfig
from decoder_service.model.kv_pool import KVPoolSpec
from decoder_service.model.reference import ReferenceModel
from decoder_service.model.weights import load_weights
from model_fixtures import make_tiny_model
from tokenizer_fixtures import catalog_path, make_tokenizer_dir
from decoder_service.engine.fusion import tuned_tools
from tune import lora, model as tmodel
from tune.__main__ import main as tune_main
from shared.dataset import Query, read_queries
from tune.data import Encoder, Source, items, split, synthetic, training_items
from tune.evaluate import decode
from tune.merge import base_fingerprint, merge
from tune.shortlist import Shortlister, with_gold
from tune.train import train

VOCAB = 400


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A tiny llama that speaks the small test tokenizer, a 12-tool registry and 48 labelled queries."""
    tmp = tmp_path_factory.mktemp("tune")
    base = make_tiny_model(tmp, "llama", "float32", tied=True, seed=1,
                           config_overrides={"vocab_size": VOCAB, "max_position_embeddings": 2048})
    make_tokenizer_dir(base, vocab_size=VOCAB)
    tools = json.loads(catalog_path("metatool").read_text())[:12]
    registry = tmp / "registry.json"
    registry.write_text(json.dumps(tools))
    rng = random.Random(0)
    lines = []
    for i in range(48):
        gold = rng.sample([t["name"] for t in tools], 1 + i % 2)
        lines.append({"query": f"request {i}: " + " and ".join(t["description"][:40] for t in tools
                                                                if t["name"] in gold), "tools": gold})
    queries = tmp / "queries.jsonl"
    queries.write_text("".join(json.dumps(q) + "\n" for q in lines))
    return tmp, base, Source("tiny", registry, queries)


def test_with_gold_replaces_the_lowest_ranked_non_gold_tool():
    assert with_gold([5, 3, 9, 1], [7]) == [5, 3, 9, 7]
    assert with_gold([5, 3, 9, 1], [1, 8]) == [5, 3, 8, 1]
    assert with_gold([5, 3], [3]) == [5, 3]
    placed = {tuple(with_gold([5, 3, 9, 1], [7], random.Random(s))) for s in range(40)}
    assert {p.index(7) for p in placed} == {0, 1, 2, 3} and all(sorted(p) == [3, 5, 7, 9] for p in placed)


def test_a_training_query_is_never_shortlisted_through_its_own_example(setup):
    tmp, base, source = setup
    tools = json.loads(source.registry.read_text())
    query = Query("zqxv wobble frobnicate", (tools[-1]["name"],))
    shortlister = Shortlister(Encoder(base).tok)
    published = shortlister.shortlists(tools, [query], frozenset(), [query.text], 3, leave_own_fold=False)[0]
    assert published[0] == tools[-1]["name"]          # its words are only in that tool's published examples
    left_out = shortlister.shortlists(tools, [query], frozenset(), [query.text], 3, leave_own_fold=True)[0]
    assert tools[-1]["name"] not in left_out and len(left_out) == 3


def test_training_lowers_the_loss_and_the_merged_model_matches_in_the_runtime(setup):
    tmp, base, source = setup
    enc = Encoder(base)
    cat = enc.catalog(source)
    train_q, _, valid_q = split(cat, read_queries(source.queries))
    retriever, place = Shortlister(enc.tok), random.Random(1)
    train_items = (training_items(cat, train_q, 6, 1, retriever, place)
                   + training_items(cat, synthetic(cat, train_q, random.Random(0)), 6, 1, retriever, place,
                                    synthetic=True))
    assert all(set(it.gold) <= set(it.shortlist) and len(it.shortlist) == 6 for it in train_items)

    torch.manual_seed(0)
    net = tmodel.load(base, "cpu")
    lora.add_lora(net, rank=4, alpha=8.0)
    assert all(("lora_" in n) == p.requires_grad for n, p in net.named_parameters())
    losses = train(net, enc, train_items, epochs=6, batch_size=8, lr=2e-2, seed=0, device="cpu", shuffled=0.5,
                   log=lambda m: None)
    first, last = np.mean(losses[:3]), np.mean(losses[-3:])
    assert last < 0.7 * first, (first, last)

    lora.save_adapters(net, tmp / "adapters", 4, 8.0, {"name": base.name, "fingerprint": base_fingerprint(base)})
    merge(base, tmp / "adapters", tmp / "merged")

    it = items(cat, valid_q or train_q, 6, retriever)[0]
    prompt = enc.prompt(it, it.shortlist)
    net.eval()
    with torch.no_grad():
        want = net(input_ids=torch.tensor([prompt])).logits[0, -1].double().numpy()
    cfg = ModelConfig.from_dir(tmp / "merged")
    ref = ReferenceModel(cfg, load_weights(tmp / "merged", cfg, "float32", progress=False),
                         KVPoolSpec(num_blocks=len(prompt) // 16 + 2, block_size=16))
    table = np.arange(len(prompt) // 16 + 2, dtype=np.int32)[None]
    ref.forward(StepBatch.from_chunks([(0, prompt, 0)], table))
    got = ref.dense_logits()[0]
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-3
    assert got.argmax() == want.argmax()

    answer = decode(net, enc, [it], "cpu")[0]
    assert len(answer) == len(it.gold) == len(set(answer)) and set(answer) <= set(it.shortlist)


def test_training_with_line_kv_lowers_the_loss_and_decodes_k_names(setup):
    """`--line-kv` trains on prompts computed as the service computes them with TOOLTRIE_LINE_KV (tune.lines; that they
    are is tests/test_lines.py's), and decodes so."""
    tmp, base, source = setup
    enc = Encoder(base)
    cat = enc.catalog(source)
    train_q, _, valid_q = split(cat, read_queries(source.queries))
    retriever = Shortlister(enc.tok)
    train_items = training_items(cat, train_q, 6, 1, retriever, random.Random(1))
    torch.manual_seed(0)
    net = tmodel.load(base, "cpu")
    lora.add_lora(net, rank=4, alpha=8.0)
    losses = train(net, enc, train_items, epochs=6, batch_size=8, lr=2e-2, seed=0, device="cpu", shuffled=0.5,
                   line_kv=True, log=lambda m: None)
    assert np.mean(losses[-3:]) < 0.7 * np.mean(losses[:3]), losses
    net.eval()
    batch = items(cat, valid_q or train_q, 6, retriever)[:4]
    for it, answer in zip(batch, decode(net, enc, batch, "cpu", line_kv=True)):
        assert len(answer) == len(it.gold) == len(set(answer)) and set(answer) <= set(it.shortlist)


def test_merge_refuses_adapters_trained_on_another_base(setup):
    tmp, base, _ = setup
    net = tmodel.load(base, "cpu")
    lora.add_lora(net, rank=2, alpha=2.0)
    lora.save_adapters(net, tmp / "other", 2, 2.0, {"name": "x", "fingerprint": "0" * 64})
    with pytest.raises(ValueError, match="trained on"):
        merge(base, tmp / "other", tmp / "refused")
    assert not (tmp / "refused").exists()


def test_cli_writes_adapters_model_and_card(setup):
    tmp, base, source = setup
    out = tmp / "run"
    tune_main(["--base", str(base), "--out", str(out), "--registry", str(source.registry), "--queries",
               str(source.queries), "--synthetic", "--shortlist", "6", "--rank", "2", "--alpha", "4",
               "--epochs", "1", "--batch-size", "16", "--device", "cpu"])
    card = json.loads((out / "card.json").read_text())
    assert card["data"]["registry"]["registry_sha256"] and card["hyperparameters"]["seed"] == 0
    assert set(card["validation"]["registry"]) >= {"recall", "retriever_recall", "shortlist_ceiling"}
    assert card["examples"]["registry"]["selection_queries"] == sum(
        q["queries"] for q in card["selection"].values())
    assert card["adapter_bytes"] == sum(p.stat().st_size for p in (out / "adapters").glob("*.safetensors"))
    names = {t["name"] for t in json.loads(source.registry.read_text())}
    assert tuned_tools(out / "adapters") == names == tuned_tools(out / "model")   # the decoder's fusion reads it
    cfg = ModelConfig.from_dir(out / "model")
    load_weights(out / "model", cfg, "float32", progress=False)
    assert (out / "model" / "tokenizer.json").is_file()


def test_evaluate_only_reports_both_splits_and_writes_nothing(setup, capsys):
    tmp, base, source = setup
    out = tmp / "evaluated"
    tune_main(["--base", str(base), "--out", str(out), "--registry", str(source.registry), "--queries",
               str(source.queries), "--shortlist", "6", "--evaluate-only", "--device", "cpu"])
    printed = capsys.readouterr().out
    report = json.loads(printed[printed.index("\n{\n") + 1:])
    assert report["selection"]["registry"]["queries"] > 0 and report["validation"]["registry"]["queries"] > 0
    assert not out.exists()
