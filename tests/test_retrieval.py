"""The first stage: BM25 terms and index, fusion with the dense scores, the intent's clauses, the examples'
pull on a tool's vector and the requests' vote, the shortlist's order, stored vectors."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from compiler_service.compiler import compile_catalog
from decoder_service.retrieval.config import NEIGHBOURS
from decoder_service.retrieval.host import Retriever, intent_parts, top_n
from decoder_service.retrieval.vectors import (VECTORS_RECIPE, Vectors, tool_vectors, vectors_blob, vectors_digest,
                                               vectors_from_blob, written_request)
from shared.bm25 import Bm25Index, terms, tool_terms
from shared.catalog import parse_registry
from shared.tokenizer import ModelTokenizer
from shared.trie import Trie

ROOT = Path(__file__).resolve().parents[1]


def test_names_split_where_a_person_reads_words():
    assert terms("getWeatherForecast") == ["weather", "forecast"]
    assert terms("PDF&URLTool") == ["pdf", "url", "tool"]
    assert terms("Pattern Monster :: Get Patterns") == ["pattern", "monster", "pattern"]
    assert terms("getPM2.5Level") == ["pm", "2", "5", "level"]
    assert terms("HTTPServer weather_forecast") == ["http", "server", "weather", "forecast"]


def test_bm25_ranks_the_tool_that_says_it():
    docs = [tool_terms("WeatherNow", "current weather and forecasts"), tool_terms("Translator", "translate text"),
            tool_terms("FlightFinder", "search cheap flights"), tool_terms("Recipes", "cooking recipes")]
    index = Bm25Index.build(docs)
    index.check(len(docs))
    scores = index.scores("what's the weather forecast in Paris", len(docs))
    assert int(np.argmax(scores)) == 0 and scores[1:].max() == 0
    ids, values = index.matched("cheap flight or weather", len(docs))
    assert sorted(ids.tolist()) == [0, 2] and np.array_equal(values, index.scores("cheap flight or weather", 4)[ids])
    assert index.matched("nothing matches this", len(docs))[0].size == 0


def test_an_index_read_from_its_arrays_is_ready_before_its_first_query():
    built = Bm25Index.build([tool_terms("WeatherNow", "current weather"), tool_terms("Recipes", "cooking recipes")])
    read = Bm25Index(built.terms, built.term_start, built.doc, built.weight)   # as a decoder reads a blob
    assert read.lookup == {t: i for i, t in enumerate(built.terms)}   # a version's first request builds nothing
    assert np.array_equal(read.scores("weather", 2), built.scores("weather", 2))


def test_a_fresh_process_compiles_nothing_at_its_first_query():
    """The first query of a process once compiled BM25's sum of postings (147 ms of a first retrieval on an H100):
    a decoder reading a version's index (arrays from a blob: read-only) compiles it then."""
    script = """
import numpy as np
from shared.bm25 import Bm25Index, _accumulate, tool_terms
built = Bm25Index.build([tool_terms("WeatherNow", "current weather"), tool_terms("Recipes", "cooking recipes")])
arrays = [np.frombuffer(getattr(built, a).tobytes(), getattr(built, a).dtype) for a in Bm25Index.ARRAYS]
read = Bm25Index(built.terms, *arrays)
compiled = len(_accumulate.signatures)
read.matched("weather today", 2)
print(compiled, len(_accumulate.signatures))
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    before, after = map(int, out.stdout.split())
    assert before >= 1 and after == before


def test_a_corrupt_index_is_refused():
    index = Bm25Index.build([["a", "b"], ["b"]])
    bad = Bm25Index(index.terms, index.term_start, index.doc.copy(), index.weight)
    bad.doc[0] = 7
    with pytest.raises(ValueError, match="outside the catalog"):
        bad.check(2)


def test_top_n_is_best_first_with_the_lower_id_on_a_tie():
    scores = np.asarray([0.5, 0.9, 0.9, -np.inf, 0.7, 0.9], np.float32)
    assert top_n(scores, 4).tolist() == [1, 2, 5, 4]
    assert top_n(scores, 6).tolist() == [1, 2, 5, 4, 0, 3]


def test_a_tools_examples_are_part_of_its_bm25_document(small_tokenizer_dir):
    registry = ('[{"name": "alpha", "description": "first tool", "examples": ["convert these pounds to euros"]},'
                ' {"name": "beta", "description": "second tool"}]')
    tok = ModelTokenizer(small_tokenizer_dir)
    trie = compile_catalog(parse_registry(registry), tok)
    alpha = trie.pointer_names.index("alpha")                  # pointer ids follow the trie, not the registry
    assert trie.meta["examples"][alpha] == ["convert these pounds to euros"]
    assert trie.meta["examples"][1 - alpha] == []
    assert trie.meta["descriptions"][alpha] == "first tool"   # the prompt's description: examples stay out of it
    trie.check(tok.tokenizer.get_vocab_size())
    retriever = Retriever(Bm25Index(trie.meta["bm25_terms"], *(trie.extra[f"bm25_{a}"] for a in Bm25Index.ARRAYS)),
                          2)
    assert retriever.shortlist("how many euros is 20 pounds", 2).ids.tolist() == [alpha, 1 - alpha]
    trie.meta["examples"] = [["fine"], [3]]
    with pytest.raises(Exception, match="'examples' does not hold one list of strings per tool"):
        trie.check(tok.tokenizer.get_vocab_size())


def test_an_intent_splits_into_its_clauses_of_three_words_or_more():
    one = "What's the weather like in Paris tomorrow?"
    assert intent_parts(one) == [one]
    two = "Find me a cheap flight to Rome, and then book a hotel near the station. Thanks!"
    assert intent_parts(two) == [two, "Find me a cheap flight to Rome", "book a hotel near the station."]
    assert intent_parts("weather and news") == ["weather and news"]     # no clause of three words: the whole
    many = ". ".join(f"Please do task number {i}" for i in range(12))
    assert len(intent_parts(many)) == 8 and intent_parts(many)[1] == "Please do task number 0."
    every = ("Search the web for news, also translate the first result then summarize it for me and also send an "
             "email to Bob, then post the summary on the team wiki and then close the ticket right away")
    assert intent_parts(every)[1:] == ["Search the web for news", "translate the first result", "summarize it for me",
                                       "send an email to Bob", "post the summary on the team wiki",
                                       "close the ticket right away"]


def without_requests(tools) -> Vectors:
    tools = np.asarray(tools, np.float32)
    return Vectors(tools, np.zeros((0, tools.shape[1]), np.float32), np.zeros(0, np.int32))   # no vote


class Table:
    """An encoder stand-in with a vector per text (the real one is tested in test_encoder.py)."""
    backend_name, dim, digest = "cpu", 2, "table"

    def __init__(self, table):
        self.table = {k: np.asarray(v, np.float32) for k, v in table.items()}

    def encode(self, texts):
        return np.stack([self.table[t] for t in texts])


def test_each_clause_of_a_request_for_two_tools_finds_its_tool():
    vectors = without_requests([[1, 0], [0, 1], [0.8, 0.6]])
    intent = "convert the money first and then check the weather"
    table = Table({intent: [0.6, 0.8], "convert the money first": [1, 0], "check the weather": [0, 1],
                   "the weather please": [0.6, 0.8]})
    retriever = Retriever(Bm25Index.build([["x"], ["y"], ["z"]]), 3, vectors, table, dense_weight=1.0)
    assert retriever.shortlist(intent, 2).ids.tolist() == [0, 1]               # a clause's best cosine each
    assert retriever.shortlist("the weather please", 2).ids.tolist() == [2, 1]  # one clause: the whole intent


def test_examples_pull_a_tools_vector_towards_the_requests_it_answers():
    trie = Trie(np.asarray([0, 0, 0], np.int32), *(np.empty(0, np.int32),) * 4, pointer_names=["a", "b", "c"],
                sep_id=0, stop_id=1, meta={"descriptions": ["one", "Finds cheap  flights.", " "],
                                           "examples": [["x", "y"], [], []]})
    # a tool without examples has one written from its description (none without a description)
    assert written_request("Finds cheap  flights.") == "I need to finds cheap flights"
    assert written_request("PDF tools", "Can you {d}?") == "Can you PDF tools?"
    table = Table({"a: one": [1, 0], "x": [0, 1], "y": [0.6, 0.8], "b: Finds cheap  flights.": [0, 3],
                   "I need to finds cheap flights": [4, 0], "c:  ": [0, 2]})
    got = tool_vectors(trie, table)
    a = np.asarray([1, 0]) + (np.asarray([0, 1]) + np.asarray([0.6, 0.8])) / 2
    assert np.allclose(got.tools, [a / np.linalg.norm(a), [0.8, 0.6], [0, 1]], atol=1e-7)
    assert got.tools.dtype == np.float32
    # the requests keep their own vectors, to vote: the examples, and the written one of a tool without any
    assert np.array_equal(got.requests, np.asarray([[0, 1], [0.6, 0.8], [4, 0]], np.float32))
    assert got.owner.tolist() == [0, 0, 1]


def test_the_requests_nearest_an_intent_vote_for_their_tools():
    # tool 0's text is nearest the request, but tool 1 answered a request phrased like it
    vectors = Vectors(np.asarray([[1, 0], [0.6, 0.8], [0, 1]], np.float32),
                      np.asarray([[0.96, 0.28], [0, 1]], np.float32), np.asarray([1, 2], np.int32))
    bm25 = Bm25Index.build([["x"], ["y"], ["z"]])
    fixed = Fixed([1, 0])
    plain = Retriever(bm25, 3, vectors, fixed, dense_weight=1.0, vote_weight=0.0)
    assert plain.shortlist("a request", 3).ids.tolist() == [0, 1, 2]
    voted = Retriever(bm25, 3, vectors, fixed, dense_weight=1.0, vote_weight=2.0)
    assert voted.shortlist("a request", 3).ids.tolist() == [1, 0, 2]
    votes = voted.votes(fixed.encode([]), np.ones(3, bool))
    assert votes.sum() == pytest.approx(1.0) and votes[1] > 0.99 and votes[0] == 0     # a softmax of the cosines
    # only the allowed tools' requests vote: without tool 1, the whole vote is tool 2's request's
    assert voted.votes(fixed.encode([]), np.asarray([True, False, True])).tolist() == [0, 0, 1]
    # at most NEIGHBOURS requests vote, the nearest
    many = Vectors(vectors.tools, np.tile([[0.96, 0.28]], (NEIGHBOURS + 1, 1)).astype(np.float32),
                   np.asarray([1] * NEIGHBOURS + [2], np.int32))
    votes = Retriever(bm25, 3, many, fixed).votes(fixed.encode([]), np.ones(3, bool))
    assert votes[1] == pytest.approx(1.0) and votes[2] == 0     # equal cosines: the lower request ids vote


class Fixed:
    """An encoder stand-in that returns given vectors (the real one is tested in test_encoder.py)."""
    backend_name, dim, digest = "cpu", 2, "fixed"

    def __init__(self, vector):
        self.vector = np.asarray([vector], np.float32)

    def encode(self, texts):
        return self.vector


def test_fusion_standardises_both_scores_over_the_allowed_tools():
    docs = [["weather"], ["weather", "weather"], ["news"], ["flight"]]
    vectors = without_requests([[1, 0], [0, 1], [0.6, 0.8], [0.8, 0.6]])
    lexical = Retriever(Bm25Index.build(docs), 4)
    assert lexical.shortlist("weather", 2).ids.tolist() == [1, 0]          # BM25 alone
    dense = Retriever(Bm25Index.build(docs), 4, vectors, Fixed([1, 0]), dense_weight=1.0)
    assert dense.shortlist("weather", 4).ids.tolist() == [0, 3, 2, 1]      # the cosine alone
    fused = Retriever(Bm25Index.build(docs), 4, vectors, Fixed([1, 0]), dense_weight=0.6)
    short = fused.shortlist("weather", 3)
    assert short.ids[0] == 0 and list(short.scores) == sorted(short.scores, reverse=True)
    allowed = fused.shortlist("weather", 3, allow=np.asarray([1, 2], np.int32))
    # over these two, each is one deviation above the other on one score: the dense weight decides
    assert allowed.ids.tolist() == [2, 1]                                  # only the allowlist, n cut to it


def test_stored_vectors_are_refused_unless_they_are_this_versions_and_intact():
    trie = Trie(np.asarray([0, 0], np.int32), *(np.empty(0, np.int32),) * 4, pointer_names=["a", "b"], sep_id=0,
                stop_id=1, meta={"content_hash": "h1", "examples": [[], ["x", "y"]], "descriptions": ["", "b"]})
    vectors = Vectors(np.asarray([[1, 0], [0, 1]], np.float32), np.asarray([[0.75, 0.5], [0, 1]], np.float32),
                      np.asarray([1, 1], np.int32))
    blob = vectors_blob(vectors, "h1", "enc")
    read = vectors_from_blob(blob, trie, "enc", 2)
    assert all(np.array_equal(getattr(read, f), getattr(vectors, f)) for f in ("tools", "requests", "owner"))
    trie.meta["examples"] = [[], ["x"]]            # another registry's examples
    with pytest.raises(ValueError, match="stored requests have shape"):
        vectors_from_blob(blob, trie, "enc", 2)
    trie.meta["examples"] = [[], ["x", "y"]]
    with pytest.raises(ValueError, match="another catalog version or encoder"):
        vectors_from_blob(blob, trie, "other-encoder", 2)
    # vectors an older recipe made with the same encoder are not this code's: recomputed, never reused
    encoder = Fixed([1, 0])
    older = vectors_blob(vectors, "h1", f"{encoder.digest}-r{VECTORS_RECIPE - 1}")
    with pytest.raises(ValueError, match="another catalog version or encoder"):
        vectors_from_blob(older, trie, vectors_digest(encoder), 2)
    tampered = bytearray(blob)
    tampered[-1] ^= 0x40
    with pytest.raises(ValueError, match="recorded hash"):
        vectors_from_blob(bytes(tampered), trie, "enc", 2)


class Hashed:
    """An encoder stand-in: a fixed unit vector per text, and a count of the texts it encoded."""
    backend_name, dim, digest = "cpu", 4, "hashed"

    def __init__(self):
        self.encoded = 0

    def encode(self, texts):
        self.encoded += len(texts)
        rows = [np.random.default_rng(sum(map(ord, t))).standard_normal(4) for t in texts]
        return np.asarray([r / np.linalg.norm(r) for r in rows], np.float32).reshape(len(texts), 4)


def test_a_versions_vectors_are_computed_once_and_read_back_by_a_restarted_decoder(redis_url, small_tokenizer_dir):
    from decoder_service.catalogs import CatalogManager
    from shared.store import CatalogStore
    registry = ('[{"name": "alpha", "description": "first tool", "examples": ["convert pounds", "to euros"]},'
                ' {"name": "beta", "description": "second tool"}]')
    trie = compile_catalog(parse_registry(registry), ModelTokenizer(small_tokenizer_dir))
    store = CatalogStore.from_url(redis_url, namespace="vectors-test")
    first, restarted = Hashed(), Hashed()
    computed = CatalogManager(store, None, encoder=first).retriever("tools", 1, trie)
    read = CatalogManager(store, None, encoder=restarted).retriever("tools", 1, trie)
    assert first.encoded == 2 + 2 + 1 and restarted.encoded == 0       # texts, examples, beta's written request
    for f in ("tools", "requests", "owner"):
        assert np.array_equal(getattr(read.vectors, f), getattr(computed.vectors, f))
    requests = {"alpha": 2, "beta": 1}       # its examples; a written one
    assert read.vectors.owner.tolist() == [i for i, t in enumerate(trie.pointer_names) for _ in range(requests[t])]
    assert read.shortlist("convert pounds", 2).ids.tolist() == computed.shortlist("convert pounds", 2).ids.tolist()

