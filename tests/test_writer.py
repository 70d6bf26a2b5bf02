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
from tune.writer import Pair, Prompts, clause_for, pairs, train_writer, write

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


def test_the_reader_scores_the_request_after_each_tool_and_reranks_by_it(tiny):
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
    # the second tool wins where the reading favours it enough to outweigh retrieval's order
    assert list(reader_score([[0.0, 1.0], [-5.0, -1.0]], (0.0, 1.0))) == pytest.approx([-1.0, 1.0])
    assert answer(row, [[-9.0, -1.0]], (0.2, 0.2)) == ["weather"]
    assert answer(row, [[-9.0, -1.0]], (1.0, 2.0)) == ["flights"]
    assert answer(row, [[-9.0, -1.0]], (1.0, 2.0), depth=1) == ["weather"], "a shallower shortlist: its first tools"


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
