"""The CUDA backend at batch 1, timed kernel by kernel at real shapes with random bf16 weights: each
kernel kind cold (L2 flushed), whole decode steps (graph, raw launches, batched), a 1,023-token prompt and a
decode at context 1,024, and the disk cache. The one-row GEMV's block size and cache hint: `python -m bench
step --option gemv_threads=128,256 --option prefetch=0,1` (warm L2, as in a step).

    python3 -m bench model [--out DIR] [--models smollm2-135m,qwen3-1.7b] [--no-long]

Writes DIR/gpu_model_h200.md (the tables), DIR/log.txt (everything printed) and DIR/results.json; the
model's correctness against float64 at these shapes is tests/test_gpu_model.py's.

Method: kernel times are CUDA-event times of graph replays. Per-kernel rows are measured cold: each replay
first reads a 256 MiB scratch matrix (evicting the 60 MB L2, leaving clean lines), then launches the kernel
once per layer (each layer has its own weights); the time of the flush alone is subtracted. GB/s counts
the weight bytes plus the activation bytes each launch must move, and is compared with a device-to-device
cuMemcpy measured in the same run (bytes read + bytes written).
"""
from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from bench.common import MODELS, ROOT, Timer, copy_bandwidth, random_weights, relaunch, shape_config
from decoder_service.model.batch import StepBatch
from decoder_service.model.kv_pool import KVPoolSpec

LOG: list[str] = []


def log(*a):
    s = " ".join(str(x) for x in a)
    print(s, flush=True)
    LOG.append(s)


def time_model(name: str, long: bool = True) -> dict:
    """Every table of one model shape."""
    from cuda.bindings import driver as drv
    from numba import cuda

    from decoder_service.model.cuda.backend import CudaBackend
    from decoder_service.gpu.launcher import check, dptr

    cfg = shape_config(name)
    w = random_weights(cfg, seed=11)
    log(f"\n=== {name}: {cfg.num_layers} layers, hidden {cfg.hidden_size}, heads {cfg.num_heads}/"
        f"{cfg.num_kv_heads}x{cfg.head_dim}, inter {cfg.intermediate_size}, vocab {cfg.vocab_size}; "
        f"weights {w.nbytes() / 2**20:.0f} MiB bf16 (random)")
    spec = KVPoolSpec(num_blocks=256, block_size=16)
    t = time.time()
    be = CudaBackend(cfg, w, spec, max_rows=256, max_logit_rows=32, max_candidates=256)
    init_s = time.time() - t
    kinfo = {n: dict(regs=k.attrs.regs, local=k.attrs.local, cache_hit=k.cache_hit)
             for n, k in be.kernels.items()}
    log(f"backend init {init_s:.1f} s (upload + compile/load); kernels: {kinfo}")
    res = {"init_s": init_s, "kernels": kinfo}
    # a 12-token prompt and four decoded tokens in non-contiguous, unordered blocks: the context timed
    rng = np.random.default_rng(5)
    bt = rng.permutation(spec.num_blocks).astype(np.int32)[:64].reshape(4, 16)
    prompt = rng.integers(3, cfg.vocab_size, 12).tolist()
    be.forward(StepBatch.from_chunks([(0, prompt, 0)], bt))
    pos = len(prompt)
    for _ in range(4):
        nxt = int(be.dense_logits()[0].argmax())
        be.forward(StepBatch.from_chunks([(0, [nxt], pos)], bt, decode_rows=1))
        pos += 1
    pos -= 1

    # ---- timing: per kernel, cold L2
    H, I, V = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    ctx = pos + 1
    be.stage(StepBatch.from_chunks([(0, [nxt], pos)], bt, decode_rows=1))   # batch 1, context ctx
    be.synchronize()
    tm = Timer(be)
    # L2 flush that leaves clean lines: a GEMV reading a 256 MiB scratch matrix (a memset would leave
    # 60 MB of dirty lines whose write-back the measured kernel would pay for).
    fl_rows, fl_k = 65536, 2048
    scratch_w = cuda.device_array(fl_rows * fl_k, np.uint16)
    check(drv.cuMemsetD16Async(dptr(scratch_w), 0x3F80, scratch_w.size, be.stream.handle))
    scratch_o = cuda.device_array(fl_rows, np.float32)
    scratch_x = cuda.device_array(fl_k, np.float32)
    check(drv.cuMemsetD32Async(dptr(scratch_x), 0x3F800000, fl_k, be.stream.handle))
    fl = relaunch(be.l_dense[0], be.kernels["k_gemv"], 256, fl_k * 4, x=scratch_x, x_stride=fl_k,
                  row_map=be.logit_rows, use_map=0, gamma=scratch_x, eps=1e-6, use_norm=0, W=scratch_w, Q=fl_k // 8,
                  K=fl_k, N=fl_rows, bias=scratch_x, use_bias=0, out=scratch_o, out_stride=fl_rows, mode=0, pf=0,
                  epl=64)   # mode 0: no RoPE (its pool arguments the dense head's, unread)

    def flush():
        fl.launch(be.sm_count * 4, 1)

    t_flush, _ = tm.graph_ms(flush)
    isz = 2
    kv_row = cfg.kv_size * isz

    def gemv(key):
        return [lambda lz=ly[key][0], g=ly[key][1]: lz.launch(g, 1) for ly in be.layers]

    kinds = {
        "qkv (norm+GEMV)": (gemv("qkv"), (cfg.q_size + 2 * cfg.kv_size) * H * isz + 4 * H, True),
        "rope + KV write": ([lambda ly=ly: be.launch_rope(ly, 1) for ly in be.layers] if be.row_plan(1).rope else [],
                            4 * 2 * (cfg.q_size + 2 * cfg.kv_size) + 2 * kv_row, False),
        "attention": ([lambda lz=ly["attn_rows"]: lz.launch(1, cfg.num_heads) for ly in be.layers],
                      2 * ctx * kv_row + 8 * cfg.q_size, False),
        "o_proj + residual": (gemv("o"), H * cfg.q_size * isz + 4 * cfg.q_size + 8 * H, True),
        "gate_up + SwiGLU": (gemv("gate_up"), 2 * I * H * isz + 4 * H + 4 * I, True),
        "down + residual": (gemv("down"), H * I * isz + 4 * I + 8 * H, True),
        "dense head (final-normed h)": ([lambda: be.l_dense[0].launch(be.l_dense[1], 1)],
                                        V * H * isz + 4 * H + 4 * V, True),
        "embedding gather": ([lambda: be.l_embed.launch(1)], H * isz + 4 * H, False),
        "final norm": ([lambda: be.l_final.launch(1)], 8 * H, False),
    }
    rows = []

    def run_kind(label, calls, nbytes, is_gemv, reps=15):
        def body():
            for c in calls:
                c()
        ms, nodes = tm.graph_ms(lambda: (flush(), body()), reps=reps)
        us = (ms - t_flush) * 1e3 / len(calls)
        gbs = nbytes / (us * 1e-6) / 1e9
        rows.append(dict(kernel=label, us=us, bytes=nbytes, gbs=gbs, gemv=is_gemv, launches=len(calls)))
        return us, gbs

    for label, (calls, nbytes, is_gemv) in kinds.items():
        if calls:                         # no rope launch where one row's RoPE runs in the QKV GEMV
            run_kind(label, calls, nbytes, is_gemv)
    for nc in (32, 256):
        cand = np.sort(rng.choice(V, nc, replace=False)).astype(np.int32)[None]
        be.stage_candidates(cand, np.array([nc], np.int32))
        be.synchronize()
        run_kind(f"sparse head, {nc} candidates", [lambda: be.l_sparse[0].launch(be.l_sparse[1], 1)],
                 nc * H * isz + 4 * H + 4 * nc, False)
    res["kernels_cold"] = rows

    # ---- whole decode step, batch 1
    n_launch = be.launches_per_step()
    cand = np.sort(rng.choice(V, 32, replace=False)).astype(np.int32)[None]
    be.stage_candidates(cand, np.array([32], np.int32))
    be.stage(StepBatch.from_chunks([(0, [nxt], pos)], bt, decode_rows=1))
    be.synchronize()
    step = {}
    ms, nodes = tm.graph_ms(lambda: (be.launch_forward(1, 1), be.launch_sparse(1)), reps=30)
    step["graph_sparse_us"], step["graph_sparse_nodes"] = ms * 1e3, nodes
    ms, nodes = tm.graph_ms(lambda: (be.launch_forward(1, 1), be.launch_dense(1)), reps=30)
    step["graph_dense_us"], step["graph_dense_nodes"] = ms * 1e3, nodes
    # raw cuLaunchKernel from the host loop (no graph): host wall per step, synchronised per step
    for _ in range(3):
        be.launch_forward(1, 1)
        be.launch_sparse(1)
    be.synchronize()
    t = time.perf_counter()
    nsteps = 30
    for _ in range(nsteps):
        be.launch_forward(1, 1)
        be.launch_sparse(1)
        be.synchronize()
    step["raw_launch_sparse_us"] = (time.perf_counter() - t) / nsteps * 1e6
    t = time.perf_counter()
    for _ in range(nsteps):
        be.launch_forward(1, 1)
        be.launch_sparse(1)
    host_enqueue = (time.perf_counter() - t) / nsteps * 1e6
    be.synchronize()
    step["host_enqueue_us_per_launch"] = host_enqueue / (n_launch + 1)
    step["launches_per_step"] = n_launch + 1
    step["weight_bytes_per_step_sparse"] = int(w.nbytes() - V * H * isz + 32 * H * isz)
    # batched decode steps (graph): R sequences decoding at once, each with its own context
    for R in (4, 8, 32):
        tabs = np.arange(R * 4, dtype=np.int32).reshape(R, 4) + 64   # 4 blocks each, after slot tables
        for s0 in range(0, R, 8):
            be.forward(StepBatch.from_chunks([(s, rng.integers(3, V, 20).tolist(), 0)
                                              for s in range(s0, min(R, s0 + 8))], tabs))
        dec = StepBatch.from_chunks([(s, [int(rng.integers(3, V))], 20) for s in range(R)], tabs, decode_rows=R)
        be.stage(dec)
        be.synchronize()
        ms, _ = tm.graph_ms(lambda R=R: (be.launch_forward(R, R), be.launch_dense(R)), reps=10)
        step[f"graph_dense_batch{R}_us"] = ms * 1e3
    res["step"] = step
    if long:
        res["long"] = long_context(be, cfg, tm, flush, t_flush, rng)
    log(f"  step (batch 1, ctx {ctx}): graph+sparse {step['graph_sparse_us']:.0f} us "
        f"({step['graph_sparse_nodes']} nodes), graph+dense {step['graph_dense_us']:.0f} us, raw "
        f"cuLaunchKernel loop {step['raw_launch_sparse_us']:.0f} us/step "
        f"({step['host_enqueue_us_per_launch']:.1f} us host per launch)")
    return res



def long_context(be, cfg, tm, flush, t_flush, rng, n_prompt=1023):
    """A 1023-token prompt prefilled in chunks of 256 rows, then attention and a decode at ctx 1024 (its
    logits against float64: tests/test_gpu_model.py)."""
    from decoder_service.gpu.launcher import event_ms, new_event
    out = {}
    V = cfg.vocab_size
    slot_tab = np.full((1, 64), -1, np.int32)
    slot_tab[0] = np.arange(192, 256, dtype=np.int32)[::-1]        # blocks 192..255, reversed
    prompt = rng.integers(3, V, n_prompt).tolist()
    chunks = [StepBatch.from_chunks([(0, prompt[i:i + 256], i)], slot_tab) for i in range(0, n_prompt, 256)]
    be.synchronize()
    e0, e1 = new_event(True), new_event(True)
    be.stream.record(e0)
    for c in chunks:
        be.forward(c)
    be.stream.record(e1)
    be.synchronize()
    ms = event_ms(e0, e1)
    out["prefill_ms"], out["prefill_tok_s"] = ms, n_prompt / (ms * 1e-3)
    dec = StepBatch.from_chunks([(0, [int(rng.integers(3, V))], n_prompt)], slot_tab, decode_rows=1)
    be.stage(dec)
    be.synchronize()
    nh = cfg.num_heads
    for label, maxs in (("split", None), ("one block per head (no split)", 1)):
        calls = []
        for ly in be.layers:
            lz = ly["attn_rows"]
            if maxs is not None:
                lz = relaunch(lz, maxs=maxs)
            gz = be.attn_grids(n_prompt + 1)[0][2] if maxs is None else 1
            calls.append(lambda lz=lz, gz=gz: lz.launch(1, nh, gz))
        msk, _ = tm.graph_ms(lambda calls=calls: (flush(), [c() for c in calls]))
        out[f"attn_ctx1024_us ({label})"] = (msk - t_flush) * 1e3 / len(calls)
    ms, nodes = tm.graph_ms(lambda: (be.launch_forward(1, 1), be.launch_sparse(1)), reps=20)
    out["step_ctx1024_graph_sparse_us"] = ms * 1e3
    log(f"  long context: prefill {n_prompt} tokens in 256-row chunks {out['prefill_ms']:.1f} ms "
        f"({out['prefill_tok_s']:.0f} tok/s); attention/layer at ctx 1024: split "
        f"{out['attn_ctx1024_us (split)']:.1f} us vs unsplit "
        f"{out['attn_ctx1024_us (one block per head (no split))']:.1f} us; decode step at ctx 1024 "
        f"(graph, sparse head) {out['step_ctx1024_graph_sparse_us']:.0f} us")
    return out


def cache_probe(storage="bfloat16"):
    """A fresh process builds the kernels: with numba's disk cache they load, not compile."""
    code = (
        "import time\n"
        "from decoder_service.model.cuda.kernels import KERNELS, model_kernel\n"
        "t=time.time(); ks=[model_kernel(n, %r) for n in KERNELS]\n"
        "print('CACHE', time.time()-t, [k.cache_hit for k in ks])\n") % storage
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    line = [ln for ln in out.stdout.splitlines() if ln.startswith("CACHE")]
    if not line:
        return {"error": out.stderr[-2000:]}
    _, secs, hits = line[0].split(" ", 2)
    return {"seconds": float(secs), "hits": hits}


def model_arguments(p) -> None:
    p.add_argument("--out", default=os.environ.get("OUT", "bench/results/out"))
    p.add_argument("--models", default="smollm2-135m,qwen3-1.7b")
    p.add_argument("--no-long", action="store_true", help="without the long-context rows")


def model(args) -> None:
    import numba
    import numba_cuda
    from numba import cuda
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    dev = cuda.get_current_device()
    env = dict(gpu=dev.name.decode() if isinstance(dev.name, bytes) else str(dev.name),
               sms=dev.MULTIPROCESSOR_COUNT, cc=dev.compute_capability, python=platform.python_version(),
               numba=numba.__version__, numba_cuda=numba_cuda.__version__, numpy=np.__version__)
    log(f"env: {env}")
    results = {"env": env}
    try:
        bw, ms = copy_bandwidth()
        results["copy_gbs"] = bw
        log(f"device-to-device cuMemcpy: {bw:.0f} GB/s (2 GiB, {ms:.2f} ms, read+write)")
        for name in args.models.split(","):
            try:
                results[name] = time_model(name, long=not args.no_long)
            except Exception as e:  # noqa: BLE001 - keep going: the other model's numbers still come back
                import traceback
                log(f"{name}: FAILED {e!r}\n{traceback.format_exc()}")
                results[name] = {"error": repr(e)}
        results["cache_probe"] = cache_probe()
        log(f"fresh process, kernels from the disk cache: {results['cache_probe']}")
    finally:
        (out / "results.json").write_text(json.dumps(results, indent=1, default=str))
        md = render(results)
        (out / "gpu_model_h200.md").write_text(md)
        (out / "log.txt").write_text("\n".join(LOG) + "\n")
        print("\n" + md)


def render(r) -> str:
    bw = r.get("copy_gbs") or float("nan")
    lines = [f"# CUDA backend on {r['env'].get('gpu')} ({r['env'].get('sms')} SMs)", "",
             f"numba {r['env']['numba']}, numba-cuda {r['env']['numba_cuda']}, numpy {r['env']['numpy']}, "
             f"Python {r['env']['python']}. Device-to-device copy: **{bw:.0f} GB/s** (read+write).", ""]
    for name in MODELS:
        m = r.get(name)
        if not m:
            continue
        if "error" in m:
            lines += [f"## {name}: FAILED {m['error']}", ""]
            continue
        lines += [f"## {name} (random bf16 weights, real shapes)", "",
                  "Per kernel at batch 1, cold L2 (graph replay, CUDA events):", "",
                  "| kernel | µs / launch | bytes / launch | GB/s | % of copy |", "| --- | --- | --- | --- | --- |"]
        for k in m["kernels_cold"]:
            lines.append(f"| {k['kernel']}{' (GEMV)' if k['gemv'] else ''} | {k['us']:.2f} | "
                         f"{k['bytes'] / 1e6:.3f} MB | {k['gbs']:.0f} | {100 * k['gbs'] / bw:.0f}% |")
        s = m["step"]
        lines += ["", "Whole decode step:", "",
                  f"- batch 1, graph (forward + sparse head, 32 candidates): **{s['graph_sparse_us']:.0f} µs**, "
                  f"{s['graph_sparse_nodes']} kernels",
                  f"- batch 1, graph (forward + dense head): {s['graph_dense_us']:.0f} µs, "
                  f"{s['graph_dense_nodes']} kernels",
                  f"- batch 1, raw cuLaunchKernel loop (no graph): {s['raw_launch_sparse_us']:.0f} µs/step, "
                  f"{s['host_enqueue_us_per_launch']:.1f} µs host time per launch, {s['launches_per_step']} launches",
                  f"- batched decode, graph (forward + dense head): batch 4 {s['graph_dense_batch4_us']:.0f} µs, "
                  f"batch 8 {s['graph_dense_batch8_us']:.0f} µs, batch 32 {s['graph_dense_batch32_us']:.0f} µs",
                  f"- init (upload + kernels): {m['init_s']:.1f} s; kernels: "
                  + ", ".join(f"{n} {v['regs']} regs/{v['local']} B local" for n, v in m["kernels"].items()), ""]
        lc = m.get("long")
        if lc:
            lines += ["Long context (1023-token prompt, then batch-1 decode at ctx 1024):", "",
                      f"- prefill in 256-row chunks: {lc['prefill_ms']:.1f} ms ({lc['prefill_tok_s']:.0f} tokens/s)",
                      f"- attention per layer at ctx 1024: split {lc['attn_ctx1024_us (split)']:.1f} µs, "
                      f"one block per head {lc['attn_ctx1024_us (one block per head (no split))']:.1f} µs",
                      f"- decode step at ctx 1024 (graph, sparse head): {lc['step_ctx1024_graph_sparse_us']:.0f} µs"]
            lines.append("")
    cp = r.get("cache_probe")
    if cp:
        lines += [f"Fresh process loading the 6 kernels from numba's disk cache: {cp}", ""]
    return "\n".join(lines)

