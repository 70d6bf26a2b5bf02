"""The fixed splits and the catalogs as published with labelled queries (shared/dataset.py)."""
from __future__ import annotations

import json

import pytest

from shared import dataset
from shared.dataset import Query, in_split, is_selection, is_validation, published


def test_the_splits_partition_every_set_and_selection_lies_within_training():
    for name in dataset.SETS:
        texts = [q.text for q in dataset.queries(name)]
        train = {t for t in texts if in_split(t, "train")}
        selection = {t for t in texts if in_split(t, "selection")}
        validation = {t for t in texts if in_split(t, "validation")}
        assert selection <= train and not train & validation and train | validation == set(texts)
        assert 0.08 < len(selection) / len(train) < 0.25, (name, len(selection), len(train))


def test_the_split_of_a_query_ignores_case_and_spacing():
    q = "Find me a   flight to Paris"
    assert is_validation(q) == is_validation(q.upper()) and is_selection(q) == is_selection(" " + q.lower())


def test_an_unknown_split_is_refused_by_name():
    with pytest.raises(ValueError, match="selection"):
        dataset.queries("metatool", "dev")


def test_published_examples_are_single_tool_queries_less_those_left_out_and_the_new_tools():
    tools = [{"name": "a", "description": "A.", "examples": ["own"]}, {"name": "b", "description": "B."}]
    labelled = [Query("one", ("a",)), Query("two", ("a", "b")), Query("three", ("b",)), Query("four", ("a",))]
    got = json.loads(published(tools, labelled, leave_out=frozenset({"four"})))
    assert got == [{"name": "a", "description": "A.", "examples": ["own", "one"]},
                   {"name": "b", "description": "B.", "examples": ["three"]}]
    assert json.loads(published(tools, labelled, new=frozenset({"b"})))[1]["examples"] == []
