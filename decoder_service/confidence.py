"""Each answered name's confidence: the calibrated chance that it is one of the tools the caller wanted.

A logistic model per stage (Platt scaling over a few features every pointer has when it is sent: how far its
retrieval score stands above the best tool a k-answer of retrieval would leave out, how far below the top it
is, its shortlist rank, and where the generator chose it, its log-probability), fitted on the selection split
(`python -m bench calibration`, never on validation) and stored in confidence.json beside this file. An answer
is a ranking, so a name is never more confident than the one before it: the served confidence is the running
minimum, and a min_confidence cut is always the answer's tail, whatever order the names are streamed in.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

CALIBRATION_FILE = Path(__file__).with_name("confidence.json")
FEATURES = ("lead", "behind_top", "log_rank", "logprob")
STAGES = ("generator", "retrieval")


def features(scores, k: int, rank: int, logprob: float) -> list[float]:
    """A pointer's features from its request's shortlist scores (best first), k, its rank and log-probability."""
    left_out = float(scores[min(k, len(scores) - 1)])
    s = float(scores[rank])
    return [s - left_out, float(scores[0]) - s, math.log1p(rank), float(logprob)]


@dataclass(frozen=True)
class Logistic:
    weights: tuple[float, ...]
    bias: float

    def __call__(self, x) -> float:
        z = self.bias + sum(w * v for w, v in zip(self.weights, x))
        return 1.0 / (1.0 + math.exp(-max(min(z, 50.0), -50.0)))


def fit_logistic(x: np.ndarray, y: np.ndarray, l2: float = 1e-2, steps: int = 50) -> Logistic:
    """Logistic regression by Newton's method with a small L2 penalty (features standardised while fitting, so
    the penalty treats them alike): a handful of parameters, stable on a few hundred labelled names."""
    mean, std = x.mean(axis=0), x.std(axis=0)
    std[std == 0] = 1.0
    z = np.hstack([(x - mean) / std, np.ones((len(x), 1))])
    w = np.zeros(z.shape[1])
    penalty = np.diag([l2] * (z.shape[1] - 1) + [0.0]) * len(x)
    for _ in range(steps):
        p = 1.0 / (1.0 + np.exp(-z @ w))
        step = np.linalg.solve(z.T @ (z * (p * (1 - p))[:, None]) + penalty, z.T @ (p - y) + penalty @ w)
        w -= step
        if np.abs(step).max() < 1e-9:
            break
    weights = w[:-1] / std
    return Logistic(tuple(float(v) for v in weights), float(w[-1] - (weights * mean).sum()))


class Calibrator:
    """The fitted model of each stage; confidence() of a pointer, capped by the previous pointer's."""

    def __init__(self, models: dict[str, Logistic]):
        self.models = models

    @classmethod
    def load(cls, path: Path = CALIBRATION_FILE) -> "Calibrator":
        data = json.loads(Path(path).read_text())
        if tuple(data["features"]) != FEATURES:
            raise ValueError(f"{path}: features {data['features']} are not this code's {list(FEATURES)}")
        return cls({s: Logistic(tuple(m["weights"]), m["bias"]) for s, m in data["stages"].items()})

    def to_json(self, **about) -> str:
        return json.dumps({"features": list(FEATURES), **about,
                           "stages": {s: {"weights": list(m.weights), "bias": m.bias}
                                      for s, m in self.models.items()}}, indent=1) + "\n"

    def confidence(self, stage: str, scores, k: int, rank: int, logprob: float, previous: float = 1.0) -> float:
        """The pointer's calibrated confidence, never above the previous pointer's (`previous`)."""
        return min(previous, self.models[stage](features(scores, k, rank, logprob)))
