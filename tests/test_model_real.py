"""The real default model (SmolLM2-135M-Instruct from `make model`) on the CPU backend."""
from __future__ import annotations

import numpy as np
import pytest
from tokenizers import Tokenizer

from decoder_service.model.__main__ import chat_text, greedy_generate, main
from decoder_service.model.batch import StepBatch
from decoder_service.model.config import ModelConfig
from decoder_service.model.cpu import CpuBackend
from decoder_service.model.kv_pool import KVPoolSpec
from decoder_service.model.reference import ReferenceModel
from decoder_service.model.weights import load_weights

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def real(model_dir):
    cfg = ModelConfig.from_dir(model_dir)
    return cfg, load_weights(model_dir, cfg, "float32", progress=False), \
        Tokenizer.from_file(str(model_dir / "tokenizer.json"))


def _chat_ids(model_dir, tokenizer, prompt):
    return tokenizer.encode(chat_text(model_dir, prompt), add_special_tokens=False).ids


def test_chat_template_is_chatml_with_the_default_system_turn(model_dir):
    assert chat_text(model_dir, "Hi") == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


def test_cli_answers_the_capital_of_france(model_dir, capsys):
    assert main(["--model", str(model_dir), "--backend", "cpu", "--max-new-tokens", "24",
                 "--prompt", "What is the capital of France?"]) == 0
    assert "Paris" in capsys.readouterr().out


def test_first_32_greedy_tokens_equal_the_reference(real, model_dir):
    cfg, w, tokenizer = real
    ids = _chat_ids(model_dir, tokenizer, "Write a short poem about the sea.")
    spec = KVPoolSpec.from_tokens(len(ids) + 32)
    # no stop token: always 32 tokens
    cpu = greedy_generate(CpuBackend(cfg, w, spec), ids, 32, set(), spec.block_size)
    ref = greedy_generate(ReferenceModel(cfg, w, spec), ids, 32, set(), spec.block_size)
    assert len(cpu) == 32
    assert cpu == ref, (tokenizer.decode(cpu), tokenizer.decode(ref))


def test_sparse_head_equals_dense_on_the_real_model(real, model_dir):
    cfg, w, tokenizer = real
    ids = _chat_ids(model_dir, tokenizer, "List three tools for fixing a bike.")
    spec = KVPoolSpec.from_tokens(len(ids))
    cpu = CpuBackend(cfg, w, spec)
    cpu.forward(StepBatch.from_chunks([(0, ids, 0)], np.arange(spec.num_blocks, dtype=np.int32)[None]))
    cand = np.random.default_rng(0).choice(cfg.vocab_size, (1, 300), replace=False).astype(np.int32)
    np.testing.assert_array_equal(cpu.sparse_logits(cand, np.array([300], np.int32))[0],
                                  cpu.dense_logits()[0, cand[0]])
