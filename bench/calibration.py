"""Confidence: fit the calibrator on the selection split, report its calibration on the validation split.

    .venv/bin/python -m bench calibration [--selection-sample 300] [--sample 100]

For each data set, its catalog published with the training split's queries as examples, less the selection
queries measured (one version for both splits), every measured query answered by both stages the decoder has
(retrieval's first k, and the generator through the engine at the service's weight), each answered name labelled
by whether it is a gold tool.
The selection split's names fit one logistic model per stage (decoder_service/confidence.py), written to
decoder_service/confidence.json; the validation split's names (the CPU sample `make quality` takes) then give
each stage's expected calibration error and reliability diagram (10 bins), and what a min_confidence keeps.
Nothing is fitted on validation. Writes bench/results/calibration_<device>.json.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np

from bench.common import device_label
from bench.quality import Harness, sample
from compiler_service.compiler import compile_catalog
from decoder_service.confidence import CALIBRATION_FILE, FEATURES, STAGES, Calibrator, features, fit_logistic
from decoder_service.retrieval.config import SHORTLIST
from shared import dataset
from shared.catalog import parse_registry
from shared.config import DEFAULT_MODEL_DIR, REPO_ROOT, Settings

BINS = 10
THRESHOLDS = (0.1, 0.2, 0.3, 0.5)


def answered(harness: Harness, name: str, splits: dict[str, list]) -> dict[str, list[dict]]:
    """Every name each stage answers for each split's queries, on one version of the set's catalog (published
    with its training split's queries as examples, less the selection queries measured, so that none is found
    through itself): the features' inputs and whether the name is a gold tool."""
    held = frozenset(q.text for q in splits.get("selection", []))
    trie = compile_catalog(parse_registry(dataset.registry(name, held)), harness.tok)
    trie.meta.update(name=name, version=1)
    retriever, engine, rt = harness.served(trie)
    out = {}
    for split, queries in splits.items():
        rows = out[split] = []
        shortlists = [retriever.shortlist(q.text, max(SHORTLIST, len(q.tools))) for q in queries]

        def row(stage, q, s, rank, logprob, index, rows=rows):
            tool = trie.pointer_names[int(s.ids[rank])]
            rows.append({"set": name, "stage": stage, "k": len(q.tools), "index": index, "rank": rank,
                         "logprob": logprob, "scores": [round(float(x), 5) for x in s.scores],
                         "gold": tool in q.tools, "query": q.text})

        wave = engine.config.max_waiting
        for start in range(0, len(queries), wave):
            batch = list(zip(queries[start:start + wave], shortlists[start:start + wave]))
            seqs = [engine.submit(rt, q.text, len(q.tools), shortlist=s) for q, s in batch]
            engine.run_until_idle()
            for (q, s), seq in zip(batch, seqs):
                for i in range(len(q.tools)):
                    row("retrieval", q, s, i, 0.0, i)
                ranks = {int(p): r for r, p in enumerate(s.ids)}
                for e in list(seq)[:-1]:
                    row("generator", q, s, ranks[e.pointer_id], float(e.logprob), e.index)
    return out


def served(calibrator: Calibrator, rows: list[dict]) -> np.ndarray:
    """The confidence the decoder would serve each row: the calibrated value, capped by the answer's previous."""
    out, previous = [], {}
    for r in rows:
        key = (r["stage"], r["query"])
        c = calibrator.confidence(r["stage"], r["scores"], r["k"], r["rank"], r["logprob"],
                                  previous.get(key, 1.0) if r["index"] else 1.0)
        previous[key] = c
        out.append(c)
    return np.array(out)


def reliability(conf: np.ndarray, gold: np.ndarray) -> dict:
    """Expected calibration error over BINS equal-width bins, and each bin's count, mean confidence and accuracy."""
    bins = np.minimum((conf * BINS).astype(int), BINS - 1)
    table, ece = [], 0.0
    for b in range(BINS):
        m = bins == b
        if m.any():
            ece += m.sum() / len(conf) * abs(conf[m].mean() - gold[m].mean())
            table.append({"bin": f"{b / BINS:.1f}-{(b + 1) / BINS:.1f}", "names": int(m.sum()),
                          "confidence": round(float(conf[m].mean()), 3), "accuracy": round(float(gold[m].mean()), 3)})
    cut = [{"min_confidence": t, "kept": round(float((conf >= t).mean()), 3),
            "precision_kept": round(float(gold[conf >= t].mean()), 3) if (conf >= t).any() else None,
            "wrong_cut": round(float((conf[~gold] < t).mean()), 3) if (~gold).any() else None,
            "right_cut": round(float((conf[gold] < t).mean()), 3) if gold.any() else None} for t in THRESHOLDS]
    return {"names": len(conf), "accuracy": round(float(gold.mean()), 3), "ece": round(float(ece), 4),
            "bins": table, "thresholds": cut}


def calibration_arguments(p) -> None:
    p.add_argument("--sets", default=",".join(dataset.SETS))
    p.add_argument("--selection-sample", type=int, default=300, help="selection queries per set to fit on (0: all)")
    p.add_argument("--sample", type=int, default=None, help="validation queries per set to report on (default: "
                   "100 on the CPU, as make quality; all on a GPU)")
    p.add_argument("--model", default=str(DEFAULT_MODEL_DIR))
    p.add_argument("--encoder", default=Settings().encoder_dir)
    p.add_argument("--backend", default="auto")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--rows", type=Path, default=None, help="also write every answered name (JSON) to this file")
    p.add_argument("--from-rows", type=Path, default=None, help="fit and report from a --rows file, answering nothing")


def calibration(args) -> None:
    if args.from_rows:
        saved = json.loads(args.from_rows.read_text())
        kind, n, fit_rows, report_rows = saved["backend"], saved["validation_sample"], saved["selection"], \
            saved["validation"]
    else:
        harness = Harness(args.model, args.encoder, args.backend)
        kind = harness.kind
        n = args.sample if args.sample is not None else (0 if kind == "cuda" else 100)
        started = time.perf_counter()
        fit_rows, report_rows = [], []
        for name in args.sets.split(","):
            rows = answered(harness, name, {"selection": sample(dataset.queries(name, "selection"),
                                                                 args.selection_sample),
                                            "validation": sample(dataset.queries(name, "validation"), n)})
            fit_rows += rows["selection"]
            report_rows += rows["validation"]
            print(f"{name}: {time.perf_counter() - started:.0f} s", flush=True)
        if args.rows:
            args.rows.write_text(json.dumps({"backend": kind, "validation_sample": n, "selection": fit_rows,
                                             "validation": report_rows}))
    models = {}
    for stage in STAGES:
        rows = [r for r in fit_rows if r["stage"] == stage]
        x = np.array([features(r["scores"], r["k"], r["rank"], r["logprob"]) for r in rows])
        models[stage] = fit_logistic(x, np.array([r["gold"] for r in rows], float))
    calibrator = Calibrator(models)
    CALIBRATION_FILE.write_text(calibrator.to_json(fitted_on="selection split", sets=args.sets.split(","),
                                                   names={s: sum(r["stage"] == s for r in fit_rows) for s in STAGES}))
    report = {}
    for split, rows in (("selection", fit_rows), ("validation", report_rows)):
        conf = served(calibrator, rows)
        gold = np.array([r["gold"] for r in rows])
        stage = np.array([r["stage"] for r in rows])
        report[split] = {s: reliability(conf[stage == s], gold[stage == s]) for s in STAGES}
    device = device_label(kind)
    out = args.out or REPO_ROOT / "bench" / "results" / f"calibration_{device}.json"
    out.write_text(json.dumps({"model": Path(args.model).name, "features": list(FEATURES),
                               "fitted_on": "selection", "selection_sample": args.selection_sample,
                               "validation_sample": n, "report": report}, indent=1) + "\n")
    print(table(report["validation"]))


def table(report: dict) -> str:
    """The validation split's reliability diagram per stage, as markdown."""
    lines = []
    for stage, r in report.items():
        lines += [f"\n{stage}: {r['names']} names, accuracy {r['accuracy']:.3f}, ECE {r['ece']:.4f}",
                  "| confidence bin | names | mean confidence | accuracy |", "| --- | --- | --- | --- |"]
        lines += [f"| {b['bin']} | {b['names']} | {b['confidence']:.3f} | {b['accuracy']:.3f} |" for b in r["bins"]]
        lines += ["| min_confidence | names kept | precision of kept | wrong names cut | right names cut |",
                  "| --- | --- | --- | --- | --- |"]
        lines += [f"| {t['min_confidence']} | {t['kept']} | {t['precision_kept']} | {t['wrong_cut']} | "
                  f"{t['right_cut']} |" for t in r["thresholds"]]
    return "\n".join(lines)
