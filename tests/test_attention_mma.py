"""k_attn_mma, prompt attention on the tensor cores, against float64 (numba's CUDA simulator, or a GPU).

Tiny one-layer bf16 models (head_dim 8, and Qwen3's 16: neither a multiple of the 32-wide chunk; on a GPU also Qwen3's
at head_dim 72 and 128, past k_attn_mma's 64: k_attn_mma_wide, the same body with its arrays sized for 128,
with a partial chunk and without; the simulator's backend stops at head_dim 16) prefill a chunk
of rows after a context whose K/V are random, at the smallest split the build allows (8 positions under
the simulator, 64 on a GPU: the context scales with it), so that a row merges up to four splits and the
last blocks are partial; the rows attend in tiles of 16 queries, rows x the KV head's query heads. Once
more with at most three splits a row (prompt_split): the chunk's rows past three splits' context take
two longer ones, in tiles of their own (and a backend asked for no splits, or more than the merge holds,
refuses). The attention output of the last layer must match float64 attention over the same q and pool
to the level of q and the weights P as bf16 hi + lo (< 3e-5; the FMA kernel's is ~3e-7, bf16 operands
alone ~3e-3), and a row's output must keep its bits when the chunk is cut elsewhere (its tile mates
change). On a GPU the `gpu`-marked test runs the same, and `python -m bench step --attention-regs 0`
measures it at SmolLM2's shape.
"""
from __future__ import annotations

import numpy as np
import pytest

from sim_runner import run_script

TOLERANCE = 3e-5


def test_prompt_attention_on_the_tensor_cores_matches_float64_under_the_simulator():
    _assert(run_script(__file__, sim=True, timeout=600))


@pytest.mark.gpu
def test_prompt_attention_on_the_tensor_cores_matches_float64_on_the_gpu():
    from numba import cuda
    if not cuda.is_available():
        pytest.skip("no CUDA GPU")
    _assert(run_script(__file__, sim=False), gpu=True)


def _assert(result: dict, gpu: bool = False) -> None:
    refused = result.pop("refused")
    assert len(refused) == 2 and all("attn_splits=" in m and "must be in [1, 64]" in m for m in refused), refused
    wide = {"qwen3, head_dim 72", "qwen3, head_dim 128"} if gpu else set()
    assert set(result) == {"llama", "qwen3", "llama, at most 3 splits"} | wide
    for arch, r in result.items():
        assert r["kernel"] == ("k_attn_mma_wide" if "head_dim" in arch else "k_attn_mma"), r
        assert r["rel"] < TOLERANCE, (arch, r)
        assert r["cut_invariant"], (arch, r)
    for name in ("llama", "qwen3", *wide):   # the split rule's wave fits every row's context in TP splits
        assert result[name]["splits"] == [1], (name, result[name])   # (k_attn_mma_wide's 65 KB: P74)
    assert result["llama, at most 3 splits"]["splits"] == [1, 2]


def _case(tmp, arch: str, most_splits: int | None = None, head_dim: int | None = None) -> dict:
    from decoder_service.model.batch import StepBatch
    from decoder_service.model.config import ModelConfig
    from decoder_service.model.cuda.backend import CudaBackend
    from decoder_service.model.cuda.attention import TP
    from decoder_service.model.kv_pool import KVPoolSpec
    from decoder_service.model.reference import attend
    from decoder_service.model.weights import f32_to_bf16, load_weights, to_float32
    from model_fixtures import make_tiny_model

    # one layer: the checked output is the last layer's, and its kernels are the same whatever comes before it (the
    # layers' own indexing is test_model_cuda_sim's); under the simulator each layer costs as much as the check
    d = make_tiny_model(tmp, arch=arch, dtype="bfloat16", seed=5,
                        config_overrides={"num_hidden_layers": 1, **({"head_dim": head_dim} if head_dim else {})})
    cfg = ModelConfig.from_dir(d)
    scale = TP // 8                    # positions scale with the smallest split: 8 simulated, 64 on a GPU
    be = CudaBackend(cfg, load_weights(d, cfg, dtype="bfloat16", progress=False), KVPoolSpec(12, 4 * scale),
                     max_rows=16, max_logit_rows=2, attn_split=TP, attn_splits=most_splits, attn_tile_from=4)
    rng = np.random.default_rng(9)
    for pool in (be.kv_k, be.kv_v):
        pool.copy_to_device(f32_to_bf16(rng.standard_normal(pool.size).astype(np.float32)))
    table = np.array([[7, 2, 9, 0, 11, 4, 1, 5]], np.int32)        # 32 x scale positions, blocks out of order
    # 13 rows at contexts 3 TP - 6 .. 3 TP + 6: at most 3 splits, the last 6 rows take longer ones
    L, nh, hd, R, start = cfg.num_layers, cfg.num_heads, cfg.head_dim, 13, 3 * TP - 7

    def prefill(first: int, rows: int) -> np.ndarray:
        """Rows first .. first + rows - 1 of the chunk at positions start ..; the last layer's output."""
        be.forward(StepBatch.from_chunks([(0, list(range(3 + first, 3 + first + rows)), start + first)], table))
        return be.att.copy_to_host()[: rows * be.kp_q].reshape(rows, be.kp_q)[:, : nh * hd].copy()

    whole = prefill(0, R)
    tiles = be.attn_tiles.copy_to_host()[: 3 * be._n_tiles].reshape(-1, 3)
    splits = sorted({int(s) // TP for s in tiles[:, 2]})        # the chunk's split sizes in TP
    q = be.qkv.copy_to_host()[: R * be.dqkv].reshape(R, be.dqkv)[:, : nh * hd].astype(np.float64)
    k, v = (to_float32(np.ascontiguousarray(a[L - 1]), "bfloat16").astype(np.float64) for a in be.kv_cache())
    ref = np.stack([attend(k, v, table[0], start + r, q[r].reshape(nh, hd)).reshape(-1) for r in range(R)])
    prefill(0, 5)                      # the same chunk cut after row 5: rows 5.. land in other tiles
    rest = prefill(5, R - 5)
    return dict(kernel=be.layers[0]["attn_tiles"].kernel.name, splits=splits,
                rel=float(np.linalg.norm(whole - ref) / np.linalg.norm(ref)),
                cut_invariant=bool(np.array_equal(whole[5:].view(np.uint32), rest.view(np.uint32))))


if __name__ == "__main__":
    import json
    import sys
    import tempfile
    from pathlib import Path

    from decoder_service.gpu import sim_accel
    from decoder_service.gpu.intrinsics import SIM
    from model_fixtures import backend_refusals
    sim_accel.install()
    with tempfile.TemporaryDirectory() as tmp:
        out = {arch: _case(Path(tmp), arch) for arch in ("llama", "qwen3")}
        for hd in () if SIM else (72, 128):
            out[f"qwen3, head_dim {hd}"] = _case(Path(tmp) / f"hd{hd}", "qwen3", head_dim=hd)
        out["llama, at most 3 splits"] = _case(Path(tmp) / "most", "llama", most_splits=3)
        out["refused"] = backend_refusals(Path(tmp) / "refused", "attn_splits", (0, 65))
    print("RESULT " + json.dumps(out))
    sys.exit(0)
