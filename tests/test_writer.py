"""tune.writer and tune.reader: the pairs they learn from, a tiny random Llama that learns to write them, and the
reader's scores (CPU). Skipped where torch or transformers is not installed."""
from __future__ import annotations

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from decoder_service.retrieval.host import intent_parts
from model_fixtures import make_chat_model
from shared import dataset
from tune import lora, model as tmodel
from tune.writer import NEGATIVES, Pair, Prompts, clause_for, pairs, rank_loss, train_writer, with_negatives, write

VOCAB = 400


def test_a_multi_tool_request_teaches_each_tool_its_own_clause():
    query = "Find flights to Paris for next week and then check the weather forecast in Paris."
    flights = clause_for(query, "searchFlights", "Search flights between two cities")
    assert flights == "Find flights to Paris for next week"
    assert clause_for(query, "getWeatherForecast", "Weather forecast of a city").startswith("check the weather")


def test_pairs_come_from_the_fit_split_alone_and_at_most_ten_a_tool():
    fit = {" ".join(part.split()) for q in dataset.queries("metatool", "train") if not dataset.is_selection(q.text)
           for part in intent_parts(q.text)}
    got = pairs(["metatool"])
    assert got and all(p.request in fit for p in got)   # a fit request or one of its clauses, never validation's
    per_tool: dict[str, int] = {}
    for p in got:
        per_tool[p.name] = per_tool.get(p.name, 0) + 1
    assert max(per_tool.values()) == 10
    assert pairs(["metatool"]) == got   # a seeded draw


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_chat_model(tmp_path_factory.mktemp("writer"), VOCAB, seed=1)


def test_the_writer_learns_a_request_and_writes_it_back(tiny):
    prompts = Prompts(tiny)
    items = [Pair("weather", "Weather forecast of a city", "what is the weather in paris")] * 8
    model = tmodel.load(tiny, "cpu")
    lora.add_lora(model, 8, 16.0)
    losses = train_writer(model, prompts, items, epochs=30, batch_size=8, lr=3e-2, seed=0, device="cpu")
    assert losses[-1] < losses[0] / 4
    written = write(model, prompts, [{"name": "weather", "description": "Weather forecast of a city"}], "cpu",
                    openers=("",))
    assert written == {"weather": ["what is the weather in paris"]}


def test_a_pair_ranks_against_its_requests_shortlist_less_its_gold_tools(tmp_path):
    import json
    rows = [{"query": "weather and flights", "gold": ["weather", "flights"], "shortlist": ["news", "weather", "flights",
             "hotels", "stocks", "maps"]}, {"query": "short", "gold": ["news"], "shortlist": ["news", "maps"]}]
    path = tmp_path / "fit.json"
    path.write_text(json.dumps({"s": {"descriptions": {n: n.upper() for r in rows for n in r["shortlist"]},
                                      "rows": rows}}))
    got = with_negatives([Pair("flights", "", "flights", "weather and flights"), Pair("maps", "", "x", "weather and "
                          "flights"), Pair("news", "", "short", "short"), Pair("weather", "", "x", "unknown")], path)
    # the tool must be the request's gold, with NEGATIVES others shortlisted; a request never its own negative
    assert [p.name for p in got] == ["flights"] and NEGATIVES <= 4
    assert got[0].negatives == (("news", "NEWS"), ("hotels", "HOTELS"), ("stocks", "STOCKS"), ("maps", "MAPS"))


def test_the_ranking_stage_makes_a_request_likelier_after_its_own_tool_than_after_its_neighbours(tiny):
    from tune.reader import likelihoods
    from tune.train import fit
    prompts = Prompts(tiny)
    tools = {"weather": "Weather forecast of a city", "flights": "Search flights between two cities",
             "hotels": "Book a hotel room", "news": "Latest headlines", "stocks": "Stock quotes"}
    request = "what is it like in paris"
    items = [Pair("weather", tools["weather"], request, request, tuple((n, d) for n, d in tools.items()
                                                                      if n != "weather"))] * 8
    model = tmodel.load(tiny, "cpu")
    lora.add_lora(model, 8, 16.0)
    row = {"parts": [request], "shortlist": list(tools)}
    before = likelihoods(model, prompts, [row], tools, "cpu")[0][0]
    losses = fit(model, items, lambda m, chunk, rng: rank_loss(m, prompts, chunk, rng, "cpu"), epochs=10,
                 batch_size=8, lr=3e-2, seed=0, device="cpu")
    after = likelihoods(model, prompts, [row], tools, "cpu")[0][0]
    assert losses[-1] < losses[0]
    assert max(before[1:]) > before[0] - 1.0 and min(after[0] - x for x in after[1:]) > 1.0, (before, after)


def test_saved_adapters_load_back_and_refuse_another_scale(tiny, tmp_path):
    import torch
    model = tmodel.load(tiny, "cpu")
    lora.add_lora(model, 8, 16.0)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(0.01)
    lora.save_adapters(model, tmp_path / "a", 8, 16.0, {})
    again = tmodel.load(tiny, "cpu")
    lora.add_lora(again, 8, 16.0)
    lora.load_adapters(again, tmp_path / "a")
    assert {n: t.tolist() for n, t in lora.adapter_tensors(again).items()} == {
        n: t.tolist() for n, t in lora.adapter_tensors(model).items()}
    other = tmodel.load(tiny, "cpu")
    lora.add_lora(other, 8, 32.0)
    with pytest.raises(ValueError, match="alpha"):
        lora.load_adapters(other, tmp_path / "a")


def test_the_reader_scores_the_request_after_each_tool_and_reranks_by_its_best_clause(tiny):
    import torch

    from decoder_service.reader import reader_score
    from tune.reader import answer, likelihoods
    prompts = Prompts(tiny)
    model = tmodel.load(tiny, "cpu")
    row = {"parts": ["weather in paris"], "shortlist": ["weather", "flights"], "scores": [1.0, 0.0], "gold": ["x"]}
    got = likelihoods(model, prompts, [row], {"weather": "Weather forecast"}, "cpu")
    head, request = prompts.prompt("flights", ""), prompts.tok.encode("weather in paris")
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([head + request])).logits[0].float(), -1)
    expected = sum(float(logp[len(head) - 1 + j, t]) for j, t in enumerate(request))
    assert got[0][0][1] == pytest.approx(expected, abs=2e-3)
    # the second tool wins where a clause favours it enough to outweigh retrieval's order
    assert list(reader_score([[0.0, 1.0], [-5.0, -1.0]])) == pytest.approx([-1.0, 1.0])
    assert answer(row, [[-9.0, -1.0]], beta=0.5) == ["weather"]
    assert answer(row, [[-9.0, -1.0]], beta=2.0) == ["flights"]


def test_the_served_reader_gives_the_measured_readers_likelihoods(tiny):
    """decoder_service.reader (the model runtime, heads and parts in separate steps) against tune.reader (PyTorch,
    each head + part whole): the figures measured are the ones served."""
    import numpy as np

    from decoder_service.reader import Reader
    from tune.reader import likelihoods
    tools = {"weather": "Weather forecast of a city", "flights": "Search flights between two airports", "notes": ""}
    intent = "What is the weather in Rome tomorrow, and then find a flight from Paris to Rome."
    row = {"parts": intent_parts(intent), "shortlist": list(tools)}
    measured = likelihoods(tmodel.load(tiny, "cpu"), Prompts(tiny), [row], tools, "cpu")[0]
    reader = Reader(tiny, "cpu")
    served = reader.likelihoods(*reader.tokens(list(tools.items()), intent))
    np.testing.assert_allclose(served, measured, rtol=1e-3, atol=1e-3)
