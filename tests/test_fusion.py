"""The fusion weight of a catalog version: tuned where the selector knows its tools, the floor's elsewhere."""
from __future__ import annotations

import json

import numpy as np

from decoder_service.engine.fusion import TUNED_TOOLS, catalog_weight, rank_prior, tuned_tools


def test_a_catalog_is_known_when_half_its_tools_were_tuned_on():
    tuned = frozenset({"A", "B", "C"})
    assert catalog_weight(["A", "B", "X", "Y"], tuned, 1.0, 1000.0) == 1.0      # half known
    assert catalog_weight(["A", "X", "Y"], tuned, 1.0, 1000.0) == 1000.0        # a third known
    assert catalog_weight(["X"], frozenset(), 1.0, 1000.0) == 1000.0            # an untuned model knows none
    assert catalog_weight(["X"], frozenset(), 1.0, None) == 1.0                 # one weight for every catalog


def test_tuned_tools_are_read_from_the_model_folder(tmp_path):
    assert tuned_tools(tmp_path) == frozenset()
    (tmp_path / TUNED_TOOLS).write_text(json.dumps({"tools": ["WeatherTool", "TripTool"]}))
    assert tuned_tools(tmp_path) == {"WeatherTool", "TripTool"}


def test_the_rank_prior_costs_the_weight_a_rank():
    assert np.array_equal(rank_prior(np.asarray([2, 0, 1]), 1.5), np.float32([-3.0, -0.0, -1.5]))
    assert rank_prior(np.asarray([0, 1]), 0.0) is None
