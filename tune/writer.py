"""python -m tune.writer: fine-tune the generator to write the requests a tool answers, and write them.

    python -m tune.writer --base models/SmolLM2-135M-Instruct --out var/writer     # a GPU: minutes

Document expansion for a catalog nobody has labelled: a tool's name and description say what it does, in the
owner's words; a user's request says what they want, in theirs. The writer learns the second from the first on
request -> tool pairs of the training splits (less the selection split), and writes a few requests for each tool of
a catalog, which the retriever then uses as it uses an owner's examples. Leave one data set out: for each data set
a writer is trained on the other two and writes that set's requests; a last writer, trained on all three, is the
one a service reads a user's catalog with (decoder_service/reader.py). Each writer's adapters are saved
(`adapters`, `adapters-without-<set>`); with --write each leave-one-out writer writes its set's requests, greedily
from a few fixed openers (`written-<set>.json`: {tool name: [requests]}). `card.json` has the recipe, losses and
timings.
"""
from __future__ import annotations

import argparse
import json
import random
import re
import time
from dataclasses import dataclass
from pathlib import Path

from decoder_service.reader import INSTRUCTION, Prompts
from decoder_service.retrieval.host import intent_parts
from shared import dataset

OPENERS = ("", "Can you", "I need", "Please")   # each tool's requests start so: diverse and deterministic
PER_TOOL = 10          # training pairs kept per tool (MetaTool asks for one tool up to 291 times)
MAX_NEW = 40           # tokens a written request may take
_WORD = re.compile(r"[a-z0-9]+")


@dataclass(frozen=True)
class Pair:
    """One tool and a request (or, for a request naming several tools, its clause) that asks for it."""
    name: str
    description: str
    request: str


def words(text: str) -> set[str]:
    """Lower-case words of a text, its camelCase and snake_case names split."""
    return set(_WORD.findall(re.sub(r"([a-z])([A-Z])", r"\1 \2", text).lower()))


def clause_for(query: str, name: str, description: str) -> str:
    """The part of a multi-tool request that asks for this tool: its clause sharing the most words with the
    tool's name and description (the first on a tie); the whole request when it has no clauses."""
    parts = intent_parts(query)[1:] or [query]
    tool = words(name) | words(description)
    return max(parts, key=lambda c: len(words(c) & tool))


def pairs(sets: list[str], seed: int = 0) -> list[Pair]:
    """Each set's fit split (training less selection) as tool -> request pairs, at most PER_TOOL a tool (a seeded
    draw): a single-tool request whole, a multi-tool one by its clause for each of its tools."""
    rng = random.Random(seed)
    out = []
    for name in sets:
        tools = {t["name"]: t.get("description", "") for t in
                 json.loads(dataset.catalog_path(name).read_text(encoding="utf-8"))}
        by_tool: dict[str, list[str]] = {}
        for q in dataset.queries(name, "train"):
            if dataset.is_selection(q.text):
                continue
            for t in q.tools:
                request = q.text if len(q.tools) == 1 else clause_for(q.text, t, tools[t])
                by_tool.setdefault(t, []).append(" ".join(request.split()))
        for t, requests in sorted(by_tool.items()):
            rng.shuffle(requests)
            out += [Pair(t, tools[t], r) for r in requests[:PER_TOOL]]
    return out


def example(prompts: Prompts, p: Pair) -> tuple[list[int], list[int]]:
    """A pair as (prompt ids, target ids): the tool's prompt, then the request and the stop token."""
    return prompts.prompt(p.name, p.description), prompts.tok.encode(p.request) + [prompts.stop_id]


def train_writer(model, prompts: Prompts, items: list[Pair], *, epochs: int, batch_size: int, lr: float, seed: int,
                 device: str, log=print) -> list[float]:
    """Train the model's trainable parameters on the pairs (request-token cross-entropy); each step's loss."""
    from tune.train import fit
    return fit(model, items, lambda p, rng: example(prompts, p), prompts.stop_id, epochs=epochs,
               batch_size=batch_size, lr=lr, seed=seed, device=device, log=log)


def trained_writer(base: Path, prompts: Prompts, sets: list[str], device: str, *, rank: int = 16, alpha: float = 32.0,
                   epochs: int = 2, batch_size: int = 32, lr: float = 5e-4, seed: int = 0, log=print):
    """(model, losses, pairs): the base with LoRA adapters trained on the pairs of `sets` (the writer's recipe)."""
    from tune.lora import add_lora
    from tune.model import load
    model = load(base, device)
    add_lora(model, rank, alpha)
    items = pairs(sets, seed)
    losses = train_writer(model, prompts, items, epochs=epochs, batch_size=batch_size, lr=lr, seed=seed,
                          device=device, log=log)
    return model, losses, items


def write(model, prompts: Prompts, tools: list[dict], device: str, openers=OPENERS, batch: int = 256) -> dict:
    """{tool name: [one request per opener]}: greedy decoding, left-padded batches, cut at the stop token."""
    import torch
    model.eval()
    jobs = [(t["name"], o, prompts.prompt(t["name"], t.get("description", ""), (" " + o) if o else ""))
            for t in tools for o in openers]
    out: dict[str, list[str]] = {t["name"]: [] for t in tools}
    order = sorted(range(len(jobs)), key=lambda i: len(jobs[i][2]))
    texts = [""] * len(jobs)
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.startswith("cuda")):
        for at in range(0, len(order), batch):
            chunk = order[at:at + batch]
            width = max(len(jobs[i][2]) for i in chunk)
            ids = torch.tensor([[prompts.stop_id] * (width - len(jobs[i][2])) + jobs[i][2] for i in chunk],
                               device=device)
            mask = torch.tensor([[0] * (width - len(jobs[i][2])) + [1] * len(jobs[i][2]) for i in chunk],
                                device=device)
            new = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=MAX_NEW, do_sample=False,
                                 eos_token_id=prompts.stop_id, pad_token_id=prompts.stop_id)[:, width:]
            for i, row in zip(chunk, new.tolist()):
                row = row[:row.index(prompts.stop_id)] if prompts.stop_id in row else row
                texts[i] = (" " + jobs[i][1] if jobs[i][1] else "") + prompts.tok.decode(row)
    for (name, _, _), text in zip(jobs, texts):
        out[name].append(" ".join(text.split()))
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m tune.writer", description=__doc__.split(":", 1)[1].strip())
    p.add_argument("--base", type=Path, required=True, help="the generator's folder (Hugging Face layout)")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--sets", default=",".join(dataset.SETS))
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--alpha", type=float, default=32.0)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--folds", default="both", choices=["loo", "all", "both"],
                   help="leave-one-out writers (adapters-without-<set>), the writer of all sets (adapters), or both")
    p.add_argument("--write", action="store_true", help="each leave-one-out writer writes requests for its "
                   "left-out set's tools (written-<set>.json, document expansion)")
    p.add_argument("--device", default="")
    args = p.parse_args(argv)
    import torch

    from tune.lora import save_adapters
    from tune.merge import base_fingerprint
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    sets = args.sets.split(",")
    prompts = Prompts(args.base)
    folds = ([(s, [x for x in sets if x != s]) for s in sets] if args.folds in ("loo", "both") else [])
    folds += [("all", sets)] if args.folds in ("all", "both") else []
    args.out.mkdir(parents=True, exist_ok=True)
    card = {"recipe": {k: v for k, v in vars(args).items() if k not in ("base", "out")}, "openers": OPENERS,
            "per_tool": PER_TOOL, "instruction": INSTRUCTION, "folds": {}}
    for held, train_sets in folds:
        started = time.perf_counter()
        model, losses, items = trained_writer(args.base, prompts, train_sets, device, rank=args.rank,
                                              alpha=args.alpha, epochs=args.epochs, batch_size=args.batch_size,
                                              lr=args.lr, seed=args.seed,
                                              log=lambda m, h=held: print(f"[{h}] {m}", flush=True))
        trained = time.perf_counter() - started
        fold = {"trained_on": train_sets, "pairs": len(items), "loss_first": losses[0], "loss_last": losses[-1],
                "train_s": round(trained, 1)}
        save_adapters(model, args.out / ("adapters" if held == "all" else f"adapters-without-{held}"), args.rank,
                      args.alpha, {"fingerprint": base_fingerprint(args.base), "trained_on": train_sets})
        if args.write and held != "all":
            tools = json.loads(dataset.catalog_path(held).read_text(encoding="utf-8"))
            written = write(model, prompts, tools, device)
            (args.out / f"written-{held}.json").write_text(json.dumps(written, indent=0, ensure_ascii=False))
            fold["write_s"] = round(time.perf_counter() - started - trained, 1)
            fold["tools"] = len(tools)
            fold["sample"] = {n: written[n] for n in list(written)[:5]}
        card["folds"][held] = fold
        print(json.dumps({held: fold}, ensure_ascii=False), flush=True)
    (args.out / "card.json").write_text(json.dumps(card, indent=1, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main()
