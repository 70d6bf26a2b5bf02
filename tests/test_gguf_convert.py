"""Tests of `make model` (modelkit.gguf_convert): tokenizer, config, tensors, numerics.

The oracles are independent of the converter: a slow pure-Python byte-level BPE that reads the
GGUF vocabulary and merges directly, and a dense float32 numpy Llama forward pass that must
answer a factual question and reach a low perplexity, which it cannot do with q/k permuted.
"""
from __future__ import annotations

import json
import re
import sys
import unicodedata

import gguf
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.numpy import load_file
from tokenizers import Tokenizer

from modelkit import gguf_convert
from shared.config import BASE_MODEL_DIR

MODEL_DIR = BASE_MODEL_DIR


def needs_model(test):
    """Mark a test `model` and skip it, saying why, where `make model` has not run."""
    absent = not (MODEL_DIR / "model.safetensors").exists()
    skip = pytest.mark.skipif(absent, reason=f"{MODEL_DIR} is absent: run `make model` first")
    return pytest.mark.model(skip(test))


# --- the reference tokenizer (oracle) -------------------------------------------------------

def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table: printable bytes map to themselves."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    table, shift = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + shift)
            shift += 1
    return table


# Unicode White_Space (what `\s` means in the Rust/Oniguruma regexes): Python's isspace() also
# counts U+001C-U+001F, so the class is spelled out.
WHITE_SPACE = [(0x09, 0x0D), (0x20, 0x20), (0x85, 0x85), (0xA0, 0xA0), (0x1680, 0x1680),
               (0x2000, 0x200A), (0x2028, 0x2029), (0x202F, 0x202F), (0x205F, 0x205F),
               (0x3000, 0x3000)]


def category_ranges(major: str) -> list[tuple[int, int]]:
    """Code point ranges whose general category starts with `major` ("L" letters, "N" numbers)."""
    ranges: list[tuple[int, int]] = []
    for cp in range(sys.maxunicode + 1):
        if unicodedata.category(chr(cp))[0] == major:
            if ranges and ranges[-1][1] == cp - 1:
                ranges[-1] = (ranges[-1][0], cp)
            else:
                ranges.append((cp, cp))
    return ranges


def class_body(ranges: list[tuple[int, int]]) -> str:
    return "".join(f"\\U{a:08x}-\\U{b:08x}" for a, b in ranges)


class ReferenceBPE:
    """Byte-level BPE done the slow, obvious way, from the GGUF vocabulary and merges.

    Pre-tokenization is llama.cpp's `smollm`: every \\p{N} character on its own, then the GPT-2
    regex on what is left. Special (CONTROL) tokens are matched in the raw text first. A byte
    without a token is dropped, as llama.cpp does.
    """

    def __init__(self, tokens: list[str], merges: list[str], specials: list[str]):
        self.vocab = {text: i for i, text in enumerate(tokens)}
        self.ranks = {tuple(m.split(" ")): rank for rank, m in enumerate(merges)}
        self.byte_char = bytes_to_unicode()
        L, N = class_body(category_ranges("L")), class_body(category_ranges("N"))
        S = class_body(WHITE_SPACE)
        self.digit = re.compile(f"([{N}])")
        self.gpt2 = re.compile(
            f"'s|'t|'re|'ve|'m|'ll|'d| ?[{L}]+| ?[{N}]+| ?[^{S}{L}{N}]+|[{S}]+(?![^{S}])|[{S}]+")
        by_length = sorted(specials, key=len, reverse=True)
        self.special = re.compile("(" + "|".join(map(re.escape, by_length)) + ")")

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        for i, chunk in enumerate(self.special.split(text)):
            if i % 2:  # a special token
                ids.append(self.vocab[chunk])
                continue
            for segment in self.digit.split(chunk):
                for word in self.gpt2.findall(segment):
                    ids.extend(self.bpe(word))
        return ids

    def bpe(self, word: str) -> list[int]:
        symbols = [self.byte_char[b] for b in word.encode("utf-8")]
        symbols = [s for s in symbols if s in self.vocab]
        while len(symbols) > 1:
            pairs = {(a, b) for a, b in zip(symbols, symbols[1:])}
            best = min(pairs, key=lambda pair: self.ranks.get(pair, float("inf")))
            if best not in self.ranks:
                break
            merged, i = [], 0
            while i < len(symbols):
                if i + 1 < len(symbols) and (symbols[i], symbols[i + 1]) == best:
                    merged.append(symbols[i] + symbols[i + 1])
                    i += 2
                else:
                    merged.append(symbols[i])
                    i += 1
            symbols = merged
        return [self.vocab[s] for s in symbols]


@pytest.fixture(scope="module")
def gguf_meta():
    reader = gguf.GGUFReader(gguf_convert.ensure_gguf())
    return {key: field.contents() for key, field in reader.fields.items()
            if key.startswith(("tokenizer.", "llama."))}


@pytest.fixture(scope="module")
def reference(gguf_meta):
    tokens = gguf_meta["tokenizer.ggml.tokens"]
    specials = [t for t, kind in zip(tokens, gguf_meta["tokenizer.ggml.token_type"]) if kind == 3]
    return ReferenceBPE(tokens, gguf_meta["tokenizer.ggml.merges"], specials)


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.from_file(str(MODEL_DIR / "tokenizer.json"))


SAMPLES = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "12345",
    "a 5 and 3.14159, 2024-06-01 or 1,000,000",
    "I'm sure they'll say it's what we've done'd",
    "héllo wörld, naïve café — Ελληνικά, русский, 日本語のテキスト, 한국어, عربي",
    "emoji 🙂🚀 and ½ ² Ⅻ ٣ symbols ©®™",
    "def f(x):\n    return x ** 2  # square\n\tif a != b: print(f'{a}')",
    "    leading spaces, trailing spaces    ",
    "a  b   c\t\td \u00a0 e\u3000f",
    "\n\n",
    "line one\n\nline two\r\n  indented\n",
    "get_weather_forecast(city='Paris', days=3)",
    "<|im_start|>user\nhi<|im_end|>",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more<file_sep><empty_output>",
    "<|im_start",
    "",
]


@needs_model
@pytest.mark.parametrize("text", SAMPLES)
def test_tokenizer_matches_reference_bpe(text, tokenizer, reference):
    assert tokenizer.encode(text).ids == reference.encode(text)


# Every character the vocabulary can spell: no surrogates, private use, unassigned (which covers
# U+40000-U+BFFFF) or control characters (which covers the six without a byte token).
representable_text = st.text(st.characters(exclude_categories=("Cs", "Co", "Cn", "Cc"),
                                           include_characters="\t\n\r "), max_size=40)


@needs_model
@settings(max_examples=300, derandomize=True, deadline=None)
@given(text=representable_text)
def test_tokenizer_matches_reference_bpe_on_generated_text(text, tokenizer, reference):
    ids = tokenizer.encode(text).ids
    assert ids == reference.encode(text)
    assert tokenizer.decode(ids, skip_special_tokens=False) == text


@needs_model
def test_tokenizer_hard_facts(tokenizer):
    assert tokenizer.encode("<|im_end|>").ids == [2]
    assert tokenizer.encode("<|im_start|>").ids == [1]
    assert tokenizer.encode("12345").tokens == ["1", "2", "3", "4", "5"]
    assert tokenizer.encode("hi").ids == [6004]  # no BOS is added
    for text in SAMPLES:
        assert tokenizer.decode(tokenizer.encode(text).ids, skip_special_tokens=False) == text


@needs_model
def test_bytes_without_a_token_are_dropped_not_fatal(tokenizer):
    # 0x04 has no token: the character vanishes. U+40000 loses its lead byte 0xF1, and its three
    # continuation bytes decode to U+FFFD each.
    assert tokenizer.encode("a\x04b").tokens == ["a", "b"]
    assert tokenizer.decode(tokenizer.encode("a\x04b").ids) == "ab"
    assert tokenizer.decode(tokenizer.encode("\U00040000x").ids) == "\ufffd\ufffd\ufffdx"


@needs_model
def test_special_tokens_and_chat_template(gguf_meta):
    tokenizer_config = json.loads((MODEL_DIR / "tokenizer_config.json").read_text())
    specials = {int(i): t["content"] for i, t in tokenizer_config["added_tokens_decoder"].items()}
    assert len(specials) == 17
    assert specials[0] == "<|endoftext|>" and specials[1] == "<|im_start|>"
    assert specials[2] == "<|im_end|>"
    assert tokenizer_config["eos_token"] == "<|im_end|>"
    assert tokenizer_config["pad_token"] == "<|im_end|>"
    assert tokenizer_config["add_bos_token"] is False
    assert tokenizer_config["chat_template"] == gguf_meta["tokenizer.chat_template"]
    added = json.loads((MODEL_DIR / "tokenizer.json").read_text())["added_tokens"]
    assert {t["id"]: t["content"] for t in added if t["special"]} == specials


# --- config and tensors ---------------------------------------------------------------------

@needs_model
def test_config_values():
    config = json.loads((MODEL_DIR / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    expected = {"hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
                "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
                "rope_theta": 100000.0, "rms_norm_eps": 1e-5, "vocab_size": 49152,
                "max_position_embeddings": 8192, "tie_word_embeddings": True,
                "bos_token_id": 1, "eos_token_id": 2}
    assert {key: config[key] for key in expected} == expected
    generation = json.loads((MODEL_DIR / "generation_config.json").read_text())
    assert generation["eos_token_id"] == 2


def expected_shapes(layers=30, hidden=576, ffn=1536, kv=192, vocab=49152):
    shapes = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,)}
    for n in range(layers):
        prefix = f"model.layers.{n}."
        shapes.update({
            prefix + "input_layernorm.weight": (hidden,),
            prefix + "post_attention_layernorm.weight": (hidden,),
            prefix + "self_attn.q_proj.weight": (hidden, hidden),
            prefix + "self_attn.k_proj.weight": (kv, hidden),
            prefix + "self_attn.v_proj.weight": (kv, hidden),
            prefix + "self_attn.o_proj.weight": (hidden, hidden),
            prefix + "mlp.gate_proj.weight": (ffn, hidden),
            prefix + "mlp.up_proj.weight": (ffn, hidden),
            prefix + "mlp.down_proj.weight": (hidden, ffn),
        })
    return shapes


@needs_model
def test_every_tensor_has_its_shape_and_float16():
    with safe_open(MODEL_DIR / "model.safetensors", framework="np") as f:
        found = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
        dtypes = {f.get_slice(name).get_dtype() for name in f.keys()}
    assert found == expected_shapes()
    assert dtypes == {"F16"}


def llama_cpp_permute(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py's `permute` (HF halves -> interleaved rope pairs)."""
    return (weight.reshape(n_heads, 2, weight.shape[0] // n_heads // 2, *weight.shape[1:])
            .swapaxes(1, 2)
            .reshape(weight.shape))


@pytest.mark.parametrize("n_heads", [9, 3, 1])
def test_unpermute_inverts_llama_cpp_permute(n_heads):
    weight = np.random.default_rng(0).standard_normal((n_heads * 64, 576)).astype(np.float32)
    permuted = llama_cpp_permute(weight, n_heads)
    assert not np.array_equal(permuted, weight)
    assert np.array_equal(gguf_convert.unpermute_rope_rows(permuted, n_heads), weight)
    assert np.array_equal(llama_cpp_permute(gguf_convert.unpermute_rope_rows(weight, n_heads),
                                            n_heads), weight)


def test_unpermute_moves_interleaved_pairs_to_halves():
    # One head of dim 4: llama.cpp rows (x0, y0, x1, y1) are Hugging Face rows (x0, x1, y0, y1).
    rows = np.array([[0], [10], [1], [11]])
    assert gguf_convert.unpermute_rope_rows(rows, 1)[:, 0].tolist() == [0, 1, 10, 11]


# --- numerics: a dense float32 Llama forward pass -------------------------------------------

def rms_norm(x, weight, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * weight


def rope(x, theta):
    """Rotate [T, heads, dim] by position, Hugging Face layout (first half pairs with second)."""
    half = x.shape[-1] // 2
    inv_freq = theta ** (-np.arange(half, dtype=np.float32) * 2 / x.shape[-1])
    angles = np.arange(x.shape[0], dtype=np.float32)[:, None] * inv_freq
    cos, sin = np.cos(angles)[:, None], np.sin(angles)[:, None]
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def hidden_states(w, cfg, ids):
    """Final normed hidden states [T, hidden] of a causal pass over `ids` (no KV cache)."""
    heads, kv_heads, dim = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    eps, T = cfg["rms_norm_eps"], len(ids)
    causal = np.triu(np.full((T, T), -np.inf, dtype=np.float32), 1)
    x = w["model.embed_tokens.weight"][ids]
    for n in range(cfg["num_hidden_layers"]):
        def p(name, n=n):
            return w[f"model.layers.{n}.{name}.weight"]

        h = rms_norm(x, p("input_layernorm"), eps)
        q = rope((h @ p("self_attn.q_proj").T).reshape(T, heads, dim), cfg["rope_theta"])
        k = rope((h @ p("self_attn.k_proj").T).reshape(T, kv_heads, dim), cfg["rope_theta"])
        v = (h @ p("self_attn.v_proj").T).reshape(T, kv_heads, dim)
        k, v = (np.repeat(t, heads // kv_heads, axis=1) for t in (k, v))
        scores = np.einsum("thd,shd->hts", q, k) / np.sqrt(dim) + causal
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        attn = np.einsum("hts,shd->thd", probs, v).reshape(T, heads * dim)
        x = x + attn @ p("self_attn.o_proj").T
        h = rms_norm(x, p("post_attention_layernorm"), eps)
        gate, up = h @ p("mlp.gate_proj").T, h @ p("mlp.up_proj").T
        x = x + (gate / (1 + np.exp(-gate)) * up) @ p("mlp.down_proj").T
    return rms_norm(x, w["model.norm.weight"], cfg["rms_norm_eps"])


@pytest.fixture(scope="module")
def model():
    weights = {name: t.astype(np.float32) for name, t in
               load_file(MODEL_DIR / "model.safetensors").items()}
    return weights, json.loads((MODEL_DIR / "config.json").read_text())


@needs_model
@pytest.mark.slow
def test_greedy_answer_names_paris(model, tokenizer):
    weights, cfg = model
    prompt = ("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
              "<|im_start|>assistant\n")
    ids = tokenizer.encode(prompt).ids
    for _ in range(8):
        logits = hidden_states(weights, cfg, ids)[-1] @ weights["model.embed_tokens.weight"].T
        ids.append(int(np.argmax(logits)))
        if ids[-1] == cfg["eos_token_id"]:
            break
    answer = tokenizer.decode(ids[len(tokenizer.encode(prompt).ids):])
    assert "Paris" in answer


PARAGRAPH = ("The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris, "
             "France. It is named after the engineer Gustave Eiffel, whose company designed "
             "and built the tower for the 1889 World's Fair. Today it is one of the most "
             "visited monuments in the world.")


@needs_model
@pytest.mark.slow
def test_perplexity_of_english_is_low(model, tokenizer):
    weights, cfg = model
    ids = tokenizer.encode(PARAGRAPH).ids
    logits = hidden_states(weights, cfg, ids)[:-1] @ weights["model.embed_tokens.weight"].T
    logits -= logits.max(-1, keepdims=True)
    log_probs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    perplexity = float(np.exp(-log_probs[np.arange(len(ids) - 1), ids[1:]].mean()))
    assert perplexity < 20, perplexity


# --- idempotent, atomic ---------------------------------------------------------------------

def test_complete_output_is_left_alone(tmp_path, monkeypatch, capsys):
    out = tmp_path / "model"
    out.mkdir()
    for name in gguf_convert.OUTPUT_FILES:
        (out / name).write_text("x")
    monkeypatch.setattr(gguf_convert, "ensure_gguf", lambda: pytest.fail("converted again"))
    gguf_convert.convert(out)
    assert capsys.readouterr().out == f"{out}: 0.0 MB\n"


def test_interrupted_conversion_leaves_nothing(tmp_path, monkeypatch):
    def write_half_then_fail(gguf_path, directory):
        (directory / "config.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(gguf_convert, "ensure_gguf", lambda: tmp_path / "unused.gguf")
    monkeypatch.setattr(gguf_convert, "write_model_dir", write_half_then_fail)
    with pytest.raises(KeyboardInterrupt):
        gguf_convert.convert(tmp_path / "model")
    assert list(tmp_path.iterdir()) == []
