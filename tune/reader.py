"""python -m tune.reader: the generator as a reader, scoring a shortlist by how likely it makes the request.

    .venv/bin/python -m tune.reader shortlists --out var/shortlists.json          # here: the unseen shortlists
    python -m tune.reader score --base <generator> --shortlists var/shortlists.json --out var/reader  # a GPU

Query likelihood for a catalog nobody has labelled: each shortlisted tool is scored by log P(request | tool), the
sum of the request's token log-probabilities after the writer's prompt for that tool (tune/writer.py), for the
whole request and each of its clauses. The writer is trained leave one data set out, so the set it reads is one it
never saw; the base generator is scored beside it. A tool's reader score weighs the request's and its best
clause's scores, each part's standardised over the shortlist; the answer is the top k of z(retrieval) + reader
score, for each of WEIGHTS (decoder_service.reader.reranked). `shortlists`
writes each unseen catalog's retrieval (published without examples, the base encoder, as `make quality`'s unseen
rows) for the selection and validation splits; `score` writes `scores.json` and `report.json` and prints recall@k
per set, k and weights.
"""
from __future__ import annotations

import argparse
import itertools
import json
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

from decoder_service.reader import Prompts, reranked
from shared import dataset

DEPTH = 12           # the service's shortlist
WEIGHTS = [(0.0, 1.0), (0.5, 1.0), (1.0, 1.0), (0.5, 2.0), (1.0, 2.0), (1.0, 3.0), (1.5, 3.0)]   # (request, clause)
DEPTHS = (12, 16, 20)    # the shorter shortlists a deeper run is also reported at
SPLITS = ("selection", "validation")


def unseen(name: str, tok, encoder):
    """(trie, retriever): data set `name`'s catalog published without examples, as the service serves it."""
    from compiler_service.compiler import compile_catalog
    from decoder_service.retrieval.config import DENSE_WEIGHT, VOTE_WEIGHT
    from decoder_service.retrieval.host import Retriever, bm25_index
    from decoder_service.retrieval.vectors import computed_vectors
    from shared.catalog import parse_registry
    tools = json.loads(dataset.catalog_path(name).read_text(encoding="utf-8"))
    trie = compile_catalog(parse_registry(dataset.published(tools, [])), tok)
    trie.meta.update(name=name, version=1)
    vectors, _ = computed_vectors(trie, encoder)
    return trie, Retriever(bm25_index(trie), len(trie.pointer_names), vectors, encoder, DENSE_WEIGHT, VOTE_WEIGHT)


def shortlists(out: Path, encoder_dir: Path, model_dir: Path, depth: int = DEPTH) -> None:
    """Each set's unseen catalog's shortlists, scores and intent parts for every query of SPLITS."""
    from decoder_service.encoder import load_encoder
    from decoder_service.retrieval.host import intent_parts
    from shared.tokenizer import ModelTokenizer
    tok, encoder = ModelTokenizer(model_dir), load_encoder(encoder_dir, "cpu")
    result = {}
    for name in dataset.SETS:
        trie, retriever = unseen(name, tok, encoder)
        names, rows = trie.pointer_names, []
        for split in SPLITS:
            for q in dataset.queries(name, split):
                s = retriever.shortlist(q.text, max(depth, len(q.tools)))
                rows.append({"split": split, "query": q.text, "gold": list(q.tools), "parts": intent_parts(q.text),
                             "shortlist": [names[i] for i in s.ids], "scores": [float(x) for x in s.scores]})
        described = dict(zip(names, trie.meta["descriptions"]))
        result[name] = {"descriptions": {n: described[n] for r in rows for n in r["shortlist"]}, "rows": rows}
        print(f"{name}: {len(rows)} queries", flush=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result))


def likelihoods(model, prompts, rows: list[dict], descriptions: dict, device: str, batch_tokens: int = 48000) -> list:
    """Per row: [parts][shortlisted tools] summed log-probabilities of the part's tokens after the tool's prompt."""
    import torch

    from tune.train import batch_tensors
    heads = {n: prompts.prompt(n, descriptions.get(n, "")) for row in rows for n in row["shortlist"]}
    jobs = [(r, p, c, heads[n], prompts.tok.encode(part)) for r, row in enumerate(rows)
            for p, part in enumerate(row["parts"]) for c, n in enumerate(row["shortlist"])]
    out = [[[0.0] * len(row["shortlist"]) for _ in row["parts"]] for row in rows]
    order = sorted(range(len(jobs)), key=lambda j: len(jobs[j][3]) + len(jobs[j][4]))
    model.eval()
    at = 0
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.startswith("cuda")):
        while at < len(order):
            chunk = order[at:at + max(1, batch_tokens // (len(jobs[order[at]][3]) + len(jobs[order[at]][4])))]
            ids, mask, where, targets = batch_tensors([jobs[j][3:] for j in chunk], prompts.stop_id, device)
            hidden = model.model(input_ids=ids, attention_mask=mask).last_hidden_state[where]
            logp = torch.log_softmax(model.lm_head(hidden).float(), -1).gather(1, targets[:, None])[:, 0]
            total = torch.zeros(len(chunk), device=device).index_add_(0, where[0], logp).tolist()
            for b, j in enumerate(chunk):
                r, p, c = jobs[j][:3]
                out[r][p][c] = round(total[b], 3)
            at += len(chunk)
    return out


def answer(row: dict, parts: list[list[float]], weights: tuple[float, float], depth: int | None = None) -> list[str]:
    """The row's top k by z(retrieval) + reader score with these weights (decoder_service.reader.reranked), over its
    first `depth` tools (all where None; never fewer than k)."""
    n = max(depth or len(row["shortlist"]), len(row["gold"]))
    return [row["shortlist"][i] for i in reranked(np.asarray(row["scores"][:n]), [p[:n] for p in parts],
                                                  len(row["gold"]), weights)]


def report(data: dict, scored: dict) -> dict:
    """recall@k per set, split, model, weights and k group ("all", "1", "2", "3", "4+") against the retrieval order;
    where the shortlists are deeper than the service's, each of DEPTHS up to theirs too ("... depth=N")."""
    out: dict = {}
    for name, d in data.items():
        for split in SPLITS:
            rows = [(i, r) for i, r in enumerate(d["rows"]) if r["split"] == split]
            methods = {"fused": lambda i, r: r["shortlist"][:len(r["gold"])]}
            deepest = max(len(r["shortlist"]) for _, r in rows)
            depths = [None] + [n for n in DEPTHS if n < deepest]
            for model, depth, w in itertools.product(scored[name], depths, WEIGHTS):
                label = f"{model} request={w[0]:g} clause={w[1]:g}" + (f" depth={depth}" if depth else "")
                methods[label] = lambda i, r, s=scored[name][model], w=w, n=depth: answer(r, s[i], w, n)
            for method, chosen in methods.items():
                hits, gold = defaultdict(int), defaultdict(int)
                for i, r in rows:
                    got = len(set(chosen(i, r)) & set(r["gold"]))
                    for group in ("all", str(len(r["gold"])) if len(r["gold"]) < 4 else "4+"):
                        hits[group] += got
                        gold[group] += len(r["gold"])
                out.setdefault(name, {}).setdefault(split, {})[method] = {g: round(hits[g] / gold[g], 4)
                                                                         for g in sorted(gold)}
    return out


def score(base: Path, data_path: Path, out: Path, epochs: int, seed: int, writers: Path | None = None) -> None:
    """Score each set's shortlists with the base and with a writer that never saw the set: the one `python -m
    tune.writer` saved in `writers` (merged into the base as the service merges it), else one trained here."""
    import torch

    from tune.merge import merge
    from tune.model import load
    from tune.writer import trained_writer
    device = "cuda" if torch.cuda.is_available() else "cpu"
    data, prompts, scored = json.loads(data_path.read_text()), Prompts(base), {}
    model = load(base, device)
    for name, d in data.items():
        started = time.perf_counter()
        scored[name] = {"base": likelihoods(model, prompts, d["rows"], d["descriptions"], device)}
        if writers:
            merge(base, writers / f"adapters-without-{name}", out / f"writer-without-{name}")
            writer = load(out / f"writer-without-{name}", device)
        else:
            writer, _, _ = trained_writer(base, prompts, [s for s in dataset.SETS if s != name], device,
                                          epochs=epochs, seed=seed, log=lambda m: None)
        scored[name]["writer"] = likelihoods(writer, prompts, d["rows"], d["descriptions"], device)
        print(f"{name}: {len(d['rows'])} queries, {time.perf_counter() - started:.0f} s", flush=True)
    out.mkdir(parents=True, exist_ok=True)
    (out / "scores.json").write_text(json.dumps(scored))
    result = report(data, scored)
    (out / "report.json").write_text(json.dumps(result, indent=1) + "\n")
    print(table(result))


def table(result: dict) -> str:
    """A markdown table: one row per set, split and method, recall@k over all queries and per k."""
    lines = ["| data set | split | method | all | per k |", "| --- | --- | --- | --- | --- |"]
    for name, splits in result.items():
        for split, methods in splits.items():
            for method, r in methods.items():
                per_k = ", ".join(f"k={g} {v:.3f}" for g, v in r.items() if g != "all")
                lines.append(f"| {dataset.SETS[name]} | {split} | {method} | {r['all']:.3f} | {per_k} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    from shared.config import DEFAULT_ENCODER_DIR, DEFAULT_MODEL_DIR
    p = argparse.ArgumentParser(prog="python -m tune.reader", description=__doc__.split(":", 1)[1].strip())
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("shortlists", help="write the unseen catalogs' shortlists (CPU)")
    s.add_argument("--out", type=Path, required=True)
    s.add_argument("--encoder", type=Path, default=DEFAULT_ENCODER_DIR)
    s.add_argument("--model", type=Path, default=DEFAULT_MODEL_DIR, help="whose tokenizer compiles the catalogs")
    s.add_argument("--depth", type=int, default=DEPTH, help="tools a shortlist (the service's: %(default)s)")
    r = sub.add_parser("score", help="train the leave-one-out writers and score the shortlists (a GPU)")
    r.add_argument("--base", type=Path, required=True)
    r.add_argument("--shortlists", type=Path, required=True)
    r.add_argument("--out", type=Path, required=True)
    r.add_argument("--epochs", type=int, default=2)
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--writers", type=Path, help="the leave-one-out writers `python -m tune.writer` saved (default: "
                   "train them here)")
    a = p.parse_args(argv)
    if a.command == "shortlists":
        shortlists(a.out, a.encoder, a.model, a.depth)
    else:
        score(a.base, a.shortlists, a.out, a.epochs, a.seed, a.writers)


if __name__ == "__main__":
    main()
