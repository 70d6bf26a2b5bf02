"""Model loading: config validation, checkpoint checks, weight conversion, KV pool sizing, batches."""
from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from decoder_service.model.batch import StepBatch
from decoder_service.model.config import ModelConfig, ModelError
from decoder_service.model.kv_pool import HostKVPool, KVPoolSpec, bytes_per_token
from decoder_service.model.weights import bf16_to_f32, f32_to_bf16, load_weights
from model_fixtures import make_tiny_model, tiny_config, write_safetensors


def _config(tmp_path, **changes):
    raw = {**tiny_config("llama", True), **changes}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    return tmp_path


@pytest.mark.parametrize("arch,head_dim,bias,norm", [("llama", 8, False, False), ("qwen2", 8, True, False),
                                                     ("qwen3", 16, False, True)])
def test_architectures_parse(tmp_path, arch, head_dim, bias, norm):
    cfg = ModelConfig.from_dir(make_tiny_model(tmp_path, arch))
    assert (cfg.head_dim, cfg.qkv_bias, cfg.qk_norm) == (head_dim, bias, norm)
    assert cfg.q_size == 4 * head_dim and cfg.kv_size == 2 * head_dim


def test_unknown_architecture_is_refused(tmp_path):
    with pytest.raises(ModelError, match=r"config\.json: unsupported architecture \['MistralForCausalLM'\]"):
        ModelConfig.from_dir(_config(tmp_path, architectures=["MistralForCausalLM"]))


@pytest.mark.parametrize("scaling,named", [({"type": "linear", "factor": 2.0}, "'linear'"),
                                           ({"rope_type": "llama3", "factor": 8.0}, "'llama3'"),
                                           ({"rope_type": "yarn"}, "'yarn'")])
def test_rope_scaling_is_refused_with_its_type(tmp_path, scaling, named):
    with pytest.raises(ModelError, match=f"config.json: unsupported rope_scaling type {named}"):
        ModelConfig.from_dir(_config(tmp_path, rope_scaling=scaling))


def test_rope_scaling_null_or_default_is_plain_rope(tmp_path):
    assert ModelConfig.from_dir(_config(tmp_path, rope_scaling=None)).rope_theta == 10000.0
    assert ModelConfig.from_dir(_config(tmp_path, rope_scaling={"rope_type": "default"}))


@pytest.mark.parametrize("change,message", [
    ({"hidden_act": "gelu"}, "unsupported hidden_act 'gelu'"),
    ({"attention_bias": True}, "unsupported attention_bias=true for LlamaForCausalLM"),
    ({"num_key_value_heads": 3}, "num_attention_heads=4 is not a multiple of num_key_value_heads=3"),
    ({"use_sliding_window": True}, "unsupported use_sliding_window=true"),
])
def test_other_unsupported_settings_are_refused(tmp_path, change, message):
    with pytest.raises(ModelError, match=message):
        ModelConfig.from_dir(_config(tmp_path, **change))


def test_missing_config_key_is_named(tmp_path):
    raw = tiny_config("llama", True)
    del raw["vocab_size"]
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ModelError, match="missing required key 'vocab_size'"):
        ModelConfig.from_dir(tmp_path)


def _rewrite(model_dir, edit):
    """Rewrite the checkpoint after `edit(tensors)` (float32 arrays by name)."""
    cfg = ModelConfig.from_dir(model_dir)
    w = load_weights(model_dir, cfg, "float32", progress=False)
    tensors = {"model.embed_tokens.weight": w.embed, "model.norm.weight": w.final_norm}
    for layer in range(cfg.num_layers):
        p = f"model.layers.{layer}."
        q, kv = cfg.q_size, cfg.kv_size
        tensors.update({p + "input_layernorm.weight": w.attn_norm[layer],
                        p + "self_attn.q_proj.weight": w.wqkv[layer, :q],
                        p + "self_attn.k_proj.weight": w.wqkv[layer, q:q + kv],
                        p + "self_attn.v_proj.weight": w.wqkv[layer, q + kv:],
                        p + "self_attn.o_proj.weight": w.wo[layer],
                        p + "post_attention_layernorm.weight": w.mlp_norm[layer],
                        p + "mlp.gate_proj.weight": w.w_gate_up[layer, :cfg.intermediate_size],
                        p + "mlp.up_proj.weight": w.w_gate_up[layer, cfg.intermediate_size:],
                        p + "mlp.down_proj.weight": w.w_down[layer]})
    edit(tensors)
    write_safetensors(model_dir / "model.safetensors", tensors, "float32")
    return cfg


def test_missing_tensor_is_named(tmp_path):
    d = make_tiny_model(tmp_path)
    cfg = _rewrite(d, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(ModelError, match="missing tensor 'model.layers.1.mlp.up_proj.weight'"):
        load_weights(d, cfg, progress=False)


def test_shape_disagreeing_with_config_names_tensor_expected_and_got(tmp_path):
    d = make_tiny_model(tmp_path)
    cfg = _rewrite(d, lambda t: t.update({"model.layers.0.self_attn.k_proj.weight": np.zeros((24, 32), np.float32)}))
    with pytest.raises(ModelError, match=r"model\.safetensors: tensor 'model\.layers\.0\.self_attn\.k_proj\.weight': "
                                         r"shape \[24, 32\] disagrees with config\.json, expected \[16, 32\]"):
        load_weights(d, cfg, progress=False)


def test_unsupported_dtype_is_refused(tmp_path):
    d = make_tiny_model(tmp_path)
    path = d / "model.safetensors"
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    header["model.norm.weight"]["dtype"] = "I32"  # same width, so only the tag is wrong
    text = json.dumps(header).encode().ljust(n)
    path.write_bytes(raw[:8] + text + raw[8 + n:])
    with pytest.raises(ModelError, match="tensor 'model.norm.weight': unsupported dtype I32"):
        load_weights(d, ModelConfig.from_dir(d), progress=False)


def test_missing_checkpoint_and_shard_are_refused(tmp_path):
    d = make_tiny_model(tmp_path, shards=2)
    cfg = ModelConfig.from_dir(d)
    (d / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ModelError, match="shard model-00002-of-00002.safetensors is missing"):
        load_weights(d, cfg, progress=False)
    (d / "model.safetensors.index.json").unlink()
    with pytest.raises(ModelError, match="neither model.safetensors nor model.safetensors.index.json"):
        load_weights(d, cfg, progress=False)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_sharded_and_single_file_load_the_same(tmp_path, dtype):
    one = make_tiny_model(tmp_path, "qwen2", dtype, tied=False, shards=1)
    three = make_tiny_model(tmp_path, "qwen2", dtype, tied=False, shards=3)
    cfg = ModelConfig.from_dir(one)
    a, b = load_weights(one, cfg, "float32", progress=False), load_weights(three, cfg, "float32", progress=False)
    assert a.source_dtype == b.source_dtype == dtype
    for name, x in vars(a).items():
        if isinstance(x, np.ndarray):
            np.testing.assert_array_equal(x, getattr(b, name), err_msg=name)


def test_weights_layout_fuses_projections_and_ties_the_head(tmp_path):
    d = make_tiny_model(tmp_path, "qwen3", "bfloat16", tied=True)
    cfg = ModelConfig.from_dir(d)
    w = load_weights(d, cfg, "bfloat16", progress=False)
    assert w.dtype == "bfloat16" and w.wqkv.dtype == np.uint16
    assert w.wqkv.shape == (2, cfg.q_size + 2 * cfg.kv_size, 32) and w.w_gate_up.shape == (2, 96, 32)
    assert w.lm_head is w.embed and w.q_norm.shape == (2, 16) and w.bqkv is None
    # bf16 on disk -> float32 is exact, and back again gives the same bits
    f = load_weights(d, cfg, "float32", progress=False)
    np.testing.assert_array_equal(f32_to_bf16(f.wqkv), w.wqkv)


def test_bf16_conversion_rounds_to_nearest_even():
    x = np.array([1.0, 1.0 + 2**-8, 1.0 + 3 * 2**-8, -2.5, np.inf, np.nan], np.float32)
    back = bf16_to_f32(f32_to_bf16(x))
    np.testing.assert_array_equal(back[:5], [1.0, 1.0, 1.0 + 2**-6, -2.5, np.inf])
    assert np.isnan(back[5])


def test_kv_pool_sizing(tmp_path):
    cfg = ModelConfig.from_dir(make_tiny_model(tmp_path))
    spec = KVPoolSpec.from_tokens(100, block_size=16)
    assert (spec.num_blocks, spec.capacity_tokens, spec.capacity_sequences(33)) == (7, 112, 2)
    per_token = bytes_per_token(cfg, np.float32)
    assert per_token == 2 * 2 * 16 * 4
    spec = KVPoolSpec.from_memory_fraction(cfg, 0.5, np.float32, 16, available_bytes=100 * 16 * per_token)
    assert spec.num_blocks == 50
    pool = HostKVPool.allocate(cfg, KVPoolSpec(3, 4), np.float32)
    assert pool.k.shape == pool.v.shape == (2, 3, 4, 2, 8)


def test_kv_pool_refuses_what_does_not_fit(tmp_path):
    cfg = ModelConfig.from_dir(make_tiny_model(tmp_path))
    with pytest.raises(ModelError, match=r"KV pool of 10000000000 blocks x 16 tokens needs [\d.]+ GiB as float32, "
                                         r"only [\d.]+ GiB of RAM available"):
        HostKVPool.allocate(cfg, KVPoolSpec(10**10, 16), np.float32)
    with pytest.raises(ModelError, match="holds no block"):
        KVPoolSpec.from_memory_fraction(cfg, 0.5, np.float32, available_bytes=1000)
    with pytest.raises(ModelError, match="must both be >= 1"):
        KVPoolSpec(0)


def test_step_batch_from_chunks_and_validation():
    table = np.array([[3, 1], [0, 2]], np.int32)
    b = StepBatch.from_chunks([(1, [5, 6, 7], 0), (0, [9], 4)], table)
    assert b.tokens.tolist() == [5, 6, 7, 9] and b.slots.tolist() == [1, 1, 1, 0]
    assert b.positions.tolist() == [0, 1, 2, 4] and b.logit_rows.tolist() == [2, 3]
    b.validate(block_size=4, num_blocks=4, vocab_size=10)
    with pytest.raises(ModelError, match="ids must be in"):
        b.validate(4, 4, vocab_size=8)
    with pytest.raises(ModelError, match=r"block_tables\[0\]: positions up to 4 need 3 valid block ids"):
        b.validate(block_size=2, num_blocks=4, vocab_size=10)
    with pytest.raises(ModelError, match=r"block_tables\[0\]: positions up to 4 need 2 valid block ids in "
                                         r"\[0, 3\), got \[3, 1\]"):
        b.validate(block_size=4, num_blocks=3, vocab_size=10)        # block 3 is past the pool
    holes = np.array([[3, 1], [-1, 2]], np.int32)
    with pytest.raises(ModelError, match=r"block_tables\[1\]: positions up to 2 need 1 valid block ids in "
                                         r"\[0, 4\), got \[-1\]"):
        StepBatch.from_chunks([(1, [5, 6, 7], 0)], holes).validate(4, 4, 10)   # a missing block
    unused = np.array([[-1, -1], [0, 2]], np.int32)   # slot 0 has no rows here: its table is not read
    StepBatch.from_chunks([(1, [5, 6, 7], 4)], unused).validate(4, 4, 10)


def test_step_batch_refuses_every_out_of_bounds_row():
    """Each fault the kernels could turn into a stray read or write, alone in an otherwise valid batch."""
    table = np.array([[3, 1], [0, 2]], np.int32)
    good = StepBatch.from_chunks([(1, [5, 6, 7], 0), (0, [9], 4)], table)

    def i32(*v):
        return np.array(v, np.int32)

    faults = [(dict(slots=i32(1, 1, 2, 0)), r"slots: must index block_tables' 2 rows"),
              (dict(positions=i32(0, -1, 2, 4)), "positions: must be >= 0"),
              (dict(logit_rows=i32(2, 4)), r"logit_rows: must be row indices in \[0, 4\)"),
              (dict(logit_rows=i32(2, 3).reshape(1, 2)), r"logit_rows: must be row indices"),
              (dict(positions=i32(0, 1, 1, 4)), r"two rows write the same \(slot, position\)"),
              (dict(tokens=i32(5, 6, 7, 9).reshape(2, 2)), "tokens/slots/positions must all be")]
    for change, message in faults:
        with pytest.raises(ModelError, match=message):
            dataclasses.replace(good, **change).validate(4, 4, 10)
    with pytest.raises(ModelError, match="same \\(slot, position\\)"):
        StepBatch.from_chunks([(0, [1], 0), (0, [1], 0)], table).validate(4, 4, 10)
    with pytest.raises(ModelError, match=r"decode_rows: must be in \[0, 4\], got 5"):
        StepBatch.from_chunks([(1, [5, 6, 7], 0), (0, [9], 4)], table, decode_rows=5).validate(4, 4, 10)
