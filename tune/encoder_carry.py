"""The base encoder made small enough to carry to a GPU machine for tune/encoder.py, and rebuilt there.

    python -m tune.encoder_carry pack --base models/all-MiniLM-L6-v2 --out .encoder_carry
    python -m tune.encoder_carry unpack --packed .encoder_carry --out /tmp/all-MiniLM-L6-v2   # on the GPU machine

all-MiniLM-L6-v2 is 91 MB in float32, over what a call to the device machine carries. The pack keeps every tensor
in float16 and, of the word embeddings, only the rows of the tokens that the data sets' texts use (12,281 of
30,522): 31 MB. The rebuilt folder has the base's tensor names, dtypes and shapes (so the same
tune.merge.base_fingerprint), float16-rounded values and zero rows for tokens no data set text holds. Training
on it gives deltas for the float32 base (the rounding is 5e-4 of a weight at most).
"""
from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file, save_file
from tokenizers import Tokenizer

from shared import dataset
from tune.encoder_data import catalog

WORDS = "embeddings.word_embeddings.weight"
FILES = ("config.json", "tokenizer.json", "sentence_bert_config.json", "modules.json", "1_Pooling/config.json")


def used_rows(base: Path) -> np.ndarray:
    """Sorted token ids of every tool text and query of the data sets, with the special tokens."""
    tok = Tokenizer.from_file(str(base / "tokenizer.json"))
    texts = [t for s in dataset.SETS for t in catalog(s).texts + [q.text for q in dataset.queries(s)]]
    ids = {i for e in tok.encode_batch(texts) for i in e.ids}
    ids |= {tok.token_to_id(t) for t in ("[PAD]", "[UNK]", "[CLS]", "[SEP]")}
    return np.array(sorted(ids), dtype=np.int64)


def pack(base: Path, out: Path) -> None:
    """Write the carried form of `base` into `out`."""
    tensors = load_file(str(base / "model.safetensors"))
    rows = used_rows(base)
    packed = {k: (v.astype(np.float16) if v.dtype == np.float32 else v) for k, v in tensors.items()}
    packed[WORDS] = tensors[WORDS][rows].astype(np.float16)
    out.mkdir(parents=True, exist_ok=True)
    save_file({**packed, "carried_rows": rows}, str(out / "model.safetensors"),
              metadata={"shapes": json.dumps({k: [list(v.shape), str(v.dtype)] for k, v in tensors.items()})})
    for name in FILES:
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(base / name, out / name)


def unpack(packed: Path, out: Path) -> None:
    """Rebuild a folder the trainer loads from the carried form."""
    with open(packed / "model.safetensors", "rb") as f:
        meta = json.loads(f.read(int.from_bytes(f.read(8), "little")))["__metadata__"]
    layout = json.loads(meta["shapes"])
    tensors = load_file(str(packed / "model.safetensors"))
    rows = tensors.pop("carried_rows")
    words = np.zeros(layout[WORDS][0], np.float32)
    words[rows] = tensors[WORDS]
    tensors[WORDS] = words
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.astype(layout[k][1]) for k, v in tensors.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    for name in FILES:
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(packed / name, out / name)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="verb", required=True)
    a = sub.add_parser("pack")
    a.add_argument("--base", type=Path, required=True)
    a.add_argument("--out", type=Path, required=True)
    b = sub.add_parser("unpack")
    b.add_argument("--packed", type=Path, required=True)
    b.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    pack(args.base, args.out) if args.verb == "pack" else unpack(args.packed, args.out)


if __name__ == "__main__":
    main()
