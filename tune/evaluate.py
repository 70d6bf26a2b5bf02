"""Validation in PyTorch: greedy decoding restricted to unused shortlisted names, and recall@k / exact-set."""
from __future__ import annotations

from collections import defaultdict

import torch

from tune import lines
from tune.data import Encoder, Item


def allowed(names: list[list[int]], used: set[int], partial: list[int], last: bool, sep: int, stop: int
            ) -> dict[int, int | None]:
    """Legal next tokens -> the name a token ends (None if it continues one): continuations of unused
    names that start with `partial`, and the separator (or, for the k-th name, the stop token) after a whole one."""
    out: dict[int, int | None] = {}
    n = len(partial)
    for j, ids in enumerate(names):
        if j in used or ids[:n] != partial:
            continue
        if len(ids) > n:
            out.setdefault(ids[n], None)
        else:
            out[stop if last else sep] = j
    return out


@torch.no_grad()
def decode(model, enc: Encoder, batch: list[Item], device: str, line_kv: bool = False) -> list[list[int]]:
    """Each item's k tool indices, greedily decoded over its shortlist listed in retrieval order (line_kv: its prompt
    computed as the service does with TOOLTRIE_LINE_KV, tune.lines)."""
    pad = enc.stop_id
    if line_kv:
        out, mask, pos = lines.first_step(model, [lines.parts(enc, it, it.shortlist) for it in batch], device)
    else:
        prompts = [enc.prompt(it, it.shortlist) for it in batch]
        width = max(map(len, prompts))
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
        pos = (mask.cumsum(1) - 1).clamp(min=0)
        out = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, logits_to_keep=1)
    cands = [[it.catalog.name_ids[i] for i in it.shortlist] for it in batch]
    chosen: list[list[int]] = [[] for _ in batch]
    partial: list[list[int]] = [[] for _ in batch]
    done = [False] * len(batch)
    while not all(done):
        logits = out.logits[:, -1].float()
        step = []
        for r, it in enumerate(batch):
            if done[r]:
                step.append(pad)
                continue
            legal = allowed(cands[r], set(chosen[r]), partial[r], len(chosen[r]) + 1 == len(it.gold),
                            enc.sep_id, enc.stop_id)
            keys = list(legal)
            t = keys[int(torch.argmax(logits[r, keys]))]
            step.append(t)
            if legal[t] is None:
                partial[r].append(t)
            else:
                chosen[r].append(legal[t])
                partial[r] = []
                done[r] = len(chosen[r]) == len(it.gold)
        mask = torch.cat([mask, torch.ones(len(batch), 1, dtype=mask.dtype, device=device)], 1)
        pos = pos[:, -1:] + 1
        out = model(input_ids=torch.tensor(step, device=device)[:, None], attention_mask=mask, position_ids=pos,
                    past_key_values=out.past_key_values, use_cache=True, logits_to_keep=1)
    return [[it.shortlist[j] for j in c] for it, c in zip(batch, chosen)]


def scores(answer: list[int], gold: list[int]) -> tuple[float, bool]:
    """(recall@k, exact set) of one answer."""
    return len(set(answer) & set(gold)) / len(gold), set(answer) == set(gold)


def evaluate(model, enc: Encoder, items: list[Item], device: str, batch_size: int = 128, line_kv: bool = False) -> dict:
    """Per catalog (and, where tools were held out, per group): the selector's recall@k and exact-set (k >= 2),
    beside the retriever's top-k and the gold-in-shortlist ceiling, on the same items (line_kv: decode's)."""
    model.eval()
    order = sorted(range(len(items)), key=lambda i: len(items[i].query))
    answers: dict[int, list[int]] = {}
    for s in range(0, len(order), batch_size):
        chunk = [items[i] for i in order[s:s + batch_size]]
        for i, a in zip(order[s:s + batch_size], decode(model, enc, chunk, device, line_kv)):
            answers[i] = a
    groups: dict[str, list[int]] = defaultdict(list)
    for i, it in enumerate(items):
        groups[it.catalog.name].append(i)
        if it.catalog.held_out:
            held = any(g in it.catalog.held_out for g in it.gold)
            groups[f"{it.catalog.name}/{'held_out_tools' if held else 'trained_tools'}"].append(i)
    report = {}
    for name, idx in sorted(groups.items()):
        rows = [(scores(answers[i], items[i].gold), scores(items[i].shortlist[:len(items[i].gold)], items[i].gold),
                 len(set(items[i].gold) & set(items[i].shortlist)) / len(items[i].gold), len(items[i].gold))
                for i in idx]
        multi = [r for r in rows if r[3] >= 2]
        report[name] = {
            "queries": len(rows),
            "recall": round(sum(r[0][0] for r in rows) / len(rows), 4),
            "retriever_recall": round(sum(r[1][0] for r in rows) / len(rows), 4),
            "shortlist_ceiling": round(sum(r[2] for r in rows) / len(rows), 4),
            "exact_set_k2plus": round(sum(r[0][1] for r in multi) / len(multi), 4) if multi else None,
            "retriever_exact_set_k2plus": round(sum(r[1][1] for r in multi) / len(multi), 4) if multi else None,
        }
    return report
