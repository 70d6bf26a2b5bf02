"""The CUDA backend's kernels against the float64 reference, on tiny random models.

The kernels run under numba's CUDA simulator (NUMBA_ENABLE_CUDASIM=1) in a *subprocess*: numba reads
that variable when it is first imported, and other test files import numba for real, so the
simulator must not leak into this process. One subprocess runs every case (this file, run as a
script) and reports JSON; each test asserts one case. The same cases run on a real GPU in the
`gpu`-marked test, which skips where there is none.

Checks (per case): logits of prefill, decode and mixed ragged batches over non-contiguous block tables
match the reference (fp32 weights: relative error < 1e-4; bf16/fp16: < 2e-2 and the same argmax); the
sparse head equals the dense head's logits for the same candidates bit for bit; a row's logits are
bit-identical alone (a decode step alone replays a captured graph, and without a q/k norm runs RoPE in
the one-row QKV GEMV; gated on done flags, its forward is skipped where all are set and gives the same
bits where one is clear) and inside a mixed batch (launched one kernel at a time; RoPE in k_rope_kv), and
a prompt's last row is bit-identical whether the prompt is prefilled in one chunk or in two (other
attention row tiles), and after a prefix's tail copied into another block (copy_kv) or in place; the
KV pool holds the reference's K/V, and K/V moved with keys rotated (place_kv) the reference's. Prompt rows
from position 4 on attend in row tiles (k_attn_mma for the bf16 models, k_attn_tiles for the others), decode
rows and earlier prompt rows one at a time (k_attn_rows); tiles split every 8 positions under the simulator,
so contexts past 8 merge splits. In the bf16 models prompt rows run their matrices in k_gemm, decode rows in
the GEMVs; steps of 8 prompt rows or more take its big tiles, so the two-chunk prompt above also checks that
big and small tiles give a row the same bits.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# (name, arch, dtype, tied)
CASES = [
    ("llama-f32", "llama", "float32", True),
    ("qwen2-bf16-untied", "qwen2", "bfloat16", False),
    ("qwen3-f32", "qwen3", "float32", True),
    ("qwen3-bf16", "qwen3", "bfloat16", True),
    ("llama-f16-untied", "llama", "float16", False),
]


def _run_cases(sim: bool, timeout: int = 600, children: int = 1) -> dict:
    """Every case's result, from `children` subprocesses running at once, each with every children-th case (the
    simulator runs on one core a process: on the 2-core machine two children take about half the time)."""
    env = dict(os.environ)
    env.pop("NUMBA_ENABLE_CUDASIM", None)
    if sim:
        env["NUMBA_ENABLE_CUDASIM"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "tests"), env.get("PYTHONPATH", "")])
    names = [c[0] for c in CASES]
    procs = [subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--json", ",".join(names[i::children])],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=str(ROOT))
             for i in range(min(children, len(names)))]
    out = {}
    try:
        for proc in procs:
            stdout, stderr = proc.communicate(timeout=timeout)
            lines = [ln for ln in stdout.splitlines() if ln.startswith("RESULTS ")]
            if proc.returncode != 0 or not lines:
                raise AssertionError(f"case runner failed (rc {proc.returncode}):\n{stdout[-3000:]}\n{stderr[-5000:]}")
            out.update(json.loads(lines[-1][len("RESULTS "):]))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return out


@pytest.fixture(scope="module")
def sim_results():
    return _run_cases(sim=True, children=min(2, os.cpu_count() or 1))


def _assert_case(res: dict, name: str) -> None:
    r = res[name]
    assert "error" not in r, r.get("error")
    for c in r["checks"]:
        assert c["ok"], f"{name} / {c['tag']}: {c}"
    assert r["sparse_tiles_ok"], r
    assert r["deterministic"], "a row's logits changed with the batch it was in"
    # without a q/k norm the lone decode row ran RoPE in k_gemv's epilogue, the mixed batch k_rope_kv
    assert r["fused_rope"] == (not name.startswith("qwen3")), r
    assert r["graphs"] == 1, f"decode-only steps: {r['graphs']} graphs held, max_graphs=1"
    assert r["gate_skips"], "a decode step gated on done flags that were all set ran its forward pass"
    assert r["gate_runs"], "a decode step gated on done flags with one clear gave other bits than ungated"
    assert r["chunk_invariant"], "a prompt's logits changed with how it was cut into chunks"
    assert r["logprob_own_row"], "a row's token log-probability changed with the logit rows beside it"
    assert r["tail_copy"], "prompt rows after a copied prefix tail (copy_kv) differ from the prefix in place"
    assert r["kv_ok"], f"KV pool differs from the reference: {r['kv_rel']}"
    assert r["place_ok"], f"K/V moved by place_kv differs from the reference's: {r['place_rel']}"


@pytest.mark.parametrize("name", [c[0] for c in CASES])
def test_cuda_kernels_match_reference_under_simulator(sim_results, name):
    _assert_case(sim_results, name)


def test_simulator_does_not_leak_into_this_process():
    from numba import config
    assert not config.ENABLE_CUDASIM


def _gpu_present() -> bool:
    code = "from numba import cuda; import sys; sys.exit(0 if cuda.is_available() else 1)"
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    try:
        return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                              timeout=60).returncode == 0
    except (OSError, subprocess.SubprocessError):  # no interpreter to start, or it hung
        return False


@pytest.mark.gpu
def test_cuda_kernels_match_reference_on_gpu():
    if not _gpu_present():
        pytest.skip("no CUDA GPU here")
    res = _run_cases(sim=False, timeout=600)
    for name, *_ in CASES:
        _assert_case(res, name)


# ------------------------------------------------------------------------ the case runner (child)
def _case(tmp: Path, arch: str, dtype: str, tied: bool) -> dict:
    import numpy as np

    from decoder_service.model.batch import StepBatch
    from decoder_service.model.config import ModelConfig
    from decoder_service.model.cuda.backend import CudaBackend
    from decoder_service.gpu.intrinsics import SIM
    from decoder_service.model.kv_pool import KVPoolSpec
    from decoder_service.model.reference import ReferenceModel, log_probabilities
    from decoder_service.model.weights import load_weights
    from model_fixtures import make_tiny_model

    tol = 1e-4 if dtype == "float32" else 2e-2
    d = make_tiny_model(tmp, arch=arch, dtype=dtype, tied=tied, seed=3)
    cfg = ModelConfig.from_dir(d)
    w = load_weights(d, cfg, dtype=dtype, progress=False)
    spec = KVPoolSpec(num_blocks=24, block_size=4)
    be = CudaBackend(cfg, w, spec, max_rows=24, max_logit_rows=4, max_candidates=8,
                     attn_split=8 if SIM else None, attn_tile_from=4, gemm_big_from=8, max_graphs=1)
    ref = ReferenceModel(cfg, w, spec)
    rng = np.random.default_rng(7)
    bt = np.full((3, 7), -1, np.int32)   # staged at a table stride of 8 (padded)
    bt[0, :5] = [17, 2, 9, 0, 21]     # non-contiguous and out of order
    bt[1, :4] = [5, 13, 1, 11]
    bt[2, :3] = [22, 3, 8]
    checks = []

    def compare(tag, batch):
        be.forward(batch)
        ref.forward(batch)
        lg, lr = be.dense_logits(), ref.dense_logits()
        rel = float(np.linalg.norm(lg - lr) / np.linalg.norm(lr))
        same_arg = bool((lg.argmax(1) == lr.argmax(1)).all())
        N = len(batch.logit_rows)
        cand = rng.integers(0, cfg.vocab_size, (N, 6)).astype(np.int32)
        n = rng.integers(1, 7, N).astype(np.int32)
        sp = be.sparse_logits(cand, n)
        eq = all(np.array_equal(sp[i, :n[i]], lg[i, cand[i, :n[i]]]) for i in range(N))
        # k_logprob: its own logits' log-softmax at the targets (float32 sums), and the reference's within tol
        targets = rng.integers(0, cfg.vocab_size, N).astype(np.int32)
        lp = be.token_logprobs(targets).astype(np.float64)
        own = float(np.abs(lp - log_probabilities(lg.astype(np.float64), targets)).max())
        lp_rel = float(np.abs(lp - ref.token_logprobs(targets)).max() / max(1.0, np.abs(lp).max()))
        ok = (rel < tol and (dtype == "float32" or same_arg) and eq and bool(np.isfinite(lg).all()) and own < 1e-4
              and lp_rel < tol)
        checks.append(dict(tag=tag, rel=rel, same_argmax=same_arg, sparse_eq_dense=eq, logprob_own=own,
                           logprob_rel=lp_rel, ok=bool(ok)))
        logprobs[tag] = targets, lp
        return lg, lr

    logprobs = {}

    prompt = rng.integers(3, cfg.vocab_size, 11).tolist()     # 3 attention tiles under the simulator
    _, lr = compare("prefill 11", StepBatch.from_chunks([(0, prompt, 0)], bt))
    pos, nxt = len(prompt), int(lr[0].argmax())
    for _ in range(2 if (arch, dtype) == ("llama", "float32") else 1):   # the simulator is slow
        _, lr = compare(f"decode {pos}", StepBatch.from_chunks([(0, [nxt], pos)], bt, decode_rows=1))
        pos, nxt = pos + 1, int(lr[0].argmax())
    other = rng.integers(3, cfg.vocab_size, 6).tolist()
    mixed = StepBatch.from_chunks([(0, [nxt], pos), (1, other, 0), (2, other[:2], 0)], bt, decode_rows=1)
    lg_mixed, _ = compare("mixed decode + prefill 6 + prefill 2", mixed)
    _, lr = compare("mixed decodes", StepBatch.from_chunks([(2, [5], 2), (1, [7], 6)], bt, decode_rows=2))
    # the decode row of slot 0, recomputed alone at the same position, is bit-identical
    be.forward(StepBatch.from_chunks([(0, [nxt], pos)], bt, decode_rows=1))
    deterministic = bool(np.array_equal(be.dense_logits()[0], lg_mixed[0]))
    graphs = be.num_graphs   # that step replayed a graph; the one of "mixed decodes" was dropped
    # the same step gated on done flags (the engine's step ahead): every flag set, its forward does not
    # run (the hidden state is still the chunked prompt's below); one clear, it runs, to the same bits
    from numba import cuda
    done = cuda.to_device(np.ones(2, np.int32))
    alone = StepBatch.from_chunks([(0, [nxt], pos)], bt, decode_rows=1)
    be.forward(StepBatch.from_chunks([(1, other[:3], 0)], bt))
    before = be.dense_logits()[0]
    be.forward(alone, skip_if_done=done)
    gate_skips = bool(np.array_equal(be.dense_logits()[0], before))
    done.copy_to_device(np.array([0, 1], np.int32))
    be.forward(alone, skip_if_done=done)
    gate_runs = bool(np.array_equal(be.dense_logits()[0], lg_mixed[0]))
    # candidate lists longer than max_candidates are tiled; an id outside the vocabulary gives NaN
    cand = rng.integers(0, cfg.vocab_size, (1, 19)).astype(np.int32)
    cand[0, 17] = cfg.vocab_size + 5
    full = be.dense_logits()
    sp = be.sparse_logits(cand, np.array([19], np.int32))
    tiles_ok = bool(np.array_equal(sp[0, :17], full[0, cand[0, :17]]) and np.isnan(sp[0, 17])
                    and sp[0, 18] == full[0, cand[0, 18]])
    # slot 1's prompt again, in two chunks (its rows fall in other attention tiles): the same bits
    be.forward(StepBatch.from_chunks([(1, other[:3], 0)], bt))
    be.forward(StepBatch.from_chunks([(2, [5], 2), (1, other[3:], 3)], bt, decode_rows=1))
    chunk_invariant = bool(np.array_equal(be.dense_logits()[1], lg_mixed[1]))
    # and its log-probability (the reader's head: a row's bits whatever the logit rows beside it)
    targets, lp_mixed = logprobs["mixed decode + prefill 6 + prefill 2"]
    logprob_own_row = bool(be.token_logprobs(targets[:2])[1] == lp_mixed[1])
    # the pool holds the reference's K and V (storage dtype rounding aside)
    k, v = be.kv_cache()
    used = sorted({int(b) for b in bt.ravel() if b >= 0})
    kr, vr = ref.pool.k[:, used], ref.pool.v[:, used]
    from decoder_service.model.weights import to_float32
    kg = to_float32(np.ascontiguousarray(k[:, used]), w.dtype).astype(np.float64)
    vg = to_float32(np.ascontiguousarray(v[:, used]), w.dtype).astype(np.float64)
    kv_rel = [float(np.linalg.norm(kg - kr) / np.linalg.norm(kr)),
              float(np.linalg.norm(vg - vr) / np.linalg.norm(vr))]
    # a copied prefix tail: slot 1's positions 4-5 (block 13) copied into a fresh block (19) of a table
    # sharing slot 1's first block; the same prompt rows after it in both tables give the same bits
    tail_bt = np.array([[5, 13, 1, 11], [5, 19, 20, 23]], np.int32)
    more = rng.integers(3, cfg.vocab_size, 3).tolist()
    be.forward(StepBatch.from_chunks([(0, more, 6)], tail_bt))
    in_place = be.dense_logits()
    be.copy_kv(13, 19, 2)
    be.forward(StepBatch.from_chunks([(1, more, 6)], tail_bt))
    tail_copy = bool(np.array_equal(be.dense_logits(), in_place))
    # K/V moved (place_kv): slot 1's positions 0-5 into blocks 23 and 20, keys rotated 9 positions further, as the
    # reference moves them; V unchanged, bit for bit
    src = np.array([20, 21, 22, 23, 52, 53], np.int32)
    dst = np.array([92, 93, 94, 95, 80, 81], np.int32)
    be.place_kv(src, dst, np.full(6, 9, np.int32))
    ref.place_kv(src, dst, np.full(6, 9, np.int32))
    k, v = be.kv_cache()
    flat_k, flat_v = (to_float32(np.ascontiguousarray(a.reshape(cfg.num_layers, -1, a.shape[-2], a.shape[-1])), w.dtype)
                      for a in (k, v))
    ref_k = ref.pool.k.reshape(cfg.num_layers, -1, *ref.pool.k.shape[3:])
    place_rel = float(np.linalg.norm(flat_k[:, dst] - ref_k[:, dst]) / np.linalg.norm(ref_k[:, dst]))
    place_ok = place_rel < tol and bool(np.array_equal(flat_v[:, dst], flat_v[:, src]))
    if (arch, dtype) == ("llama", "float32"):   # a 41-token context: 6 splits to merge
        long_bt = np.arange(12, dtype=np.int32)[None]
        long = rng.integers(3, cfg.vocab_size, 41).tolist()
        compare("prefill 20", StepBatch.from_chunks([(0, long[:20], 0)], long_bt))
        compare("prefill 21 more", StepBatch.from_chunks([(0, long[20:], 20)], long_bt))
    return dict(checks=checks, deterministic=deterministic, fused_rope=be.fused_rope, graphs=graphs,
                gate_skips=gate_skips, gate_runs=gate_runs,
                chunk_invariant=chunk_invariant, logprob_own_row=logprob_own_row, tail_copy=tail_copy,
                place_rel=place_rel, place_ok=place_ok,
                sparse_tiles_ok=tiles_ok,
                kv_rel=kv_rel, kv_ok=max(kv_rel) < tol)


def _main() -> None:
    import tempfile
    import time

    sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
    from decoder_service.gpu import sim_accel
    sim_accel.install()
    out = {}
    wanted = sys.argv[2].split(",") if len(sys.argv) > 2 else [c[0] for c in CASES]   # the cases this child runs
    with tempfile.TemporaryDirectory() as tmp:
        for name, arch, dtype, tied in (c for c in CASES if c[0] in wanted):
            t = time.time()
            try:
                out[name] = _case(Path(tmp), arch, dtype, tied)
            except Exception as e:  # noqa: BLE001 - report, and let the other cases run
                import traceback
                out[name] = {"error": f"{e!r}\n{traceback.format_exc()}"}
            out[name]["seconds"] = round(time.time() - t, 2)
            print(name, json.dumps(out[name]), flush=True)
    print("RESULTS " + json.dumps(out), flush=True)


if __name__ == "__main__":
    _main()
