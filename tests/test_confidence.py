"""Each Pointer's confidence and min_confidence, over real gRPC and a real Redis (tiny model, CPU backend)."""
import math

import grpc
import numpy as np
import pytest

from decoder_service.confidence import Calibrator, Logistic, features, fit_logistic
from decoder_stack import TOOLS, DecoderStack, discover, failure, trie_of
from shared.rpc import decoder_pb2 as pb
from tooltrie import cli

K = 4
INTENT = "what's the weather like in Paris this weekend"


@pytest.fixture(scope="module")
def stack(tmp_path_factory, small_tokenizer_dir, redis_url):
    s = DecoderStack(tmp_path_factory.mktemp("stack"), small_tokenizer_dir, redis_url)
    s.store.publish("conf", trie_of(s.tok, TOOLS))
    s.start()
    yield s
    s.close()


def answer(stack, mode, min_confidence=0.0):
    """The pointers and the Done of one request."""
    events = list(stack.stub().Discover(pb.DiscoverRequest(catalog="conf", intent=INTENT, k=K, mode=mode,
                                                           min_confidence=min_confidence), timeout=60))
    assert events[0].HasField("accepted") and events[-1].HasField("done")
    return [e.pointer for e in events[1:-1]], events[-1].done


def float32_at_most(x: float) -> float:
    """The request's float field nearest x from below, so that a name of confidence x reaches it."""
    f = np.float32(x)
    return float(f if float(f) <= x else np.nextafter(f, np.float32(0)))


@pytest.mark.parametrize("mode", [pb.MODE_DECODE, pb.MODE_RETRIEVE])
def test_min_confidence_cuts_the_answers_tail_and_reports_the_cut(stack, mode):
    full, done = answer(stack, mode)
    assert len(full) == K and done.cut == 0            # without min_confidence: exactly k
    conf = [p.confidence for p in full]
    assert all(0.0 <= c <= 1.0 for c in conf) and conf == sorted(conf, reverse=True)
    for threshold in (float32_at_most(conf[-1]), float32_at_most(conf[0]), float32_at_most((conf[0] + conf[-1]) / 2),
                      1.0):
        kept, done = answer(stack, mode, threshold)
        n = sum(c >= threshold for c in conf)
        assert [(p.index, p.name, p.confidence) for p in kept] == [(p.index, p.name, p.confidence) for p in full[:n]]
        assert done.cut == K - n
    assert answer(stack, mode, 1.0)[0] == [] and answer(stack, mode, 1.0)[1].cut == K   # none reaches 1


@pytest.mark.parametrize("bad", [-0.1, 1.5, math.nan, math.inf])
def test_a_min_confidence_outside_0_to_1_is_invalid(stack, bad):
    err = failure(stack.stub(), catalog="conf", intent=INTENT, k=1, min_confidence=bad)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "min_confidence must be from 0 to 1" in err.details()
    _, pointers = discover(stack.stub(), catalog="conf", intent=INTENT, k=1)
    assert len(pointers) == 1


def test_the_committed_calibration_loads_and_caps_by_the_previous():
    calibrator = Calibrator.load()
    scores = [3.0, 2.0, 1.0, 0.5, 0.0]
    for stage in ("generator", "retrieval"):
        top = calibrator.confidence(stage, scores, 1, 0, 0.0)
        assert 0.0 < top < 1.0
        assert calibrator.confidence(stage, scores, 2, 1, 0.0, previous=0.01) == 0.01   # capped by the previous


def test_fit_logistic_recovers_a_known_model():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(4000, 2))
    truth = Logistic((1.5, -2.0), 0.3)
    y = (rng.random(4000) < np.array([truth(row) for row in x])).astype(float)
    fitted = fit_logistic(x, y, l2=1e-4)
    assert np.allclose(fitted.weights, truth.weights, atol=0.2) and abs(fitted.bias - truth.bias) < 0.2
    assert features([2.0, 1.0, 0.5], 1, 0, -0.2) == [1.0, 0.0, 0.0, -0.2]


def test_the_cli_prints_each_confidence_and_the_cut(stack, capsys):
    argv = ["--decoder", stack.addr, "discover", INTENT, "-k", "2", "--catalog", "conf", "--retrieve-only"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert out.startswith("1. ") and "(confidence " in out and "left out" not in out
    assert cli.main(argv + ["--min-confidence", "1"]) == 0
    assert capsys.readouterr().out.startswith("   2 of the 2 below confidence 1, left out")
    assert cli.main(argv + ["--min-confidence", "2"]) == 2
