"""The encoder's configuration: a validated view of a sentence-transformers BERT folder.

What the runtime cannot reproduce exactly is refused here, before any weight is read: another
architecture or activation, relative positions, a pooling other than the mean, a pipeline without
the final L2 normalisation.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from shared.errors import ModelError

MAX_TOKENS = 256   # the kernels' bound on a text's tokens (attention scores live in shared memory)


def _read_json(path: Path):
    if not path.is_file():
        raise ModelError(f"{path}: missing (run `make model`)")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except ValueError as e:
        raise ModelError(f"{path}: not valid JSON ({e})") from None


@dataclass(frozen=True)
class EncoderConfig:
    """The shapes and constants of a BERT sentence encoder with mean pooling and L2 normalisation."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    max_position_embeddings: int
    type_vocab_size: int
    layer_norm_eps: float
    max_seq_length: int        # sentence-transformers truncates every text to this many tokens

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "EncoderConfig":
        d = Path(model_dir)
        cfg = _read_json(d / "config.json")
        where = d / "config.json"
        checks = {"model_type": "bert", "hidden_act": "gelu", "position_embedding_type": "absolute"}
        for key, want in checks.items():
            if cfg.get(key, want) != want:
                raise ModelError(f"{where}: {key} is {cfg.get(key)!r}; only {want!r} is supported")
        try:
            out = cls(vocab_size=int(cfg["vocab_size"]), hidden_size=int(cfg["hidden_size"]),
                      intermediate_size=int(cfg["intermediate_size"]),
                      num_layers=int(cfg["num_hidden_layers"]), num_heads=int(cfg["num_attention_heads"]),
                      max_position_embeddings=int(cfg["max_position_embeddings"]),
                      type_vocab_size=int(cfg.get("type_vocab_size", 2)),
                      layer_norm_eps=float(cfg.get("layer_norm_eps", 1e-12)),
                      max_seq_length=int(_read_json(d / "sentence_bert_config.json")["max_seq_length"]))
        except KeyError as e:
            raise ModelError(f"{where}: missing {e.args[0]!r}") from None
        if out.hidden_size % out.num_heads:
            raise ModelError(f"{where}: hidden_size {out.hidden_size} is not a multiple of "
                             f"num_attention_heads {out.num_heads}")
        if not 2 <= out.max_seq_length <= min(MAX_TOKENS, out.max_position_embeddings):
            raise ModelError(f"{d / 'sentence_bert_config.json'}: max_seq_length {out.max_seq_length} is "
                             f"outside 2..{min(MAX_TOKENS, out.max_position_embeddings)}")
        _check_pipeline(d)
        return out


def _check_pipeline(d: Path) -> None:
    """The sentence-transformers modules must be Transformer -> mean Pooling -> Normalize."""
    modules = _read_json(d / "modules.json")
    kinds = [m.get("type", "").rsplit(".", 1)[-1] for m in modules]
    if kinds != ["Transformer", "Pooling", "Normalize"]:
        raise ModelError(f"{d / 'modules.json'}: modules {kinds}; only Transformer, Pooling, Normalize "
                         f"is supported")
    path = d / modules[1].get("path", "") / "config.json"
    modes = sorted(k for k, v in _read_json(path).items() if k.startswith("pooling_mode") and v)
    if modes != ["pooling_mode_mean_tokens"]:
        raise ModelError(f"{path}: pooling {modes}; only mean pooling is supported")
