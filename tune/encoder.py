"""python -m tune.encoder: contrastive fine-tuning of the sentence encoder on request -> tool pairs, as LoRA deltas.

    python -m tune.encoder --base models/all-MiniLM-L6-v2 --out var/tune-encoder    # a GPU: 7 minutes on one H100

Pairs are the training split less the selection split of each data set (tune/encoder_data.py); the loss is
in-batch negatives (cosine times SCALE, cross-entropy towards the row's own tool; every other gold tool of the row
masked), optionally with one retrieval-mined hard negative a row (a tool the base encoder ranks among the HARD_POOL
nearest to the request that is not gold). Each recipe of the grid (the product of the comma-separated values) is
trained once per left-out data set, on the other two, and scored by dense recall@k on the left-out set's selection
split, its catalog without examples (the tool's own text against the whole request: the proxy that chooses; `bench
quality` measures the service's retriever). The recipe with the best mean is kept: its three leave-one-out deltas
and a default trained on all the sets are written as `tuned-without-<set>.safetensors` and `tuned.safetensors`
(fp16 LoRA A and B of every linear layer, with rank, alpha, the base's fingerprint and the sets in the metadata),
with card.json. Seeded; the defaults are the grid that chose the committed deltas (tune/encoder_deltas/, their
card.json; docs/quality.md); `make model` merges them with numpy (tune/encoder_merge.py).
"""
from __future__ import annotations

import argparse
import itertools
import json
import platform
import random
import time
from pathlib import Path

import numpy as np
import torch
import transformers
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer

from shared.dataset import SETS
from tune import encoder_data as data
from tune.lora import add_lora, adapter_tensors
from tune.merge import base_fingerprint

TARGETS = ("query", "key", "value", "dense")   # every linear layer of a BERT layer (no pooler is built)
SCALE = 20.0      # cosine -> logit, as sentence-transformers' MultipleNegativesRankingLoss
HARD_POOL = 10    # a hard negative is drawn from the base encoder's this many nearest non-gold tools


class SentenceEncoder(torch.nn.Module):
    """A sentence-transformers BERT folder in PyTorch: WordPiece cut at max_seq_length, BERT, mean over the tokens,
    L2 norm (what decoder_service.encoder computes)."""

    def __init__(self, folder: Path, device: str):
        super().__init__()
        folder = Path(folder)
        raw = json.loads((folder / "config.json").read_text())
        config = transformers.BertConfig(**{k: v for k, v in raw.items() if k not in ("architectures", "model_type")})
        self.bert = transformers.BertModel(config, add_pooling_layer=False)
        state = {k.removeprefix("bert."): v.float() for k, v in load_file(str(folder / "model.safetensors")).items()}
        own = self.bert.state_dict()
        missing = set(own) - set(state) - {"embeddings.position_ids"}
        if missing:
            raise ValueError(f"{folder}: missing {sorted(missing)}")
        self.bert.load_state_dict({k: v for k, v in state.items() if k in own and k != "embeddings.position_ids"},
                                  strict=False)
        self.tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
        self.tok.no_padding()
        self.tok.enable_truncation(json.loads((folder / "sentence_bert_config.json").read_text())["max_seq_length"])
        self.device = device
        self.to(device)

    def forward(self, texts: list[str]) -> torch.Tensor:
        """[n, H] unit vectors of the texts."""
        ids = [e.ids for e in self.tok.encode_batch(list(texts))]
        width = max(map(len, ids))
        tokens = torch.tensor([x + [0] * (width - len(x)) for x in ids], device=self.device)
        mask = torch.tensor([[1] * len(x) + [0] * (width - len(x)) for x in ids], device=self.device)
        hidden = self.bert(input_ids=tokens, attention_mask=mask).last_hidden_state
        mean = (hidden * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)
        return torch.nn.functional.normalize(mean, dim=-1)

    @torch.no_grad()
    def encode(self, texts: list[str], batch: int = 512) -> torch.Tensor:
        """forward in eval mode (no dropout), in batches."""
        was = self.training
        self.eval()
        out = torch.cat([self(texts[at:at + batch]) for at in range(0, len(texts), batch)])
        self.train(was)
        return out


def recall(model: SentenceEncoder, cat: data.Catalog, queries: list) -> float:
    """Dense recall@k (k: the query's gold count) of the queries over the catalog's tool texts."""
    tools = model.encode(cat.texts)
    vecs = model.encode([q.text for q in queries])
    index, hits, gold = cat.index, 0, 0
    for q, row in zip(queries, (vecs @ tools.T).cpu().numpy()):
        top = np.argsort(-row, kind="stable")[:len(q.tools)]
        hits += len({index[t] for t in q.tools} & set(top.tolist()))
        gold += len(q.tools)
    return hits / gold


def mined(model: SentenceEncoder, cats: dict[str, data.Catalog], pairs: list[data.Pair]) -> dict[tuple, list[int]]:
    """(catalog, query) -> the HARD_POOL tools the model ranks nearest the query that are none of its gold tools."""
    out = {}
    for name in sorted({p.catalog for p in pairs}):
        mine = {p.query: p.gold for p in pairs if p.catalog == name}
        queries = list(mine)
        scores = (model.encode(queries) @ model.encode(cats[name].texts).T).cpu().numpy()
        for q, row in zip(queries, scores):
            order = [int(i) for i in np.argsort(-row, kind="stable")[:HARD_POOL + len(mine[q])] if i not in mine[q]]
            out[(name, q)] = order[:HARD_POOL]
    return out


def train(model: SentenceEncoder, pairs: list[data.Pair], cats: dict[str, data.Catalog], recipe: dict,
          negatives: dict | None, seed: int, log=print) -> list[float]:
    """Train the model's trainable (LoRA) parameters on the pairs; returns each step's loss. AdamW, linear warmup
    over the first 10% of the steps then linear decay to 0; one random.Random(seed) draws the batches and the
    hard negatives."""
    rng = random.Random(seed)
    plan = [b for _ in range(recipe["epochs"]) for b in data.epoch(pairs, recipe["batch"], rng, recipe["per_tool"])]
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=recipe["lr"], weight_decay=0.0)
    warm = max(1, len(plan) // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: (s + 1) / warm if s < warm else max(0.0, (len(plan) - s) / max(1, len(plan) - warm)))
    model.train()
    losses = []
    for batch in plan:
        cols = [(p.catalog, p.tool) for p in batch]
        if negatives is not None and recipe["hard"]:
            cols += [(p.catalog, rng.choice(negatives[(p.catalog, p.query)])) for p in batch]
        q = model([p.query for p in batch])
        t = model([cats[c].texts[i] for c, i in cols])
        logits = SCALE * q @ t.T
        masked = torch.tensor([[c != r and cols[c][0] == p.catalog and cols[c][1] in p.gold for c in range(len(cols))]
                               for r, p in enumerate(batch)], device=model.device)
        loss = torch.nn.functional.cross_entropy(logits.masked_fill(masked, float("-inf")),
                                                 torch.arange(len(batch), device=model.device))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        losses.append(float(loss.detach()))
    log(f"  {len(plan)} steps, loss {np.mean(losses[:max(1, len(losses) // 10)]):.3f} -> "
        f"{np.mean(losses[-max(1, len(losses) // 10):]):.3f}")
    return losses


def delta(base: Path, device: str, pairs: list[data.Pair], cats: dict, recipe: dict, negatives: dict | None,
          seed: int, log=print) -> tuple[SentenceEncoder, dict[str, torch.Tensor], list[float]]:
    """A fresh base with LoRA on TARGETS, trained on the pairs: (the model, its fp16 A and B tensors, the losses)."""
    torch.manual_seed(seed)
    model = SentenceEncoder(base, device)
    add_lora(model.bert, recipe["rank"], recipe["alpha"], TARGETS)
    model.to(device)
    losses = train(model, pairs, cats, recipe, negatives, seed, log)
    return model, adapter_tensors(model.bert), losses


def save_delta(path: Path, tensors: dict[str, torch.Tensor], recipe: dict, fingerprint: str,
               trained_on: list[str]) -> None:
    """One delta file: the adapters' fp16 tensors, and in its metadata what tune/encoder_merge.py needs and checks."""
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path), metadata={"rank": str(recipe["rank"]), "alpha": str(recipe["alpha"]),
                                            "base_fingerprint": fingerprint, "trained_on": ",".join(trained_on),
                                            "recipe": json.dumps(recipe, sort_keys=True)})


def parse_args(argv: list[str] | None):
    p = argparse.ArgumentParser(prog="python -m tune.encoder", description=__doc__.split("\n")[0].split(": ", 1)[1])
    p.add_argument("--base", type=Path, required=True, help="the base sentence-transformers folder")
    p.add_argument("--out", type=Path, required=True, help="where the deltas and card.json are written")
    p.add_argument("--sets", default=",".join(SETS), help="the data sets (each is left out once)")
    p.add_argument("--lr", default="1e-4,3e-4,1e-3", help="learning rates (comma-separated: a grid)")
    p.add_argument("--hard", default="0,1", help="hard negatives a row, 0 or 1 (comma-separated: a grid)")
    p.add_argument("--per-tool", default="0,20", help="pairs of one tool an epoch, 0: all (comma-separated: a grid)")
    p.add_argument("--epochs", default="2", help="epochs (comma-separated: a grid)")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--alpha", type=float, default=32.0)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="", help="cuda or cpu (default: cuda when available)")
    return p.parse_args(argv)


def grid(args) -> list[dict]:
    """Every recipe of the grid, in the order given."""
    axes = {"lr": [float(x) for x in args.lr.split(",")], "hard": [int(x) for x in args.hard.split(",")],
            "per_tool": [int(x) for x in args.per_tool.split(",")], "epochs": [int(x) for x in args.epochs.split(",")]}
    return [dict(zip(axes, values), rank=args.rank, alpha=args.alpha, batch=args.batch)
            for values in itertools.product(*axes.values())]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    sets = args.sets.split(",")
    cats = {s: data.catalog(s) for s in sets}
    fit = {s: data.pairs(cats[s], data.split_queries(s, "fit")) for s in sets}
    selection = {s: data.split_queries(s, "selection") for s in sets}
    started = time.perf_counter()
    base = SentenceEncoder(args.base, device)
    base_recall = {s: round(recall(base, cats[s], selection[s]), 4) for s in sets}
    negatives = mined(base, cats, [p for s in sets for p in fit[s]])
    del base
    print(f"base: selection dense recall@k {base_recall}; pairs {({s: len(fit[s]) for s in sets})}", flush=True)
    trials, deltas = [], {}
    for i, recipe in enumerate(grid(args)):
        print(f"recipe {i}: {recipe}", flush=True)
        unseen = {}
        for s in sets:
            model, tensors, losses = delta(args.base, device, [p for o in sets if o != s for p in fit[o]], cats,
                                           recipe, negatives, args.seed)
            unseen[s] = round(recall(model, cats[s], selection[s]), 4)
            deltas[(i, s)] = tensors
            print(f"  without {s}: {unseen[s]} (base {base_recall[s]})", flush=True)
        trials.append({"recipe": recipe, "unseen_selection_recall": unseen,
                       "mean": round(float(np.mean(list(unseen.values()))), 4)})
    best = max(range(len(trials)), key=lambda i: (trials[i]["mean"], -i))
    recipe = trials[best]["recipe"]
    print(f"chosen: recipe {best} {recipe}", flush=True)
    model, tensors, losses = delta(args.base, device, [p for s in sets for p in fit[s]], cats, recipe, negatives,
                                   args.seed)
    default_recall = {s: round(recall(model, cats[s], selection[s]), 4) for s in sets}
    fingerprint = base_fingerprint(args.base)
    save_delta(args.out / "tuned.safetensors", tensors, recipe, fingerprint, sets)
    for s in sets:
        save_delta(args.out / f"tuned-without-{s}.safetensors", deltas[(best, s)], recipe, fingerprint,
                   [o for o in sets if o != s])
    card = {"base": {"name": Path(args.base).resolve().name, "fingerprint": fingerprint},
            "pairs": {s: len(fit[s]) for s in sets}, "seed": args.seed, "chosen": best, "trials": trials,
            "selection_dense_recall": {"base": base_recall, "tuned (all sets)": default_recall,
                                       "tuned without the set (unseen)": trials[best]["unseen_selection_recall"]},
            "default_loss_first_last": [round(losses[0], 4), round(losses[-1], 4)],
            "seconds": round(time.perf_counter() - started, 1),
            "software": {"python": platform.python_version(), "torch": torch.__version__,
                         "transformers": transformers.__version__, "device": device}}
    (args.out / "card.json").write_text(json.dumps(card, indent=1) + "\n")
    print("| selection, dense recall@k | " + " | ".join(SETS.get(s, s) for s in sets) + " |")
    print("| --- |" + " --- |" * len(sets))
    for label, row in card["selection_dense_recall"].items():
        print(f"| {label} | " + " | ".join(f"{row[s]:.3f}" for s in sets) + " |")
    for t in trials:
        print(f"| {t['recipe']} | " + " | ".join(f"{t['unseen_selection_recall'][s]:.3f}" for s in sets)
              + f" | mean {t['mean']:.3f}")


if __name__ == "__main__":
    main()
