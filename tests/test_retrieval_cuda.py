"""The device shortlist (retrieval/cuda.py: k_fuse, the requests' k_vote, k_add, k_top and k_merge) against the host's
top_n, under numba's CUDA simulator (in a subprocess, as tests/sim_runner.py explains), and on a GPU where there is
one."""
from __future__ import annotations

import json

import numpy as np
import pytest

from sim_runner import run_script


def test_the_device_shortlist_is_the_hosts_under_the_simulator():
    result = run_script(__file__, sim=True)
    assert result["cases"] >= 4 and result["mismatches"] == [], result["mismatches"][:3]


@pytest.mark.gpu
def test_the_device_shortlist_is_the_hosts_on_the_gpu():
    from numba import cuda
    if not cuda.is_available():
        pytest.skip("no CUDA GPU")
    result = run_script(__file__, sim=False)
    assert result["cases"] >= 4 and result["mismatches"] == [], result["mismatches"][:3]


def main() -> None:
    from decoder_service.retrieval.config import NEIGHBOURS, VOTE_TEMPERATURE
    from decoder_service.retrieval.host import top_n
    from decoder_service.retrieval.cuda import SIM, DeviceScorer
    rng = np.random.default_rng(3)
    # SIM: k_merge takes 3 lists of tools and 5 of requests (more than a 4-lane warp); k_fuse unrolled + tail
    n, dim, m = (150, 40, 300) if SIM else (100_000, 384, 50_000)
    vectors = rng.standard_normal((n, dim)).astype(np.float16)
    vectors[n // 2:n // 2 + 30] = vectors[10:40]          # equal scores: the lower id must win
    requests = rng.standard_normal((m, dim)).astype(np.float16)
    owner = rng.integers(0, n, m).astype(np.int32)
    scorer = DeviceScorer(vectors, (requests, owner))
    mismatches, cases = [], 0
    for case, (top, matched, parts, vote) in enumerate([(20, 0, 1, 0.0), (10, 25, 3, 0.0), (1, 3, 2, 0.0),
                                                        (40, n // 3, 8, 0.0), (20, n, 1, 0.0), (20, 25, 1, 2.0),
                                                        (10, n // 3, 3, 0.5)]):
        axes = [(7 * case + 5 * p) % dim for p in range(parts)]   # distinct, in the unrolled runs and the tail
        queries = np.zeros((parts, dim), np.float32)
        queries[np.arange(parts), axes] = 1.0              # each cosine is one exact product
        ids = np.sort(rng.choice(n, matched, replace=False)).astype(np.int32)
        values = rng.integers(1, 8, matched).astype(np.float32)
        got_ids, got_scores = scorer.shortlist(queries, 1.0, 0.0, (ids, values), 0.5, top, vote)
        host = vectors[:, axes].astype(np.float32).max(axis=1)   # the best part's cosine
        if vote:   # retrieval.host.Retriever.votes, added in the device's order and precision
            cos = requests[:, axes].astype(np.float32).max(axis=1)
            near = top_n(cos, NEIGHBOURS)
            share = np.exp((cos[near].astype(np.float64) - cos[near[0]]) / VOTE_TEMPERATURE)
            for e, x in zip(near, share / share.sum()):
                host[owner[e]] += np.float32(vote * x)
        host[ids] += np.float32(0.5) * values
        want = top_n(host, top)
        if list(got_ids) != list(want) or not np.allclose(got_scores, host[want], rtol=1e-6, atol=0):
            mismatches.append(f"case {case}: {list(got_ids)[:8]} vs {list(want)[:8]}")
        elif not vote and not np.array_equal(got_scores, host[want]):
            mismatches.append(f"case {case}: scores {got_scores[:4]} vs {host[want][:4]}")
        cases += 1
    mismatches += through_the_retriever(rng, SIM)
    print("RESULT " + json.dumps({"cases": cases + 1, "mismatches": mismatches}))


def tiny_cuda_encoder(sim: bool):
    """A tiny random BERT (tests/test_encoder.py's) on the CUDA backend (under the simulator too, which
    load_encoder refuses): the device path encodes the intent itself."""
    import tempfile
    from pathlib import Path

    from decoder_service.encoder import Encoder, EncoderConfig
    from decoder_service.encoder.cuda import CudaEncoder
    from decoder_service.encoder.weights import load_weights
    from test_encoder import write_tiny_model
    # the GPU's K segments are 32 wide; under the simulator one layer (what is checked is the device path around the
    # encoder pass, the encoder's kernels being test_encoder's)
    shape = dict(num_hidden_layers=1) if sim else dict(hidden_size=64, intermediate_size=128)
    d = write_tiny_model(Path(tempfile.mkdtemp()) / "tiny", **shape)
    cfg = EncoderConfig.from_dir(d)
    return Encoder(d, cfg, CudaEncoder(cfg, load_weights(d, cfg)), "cuda", "tiny", "tiny")


def through_the_retriever(rng, sim: bool) -> list[str]:
    """Retriever.shortlist on the device (the intent's parts encoded there, the moments and the coefficients
    computed there, BM25's matches from the host, the vote) against the host's fusion (Retriever.scores, top_n)
    of the same catalog and encoder, for an intent of one part and one of three."""
    from decoder_service.retrieval.host import Retriever, top_n
    from decoder_service.retrieval.vectors import Vectors
    from shared.bm25 import Bm25Index
    encoder = tiny_cuda_encoder(sim)
    n, m, dim = (120, 60, encoder.dim) if sim else (20_000, 10_000, encoder.dim)
    words = "weather flight hotel money stock news pdf music recipe map".split()
    index = Bm25Index.build([[words[i % 10], words[i * 7 % 10]] for i in range(n)])

    def unit(a):
        return (a / np.linalg.norm(a, axis=1, keepdims=True)).astype(np.float16).astype(np.float32)

    vectors = Vectors(unit(rng.standard_normal((n, dim))), unit(rng.standard_normal((m, dim))),
                      np.sort(rng.integers(0, n, m)).astype(np.int32))
    retriever = Retriever(index, n, vectors, encoder)
    out, first = [], {}
    for intent in ("the weather in rome", "convert the pdf to text and then search a flight, then book a hotel"):
        got = retriever.shortlist(intent, 10, tokenize=str.split)    # the prompt's tokens, while the device scores
        first = first or {"intent": intent, "before": got}
        if got.intent_ids != intent.split():
            out.append(f"retriever {intent!r}: intent_ids {got.intent_ids}")
        host = retriever.scores(intent)
        want = top_n(host, 10)
        if list(got.ids) != list(want) or not np.allclose(got.scores, host[want], rtol=1e-4, atol=1e-4):
            out.append(f"retriever {intent!r}: {list(got.ids)} vs {list(want)}")
    if retriever.device is None:
        return ["the retriever did not take the device path"]
    return out + timed_steps(retriever, **first)


def timed_steps(retriever, intent: str, before) -> list[str]:
    """The bench's step-by-step times of a device retrieval: every step named in stream order (the nearest requests'
    k_merge only over more than one slice of them), each timed, and the launches replayed on the intent's inputs
    leave its next shortlist as it was (`before`)."""
    from bench.serve import device_steps
    from bench.workload import Query
    steps = device_steps(retriever, [Query(intent, 1)], 10, repeat=1, samples=1)
    nearest = ["k_top (nearest requests)"] + (["k_merge (nearest requests)"] if retriever.device.nearest.lists > 1
                                              else [])
    want = (["encoder pass", "k_moments", "k_fuse"] + nearest +
            ["k_vote", "k_add", "k_top (shortlist)", "k_merge (shortlist)"])
    after = retriever.shortlist(intent, 10)
    out = [] if list(steps) == want else [f"device steps {list(steps)}, want {want}"]
    out += [] if all(v > 0 for v in steps.values()) else [f"device steps untimed: {steps}"]
    if list(after.ids) != list(before.ids) or not np.array_equal(after.scores, before.scores):
        out.append(f"the shortlist after the timed steps: {list(after.ids)} vs {list(before.ids)}")
    return out


if __name__ == "__main__":
    main()
