"""The selector's prompt with tool-line KV (decoder_service/engine/lines.py) in PyTorch, for training with it.

Served so, a tool line attends to the prefix and to itself only, at its canonical place right after the prefix, and
its keys are rotated to where the prompt lists it; the rest of the prompt and the answer attend to everything. Two
passes compute the same here: the first the prefix and each line alone, the second the rest after those K/V, moved.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache

from shared.prompt import line_units


@dataclass(frozen=True)
class Parts:
    """A prompt cut as line KV serves it."""
    prefix: list[int]
    units: list[list[int]]   # each listed tool's line and its newline
    rows: int                # the prompt rows the lines fill (the last newline is not the prompt's)
    rest: list[int]          # the rest of the prompt: the intent, k and the assistant header


def parts(enc, item, order: list[int]) -> Parts:
    """`enc.prompt(item, order)` cut into its Parts (tune.data.Encoder; the template lists the tools first)."""
    cut = line_units(enc.template, enc.tok, [item.catalog.line_ids[i] for i in order], len(item.gold))
    if cut is None:
        raise ValueError("line KV needs a template that lists the tools right after its prefix")
    units, rows = cut
    prompt = enc.prompt(item, order)
    return Parts(enc.prefix_ids, units, rows, prompt[len(enc.prefix_ids) + rows:])


def layer_kv(cache, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A cache layer's keys and values [batch, kv heads, positions, head dim] (transformers 4 and 5)."""
    if hasattr(cache, "layers"):
        return cache.layers[layer].keys, cache.layers[layer].values
    return cache.key_cache[layer], cache.value_cache[layer]


def rotated(k: torch.Tensor, shift: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Keys [batch, heads, positions, d], each position's rotated its `shift` [batch, positions] positions further
    (RoPE, rotate_half pairs)."""
    angle = shift.double()[..., None] * inv_freq.double()
    cos, sin = torch.cos(angle).to(k.dtype), torch.sin(angle).to(k.dtype)
    cos, sin = torch.cat([cos, cos], -1)[:, None], torch.cat([sin, sin], -1)[:, None]
    half = k.shape[-1] // 2
    return k * cos + torch.cat([-k[..., half:], k[..., :half]], -1) * sin


def moves(prompts: list[Parts], longest: int, device: str) -> tuple[torch.Tensor, ...]:
    """Where each prompt's cache rows come from in the lines' pass: (line, position, shift, real) [batch, longest],
    left-padded (real 0 on the padding). A prompt's first line holds its prefix; each line's rows follow at its
    place in the prompt, `shift` positions past its canonical one."""
    rows: list[list[list[int]]] = []
    first = 0
    for p in prompts:
        start = at = len(p.prefix)
        line, pos, shift = [first] * start, list(range(start)), [0] * start
        for j, unit in enumerate(p.units):
            n = min(len(unit), start + p.rows - at)
            line += [first + j] * n
            pos += range(start, start + n)
            shift += [at - start] * n
            at += n
        first += len(p.units)
        pad = [0] * (longest - len(line))
        rows.append([pad + line, pad + pos, pad + shift, pad + [1] * len(line)])
    return tuple(torch.tensor([r[i] for r in rows], device=device) for i in range(4))


def prompt_cache(model, prompts: list[Parts], device: str) -> tuple[DynamicCache, torch.Tensor, torch.Tensor]:
    """(cache, mask, next position) of each prompt's prefix and lines as served: the prefix computed once, every line
    after it at its canonical place (one pass over all of them), its K/V moved to where its prompt lists it;
    left-padded to the longest, the mask 0 on the padding. The prompts share their prefix (the template's)."""
    prefix = prompts[0].prefix
    if any(p.prefix != prefix for p in prompts):
        raise ValueError("the prompts of a batch must share their prefix")
    units = [u for p in prompts for u in p.units]
    width = max(map(len, units))
    head = model.model(input_ids=torch.tensor([prefix], device=device), use_cache=True).past_key_values
    lines = DynamicCache()
    for layer in range(model.config.num_hidden_layers):
        lines.update(*(t.expand(len(units), -1, -1, -1) for t in layer_kv(head, layer)), layer)
    ids = torch.tensor([u + [0] * (width - len(u)) for u in units], device=device)
    mask = torch.tensor([[1] * (len(prefix) + len(u)) + [0] * (width - len(u)) for u in units], device=device)
    model.model(input_ids=ids, attention_mask=mask, past_key_values=lines, use_cache=True,
                position_ids=len(prefix) + torch.arange(width, device=device)[None].expand(len(units), -1))
    inv_freq = model.model.rotary_emb.inv_freq
    lengths = [len(p.prefix) + p.rows for p in prompts]
    line, pos, shift, real = moves(prompts, max(lengths), device)
    real = real[:, None, :, None]
    cache = DynamicCache()
    for layer in range(model.config.num_hidden_layers):
        keys, values = (t[line, :, pos].transpose(1, 2) * real for t in layer_kv(lines, layer))
        cache.update(rotated(keys, shift, inv_freq), values, layer)
    past = real[:, 0, :, 0].long()
    return cache, past, torch.tensor(lengths, device=device)


def hidden(model, prompts: list[Parts], tails: list[list[int]], device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(final hidden states [batch, width, H], mask) of each prompt's rest followed by its tail (an answer, or
    nothing), after its lines as served; right-padded."""
    cache, past, start = prompt_cache(model, prompts, device)
    seqs = [p.rest + t for p, t in zip(prompts, tails)]
    width = max(map(len, seqs))
    ids = torch.tensor([s + [0] * (width - len(s)) for s in seqs], device=device)
    mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs], device=device)
    positions = start[:, None] + torch.arange(width, device=device)[None]
    out = model.model(input_ids=ids, attention_mask=torch.cat([past, mask], 1), position_ids=positions,
                      past_key_values=cache, use_cache=True)
    return out.last_hidden_state, mask


def answer_loss(model, prompts: list[Parts], answers: list[list[int]], device: str) -> torch.Tensor:
    """Mean cross-entropy of the answer tokens after prompts served with line KV (tune.train.answer_loss's)."""
    states, _ = hidden(model, prompts, answers, device)
    rows = [r for r, a in enumerate(answers) for _ in a]
    cols = [len(p.rest) + j - 1 for p, a in zip(prompts, answers) for j in range(len(a))]
    logits = model.lm_head(states[rows, cols]).float()
    return torch.nn.functional.cross_entropy(logits, torch.tensor([t for a in answers for t in a], device=device))


def first_step(model, prompts: list[Parts], device: str):
    """(output: the last prompt token's logits and the cache, the mask so far, each row's last position) of prompts
    served with line KV, their rests left-padded to end together: tune.evaluate.decode's first step."""
    cache, past, start = prompt_cache(model, prompts, device)
    width = max(len(p.rest) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p.rest)) + p.rest for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p.rest)) + [1] * len(p.rest) for p in prompts], device=device)
    positions = (start[:, None] + mask.cumsum(1) - 1).clamp(min=0)
    mask = torch.cat([past, mask], 1)
    out = model(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache, use_cache=True,
                logits_to_keep=1)
    return out, mask, positions
