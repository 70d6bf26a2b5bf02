"""The CPU backend against the float64 reference, and its determinism, on tiny random models."""
from __future__ import annotations

import numpy as np
import pytest

from decoder_service.cpu_kernels import matmul_t
from decoder_service.gpu.device import resolve_backend
from decoder_service.model.backend import make_backend
from decoder_service.model.batch import StepBatch
from decoder_service.model.config import ModelConfig, ModelError
from decoder_service.model.cpu import CpuBackend
from decoder_service.model.kv_pool import KVPoolSpec
from decoder_service.model.reference import ReferenceModel
from decoder_service.model.weights import load_weights
from model_fixtures import make_tiny_model

SPEC = KVPoolSpec(num_blocks=48, block_size=4)
# (arch, dtype on disk, tied head): every family, both head kinds, every dtype.
CASES = [("llama", "float32", True), ("llama", "bfloat16", False), ("llama", "float16", True),
         ("qwen2", "float32", False), ("qwen2", "bfloat16", True),
         ("qwen3", "float32", True), ("qwen3", "bfloat16", False)]


def _load(tmp_path, arch="llama", dtype="float32", tied=True, seed=0):
    d = make_tiny_model(tmp_path, arch, dtype, tied, seed)
    cfg = ModelConfig.from_dir(d)
    return cfg, load_weights(d, cfg, "float32", progress=False)


def _shuffled_tables(seed, sequences=3, blocks_each=12):
    """Block tables whose ids are scattered over the pool, never in order."""
    ids = np.random.default_rng(seed).permutation(SPEC.num_blocks)[: sequences * blocks_each]
    return ids.reshape(sequences, blocks_each).astype(np.int32)


def _assert_matches(cpu_logits, ref_logits, what):
    # The CPU backend computes in float32 whatever the weights' disk dtype (bf16 and fp16 widen
    # exactly), so the fp32 bound applies to every case, not only the 2e-2 allowed for bf16 weights.
    rel = np.linalg.norm(cpu_logits - ref_logits) / np.linalg.norm(ref_logits)
    assert rel < 1e-4, f"{what}: relative error {rel:.2e}"
    np.testing.assert_array_equal(cpu_logits.argmax(1), ref_logits.argmax(1), err_msg=what)


@pytest.mark.parametrize("arch,dtype,tied", CASES)
def test_cpu_matches_reference_prefill_mixed_and_decode(tmp_path, arch, dtype, tied):
    cfg, w = _load(tmp_path, arch, dtype, tied)
    ref, cpu = ReferenceModel(cfg, w, SPEC), CpuBackend(cfg, w, SPEC)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, cfg.vocab_size, n).tolist() for n in (11, 10, 9)]
    tables = _shuffled_tables(2)
    steps = [
        # two sequences prefilling (ragged)
        [(0, prompts[0], 0), (1, prompts[1][:6], 0)],
        # mixed: a new prompt's first chunk, another prompt's second chunk, a decode row
        [(2, prompts[2][:5], 0), (1, prompts[1][6:], 6), (0, [7], 11)],
    ]
    for step, chunks in enumerate(steps):
        batch = StepBatch.from_chunks(chunks, tables)
        ref.forward(batch)
        cpu.forward(batch)
        _assert_matches(cpu.dense_logits(), ref.dense_logits(), f"step {step}")
    lengths = [12, 10, 5]
    for step in range(4):  # decode all three (one still finishing its prompt), greedy on the cpu's choice
        logits = cpu.dense_logits()
        nxt = [int(t) for t in logits.argmax(1)]
        chunks = [(0, [nxt[2]], lengths[0]), (1, [nxt[1]], lengths[1]),
                  (2, prompts[2][5:] if step == 0 else [nxt[0]], lengths[2])]
        batch = StepBatch.from_chunks(chunks, tables)
        ref.forward(batch)
        cpu.forward(batch)
        lengths = [n + len(c[1]) for n, c in zip(lengths, chunks)]
        _assert_matches(cpu.dense_logits(), ref.dense_logits(), f"decode step {step}")
        cand = np.stack([rng.permutation(cfg.vocab_size)[:20] for _ in range(3)]).astype(np.int32)
        n = np.array([20, 7, 1], np.int32)
        got, want = cpu.sparse_logits(cand, n), ref.sparse_logits(cand, n)
        for i in range(3):
            _assert_matches(got[i:i + 1, : n[i]], want[i:i + 1, : n[i]], f"sparse row {i}")


def test_reference_prefill_equals_token_by_token_decode(tmp_path):
    """The oracle agrees with itself: one prefill step or one step per token, same logits."""
    cfg, w = _load(tmp_path, "qwen3", "float32", False)
    tokens = np.random.default_rng(3).integers(0, cfg.vocab_size, 9).tolist()
    table = _shuffled_tables(4, 1)
    whole, stepwise = ReferenceModel(cfg, w, SPEC), ReferenceModel(cfg, w, SPEC)
    whole.forward(StepBatch.from_chunks([(0, tokens, 0)], table))
    for p, t in enumerate(tokens):
        stepwise.forward(StepBatch.from_chunks([(0, [t], p)], table))
    np.testing.assert_allclose(whole.dense_logits(), stepwise.dense_logits(), rtol=1e-12, atol=1e-12)


def _run(backend, steps, tables, target):
    """Run `steps` (lists of chunks); return the dense logits of slot `target` at each step."""
    out = []
    for chunks in steps:
        backend.forward(StepBatch.from_chunks(chunks, tables))
        logits = backend.dense_logits()
        out.append(logits[[c[0] for c in chunks].index(target)])
    return out


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_a_sequence_is_bit_identical_alone_or_in_any_batch(tmp_path, arch):
    cfg, w = _load(tmp_path, arch, "bfloat16", True)
    rng = np.random.default_rng(5)
    prompt = rng.integers(0, cfg.vocab_size, 13).tolist()
    other = [rng.integers(0, cfg.vocab_size, 9).tolist() for _ in range(2)]
    tables = _shuffled_tables(6)
    alone = _run(CpuBackend(cfg, w, SPEC), [[(1, prompt, 0)], [(1, [3], 13)], [(1, [4], 14)]], tables, 1)
    # the same sequence: prefilled in two chunks beside other prompts, then decoded among
    # other rows at other positions in the batch
    crowded = _run(CpuBackend(cfg, w, SPEC), [
        [(0, other[0], 0), (1, prompt[:5], 0)],
        [(2, other[1][:4], 0), (1, prompt[5:], 5), (0, [9], 9)],
        [(1, [3], 13), (2, other[1][4:], 4), (0, [8], 10)],
        [(0, [1], 11), (2, [2], 9), (1, [4], 14)],
    ], tables, 1)
    np.testing.assert_array_equal(alone[0], crowded[1])
    np.testing.assert_array_equal(alone[1], crowded[2])
    np.testing.assert_array_equal(alone[2], crowded[3])


@pytest.mark.parametrize("n,k", [(960, 576), (576, 1536), (49, 37)])
def test_matmul_row_is_bit_identical_alone_or_in_any_batch(n, k):
    """The property BLAS lacks: OpenBLAS computes one row with gemv and small batches with a small-matrix
    kernel, and the results differ from its blocked kernel's in the last bits."""
    rng = np.random.default_rng(7)
    w = rng.standard_normal((n, k)).astype(np.float32)
    x = rng.standard_normal((150, k)).astype(np.float32)
    row = x[40:41]
    alone = np.empty((1, n), np.float32)
    matmul_t(row, w, alone)
    for size, at in [(2, 0), (2, 1), (3, 2), (4, 3), (5, 1), (7, 6), (8, 5), (17, 16), (64, 33), (65, 64), (150, 40)]:
        batch = x[:size].copy()
        batch[at] = row[0]
        out = np.empty((size, n), np.float32)
        matmul_t(batch, w, out)
        np.testing.assert_array_equal(out[at], alone[0], err_msg=f"batch of {size}, row {at}")


def test_sparse_head_is_bit_identical_to_dense(tmp_path):
    cfg, w = _load(tmp_path, "qwen2", "float32", False)
    cpu = CpuBackend(cfg, w, SPEC)
    rng = np.random.default_rng(8)
    cpu.forward(StepBatch.from_chunks([(s, rng.integers(0, cfg.vocab_size, 5).tolist(), 0) for s in range(3)],
                                      _shuffled_tables(9)))
    dense = cpu.dense_logits()
    cand = rng.integers(0, cfg.vocab_size, (3, 40)).astype(np.int32)
    n = np.array([40, 13, 0], np.int32)
    sparse = cpu.sparse_logits(cand, n)
    for i in range(3):
        np.testing.assert_array_equal(sparse[i, : n[i]], dense[i, cand[i, : n[i]]])


def test_backend_selection(tmp_path, monkeypatch):
    from numba import config

    cfg, w = _load(tmp_path)
    assert isinstance(make_backend(cfg, w, SPEC, "cpu"), CpuBackend)
    with pytest.raises(ModelError, match="unknown backend 'tpu'"):
        resolve_backend("tpu")
    monkeypatch.setattr(config, "ENABLE_CUDASIM", True)
    assert resolve_backend("auto") == "cpu"
    with pytest.raises(ModelError, match="backend 'cuda' was requested but numba's CUDA simulator is enabled"):
        resolve_backend("cuda")


@pytest.mark.parametrize("model", ["cpu", "reference"])
def test_a_copied_prefix_tail_gives_the_recomputed_logits(tmp_path, model):
    """A catalog prefix's last partial block is copied into a request's first block (copy_kv): the
    request's prompt rows after it get the bits they get after the prefix computed in place."""
    cfg, w = _load(tmp_path, "llama", "float32", True)
    backend = (CpuBackend if model == "cpu" else ReferenceModel)(cfg, w, SPEC)
    rng = np.random.default_rng(5)
    prefix, suffix = rng.integers(0, cfg.vocab_size, 10).tolist(), rng.integers(0, cfg.vocab_size, 5).tolist()
    tables = np.array([[3, 7, 11, 14, -1], [3, 7, 20, 21, 22]], np.int32)  # two whole blocks shared, tail in 11
    backend.forward(StepBatch.from_chunks([(0, prefix, 0)], tables))
    backend.forward(StepBatch.from_chunks([(0, suffix, 10)], tables))
    in_place = backend.dense_logits()
    backend.copy_kv(11, 20, 2)
    backend.forward(StepBatch.from_chunks([(1, suffix, 10)], tables))
    np.testing.assert_array_equal(backend.dense_logits(), in_place)
