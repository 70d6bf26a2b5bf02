"""The training loop: answer-token cross-entropy over shortlist prompts, AdamW, warmup then cosine."""
from __future__ import annotations

import contextlib
import math
import random
import time

import torch

from tune import lines
from tune.data import Encoder, Item


def batch_tensors(examples: list[tuple[list[int], list[int]]], pad: int, device: str):
    """(input ids, attention mask, positions whose next token is an answer token, those tokens), right-padded."""
    width = max(len(p) + len(a) for p, a in examples)
    ids, mask, rows, cols, targets = [], [], [], [], []
    for r, (p, a) in enumerate(examples):
        seq = p + a
        ids.append(seq + [pad] * (width - len(seq)))
        mask.append([1] * len(seq) + [0] * (width - len(seq)))
        for j, t in enumerate(a):
            rows.append(r)
            cols.append(len(p) + j - 1)
            targets.append(t)

    def t(x):
        return torch.tensor(x, device=device)

    return t(ids), t(mask), (t(rows), t(cols)), t(targets)


def answer_loss(model, ids, mask, where, targets) -> torch.Tensor:
    """Mean cross-entropy of the answer tokens; the vocabulary projection runs on those positions only."""
    hidden = model.model(input_ids=ids, attention_mask=mask).last_hidden_state
    logits = model.lm_head(hidden[where]).float()
    return torch.nn.functional.cross_entropy(logits, targets)


def lr_at(step: int, total: int, peak: float, warmup: float = 0.05, floor: float = 0.1) -> float:
    """Linear warmup over the first `warmup` of the steps, then cosine down to `floor` * peak."""
    w = max(1, int(warmup * total))
    if step < w:
        return peak * (step + 1) / w
    progress = (step - w) / max(1, total - w)
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))


def train(model, enc: Encoder, items: list[Item], *, epochs: int, batch_size: int, lr: float, seed: int,
          device: str, shuffled: float = 0.0, line_kv: bool = False, log=print) -> list[float]:
    """Train the selector; returns each step's loss. Every epoch reshuffles the items, and the shortlist order of a
    `shuffled` share of them (the rest keep retrieval order, as served, so that the selector learns how far to
    trust the rank); one `random.Random(seed)` drives both. line_kv: its prompts as the service computes them with
    TOOLTRIE_LINE_KV (tune.lines)."""
    def example(it, rng):
        order = enc.order(it, rng, shuffled >= 1 or (shuffled > 0 and rng.random() < shuffled))
        return (lines.parts(enc, it, order) if line_kv else enc.prompt(it, order)), enc.answer(it)

    def line_loss(model, examples):
        return lines.answer_loss(model, [p for p, _ in examples], [a for _, a in examples], device)

    return fit(model, items, example, enc.stop_id, epochs=epochs, batch_size=batch_size, lr=lr, seed=seed,
               device=device, loss=line_loss if line_kv else None, log=log)


def fit(model, items: list, example, pad: int, *, epochs: int, batch_size: int, lr: float, seed: int, device: str,
        loss=None, log=print) -> list[float]:
    """Train the model's trainable parameters on the answer tokens of `example(item, rng)`'s (prompt ids, answer
    ids), AdamW, warmup then cosine; returns each step's loss. Every epoch reshuffles the items with the one
    `random.Random(seed)` that `example` also draws from. loss(model, examples): the batch's loss where the
    examples are not (prompt ids, answer ids)."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    steps_per_epoch = math.ceil(len(items) / batch_size)
    total = epochs * steps_per_epoch
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.startswith("cuda") else contextlib.nullcontext()
    losses: list[float] = []
    started = time.perf_counter()
    model.train()
    for epoch in range(epochs):
        order = list(items)
        rng.shuffle(order)
        for s in range(steps_per_epoch):
            examples = [example(it, rng) for it in order[s * batch_size:(s + 1) * batch_size]]
            for group in opt.param_groups:
                group["lr"] = lr_at(len(losses), total, lr)
            with autocast:
                value = loss(model, examples) if loss else answer_loss(model, *batch_tensors(examples, pad, device))
            opt.zero_grad(set_to_none=True)
            value.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            losses.append(float(value.detach()))
            if len(losses) % 50 == 0 or len(losses) == total:
                recent = losses[-50:]
                log(f"epoch {epoch + 1} step {len(losses)}/{total} loss {sum(recent) / len(recent):.4f} "
                    f"({time.perf_counter() - started:.0f} s)")
    return losses
