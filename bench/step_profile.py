"""Where a multi-row forward step spends its time, kernel kind by kernel kind (CUDA only).

    python3 bench/step_profile.py [--shape smollm2-135m] [--rows 1,16,48,256] [--prefix 0,4955]
    python3 bench/step_profile.py --rows 64 --prefix 4955 --attention-regs 0,80,72,64,56

One sequence prefills R rows at positions P..P+R-1 after a P-token prefix already in the pool (the
shape of a tooltrie request: the catalog prefix is cached, the query suffix is prefilled), and R
sequences each decode one row at position P (the all-at-once shape). For each kind of launch, a graph
of that launch for every layer is replayed (warm L2, as in a real step) and its median CUDA-event time
is divided by the layers; the last column is the whole forward pass. Random bf16 weights.
With --attention-regs, only attention, compiled under each register cap, on random K/V (perf log b6).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.gpu_model_check import MODELS, Timer, random_weights  # noqa: E402
from decoder_service.model.batch import StepBatch  # noqa: E402
from decoder_service.model.config import ModelConfig  # noqa: E402
from decoder_service.model.kv_pool import KVPoolSpec  # noqa: E402

BLOCK = 16
KINDS = ("qkv", "rope", "attn", "o", "gate_up", "down")


def prefill_batch(rows: int, prefix: int, per_seq: int) -> StepBatch:
    table = np.arange(per_seq, dtype=np.int32)[None]
    return StepBatch(tokens=np.full(rows, 198, np.int32), slots=np.zeros(rows, np.int32),
                     positions=np.arange(prefix, prefix + rows, dtype=np.int32), block_tables=table,
                     logit_rows=np.array([rows - 1], np.int32))


def decode_batch(rows: int, prefix: int, per_seq: int) -> StepBatch:
    """R sequences sharing the prefix's full blocks (as requests of one catalog do), one row each."""
    shared = prefix // BLOCK
    own = prefix // BLOCK + 1 - shared
    tables = np.full((rows, per_seq), -1, np.int32)
    tables[:, :shared] = np.arange(shared)
    tables[:, shared:shared + own] = shared + np.arange(rows * own).reshape(rows, own)
    return StepBatch(tokens=np.full(rows, 198, np.int32), slots=np.arange(rows, dtype=np.int32),
                     positions=np.full(rows, prefix, np.int32), block_tables=tables,
                     logit_rows=np.arange(rows, dtype=np.int32))


def profile(be, timer, batch: StepBatch) -> dict:
    R = batch.num_rows
    be.stage(batch)
    be.synchronize()
    out = {}
    nq = be.cfg.num_heads + be.cfg.num_kv_heads
    attn = be.attn_grid(R, int(batch.positions.max()) + 1)
    gemv, tiles = be.row_tiles(R)
    for kind in KINDS:
        def body(kind=kind):
            for layer in be.layers:
                if kind == "rope":
                    layer["rope"].launch(R, nq)
                elif kind == "attn":
                    layer["attn"].launch(*attn)
                else:
                    be.launch_tiles(layer[gemv[kind]], tiles)
        ms, _ = timer.graph_ms(body, reps=9)
        out[kind] = ms * 1e3 / len(be.layers)
    ms, _ = timer.graph_ms(lambda: be.launch_forward(R, len(batch.logit_rows)), reps=9)
    out["forward"] = ms * 1e3
    return out


def attention_variants(be, timer, per_seq: int, caps: list[int]) -> None:
    """k_attn compiled with register caps (0: none; a lower cap, more resident blocks per SM) on the
    same inputs: µs per layer, and whether each variant's output is bit-identical to the first."""
    from numba import cuda

    from bench.gpu_model_check import rand_bf16
    from decoder_service.model.cuda import kernels
    from decoder_service.model.cuda.launcher import Kernel, Launch
    rng = np.random.default_rng(5)
    for pool in (be.kv_k, be.kv_v):   # random K/V, so that every score and weight differs
        pool.copy_to_device(rand_bf16(rng, (pool.size,), 1.0))
    variants = []
    for regs in caps:
        kern = be.kernels["k_attn"] if not regs else \
            Kernel("k_attn", be.storage, dispatcher=cuda.jit(max_registers=regs)(kernels.k_attn.py_func))
        launches = [Launch(kern, a.block, a.shmem, a.args, be.stream.handle, a.name)
                    for a in (layer["attn"] for layer in be.layers)]
        variants.append((f"register cap {regs or 'none'} ({kern.attrs.regs} registers, "
                         f"{kern.occupancy(launches[0].block, launches[0].shmem)} blocks/SM)", launches))
    cases = [("decode", 1, 4955), ("prefill", 48, 4955), ("decode", 64, 4955), ("decode", 1, 1023)]
    table = {name: [] for name, _ in variants}
    same = {name: True for name, _ in variants}
    for case, R, prefix in cases:
        batch = (prefill_batch if case == "prefill" else decode_batch)(R, prefix, per_seq)
        be.forward(batch)   # q for the rows, and their own K/V written
        be.synchronize()
        grid = be.attn_grid(R, int(batch.positions.max()) + 1)
        ref = None
        for name, launches in variants:
            ms, _ = timer.graph_ms(lambda launches=launches: [lz.launch(*grid) for lz in launches], reps=9)
            table[name].append(ms * 1e3 / len(launches))
            launches[0].launch(*grid)
            be.synchronize()
            out = be.att.copy_to_host()[: R * be.kp_q].view(np.uint32)
            ref = out if ref is None else ref
            same[name] &= bool(np.array_equal(out, ref))
    print("\nattention variants: µs per layer (" + ", ".join(f"{c} {r} rows at {p}" for c, r, p in cases) + ")")
    print("| variant | " + " | ".join(f"{c} {r}@{p}" for c, r, p in cases) + " | bit-identical |")
    print("| --- | " + " | ".join("---" for _ in cases) + " | --- |")
    for name, _ in variants:
        print(f"| {name} | " + " | ".join(f"{t:.1f}" for t in table[name]) + f" | {same[name]} |", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="smollm2-135m")
    p.add_argument("--rows", default="1,16,48,256")
    p.add_argument("--prefix", default="0,4955")
    p.add_argument("--attention-regs", default="", help="e.g. 0,80,64: time k_attn under these register caps")
    args = p.parse_args()
    from decoder_service.model.cuda.backend import CudaBackend
    cfg = ModelConfig.from_dict(MODELS[args.shape], args.shape)
    rows_list = [int(r) for r in args.rows.split(",")]
    prefixes = [int(x) for x in args.prefix.split(",")]
    per_seq = -(-(max(prefixes) + max(rows_list) + 1) // BLOCK)
    max_r = max(rows_list)
    spec = KVPoolSpec(per_seq + max_r, BLOCK)
    be = CudaBackend(cfg, random_weights(cfg, seed=1), spec, max_rows=max_r, max_logit_rows=max_r,
                     max_table=per_seq * max_r)
    timer = Timer(be)
    if args.attention_regs:
        attention_variants(be, timer, per_seq, [int(r) for r in args.attention_regs.split(",")])
        return
    print(f"{args.shape}: µs per layer by kernel kind; forward = whole pass (µs)")
    print("| case | prefix | rows | " + " | ".join(KINDS) + " | forward |")
    print("| --- | --- | --- | " + " | ".join("---" for _ in KINDS) + " | --- |")
    for prefix in prefixes:
        for R in rows_list:
            for case, make in (("prefill", prefill_batch), ("decode", decode_batch)):
                t = profile(be, timer, make(R, prefix, per_seq))
                print(f"| {case} | {prefix} | {R} | " + " | ".join(f"{t[k]:.1f}" for k in KINDS)
                      + f" | {t['forward']:.0f} |", flush=True)


if __name__ == "__main__":
    main()
