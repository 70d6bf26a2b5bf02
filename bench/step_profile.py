"""Where a multi-row forward step spends its time, kernel kind by kernel kind (CUDA only).

    python3 bench/step_profile.py [--shape smollm2-135m] [--rows 1,16,48,256] [--prefix 0,4955]
    python3 bench/step_profile.py --rows 256 --prefix 4955 --attention-regs 0,128 --attention-splits 128,512
    python3 bench/step_profile.py --rows 256 --prefix 4955 --row-splits 64
    python3 bench/step_profile.py --rows 1,58 --prefix 4985 --option gemm_warps=4,8 --option gemv_threads=64
    python3 bench/step_profile.py --rows 58 --prefix 7999 --attention-splits 256,512 \
        --cases prefill:58@4985,prefill:16@2047

One sequence prefills R rows at positions P..P+R-1 after a P-token prefix already in the pool (the
shape of a tooltrie request: the catalog prefix is cached, the query suffix is prefilled), and R
sequences each decode one row at position P (the all-at-once shape). For each kind of launch, a graph
of that launch for every layer is replayed (warm L2, as in a real step) and its median CUDA-event time
is divided by the layers; the last column is the whole forward pass. Random bf16 weights. With
--option NAME=V1,V2, every case again on a backend of its own per value of that constructor option
(perf log g1: k_gemm's warps, the one-row GEMVs' block size).
With --attention-regs / --attention-splits / --row-splits, only attention, compiled under each register
cap or with each split size (k_attn_rows: each most splits a row), on random K/V, against a float64
attention (perf log b6, a1, d2).
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.gpu_model_check import MODELS, Timer, random_weights  # noqa: E402
from decoder_service.model.batch import StepBatch  # noqa: E402
from decoder_service.model.config import ModelConfig  # noqa: E402
from decoder_service.model.cuda.kernels import MAX_SPLITS, ROW_SPLITS  # noqa: E402
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
                     logit_rows=np.arange(rows, dtype=np.int32), decode_rows=rows)


def sized_backend(cfg: ModelConfig, max_rows: int, max_position: int, spare: int = 1, **options):
    """A CudaBackend (random bf16 weights, seed 1; `options` to its constructor) for max_rows rows of
    prefill_batch or decode_batch up to max_position, and the blocks a sequence's table spans (per_seq).
    The pool holds one sequence's blocks plus `spare` blocks a row (its size sets where random K/V land:
    logits_hash keeps 2, so its hashes stay comparable across checkouts)."""
    from decoder_service.model.cuda.backend import CudaBackend
    per_seq = -(-(max_position + 1) // BLOCK)
    be = CudaBackend(cfg, random_weights(cfg, seed=1), KVPoolSpec(per_seq + spare * max_rows, BLOCK),
                     max_rows=max_rows, max_logit_rows=max_rows, max_table=per_seq * max_rows, **options)
    return be, per_seq


def relaunched(be, key: str, kernel=None, arg: int | None = None, value=None) -> list:
    """The layers' `key` launches packed again (same block, shared memory, stream), on `kernel` (None:
    theirs) and with argument `arg` set to `value` (None: unchanged)."""
    from decoder_service.model.cuda.launcher import Launch
    out = []
    for layer in be.layers:
        a = layer[key]
        args = list(a.args)
        if arg is not None:
            args[arg] = value
        k = kernel or a.kernel
        k.allow_dynamic_shared(a.shmem)
        out.append(Launch(k, a.block, a.shmem, args, be.stream.handle, a.name))
    return out


def profile(be, timer, batch: StepBatch) -> dict:
    R = batch.num_rows
    be.stage(batch)
    be.synchronize()
    out = {}
    nq = be.cfg.num_heads + be.cfg.num_kv_heads
    attn = be.attn_grids(int(batch.positions.max()) + 1)
    plan = be.row_plan(R)
    for kind in KINDS:
        def body(kind=kind):
            for layer in be.layers:
                if kind == "rope":
                    if plan.rope:
                        layer["rope"].launch(R, nq)
                elif kind == "attn":
                    be.launch_attention(layer, attn)
                else:
                    be.launch_matrix(layer, kind, plan)
        ms, _ = timer.graph_ms(body, reps=9)
        out[kind] = ms * 1e3 / len(be.layers)
    ms, _ = timer.graph_ms(lambda: be.launch_forward(R, len(batch.logit_rows)), reps=9)
    out["forward"] = ms * 1e3
    return out


def reference_attention(be, batch: StepBatch, layer: int) -> np.ndarray:
    """float64 attention of the batch's rows at `layer` from the q in be.qkv and the pool: [R, q_size]."""
    from decoder_service.model.reference import attend
    from decoder_service.model.weights import to_float32
    nh, hd = be.cfg.num_heads, be.cfg.head_dim
    k, v = (to_float32(np.ascontiguousarray(a[layer]), be.storage).astype(np.float64) for a in be.kv_cache())
    q = be.qkv.copy_to_host()[: batch.num_rows * be.dqkv].reshape(batch.num_rows, be.dqkv)
    return np.stack([attend(k, v, batch.block_tables[batch.slots[r]], int(batch.positions[r]),
                            q[r, : nh * hd].reshape(nh, hd).astype(np.float64)).reshape(-1)
                     for r in range(batch.num_rows)])


def attention_launches(be, regs: int = 0) -> list:
    """The layers' prompt attention launches, the tiles' kernel compiled under a register cap (0: its own,
    e.g. k_attn_mma's MMA_ATTN_REGISTERS)."""
    from numba import cuda

    from decoder_service.model.cuda import kernels
    from decoder_service.model.cuda.launcher import Kernel
    name = be.layers[0]["attn_tiles"].kernel.name     # k_attn_mma (bf16) or k_attn_tiles
    kern = be.kernels[name] if not regs else \
        Kernel(name, be.storage, dispatcher=cuda.jit(max_registers=regs)(kernels.KERNELS[name].py_func))
    return relaunched(be, "attn_tiles", kern)


CASES = [("decode", 1, 4955), ("prefill", 48, 4955), ("prefill", 16, 4955), ("prefill", 48, 2047),
         ("prefill", 48, 1023), ("prefill", 48, 255), ("decode", 64, 4955), ("decode", 256, 4955),
         ("decode", 1, 1023)]


def parse_case(text: str) -> tuple[str, int, int]:
    """A case as KIND:ROWS@PREFIX (decode:1@4955, prefill:58@4985): CASES' (kind, rows, prefix)."""
    kind, _, shape = text.partition(":")
    rows, _, prefix = shape.partition("@")
    if kind not in ("decode", "prefill") or not rows.isdigit() or not prefix.isdigit():
        raise SystemExit(f"bad case {text!r}: expected decode:R@P or prefill:R@P")
    return kind, int(rows), int(prefix)


def attention_variants(be, timer, per_seq: int, variants: list, cases: list = CASES) -> None:
    """Attention variants [(name, launches, grid(batch))] on the same random K/V: µs per layer, the
    relative error of the last layer's output against float64, and whether it is bit-identical to the
    first variant of the same kernel (a register cap must not change a bit; a split size may)."""
    from bench.gpu_model_check import rand_bf16
    rng = np.random.default_rng(5)
    for pool in (be.kv_k, be.kv_v):   # random K/V, so that every score and weight differs
        pool.copy_to_device(rand_bf16(rng, (pool.size,), 1.0))
    cases = [c for c in cases if c[1] <= be.max_rows]
    table = {name: [] for name, _, _ in variants}
    errs = {name: 0.0 for name, _, _ in variants}
    same = {name: True for name, _, _ in variants}
    for case, R, prefix in cases:
        batch = (prefill_batch if case == "prefill" else decode_batch)(R, prefix, per_seq)
        be.forward(batch)   # q for the rows, and their own K/V written
        be.synchronize()
        ref = reference_attention(be, batch, len(be.layers) - 1)
        first = {}
        for name, launches, grid_of in variants:
            grid = grid_of(batch)
            ms, _ = timer.graph_ms(lambda launches=launches: [lz.launch(*grid) for lz in launches], reps=9)
            table[name].append(ms * 1e3 / len(launches))
            launches[-1].launch(*grid)
            be.synchronize()
            out = be.att.copy_to_host()[: R * be.kp_q].reshape(R, be.kp_q)[:, : ref.shape[1]]
            errs[name] = max(errs[name], float(np.linalg.norm(out - ref) / np.linalg.norm(ref)))
            base = first.setdefault(launches[0].kernel.name, out)
            same[name] &= bool(np.array_equal(out.view(np.uint32), base.view(np.uint32)))
    print("\nattention variants: µs per layer; error = max relative error against float64")
    print("| variant | " + " | ".join(f"{c} {r}@{p}" for c, r, p in cases) + " | error | bit-identical to the kernel's first |")
    print("| --- | " + " | ".join("---" for _ in cases) + " | --- | --- |")
    for name, _, _ in variants:
        print(f"| {name} | " + " | ".join(f"{t:.1f}" for t in table[name])
              + f" | {errs[name]:.1e} | {same[name]} |", flush=True)


def staged(be, batch: StepBatch, kernel: str, split: int | None = None, row_splits: int = ROW_SPLITS) -> tuple:
    """Stage the batch so that every row goes to one attention kernel ("rows" or "tiles"), the tiles
    at `split` positions at every context (None: the backend's prompt_split rule); its grid."""
    saved = be.attn_tile_from, be.attn_split, be.most_splits
    be.attn_tile_from = 0
    if split is not None:
        be.attn_split, be.most_splits = split, MAX_SPLITS
    try:
        be.stage(dataclasses.replace(batch, decode_rows=batch.num_rows if kernel == "rows" else 0))
        rows, tiles = be.attn_grids(int(batch.positions.max()) + 1, row_splits)
    finally:
        be.attn_tile_from, be.attn_split, be.most_splits = saved
    return rows if kernel == "rows" else tiles


def kernel_variants(be, regs_list: list[int], splits: list[int], row_splits: list[int] = ()) -> list:
    """k_attn_rows for every row (at the backend's ROW_SPLITS, then at each of row_splits), then the
    prompt tiles' kernel (k_attn_mma or k_attn_tiles) for every row under each register cap (at the
    backend's split rule), then at each split size at every context."""
    def grid(split=None):
        return lambda batch: staged(be, batch, "tiles", split)

    def rows_grid(maxs):
        return lambda batch: staged(be, batch, "rows", row_splits=maxs)
    rows = [layer["attn_rows"] for layer in be.layers]
    out = [("k_attn_rows (a block per row, head, split)", rows, rows_grid(ROW_SPLITS))]
    maxs = len(rows[0].args) - 1    # k_attn_rows' last argument: at most this many splits a row
    out += [(f"k_attn_rows, at most {m} splits", relaunched(be, "attn_rows", arg=maxs, value=m), rows_grid(m))
            for m in row_splits]
    for regs in regs_list:
        launches = attention_launches(be, regs)
        k = launches[0].kernel
        out.append((f"{k.name}, cap {regs or 'none'} ({k.attrs.regs} registers, "
                    f"{k.occupancy(launches[0].block, launches[0].shmem)} blocks/SM; split {be.attn_split}, "
                    f"at most {be.most_splits} splits)", launches, grid()))
    for split in splits:
        launches = attention_launches(be)
        out.append((f"{launches[0].kernel.name}, split {split}", launches, grid(split)))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="smollm2-135m")
    p.add_argument("--rows", default="1,16,48,256")
    p.add_argument("--prefix", default="0,4955")
    p.add_argument("--attention-regs", default="",
                   help="e.g. 0,128,255: time prompt attention under these register caps (0: the kernel's own)")
    p.add_argument("--attention-splits", default="", help="e.g. 128,512: and with these split sizes")
    p.add_argument("--row-splits", default="", help="e.g. 64: and k_attn_rows with at most these splits a row")
    p.add_argument("--option", action="append", default=[], metavar="NAME=V1,V2",
                   help="and every case again on a backend built with CudaBackend option NAME at each value "
                        "(e.g. gemm_warps=4,8 or gemv_threads=64); repeatable")
    p.add_argument("--cases", default="", help="attention variants' cases, e.g. prefill:58@4985,decode:1@1023 "
                   "(default: CASES; each fits --rows and --prefix)")
    args = p.parse_args()
    cfg = ModelConfig.from_dict(MODELS[args.shape], args.shape)
    rows_list = [int(r) for r in args.rows.split(",")]
    prefixes = [int(x) for x in args.prefix.split(",")]
    be, per_seq = sized_backend(cfg, max(rows_list), max(prefixes) + max(rows_list))
    timer = Timer(be)
    if args.attention_regs or args.attention_splits or args.row_splits:
        ints = lambda a: [int(x) for x in a.split(",") if x]  # noqa: E731
        attention_variants(be, timer, per_seq,
                           kernel_variants(be, ints(args.attention_regs or "0"), ints(args.attention_splits),
                                           ints(args.row_splits)),
                           [parse_case(c) for c in args.cases.split(",")] if args.cases else CASES)
        return
    print(f"{args.shape}: µs per layer by kernel kind; forward = whole pass (µs)")
    print("| case | prefix | rows | " + " | ".join(KINDS) + " | forward |")
    print("| --- | --- | --- | " + " | ".join("---" for _ in KINDS) + " | --- |")
    variants = [("", {})] + [(f", {name}={v}", {name: int(v)})
                             for name, values in (o.split("=", 1) for o in args.option) for v in values.split(",")]
    for suffix, option in variants:
        if option:      # a backend of its own, built with that constructor option
            be, _ = sized_backend(cfg, max(rows_list), max(prefixes) + max(rows_list), **option)
            timer = Timer(be)
        for prefix in prefixes:
            for R in rows_list:
                for case, make in (("prefill", prefill_batch), ("decode", decode_batch)):
                    t = profile(be, timer, make(R, prefix, per_seq))
                    print(f"| {case}{suffix} | {prefix} | {R} | " + " | ".join(f"{t[k]:.1f}" for k in KINDS)
                          + f" | {t['forward']:.0f} |", flush=True)


if __name__ == "__main__":
    main()
