"""Greedy chat generation from the command line, on either backend.

    python -m decoder_service.model --model models/SmolLM2-135M-Instruct --backend cpu --prompt "..."

`--bench-prefill N` instead times a prefill of N random tokens (in chunks, as the engine does) and the
decode steps that follow it, and prints tokens/s and ms/token.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

import numpy as np

from ..gpu.device import BACKENDS, resolve_backend
from .backend import make_backend, weights_dtype
from .batch import StepBatch
from .config import ModelConfig, ModelError
from .kv_pool import KVPoolSpec
from .weights import load_weights

_SYSTEM_DEFAULT = re.compile(r"<\|im_start\|>system\n(.*?)<\|im_end\|>", re.S)


def chat_text(model_dir: Path, prompt: str) -> str:
    """`prompt` as one user turn of the model's chat template, with the assistant turn opened.

    Only ChatML templates (<|im_start|>role\\n...<|im_end|>) are understood, including the default system
    message such a template inserts when the conversation has none (SmolLM2 does); rendering arbitrary
    Jinja templates would need jinja2, which the project does not depend on.
    """
    path = model_dir / "tokenizer_config.json"
    template = json.loads(path.read_text()).get("chat_template") if path.is_file() else None
    if not template or "<|im_start|>" not in template:
        raise ModelError(f"{path}: no ChatML chat_template (the only template kind supported)")
    system = _SYSTEM_DEFAULT.search(template)
    head = f"<|im_start|>system\n{system.group(1)}<|im_end|>\n" if system else ""
    return f"{head}<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n"


def greedy_generate(backend, prompt_ids: list[int], max_new_tokens: int, stop_ids: set[int],
                    block_size: int, chunk: int = 512) -> list[int]:
    """Greedy tokens after `prompt_ids` (sequence slot 0, blocks 0..n in order), up to a stop id."""
    table = np.arange(-(-(len(prompt_ids) + max_new_tokens) // block_size), dtype=np.int32)[None]
    for start in range(0, len(prompt_ids), chunk):
        backend.forward(StepBatch.from_chunks([(0, prompt_ids[start:start + chunk], start)], table))
    out: list[int] = []
    while len(out) < max_new_tokens:
        token = int(backend.dense_logits()[0].argmax())
        if token in stop_ids:
            break
        out.append(token)
        backend.forward(StepBatch.from_chunks([(0, [token], len(prompt_ids) + len(out) - 1)], table))
    return out


def bench(backend, vocab: int, tokens: int, chunk: int, block_size: int, decode_steps: int = 32) -> str:
    rng = np.random.default_rng(0)
    ids = rng.integers(0, vocab, tokens + decode_steps).tolist()
    table = np.arange(-(-(tokens + decode_steps) // block_size), dtype=np.int32)[None]
    backend.forward(StepBatch.from_chunks([(0, ids[:chunk], 0)], table))  # compile / warm up
    t0 = time.perf_counter()
    for start in range(0, tokens, chunk):
        backend.forward(StepBatch.from_chunks([(0, ids[start:start + chunk], start)], table))
    prefill = time.perf_counter() - t0
    t0 = time.perf_counter()
    for i in range(decode_steps):
        backend.forward(StepBatch.from_chunks([(0, [ids[tokens + i]], tokens + i)], table))
        backend.dense_logits()
    decode = (time.perf_counter() - t0) / decode_steps
    return (f"prefill {tokens} tokens in chunks of {chunk}: {prefill:.1f} s, {tokens / prefill:.0f} tokens/s; "
            f"decode at context {tokens}: {decode * 1e3:.1f} ms/token")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m decoder_service.model", description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, required=True, help="Hugging Face-layout model directory")
    ap.add_argument("--backend", choices=BACKENDS, default="auto")
    ap.add_argument("--prompt", help="the user message to answer")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--bench-prefill", type=int, metavar="N", help="time an N-token prefill instead")
    ap.add_argument("--chunk", type=int, default=512, help="prefill chunk (rows per step)")
    args = ap.parse_args(argv)
    if (args.prompt is None) == (args.bench_prefill is None):
        ap.error("give exactly one of --prompt and --bench-prefill")
    try:
        from tokenizers import Tokenizer

        cfg = ModelConfig.from_dir(args.model)
        name = resolve_backend(args.backend)
        weights = load_weights(args.model, cfg, weights_dtype(name, cfg))
        if args.bench_prefill:
            spec = KVPoolSpec.from_tokens(args.bench_prefill + 64)
            print(bench(make_backend(cfg, weights, spec, name), cfg.vocab_size, args.bench_prefill,
                        args.chunk, spec.block_size))
            return 0
        tokenizer = Tokenizer.from_file(str(args.model / "tokenizer.json"))
        prompt_ids = tokenizer.encode(chat_text(args.model, args.prompt), add_special_tokens=False).ids
        spec = KVPoolSpec.from_tokens(len(prompt_ids) + args.max_new_tokens)
        stop = {i for i in (tokenizer.token_to_id("<|im_end|>"), cfg.eos_token_id) if i is not None}
        ids = greedy_generate(make_backend(cfg, weights, spec, name), prompt_ids, args.max_new_tokens,
                              stop, spec.block_size, args.chunk)
        print(tokenizer.decode(ids, skip_special_tokens=True))
        return 0
    except ModelError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
