"""`python -m bench reader`: the reader's time a request, and its likelihoods against the CPU backend's.

    .venv/bin/python -m bench reader [--reader models/SmolLM2-135M-Instruct-writer] [--backend auto]

Each data set's catalog published without examples (as an unseen catalog is served), the first --requests
validation queries of each, their shortlists of 12 from the service's retriever. On the chosen backend, each
request's likelihoods (decoder_service.reader) are timed after --warm untimed ones (the heads earlier requests read
kept, as a service keeps them), then again with all its heads kept (the same bits), and each tool's alone (the same
bits as in its shortlist, for the first request). A last pass splits a read with its heads kept into its parts'
steps (forward and log-probabilities, the device synchronised around them, with their logit rows) and the rest.
Where the backend is not the CPU, the first --check requests are read on the CPU backend too: the largest relative
difference, and whether the reranked answers are the same; on the CPU, the memory the reader added to the process
(resident, after every read).
Writes bench/results/reader_served_<device>.json and prints a table.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np

from bench.common import device_label
from decoder_service.encoder import load_encoder
from decoder_service.retrieval.config import SHORTLIST
from decoder_service.reader import Reader, reranked
from shared import dataset
from shared.config import REPO_ROOT, Settings
from shared.tokenizer import ModelTokenizer
from tune.reader import unseen


def reader_arguments(p) -> None:
    p.add_argument("--reader", default=Settings().reader_dir, help="the reader's model folder")
    p.add_argument("--backend", default="auto")
    p.add_argument("--requests", type=int, default=10, help="validation queries of each data set")
    p.add_argument("--warm", type=int, default=3, help="requests read before the timed ones")
    p.add_argument("--check", type=int, default=3, help="requests also read on the CPU backend (off the CPU)")
    p.add_argument("--out", type=Path, default=REPO_ROOT / "bench" / "results")


def shortlisted(n: int) -> list[tuple[list[tuple[str, str]], str, np.ndarray, int]]:
    """(tools, intent, retrieval scores, k) of the first n validation queries of each set, unseen-published."""
    settings = Settings()
    tok, encoder = ModelTokenizer(settings.model_dir), load_encoder(settings.encoder_dir, "cpu")
    out = []
    for name in dataset.SETS:
        trie, retriever = unseen(name, tok, encoder)
        names, descriptions = trie.pointer_names, trie.meta["descriptions"]
        for q in dataset.queries(name, "validation")[:n]:
            s = retriever.shortlist(q.text, SHORTLIST)
            out.append(([(names[i], descriptions[i]) for i in s.ids], q.text, s.scores, len(q.tools)))
    return out


def resident_bytes() -> int:
    """This process's resident memory (Linux)."""
    status = Path("/proc/self/status").read_text()
    return int(status.split("VmRSS:")[1].split()[0]) * 1024


def timed_steps(read: Reader) -> list[tuple[float, int]]:
    """Time each parts' step of `read` from now on (its forward and log-probabilities, the device synchronised
    before and after): (seconds, logit rows) of each, in order."""
    steps, run = [], read._run
    sync = getattr(read.model, "synchronize", lambda: None)

    def step(batch, targets):
        sync()
        started = time.perf_counter()
        out = run(batch, targets)
        sync()
        steps.append((time.perf_counter() - started, len(targets)))
        return out
    read._run = step
    return steps


def reader(args) -> None:
    requests = shortlisted(args.requests)
    before = resident_bytes()
    read = Reader(Path(args.reader), args.backend)
    times, kept, repeat_same = [], [], True
    for i, (tools, intent, _, _) in enumerate(requests):
        heads, parts = read.tokens(tools, intent)
        started = time.perf_counter()
        first = read.likelihoods(heads, parts)
        middle = time.perf_counter()
        repeat_same &= bool(np.array_equal(first, read.likelihoods(heads, parts)))
        if i >= args.warm:
            times.append(middle - started)
            kept.append(time.perf_counter() - middle)
    # where a read with its heads kept spends its time: the parts' steps, and the rest (host work, K/V moves)
    steps, split = timed_steps(read), []
    for tools, intent, _, _ in requests[args.warm:]:
        heads, parts = read.tokens(tools, intent)
        read.likelihoods(heads, parts)   # its heads kept again (a small cache drops earlier requests')
        started, done = time.perf_counter(), len(steps)
        read.likelihoods(heads, parts)
        seconds, rows = (sum(x) for x in zip(*steps[done:]))
        split.append((seconds, time.perf_counter() - started - seconds, rows, len(steps) - done))
    heads, parts = read.tokens(*requests[0][:2])
    alone = np.stack([read.likelihoods([h], parts)[:, 0] for h in heads], axis=1)
    record = {"device": device_label(read.kind), "reader": Path(args.reader).name, "requests": len(requests),
              "timed": len(times), "p50_ms": round(1e3 * float(np.median(times)), 2),
              "p90_ms": round(1e3 * float(np.percentile(times, 90)), 2),
              "kept_p50_ms": round(1e3 * float(np.median(kept)), 2),
              "kept_p90_ms": round(1e3 * float(np.percentile(kept, 90)), 2),
              "kept_steps_p50_ms": round(1e3 * float(np.median([s[0] for s in split])), 2),
              "kept_rest_p50_ms": round(1e3 * float(np.median([s[1] for s in split])), 2),
              "logit_rows_mean": round(float(np.mean([s[2] for s in split])), 1),
              "steps_mean": round(float(np.mean([s[3] for s in split])), 2), "repeat_same": repeat_same,
              "alone_same": bool(np.array_equal(alone, read.likelihoods(heads, parts)))}
    if read.kind == "cpu":
        record["resident_gib"] = round((resident_bytes() - before) / 2**30, 2)
    else:
        cpu, worst, same = Reader(Path(args.reader), "cpu"), 0.0, 0
        for tools, intent, scores, k in requests[:args.check]:
            heads, parts = read.tokens(tools, intent)
            a, b = read.likelihoods(heads, parts), cpu.likelihoods(heads, parts)
            worst = max(worst, float(np.abs(a - b).max() / np.abs(b).max()))
            same += reranked(scores, a, k).tolist() == reranked(scores, b, k).tolist()
        record.update(checked=args.check, max_rel_vs_cpu=worst, same_answers=same)
    out = Path(args.out) / f"reader_served_{record['device']}.json"
    out.write_text(json.dumps(record, indent=1) + "\n")
    print("| " + " | ".join(record) + " |\n| " + " | ".join("---" for _ in record) + " |\n| "
          + " | ".join(str(v) for v in record.values()) + " |")
    print(f"written to {out}")
