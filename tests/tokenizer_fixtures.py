"""A small byte-level BPE tokenizer in a model-like directory, for fast compiler tests.

It is trained here on the shared catalogs' names, so it behaves like a real byte-level tokenizer
(merges, a single-token newline, ChatML special tokens) without needing `make model`.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

# ../shared/data beside the checkout; TOOLTRIE_SHARED_DATA points elsewhere (the GPU machine gets a copy)
SHARED_DATA = Path(os.environ.get("TOOLTRIE_SHARED_DATA", Path(__file__).resolve().parents[2] / "shared" / "data"))
CHATML_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                   "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def catalog_path(name: str) -> Path:
    return SHARED_DATA / name / "catalog.json"


def make_tokenizer_dir(directory: Path, vocab_size: int = 2000) -> Path:
    """Write tokenizer.json and tokenizer_config.json (ChatML) into directory and return it."""
    directory.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = []
    for name in ("metatool", "bigcatalog", "toolbench"):
        corpus += [t["name"] + "\n" + t["description"] for t in json.loads(catalog_path(name).read_text())]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>", "<|im_start|>",
                                                                        "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus, trainer)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": CHATML_TEMPLATE, "eos_token": "<|im_end|>", "bos_token": "<|im_start|>"}))
    return directory
