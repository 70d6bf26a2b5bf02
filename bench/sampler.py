"""The device sampler's cost: a constrained decode step against an unconstrained one, and the sampler's
kernels alone with the trie in constant or global memory. MetaTool's trie, every row at its root (its
widest node: the worst case for the mask and the sparse head).

    python3 -m bench constrained-step [--backend cuda]  (H200: random bf16 weights at the real shapes)
    python -m bench constrained-step --backend cpu --shapes smollm2-135m   (Qwen3 is too slow here)
    python3 -m bench sampler [--tokenizer DIR]

constrained-step: each of B rows decodes one token at position CTX - 1 of its own sequence (paged KV,
one block table per row).
- unconstrained: forward + dense head (logits for the whole vocabulary; the argmax is not included,
  which favours this side);
- constrained: forward + k_mask (legal edges -> candidates) + sparse head + k_select (argmax,
  log-softmax, trie advance), everything on the device.
On cuda each side is one captured CUDA graph and the figure is the median of replays timed with CUDA
events; on cpu it is the median wall time of the host path (forward + dense_logits vs forward + host
sampler + sparse_logits).

sampler (GPU): k_mask and k_select alone, CUDA events around 200 raw launches of each (the engine's
launch path, launcher.Launch), by batch size; k_mask at the root every time, k_select after it (its cost
does not depend on the node).
"""
from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import numpy as np

from bench.common import BLOCK, Timer, ints, random_weights, shape_config
from compiler_service.compiler import compile_catalog
from decoder_service.model.batch import StepBatch
from decoder_service.model.kv_pool import KVPoolSpec
from shared.catalog import parse_registry
from shared.config import DEFAULT_MODEL_DIR
from shared.dataset import data_dir
from shared.tokenizer import ModelTokenizer

CTX = 1024


def metatool_trie(tokenizer: str):
    """MetaTool's catalog compiled with the tokenizer of the model directory `tokenizer`."""
    tok = ModelTokenizer(tokenizer)
    return compile_catalog(parse_registry((data_dir() / "metatool" / "catalog.json").read_text()), tok)


def context_batch(rows: int) -> StepBatch:
    """`rows` rows decoding at position CTX - 1, each in its own blocks."""
    per_seq = CTX // BLOCK
    tables = np.arange(rows * per_seq, dtype=np.int32).reshape(rows, per_seq)
    return StepBatch(tokens=np.full(rows, 198, np.int32), slots=np.arange(rows, dtype=np.int32),
                     positions=np.full(rows, CTX - 1, np.int32), block_tables=tables,
                     logit_rows=np.arange(rows, dtype=np.int32), decode_rows=rows)


def root_launches(packed, rows: int, const: int, cmax: int, stream, logits, cand_token=None, count=None):
    """k_mask and k_select for `rows` rows at the root of a packed trie (k 3, nothing emitted, every tool
    allowed; const 1: the trie is read from constant memory, 0: from the arena), on the stream handle
    `stream`, the candidates' logits read from `logits` (the candidate tokens and counts written to
    cand_token and count where given): (mask, select, the rows' buffers, the candidates' buffers)."""
    from numba import cuda

    from decoder_service.engine import device_trie as cs

    def i32(a):
        return cuda.to_device(np.ascontiguousarray(a, np.int32))

    def zeros():
        return i32(np.zeros(rows))

    row = {"base": zeros(), "const": i32(np.full(rows, const)), "node": zeros(), "n_emitted": zeros(),
           "k": i32(np.full(rows, 3)), "allow_start": zeros(), "allow_len": i32(np.full(rows, -1)),
           "prior": zeros(), "emitted": i32(np.full(rows * 4, -1))}
    cand = {"token": i32(np.zeros(rows * cmax)) if cand_token is None else cand_token,
            "count": zeros() if count is None else count, "status": zeros(),
            **{key: i32(np.zeros(rows * cmax)) for key in ("child", "lo", "edge", "ends")},
            "bias": cuda.to_device(np.zeros(rows * cmax, np.float32))}
    picks = {"done": zeros(), "token": zeros(), "edge": zeros(), "logprob": cuda.to_device(np.zeros(rows))}
    mask, select = cs.sampler_launches(cs.TrieKernels.get(), stream, i32(packed), row, 4, i32(np.zeros(1)),
                                       cuda.to_device(np.zeros(1, np.float32)), True, cand, cmax, logits, picks)
    return mask, select, row, cand


def cuda_sides(be, trie, rows):
    """(unconstrained ms, constrained ms, graph nodes of each) for one batch size."""
    from decoder_service.engine import device_trie as cs
    batch = context_batch(rows)
    be.stage(batch)
    packed = cs.pack_trie(trie)
    cs.ConstantTrie(cs.TrieKernels.get()).bind(("metatool", 1), packed, be.stream)
    mask, select, row, cand = root_launches(packed, rows, 1, be.max_candidates, be.stream.handle, be.sparse, be.cand,
                                            be.ncand)
    node, status = row["node"], cand["status"]

    def constrained():
        be.stream.memset0(node)  # every replay starts at the root: the widest node
        be.launch_forward(rows, rows, CTX)
        mask.launch(rows)
        be.launch_sparse(rows)
        select.launch(rows)

    def unconstrained():
        be.launch_forward(rows, rows, CTX)
        be.launch_dense(rows)

    constrained()
    be.synchronize()
    assert (status.copy_to_host() == cs.OK).all(), "the root mask must be non-empty"
    timer = Timer(be)
    u_ms, u_nodes = timer.graph_ms(unconstrained)
    c_ms, c_nodes = timer.graph_ms(constrained)
    return u_ms, c_ms, u_nodes, c_nodes


def cpu_sides(be, trie, rows, reps=5):
    from decoder_service.engine.sampler import legal_edges, select
    batch = context_batch(rows)
    emitted = np.full(3, -1, np.int32)
    buf = np.empty(trie.max_fanout(), np.int32)

    def constrained():
        be.forward(batch)
        n = legal_edges(0, trie.node_edge_start, trie.edge_child, trie.edge_lo, trie.edge_hi, emitted, 0, 3,
                        np.empty(0, np.int32), True, buf)
        cand = np.tile(trie.edge_token[buf[:n]], (rows, 1))
        logits = be.sparse_logits(cand, np.full(rows, n, np.int32))
        for r in range(rows):
            select(logits[r], cand[r])

    def unconstrained():
        be.forward(batch)
        be.dense_logits()

    out = []
    for fn in (unconstrained, constrained):
        fn()
        ts = []
        for _ in range(reps):
            t = time.perf_counter()
            fn()
            ts.append((time.perf_counter() - t) * 1e3)
        out.append(statistics.median(ts))
    return out[0], out[1], None, None


def constrained_step_arguments(p) -> None:
    p.add_argument("--backend", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--rows", default="1,16,64,256")
    p.add_argument("--shapes", default="smollm2-135m,qwen3-1.7b")
    p.add_argument("--tokenizer", default=str(DEFAULT_MODEL_DIR))
    p.add_argument("--out", default=None, help="also write the results as JSON here")


def constrained_step(args) -> None:
    trie = metatool_trie(args.tokenizer)
    rows_list = ints(args.rows)
    results = []
    print(f"MetaTool trie: root fan-out {trie.max_fanout()}; context {CTX}; backend {args.backend}")
    print("| shape | rows | unconstrained ms | constrained ms | constrained - unconstrained µs | graph nodes |")
    print("| --- | --- | --- | --- | --- | --- |")
    for shape in args.shapes.split(","):
        cfg = shape_config(shape)
        spec = KVPoolSpec(max(rows_list) * CTX // BLOCK, BLOCK)
        weights = random_weights(cfg, seed=1)
        if args.backend == "cuda":
            from decoder_service.model.cuda.backend import CudaBackend
            be = CudaBackend(cfg, weights, spec, max_rows=max(rows_list), max_logit_rows=max(rows_list),
                             max_candidates=256, max_table=max(rows_list) * (CTX // BLOCK))
            side = cuda_sides
        else:
            from decoder_service.model.cpu import CpuBackend
            be = CpuBackend(cfg, weights, spec)
            side = cpu_sides
        for rows in rows_list:
            u, c, un, cn = side(be, trie, rows)
            results.append({"shape": shape, "rows": rows, "unconstrained_ms": round(u, 4),
                            "constrained_ms": round(c, 4), "graph_nodes": [un, cn]})
            print(f"| {shape} | {rows} | {u:.3f} | {c:.3f} | {(c - u) * 1e3:+.0f} | {un} / {cn} |", flush=True)
        del be   # before the next shape's weights
    if args.out:
        Path(args.out).write_text(json.dumps({"backend": args.backend, "ctx": CTX, "results": results}, indent=2))


def time_kernels(trie, packed, use_const, n_rows, stream, reps=200):
    """(k_mask µs, k_select µs) per launch for n_rows rows at the root."""
    from numba import cuda

    from decoder_service.gpu.launcher import event_ms, new_event
    cmax = trie.max_fanout()
    logits = cuda.to_device(np.random.default_rng(0).standard_normal(n_rows * cmax).astype(np.float32))
    mask, select, _, cand = root_launches(packed, n_rows, use_const, cmax, stream.handle, logits)
    ncand, status = cand["count"], cand["status"]
    mask.launch(n_rows)
    stream.synchronize()
    assert (status.copy_to_host() == 0).all() and (ncand.copy_to_host() == cmax).all(), "root mask incomplete"
    times = []
    start, end = new_event(True), new_event(True)
    for launch in (mask, select):
        launch.launch(n_rows)
        stream.record(start)
        for _ in range(reps):
            launch.launch(n_rows)
        stream.record(end)
        stream.synchronize()
        times.append(event_ms(start, end) * 1e3 / reps)
    return times


def sampler_arguments(p) -> None:
    p.add_argument("--tokenizer", default=str(DEFAULT_MODEL_DIR),
                   help="the model directory whose tokenizer compiles MetaTool's trie")
    p.add_argument("--rows", default="1,16,64,256")


def sampler(args) -> None:
    from decoder_service.engine import device_trie as cs
    from decoder_service.gpu.launcher import Stream
    trie = metatool_trie(args.tokenizer)
    packed = cs.pack_trie(trie)
    stream = Stream()
    cs.ConstantTrie(cs.TrieKernels.get()).bind(("metatool", 1), packed, stream)
    print(f"MetaTool trie: {trie.num_nodes} nodes, {trie.num_edges} edges, root fan-out {trie.max_fanout()}, "
          f"{len(packed) * 4} bytes packed")
    print("| rows | k_mask const µs | k_mask global µs | k_select µs |\n| --- | --- | --- | --- |")
    for n in ints(args.rows):
        (mc, sel), (mg, _) = time_kernels(trie, packed, 1, n, stream), time_kernels(trie, packed, 0, n, stream)
        print(f"| {n} | {mc:.1f} | {mg:.1f} | {sel:.1f} |", flush=True)
