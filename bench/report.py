"""The benchmark's outputs: JSON (everything measured), a markdown table, and a PNG chart."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path


def peer_available() -> bool:
    return all(importlib.util.find_spec(m) is not None for m in ("torch", "xgrammar"))


def _ratio(a, b) -> str:
    return f"{a / b:.1f}x" if a and b else "-"


def _batch_qps(peer: dict) -> float | None:
    """The peer's queries per second in batches (None: not measured)."""
    return next((v["qps"] for k, v in peer.items() if k.startswith("batch_")), None)


def _workloads(res: dict):
    """(shape, its entry, workload, its entry) in the report's order: shapes as run, workloads by name."""
    for shape, e in res["shapes"].items():
        for name, w in sorted(e["workloads"].items()):
            yield shape, e, name, w


def markdown(res: dict) -> str:
    lines = [f"# tooltrie against the PyTorch peer: {res['device']}, {res['started']}", "",
             f"Copy bandwidth measured in the last run: {res['copy_bandwidth_gbs']:.0f} GB/s. The runs "
             f"(`python3 -m bench` with these arguments; `--merge` adds shapes or workloads to an earlier run; "
             f"a shape's decode-step table is its latest run's):", ""]
    runs = {}
    for shape, e, name, w in _workloads(res):
        run = w.get("run", {})
        key = (run.get("started", e.get("started", res["started"])),
               json.dumps(run.get("args", e.get("args", res["args"]))))
        runs.setdefault(key, []).append(f"{shape} / {name}")
    lines += [f"- {', '.join(what)}, {started}: {args}" for (started, args), what in runs.items()] + [""]
    steps = [(shape, e) for shape, e in res["shapes"].items() if e.get("step")]
    if steps:
        lines += ["## Decode step (µs, one captured graph per side; rows at the MetaTool root)", "",
                  "| shape | floor | batch | unconstrained | constrained | constrained − unconstrained | "
                  "launches (unconstrained / constrained) |",
                  "| --- | --- | --- | --- | --- | --- | --- |"]
        for shape, e in steps:
            for s in e["step"]:
                launches = " / ".join(map(str, s.get("graph_nodes") or ["-"]))
                lines.append(f"| {shape} | {e['floor_us']:.0f} | {s['rows']} | {s['unconstrained_us']:.0f} | "
                             f"{s['constrained_us']:.0f} | {s['constrained_us'] - s['unconstrained_us']:+.0f} | "
                             f"{launches} |")
        lines.append("")
        lines += [f"Device memory in use after the {shape} runs: {e['device_memory_used_gib']:.1f} GiB (tooltrie's "
                  f"weights, KV pool and step buffers, and the peer's CUDA context where it ran)."
                  for shape, e in steps if "device_memory_used_gib" in e] + [""]
    r = res.get("retrieval")
    if r:
        size = r.get("size", 20)   # runs recorded before the size was are of 20
        lines += ["## Retrieval (the first stage alone, concurrency 1)", "",
                  f"{r['tools']:,} tools: compiled in {r['compile_s']:.1f} s, "
                  f"tool vectors in {r['tool_vectors_s']:.1f} s; "
                  f"a shortlist of {size} (encode the intent, BM25, fused top {size}): "
                  f"p50 {r['shortlist']['p50_ms']:.3f} ms, "
                  f"p90 {r['shortlist']['p90_ms']:.3f} ms, of which encoding the intent p50 "
                  f"{r['encode_intent']['p50_ms']:.3f} ms"
                  + (f" (its parts, as the shortlist encodes them: {r['encode_parts']['p50_ms']:.3f} ms)"
                     if "encode_parts" in r else "")
                  + (f"; the device scorer alone p50 {r['device_score']['p50_ms']:.3f} ms"
                     if "device_score" in r else "")
                  + (f"; the parts' token ids p50 {r['token_ids']['p50_ms']:.3f} ms" if "token_ids" in r else "") + ".",
                  ""]
        steps = r.get("device_steps_us")
        if steps:
            lines += ["Its steps on the device, in stream order (µs a launch, each repeated in one captured graph "
                      "on a query's own inputs, the median over the queries; the gaps between steps not included):", "",
                      "| " + " | ".join(steps) + " | sum |", "|" + " --- |" * (len(steps) + 1),
                      "| " + " | ".join(f"{v:.1f}" for v in steps.values()) + f" | {sum(steps.values()):.1f} |", ""]
    lines += ["## Per query (wall clock from submit to the last pointer)", "",
              "| shape | workload | side | warm-up s | p50 ms | p90 ms | p99 ms | first pointer p50 ms | "
              "tokens/answer | decode step µs (batch 1) | all at once q/s | repeats |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    speedups = []
    for shape, e, name, w in _workloads(res):
        t, peer = w["tooltrie"], w.get("peer")
        c1 = t["concurrency_1"]
        step1 = next((s["constrained_us"] for s in e.get("step", []) if s["rows"] == 1), None)
        lines.append(f"| {shape} | {name} | tooltrie | {t['warmup_s']:.2f} | {c1['p50_ms']:.1f} | "
                     f"{c1['p90_ms']:.1f} | {c1['p99_ms']:.1f} | {c1['ttfp']['p50_ms']:.1f} | "
                     f"{c1['tokens_per_answer']:.1f} | {step1 if step1 is not None else '-'} | "
                     f"{t['all_at_once']['qps']:.1f} | {w['queries'] - t['exactly_k']} |")  # not k distinct
        if peer:
            p1 = peer["concurrency_1"]
            qps = _batch_qps(peer)       # None where the run ended before the peer's batches
            lines.append(f"| {shape} | {name} | peer | {p1['warmup_s']:.2f} | {p1['p50_ms']:.1f} | "
                         f"{p1['p90_ms']:.1f} | {p1['p99_ms']:.1f} | {p1['ttfp']['p50_ms']:.1f} | "
                         f"{p1['tokens_per_answer']:.1f} | {p1['decode_step_us']:.0f} | "
                         f"{'-' if qps is None else f'{qps:.1f}'} | {p1['repeats']} |")
            speedups.append(f"| {shape} | {name} | {_ratio(p1['p50_ms'], c1['p50_ms'])} | "
                            f"{_ratio(p1['p90_ms'], c1['p90_ms'])} | "
                            f"{_ratio(t['all_at_once']['qps'], qps)} |")
    lines.append("")
    if speedups:
        lines += ["## tooltrie's speed-up over the peer", "",
                  "| shape | workload | p50, concurrency 1 | p90, concurrency 1 | queries/s, all at once |",
                  "| --- | --- | --- | --- | --- |", *speedups, ""]
    for shape, _, name, w in _workloads(res):
        d = w["tooltrie"].get("determinism")
        if d:
            lines += ["## Determinism", "",
                      f"{shape} / {name}: {d['batches']} random shuffled batches, {d['requests']} answers "
                      f"compared bit for bit with the same query alone: **{d['mismatches']} mismatches**.", ""]
    return "\n".join(lines)


def chart(res: dict, path: Path) -> bool:
    """Per-query p50 / p90 at concurrency 1 and queries per second, tooltrie beside the peer."""
    if importlib.util.find_spec("matplotlib") is None:
        return False
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    labels, ours, peers = [], [], []
    for shape, _, name, w in _workloads(res):
        labels.append(f"{shape}\n{name}")
        t, p = w["tooltrie"], w.get("peer")
        ours.append((t["concurrency_1"]["p50_ms"], t["concurrency_1"]["p90_ms"], t["all_at_once"]["qps"]))
        peers.append((p["concurrency_1"]["p50_ms"], p["concurrency_1"]["p90_ms"], _batch_qps(p)) if p
                     else (None, None, None))
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    x = range(len(labels))
    for ax, i, title in zip(axes, range(3), ("per query p50, concurrency 1 (ms)",
                                              "per query p90, concurrency 1 (ms)", "all at once (queries/s)")):
        ax.bar([v - 0.2 for v in x], [o[i] for o in ours], 0.4, label="tooltrie")
        ax.bar([v + 0.2 for v in x], [p[i] or 0 for p in peers], 0.4, label="PyTorch peer + XGrammar")
        for v, p in zip(x, peers):
            if p[i] is None:   # a figure the run did not measure reads as such, not as a zero
                ax.text(v + 0.2, 0, "not\nmeasured", ha="center", va="bottom", fontsize=7, color="tab:orange")
        ax.set_xticks(list(x), labels, fontsize=8)
        ax.set_title(title, fontsize=10)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"tooltrie vs the PyTorch peer on {res['device']}", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def write(res: dict, out: Path, device: str) -> str:
    """bench_<device>.json / .md / .png under out; returns the markdown."""
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"bench_{device}"
    stem.with_suffix(".json").write_text(json.dumps(res, indent=1))
    md = markdown(res)
    stem.with_suffix(".md").write_text(md + "\n")
    chart(res, stem.with_suffix(".png"))
    return md
