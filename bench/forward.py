"""The forward pass on the GPU, kernel by kernel (random bf16 weights at a model's real shapes).

    python3 -m bench step [--shape smollm2-135m] [--rows 1,16,48,256] [--prefix 0,4955]
    python3 -m bench step --rows 256 --prefix 4955 --attention-regs 0,128 --attention-splits 128,512
    python3 -m bench step --rows 256 --prefix 4955 --row-splits 64
    python3 -m bench step --rows 1,58 --prefix 4985 --option gemm_warps=4,8 --option gemv_threads=64
    python3 -m bench step --rows 58 --prefix 7999 --attention-splits 256,512 \
        --cases prefill:58@4985,prefill:16@2047
    ncu --profile-from-start off --clock-control none --cache-control none \
        --metrics gpu__time_duration.sum --csv python3 -m bench kernel-profile decode:1@4955 prefill:71@4955
    python3 -m bench gemm [--rows 16,71,256,512]

step: one sequence prefills R rows at positions P..P+R-1 after a P-token prefix already in the pool (the
shape of a tooltrie request: the catalog prefix is cached, the query suffix is prefilled), and R
sequences each decode one row at position P (the all-at-once shape). For each kind of launch, a graph
of that launch for every layer is replayed (warm L2, as in a real step) and its median CUDA-event time
is divided by the layers; the last column is the whole forward pass. With --option NAME=V1,V2, every
case again on a backend of its own per value of that constructor option (P68, P69, P70: k_gemm's warps,
the one-row GEMVs' block size). With --attention-regs / --attention-splits / --row-splits, only
attention, compiled under each register cap or with each split size (k_attn_rows: each most splits a
row), on random K/V, against a float64 attention (P18, P20, P40).

kernel-profile: each case runs once unprofiled (compiles, warms L2) and once between cudaProfilerStart
and Stop, launch by launch (no graph), so that ncu's per-kernel durations add up to the step's device
time without the launch gaps a graph replay would still have.

gemm: µs per layer of each matrix for M prompt rows at the SmolLM2 shape, the backend's GEMV row tiles against
k_gemm's small tiles, the same on one register set, and its big tiles (graphs of the layers' launches, L2 warm as
in a real step). k_gemm's correctness is tests/test_gemm.py's.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from bench.common import (MODELS, Timer, case_batch, ints, parse_case, rand_bf16, random_weights, relaunch,
                          shape_config, sized_backend)
from decoder_service.model.batch import StepBatch

KINDS = ("qkv", "rope", "attn", "o", "gate_up", "down")


def relaunched(be, key: str, kernel=None, **changed) -> list:
    """The layers' `key` launches packed again, on `kernel` (None: theirs), the arguments named in `changed`
    set."""
    return [relaunch(layer[key], kernel, **changed) for layer in be.layers]


def profile(be, timer, batch: StepBatch) -> dict:
    R = batch.num_rows
    be.stage(batch)
    be.synchronize()
    out = {}
    attn = be.attn_grids(int(batch.positions.max()) + 1)
    plan = be.row_plan(R)
    for kind in KINDS:
        def body(kind=kind):
            for layer in be.layers:
                if kind == "rope":
                    if plan.rope:
                        be.launch_rope(layer, R)
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
    name = be.layers[0]["attn_tiles"].kernel.name     # k_attn_mma (bf16) or k_attn_tiles
    kern = be.kernels[name] if not regs else \
        kernels.model_kernel(name, be.storage, cuda.jit(max_registers=regs)(kernels.KERNELS[name].py_func))
    return relaunched(be, "attn_tiles", kern)


CASES = [("decode", 1, 4955), ("prefill", 48, 4955), ("prefill", 16, 4955), ("prefill", 48, 2047),
         ("prefill", 48, 1023), ("prefill", 48, 255), ("decode", 64, 4955), ("decode", 256, 4955),
         ("decode", 1, 1023)]


def attention_variants(be, timer, per_seq: int, variants: list, cases: list = CASES) -> None:
    """Attention variants [(name, launches, grid(batch))] on the same random K/V: µs per layer, the
    relative error of the last layer's output against float64, and whether it is bit-identical to the
    first variant of the same kernel (a register cap must not change a bit; a split size may)."""
    rng = np.random.default_rng(5)
    for pool in (be.kv_k, be.kv_v):   # random K/V, so that every score and weight differs
        pool.copy_to_device(rand_bf16(rng, (pool.size,), 1.0))
    cases = [c for c in cases if c[1] <= be.max_rows]
    table = {name: [] for name, _, _ in variants}
    errs = {name: 0.0 for name, _, _ in variants}
    same = {name: True for name, _, _ in variants}
    for case, R, prefix in cases:
        batch = case_batch(case, R, prefix, per_seq)
        be.forward(batch)   # q for the rows, and their own K/V written
        be.synchronize()
        ref = reference_attention(be, batch, len(be.layers) - 1)
        first = {}
        for name, launches, grid_of in variants:
            grid = grid_of(batch)
            ms, _ = timer.graph_ms(lambda launches=launches, grid=grid: [lz.launch(*grid) for lz in launches], reps=9)
            table[name].append(ms * 1e3 / len(launches))
            launches[-1].launch(*grid)
            be.synchronize()
            out = be.att.copy_to_host()[: R * be.kp_q].reshape(R, be.kp_q)[:, : ref.shape[1]]
            errs[name] = max(errs[name], float(np.linalg.norm(out - ref) / np.linalg.norm(ref)))
            base = first.setdefault(launches[0].kernel.name, out)
            same[name] &= bool(np.array_equal(out.view(np.uint32), base.view(np.uint32)))
    print("\nattention variants: µs per layer; error = max relative error against float64")
    print("| variant | " + " | ".join(f"{c} {r}@{p}" for c, r, p in cases)
          + " | error | bit-identical to the kernel's first |")
    print("| --- | " + " | ".join("---" for _ in cases) + " | --- | --- |")
    for name, _, _ in variants:
        print(f"| {name} | " + " | ".join(f"{t:.1f}" for t in table[name])
              + f" | {errs[name]:.1e} | {same[name]} |", flush=True)


def staged(be, batch: StepBatch, kernel: str, split: int | None = None, row_splits: int | None = None) -> tuple:
    """Stage the batch so that every row goes to one attention kernel ("rows" or "tiles"), the tiles
    at `split` positions at every context (None: the backend's prompt_split rule), k_attn_rows at most
    `row_splits` splits a row (None: ROW_SPLITS); its grid."""
    from decoder_service.model.cuda.backend import MAX_SPLITS, ROW_SPLITS
    saved = be.attn_tile_from, be.attn_split, be.most_splits
    be.attn_tile_from = 0
    if split is not None:
        be.attn_split, be.most_splits = split, MAX_SPLITS
    try:
        be.stage(dataclasses.replace(batch, decode_rows=batch.num_rows if kernel == "rows" else 0))
        rows, tiles = be.attn_grids(int(batch.positions.max()) + 1, row_splits or ROW_SPLITS)
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
    out = [("k_attn_rows (a block per row, head, split)", rows, rows_grid(None))]
    out += [(f"k_attn_rows, at most {m} splits", relaunched(be, "attn_rows", maxs=m), rows_grid(m))
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


def step_arguments(p) -> None:
    p.add_argument("--shape", default="smollm2-135m", choices=sorted(MODELS))
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


def step(args) -> None:
    cfg = shape_config(args.shape)
    rows_list, prefixes = ints(args.rows), ints(args.prefix)
    be, per_seq = sized_backend(cfg, max(rows_list), max(prefixes) + max(rows_list))
    timer = Timer(be)
    if args.attention_regs or args.attention_splits or args.row_splits:
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
                for case in ("prefill", "decode"):
                    t = profile(be, timer, case_batch(case, R, prefix, per_seq))
                    print(f"| {case}{suffix} | {prefix} | {R} | " + " | ".join(f"{t[k]:.1f}" for k in KINDS)
                          + f" | {t['forward']:.0f} |", flush=True)



def kernel_profile_arguments(p) -> None:
    p.add_argument("cases", nargs="+", help="decode:R@P or prefill:R@P")
    p.add_argument("--shape", default="smollm2-135m", choices=sorted(MODELS))


def kernel_profile(args) -> None:
    from numba import cuda
    cases = [parse_case(c) for c in args.cases]
    be, per_seq = sized_backend(shape_config(args.shape), max(r for _, r, _ in cases),
                                max(p + r for _, r, p in cases), graph_rows=0)
    for kind, rows, prefix in cases:
        batch = case_batch(kind, rows, prefix, per_seq)
        be.forward(batch)
        be.synchronize()
        cuda.profile_start()
        be.forward(batch)
        be.synchronize()
        cuda.profile_stop()
        print(f"profiled {kind} {rows} rows at position {prefix}", flush=True)


def gemm_arguments(p) -> None:
    p.add_argument("--rows", default="16,71,256,512")


def gemm(args) -> None:
    from decoder_service.model.cuda.backend import TILE_ROWS, CudaBackend
    from decoder_service.model.cuda.plan import RowPlan
    from decoder_service.model.cuda.kernels import GEMM_KINDS
    from decoder_service.model.kv_pool import KVPoolSpec
    rows = ints(args.rows)
    cfg = shape_config("smollm2-135m")
    be = CudaBackend(cfg, random_weights(cfg, seed=1), KVPoolSpec(64, 16), max_rows=max(rows))
    rng = np.random.default_rng(2)
    for buf in (be.x, be.att, be.act):
        buf.copy_to_device(rng.standard_normal(buf.size).astype(np.float32))
    timer = Timer(be)
    print(", ".join(f"{n} {k.attrs.regs} regs/{k.attrs.local} B local" for n, k in be.kernels.items()
                    if n.startswith("k_gemm")))
    print("| rows | matrix | GEMV tiles (µs/layer) | k_gemm (µs/layer) | one register set (µs/layer) | "
          "big tiles (µs/layer) | GEMV / k_gemm | k_gemm / big |\n| --- | --- | --- | --- | --- | --- | --- | --- |")
    n = len(be.layers)

    def per_layer_us(key: str, plan: RowPlan) -> float:
        ms, _ = timer.graph_ms(lambda: [be.launch_matrix(ly, key, plan) for ly in be.layers])
        return ms * 1e3 / n

    for R in rows:
        be.n_rows.value = R
        be.gemm_rows[0].value, be.gemm_rows[1].value = 0, R
        for key in ("qkv", "o", "gate_up", "down"):
            tiles = RowPlan({key: key + "/tile"}, -(-R // TILE_ROWS), 0, "", True)   # every row on the GEMV tiles
            gemms = [RowPlan({}, 0, R, {key: f"{key}/{kind}"}, True) for kind in GEMM_KINDS]
            t, g, one, big = (per_layer_us(key, plan) for plan in (tiles, *gemms))
            print(f"| {R} | {key} | {t:.1f} | {g:.1f} | {one:.1f} | {big:.1f} | {t / g:.2f}× | {g / big:.2f}× |",
                  flush=True)
