"""python -m tune: fine-tune the selector on retrieved shortlists; write adapters, a merged model and a card."""
from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

from decoder_service.engine.fusion import TUNED_TOOLS
from shared.dataset import data_dir, read_queries
from tune.data import Encoder, Source, held_out_tools, items, split, synthetic, training_items
from tune.merge import base_fingerprint, file_sha256, merge
from tune.shortlist import FOLDS, Shortlister

PAPER_SETS = ("metatool", "toolbench", "bigcatalog")


def parse_args(argv: list[str] | None):
    p = argparse.ArgumentParser(prog="python -m tune", description=__doc__.split(":", 1)[1].strip())
    p.add_argument("--base", type=Path, required=True, help="base model folder (Hugging Face layout)")
    p.add_argument("--out", type=Path, required=True, help="output folder: adapters/, model/, card.json")
    p.add_argument("--registry", type=Path, action="append", default=[], help="your registry (repeatable)")
    p.add_argument("--queries", type=Path, action="append", default=[],
                   help="labelled queries for the registry at the same position (dev_queries.jsonl format)")
    p.add_argument("--sets", default="", help=f"comma-separated data sets of --data-dir ({','.join(PAPER_SETS)})")
    p.add_argument("--data-dir", type=Path, default=None, help="the data sets' folder (default: ../shared/data)")
    p.add_argument("--repeat", default="", help="per-set repetition of its training queries, e.g. toolbench=4")
    p.add_argument("--synthetic", action="store_true", help="add a synthetic query for each tool no training "
                   "query names")
    p.add_argument("--synthetic-per-set", type=int, default=0, help="at most N synthetic queries per set "
                   "(a seeded sample; 0: all)")
    p.add_argument("--hold-out-tools", type=float, default=0.0,
                   help="fraction of each catalog's tools kept out of labelled training (reported separately)")
    p.add_argument("--shortlist", type=int, default=20)
    p.add_argument("--encoder", type=Path, help="the service's dense encoder folder (all-MiniLM-L6-v2); without "
                   "it, shortlists come from BM25 alone")
    p.add_argument("--folds", type=int, default=FOLDS, help="a training query is shortlisted over the catalog "
                   "published without its fold's examples")
    p.add_argument("--shortlist-cache", type=Path, help="JSON cache of shortlists (read, then extended)")
    p.add_argument("--shuffled", type=float, default=0.0, help="share of training prompts whose shortlist is "
                   "shuffled each epoch; the rest list it in retrieval order, as served")
    p.add_argument("--evaluate-only", action="store_true", help="evaluate --base on the selection and validation "
                   "splits, train nothing")
    p.add_argument("--line-kv", action="store_true", help="train and evaluate with each tool line attending to the "
                   "prefix and itself only, as the service computes prompts with TOOLTRIE_LINE_KV=1 (tune/lines.py)")
    p.add_argument("--full", action="store_true", help="full fine-tune instead of LoRA (no adapters written)")
    p.add_argument("--rank", type=int, default=32)
    p.add_argument("--alpha", type=float, default=64.0)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-train", type=int, default=0, help="use only the first N training items (smoke tests)")
    p.add_argument("--max-validation", type=int, default=0, help="validate on at most N queries per set")
    p.add_argument("--prepare-only", action="store_true", help="build the examples (and the shortlist cache), "
                   "then stop")
    p.add_argument("--device", default="", help="cuda or cpu (default: cuda when available)")
    return p.parse_args(argv)


def sources_of(args) -> list[Source]:
    """The labelled data sets named on the command line."""
    if len(args.registry) != len(args.queries):
        raise SystemExit("give one --queries per --registry")
    out = [Source(r.stem if r.stem != "catalog" else r.parent.name, r, q) for r, q in zip(args.registry, args.queries)]
    folder = args.data_dir or data_dir()
    out += [Source(s, folder / s / "catalog.json", folder / s / "dev_queries.jsonl")
            for s in filter(None, args.sets.split(","))]
    if not out:
        raise SystemExit("nothing to train on: give --registry/--queries or --sets")
    return out


def answerable(found: list) -> list:
    """The items whose k fits their shortlist."""
    return [it for it in found if len(it.gold) <= len(it.shortlist)]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    import torch
    from tune import lora, model as tmodel
    from tune.card import write_card
    from tune.evaluate import evaluate
    from tune.train import train

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    repeat = {k: int(v) for k, v in (x.split("=") for x in filter(None, args.repeat.split(",")))}
    rng, place = random.Random(args.seed), random.Random(args.seed + 2)
    enc = Encoder(args.base)
    shortlister = Shortlister(enc.tok, args.encoder, args.shortlist_cache, args.folds)
    train_items, select_items, valid_items, counts, tools = [], [], [], {}, set()
    for source in sources_of(args):
        cat = enc.catalog(source)
        tools.update(cat.names)
        cat.held_out = held_out_tools(cat.names, args.hold_out_tools)
        train_q, select_q, valid_q = split(cat, read_queries(source.queries))
        synth = synthetic(cat, train_q, rng) if args.synthetic else []
        if args.synthetic_per_set and len(synth) > args.synthetic_per_set:
            synth = random.Random(args.seed + 1).sample(synth, args.synthetic_per_set)
        if args.max_validation:
            valid_q = valid_q[:args.max_validation]
        train_items += training_items(cat, train_q, args.shortlist, repeat.get(source.name, 1), shortlister, place)
        train_items += training_items(cat, synth, args.shortlist, 1, shortlister, place, synthetic=True)
        valid_items += answerable(items(cat, valid_q, args.shortlist, shortlister))
        select_items += answerable(items(cat, select_q, args.shortlist, shortlister, leave_own_fold=True))
        found = items(cat, train_q, args.shortlist, shortlister, leave_own_fold=True)   # cached: no recompute
        counts[source.name] = {"tools": len(cat.names), "held_out_tools": len(cat.held_out),
                               "train_gold_in_shortlist": round(sum(len(set(it.gold) & set(it.shortlist))
                                                                    / len(it.gold) for it in found) / len(found), 4)
                               if found else None,
                               "train_queries": len(train_q), "synthetic_queries": len(synth),
                               "repeat": repeat.get(source.name, 1), "selection_queries": len(select_q),
                               "validation_queries": len(valid_q)}
        print(f"{source.name}: {counts[source.name]}", flush=True)
    if args.max_train:
        train_items = random.Random(args.seed).sample(train_items, min(args.max_train, len(train_items)))

    print(f"{len(train_items)} training items, {len(select_items)} selection and {len(valid_items)} validation "
          "queries", flush=True)
    if args.prepare_only:
        return
    torch.manual_seed(args.seed)
    net = tmodel.load(args.base, device)
    if args.evaluate_only:
        print(json.dumps({"selection": evaluate(net, enc, select_items, device, line_kv=args.line_kv),
                          "validation": evaluate(net, enc, valid_items, device, line_kv=args.line_kv)}, indent=1),
              flush=True)
        return
    if not args.full:
        lora.add_lora(net, args.rank, args.alpha)
    started = time.perf_counter()
    losses = train(net, enc, train_items, epochs=args.epochs, batch_size=args.batch_size, lr=args.lr,
                   seed=args.seed, device=device, shuffled=args.shuffled, line_kv=args.line_kv,
                   log=lambda m: print(m, flush=True))
    seconds = time.perf_counter() - started
    selection, validation = (evaluate(net, enc, chosen, device, line_kv=args.line_kv)
                             for chosen in (select_items, valid_items))
    print(json.dumps({"selection": selection, "validation": validation}, indent=1), flush=True)

    args.out.mkdir(parents=True, exist_ok=True)
    base = {"name": args.base.name, "fingerprint": base_fingerprint(args.base),
            "sha256": file_sha256(args.base / "model.safetensors")}
    extra = {}
    known = json.dumps({"tools": sorted(tools)}, indent=0) + "\n"   # the catalogs the selector now knows
    if args.full:
        tmodel.save(net, args.base, args.out / "model", torch.float16)
        (args.out / "model" / TUNED_TOOLS).write_text(known)
    else:
        files = lora.save_adapters(net, args.out / "adapters", args.rank, args.alpha, base)
        extra["adapter_bytes"] = sum(f.stat().st_size for f in files)
        (args.out / "adapters" / TUNED_TOOLS).write_text(known)
        merge(args.base, args.out / "adapters", args.out / "model")
    hyper = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    write_card(args.out / "card.json", sources=sources_of(args), base=base, args=hyper, counts=counts,
               losses=losses, seconds=seconds, selection=selection, validation=validation, extra=extra)
    print(f"wrote {args.out} (train {seconds:.0f} s)", file=sys.stderr)


if __name__ == "__main__":
    main()
