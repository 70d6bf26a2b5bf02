"""The first stage: BM25 terms and index, fusion with the dense scores, the shortlist's order, stored vectors."""
from __future__ import annotations

import numpy as np
import pytest

from decoder_service.retrieval import Retriever, top_n, vectors_blob, vectors_from_blob
from shared.bm25 import Bm25Index, terms, tool_terms
from shared.trie import Trie


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


class Fixed:
    """An encoder stand-in that returns given vectors (the real one is tested in test_encoder.py)."""
    backend_name, dim, digest = "cpu", 2, "fixed"

    def __init__(self, vector):
        self.vector = np.asarray([vector], np.float32)

    def encode(self, texts):
        return self.vector


def test_fusion_standardises_both_scores_over_the_allowed_tools():
    docs = [["weather"], ["weather", "weather"], ["news"], ["flight"]]
    vectors = np.asarray([[1, 0], [0, 1], [0.6, 0.8], [0.8, 0.6]], np.float32)
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
                stop_id=1, meta={"content_hash": "h1"})
    vectors = np.asarray([[1, 0], [0, 1]], np.float32)
    blob = vectors_blob(vectors, "h1", "enc")
    assert np.array_equal(vectors_from_blob(blob, trie, "enc", 2), vectors)
    with pytest.raises(ValueError, match="another catalog version or encoder"):
        vectors_from_blob(blob, trie, "other-encoder", 2)
    tampered = bytearray(blob)
    tampered[-1] ^= 0x40
    with pytest.raises(ValueError, match="recorded hash"):
        vectors_from_blob(bytes(tampered), trie, "enc", 2)
