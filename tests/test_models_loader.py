"""Checkpoint saving/loading, config parsing, the tiny builders and the tokenizer helpers."""

from __future__ import annotations

import json
import os
import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import save_file

from jspec.models.config import ModelConfig
from jspec.models.loader import (
    apply_chat_template,
    load_checkpoint,
    load_tokenizer,
    save_checkpoint,
)
from jspec.models.params import init_params, param_shapes
from jspec.models.tiny import (
    EOS_ID,
    IM_END_ID,
    TINY_INIT_STD,
    TOKENIZER_VOCAB_SIZE,
    tiny_config,
    write_tiny_checkpoint,
)
from jspec.models.transformer import dense_forward

dense = jax.jit(dense_forward, static_argnames=("cfg",))
PROMPT = jnp.asarray(np.random.default_rng(0).integers(0, TOKENIZER_VOCAB_SIZE, 24))


def assert_trees_equal(a, b):
    assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32))


def checkpoint_files(path) -> list[str]:
    """The weight files a checkpoint directory holds: the single file, or the index's shards."""
    path = os.fspath(path)
    if os.path.isfile(os.path.join(path, "model.safetensors")):
        return [os.path.join(path, "model.safetensors")]
    with open(os.path.join(path, "model.safetensors.index.json")) as f:
        shards = set(json.load(f)["weight_map"].values())
    return [os.path.join(path, shard) for shard in sorted(shards)]


def read_tensors(path) -> dict[str, np.ndarray]:
    out = {}
    for file in checkpoint_files(path):
        with safe_open(file, framework="np") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


def rewrite_weights(path, tensors) -> None:
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})


# ----------------------------------------------------------------------------- round trips
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
def test_round_trip_gives_same_logits(tmp_path, dtype):
    cfg = tiny_config("llama")
    params = init_params(cfg, seed=1, dtype=dtype, std=TINY_INIT_STD)
    save_checkpoint(tmp_path, cfg, params)
    cfg2, loaded = load_checkpoint(tmp_path, dtype=dtype)
    assert cfg2 == cfg
    assert_trees_equal(loaded, params)
    np.testing.assert_array_equal(np.asarray(dense(loaded, PROMPT, cfg=cfg)),
                                  np.asarray(dense(params, PROMPT, cfg=cfg)))
    assert json.load(open(tmp_path / "config.json"))["torch_dtype"] == jnp.dtype(dtype).name
    stored = read_tensors(tmp_path)["model.layers.0.mlp.down_proj.weight"]
    assert stored.dtype == np.dtype(jnp.dtype(dtype))  # bf16 stays bf16 on disk


@pytest.mark.parametrize("overrides", [
    dict(model_type="llama", qkv_bias=True, o_bias=True),
    dict(model_type="qwen2"),
    dict(model_type="mistral", num_heads=8, num_kv_heads=1, intermediate_size=96),
], ids=["llama-bias", "qwen2-tied", "mistral-gqa8"])
def test_round_trip_each_family(tmp_path, overrides):
    cfg = tiny_config(**overrides)
    params = init_params(cfg, seed=2, dtype=jnp.float32)
    save_checkpoint(tmp_path, cfg, params)
    cfg2, loaded = load_checkpoint(tmp_path, dtype=jnp.float32)
    assert cfg2 == cfg
    assert_trees_equal(loaded, params)


def test_sharded_round_trip(tmp_path):
    cfg = tiny_config("qwen2")
    params = init_params(cfg, seed=3, dtype=jnp.bfloat16)
    save_checkpoint(tmp_path, cfg, params, max_shard_bytes=40_000)
    shards = sorted(f for f in os.listdir(tmp_path) if f.endswith(".safetensors"))
    assert len(shards) > 2 and not (tmp_path / "model.safetensors").exists()
    assert all(re.fullmatch(rf"model-\d{{5}}-of-{len(shards):05d}\.safetensors", s)
               for s in shards)
    index = json.load(open(tmp_path / "model.safetensors.index.json"))
    assert set(index["weight_map"].values()) == set(shards)
    assert index["metadata"]["total_size"] == sum(a.nbytes for a in read_tensors(tmp_path).values())
    _, loaded = load_checkpoint(tmp_path, dtype=jnp.bfloat16)
    assert_trees_equal(loaded, params)
    # Saving again unsharded replaces the shards rather than leaving both around.
    save_checkpoint(tmp_path, cfg, params)
    assert sorted(f for f in os.listdir(tmp_path) if f.endswith(".safetensors")) == [
        "model.safetensors"]


def test_dtype_conversion_on_load(tmp_path):
    cfg = tiny_config("llama")
    bf16 = init_params(cfg, seed=4, dtype=jnp.bfloat16)
    save_checkpoint(tmp_path / "bf16", cfg, bf16)
    _, as_fp32 = load_checkpoint(tmp_path / "bf16", dtype=jnp.float32)
    assert_trees_equal(as_fp32, jax.tree_util.tree_map(lambda a: a.astype(jnp.float32), bf16))

    fp32 = init_params(cfg, seed=4, dtype=jnp.float32)
    save_checkpoint(tmp_path / "fp32", cfg, fp32)
    _, as_bf16 = load_checkpoint(tmp_path / "fp32")  # bf16 is the default
    assert_trees_equal(as_bf16, jax.tree_util.tree_map(lambda a: a.astype(jnp.bfloat16), fp32))


def test_tied_checkpoint_has_one_embedding_tensor(tmp_path):
    cfg = tiny_config("qwen2")
    params = init_params(cfg, seed=5, dtype=jnp.float32)
    save_checkpoint(tmp_path, cfg, params)
    tensors = read_tensors(tmp_path)
    assert "lm_head.weight" not in tensors and "model.embed_tokens.weight" in tensors
    # A redundant lm_head.weight (and unknown extras) in a tied checkpoint are ignored.
    tensors["lm_head.weight"] = np.zeros((cfg.vocab_size, cfg.hidden_size), np.float32)
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.ones(8, np.float32)
    rewrite_weights(tmp_path, tensors)
    _, loaded = load_checkpoint(tmp_path, dtype=jnp.float32)
    np.testing.assert_array_equal(np.asarray(loaded["lm_head"]), np.asarray(params["embed"]).T)
    assert loaded["lm_head"].shape == param_shapes(cfg)["lm_head"]


# ----------------------------------------------------------------------------- bad checkpoints
@pytest.fixture
def checkpoint_copy(tmp_path, tiny_checkpoint):
    path = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoint, path)
    return path


def test_missing_directory_and_config(tmp_path, checkpoint_copy):
    with pytest.raises(ValueError, match="does not exist"):
        load_checkpoint(tmp_path / "nowhere")
    os.remove(checkpoint_copy / "config.json")
    with pytest.raises(ValueError, match="no config.json"):
        load_checkpoint(checkpoint_copy)


def test_missing_weights(checkpoint_copy):
    os.remove(checkpoint_copy / "model.safetensors")
    with pytest.raises(ValueError, match=r"model\.safetensors or model\.safetensors\.index\.json"):
        load_checkpoint(checkpoint_copy)


@pytest.mark.parametrize("damage", ["garbage", "truncated"])
def test_corrupt_weights_file(checkpoint_copy, damage):
    file = checkpoint_copy / "model.safetensors"
    data = file.read_bytes()
    file.write_bytes(b"\x13\x37" * 100 if damage == "garbage" else data[: len(data) // 2])
    with pytest.raises(ValueError, match=r"cannot read safetensors file .*model\.safetensors"):
        load_checkpoint(checkpoint_copy)


def test_missing_tensor(checkpoint_copy):
    tensors = read_tensors(checkpoint_copy)
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    rewrite_weights(checkpoint_copy, tensors)
    with pytest.raises(ValueError, match=r"missing tensor 'model\.layers\.1\.self_attn\.k_proj"
                                         r"\.weight'"):
        load_checkpoint(checkpoint_copy)


def test_wrong_shape(checkpoint_copy):
    tensors = read_tensors(checkpoint_copy)
    tensors["model.layers.0.mlp.up_proj.weight"] = np.zeros((100, 64), np.float32)
    rewrite_weights(checkpoint_copy, tensors)
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.mlp\.up_proj\.weight'.*shape "
                                         r"\[100, 64\], expected \[128, 64\]"):
        load_checkpoint(checkpoint_copy)


def test_index_pointing_at_missing_shard(tmp_path):
    cfg = tiny_config("llama")
    save_checkpoint(tmp_path, cfg, init_params(cfg, dtype=jnp.float32), max_shard_bytes=100_000)
    shards = sorted(set(json.load(open(tmp_path / "model.safetensors.index.json"))
                        ["weight_map"].values()))
    assert len(shards) >= 2
    os.remove(tmp_path / shards[1])
    with pytest.raises(ValueError, match=rf"shard {re.escape(repr(shards[1]))}"):
        load_checkpoint(tmp_path)


# ----------------------------------------------------------------------------- config parsing
QWEN25_05B = {  # the shape of Qwen2.5-0.5B's config.json
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_act": "silu",
    "hidden_size": 896, "intermediate_size": 4864, "num_attention_heads": 14,
    "num_hidden_layers": 24, "num_key_value_heads": 2, "vocab_size": 151936,
    "max_position_embeddings": 32768, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
    "rope_scaling": None, "sliding_window": 32768, "use_sliding_window": False,
    "max_window_layers": 21, "tie_word_embeddings": True, "bos_token_id": 151643,
    "eos_token_id": 151643, "torch_dtype": "bfloat16",
}
LLAMA32_1B = {  # Llama-3.2-1B, older top-level rope_scaling style
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
    "hidden_size": 2048, "intermediate_size": 8192, "num_attention_heads": 32,
    "num_hidden_layers": 16, "num_key_value_heads": 8, "head_dim": 64, "vocab_size": 128256,
    "max_position_embeddings": 131072, "rms_norm_eps": 1e-05, "rope_theta": 500000.0,
    "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": True,
    "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009],
}
MISTRAL_7B = {  # Mistral-7B-v0.1
    "architectures": ["MistralForCausalLM"], "model_type": "mistral", "hidden_act": "silu",
    "hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32,
    "num_hidden_layers": 32, "num_key_value_heads": 8, "vocab_size": 32000,
    "max_position_embeddings": 32768, "rms_norm_eps": 1e-05, "rope_theta": 10000.0,
    "sliding_window": 4096, "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
}


def test_parse_qwen2():
    cfg = ModelConfig.from_hf_dict(QWEN25_05B)
    assert (cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (
        896, 24, 14, 2, 64)
    assert cfg.qkv_bias and not cfg.o_bias and cfg.tie_word_embeddings
    assert cfg.sliding_window is None and cfg.rope_scaling is None
    assert cfg.rope_theta == 1e6 and cfg.eos_token_ids == (151643,)


def test_parse_llama3_rope_scaling():
    cfg = ModelConfig.from_hf_dict(LLAMA32_1B)
    scaling = cfg.rope_scaling_dict
    assert scaling["rope_type"] == "llama3" and scaling["factor"] == 32.0
    assert scaling["original_max_position_embeddings"] == 8192
    assert cfg.rope_theta == 500000.0 and cfg.eos_token_ids == (128001, 128008, 128009)
    assert not cfg.qkv_bias and not cfg.o_bias and cfg.head_dim == 64
    hash(cfg)  # static jit argument


def test_parse_transformers5_rope_parameters():
    hf = {k: v for k, v in LLAMA32_1B.items() if k not in ("rope_theta", "rope_scaling")}
    hf["rope_parameters"] = {"rope_theta": 500000.0, **LLAMA32_1B["rope_scaling"]}
    assert ModelConfig.from_hf_dict(hf) == ModelConfig.from_hf_dict(LLAMA32_1B)
    plain = dict(hf, rope_parameters={"rope_type": "default", "rope_theta": 1234.0})
    cfg = ModelConfig.from_hf_dict(plain)
    assert cfg.rope_theta == 1234.0 and cfg.rope_scaling is None


def test_parse_mistral_sliding_window():
    cfg = ModelConfig.from_hf_dict(MISTRAL_7B)
    assert cfg.sliding_window == 4096 and cfg.head_dim == 128 and not cfg.qkv_bias
    assert ModelConfig.from_hf_dict(dict(MISTRAL_7B, sliding_window=None)).sliding_window is None


@pytest.mark.parametrize("hf", [QWEN25_05B, LLAMA32_1B, MISTRAL_7B], ids=["qwen2", "llama",
                                                                          "mistral"])
def test_to_hf_dict_round_trip(hf):
    cfg = ModelConfig.from_hf_dict(hf)
    assert ModelConfig.from_hf_dict(cfg.to_hf_dict()) == cfg


@pytest.mark.parametrize("change, message", [
    (dict(model_type="gpt2"), r"model_type 'gpt2' is not supported; supported: llama, qwen2, "
                              r"mistral"),
    (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}),
     r"rope scaling type 'yarn' is not supported; supported: default, linear, llama3"),
    (dict(rope_scaling={"type": "dynamic", "factor": 4.0}), r"'dynamic' is not supported"),
    (dict(use_sliding_window=True), r"use_sliding_window=True is not supported.*supported: "
                                    r"use_sliding_window=False"),
    (dict(hidden_act="gelu"), r"hidden_act 'gelu' is not supported; supported: silu"),
])
def test_unsupported_configs_are_refused(change, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf_dict(dict(QWEN25_05B, **change))


def test_unsupported_config_in_a_checkpoint(checkpoint_copy):
    config = json.load(open(checkpoint_copy / "config.json"))
    config["rope_scaling"] = {"rope_type": "yarn", "factor": 2.0}
    json.dump(config, open(checkpoint_copy / "config.json", "w"))
    with pytest.raises(ValueError, match="'yarn' is not supported"):
        load_checkpoint(checkpoint_copy)


# ----------------------------------------------------------------------------- tiny builders
def test_tiny_pair_shares_tokenizer_and_vocab(tiny_pair):
    target_path, draft_path = tiny_pair
    target_cfg, _ = load_checkpoint(target_path, dtype=jnp.float32)
    draft_cfg, draft = load_checkpoint(draft_path, dtype=jnp.float32)
    assert target_cfg.vocab_size == draft_cfg.vocab_size == len(load_tokenizer(draft_path))
    assert (target_cfg.num_layers, target_cfg.hidden_size) == (2, 64)
    assert draft_cfg.num_layers == 1 and draft_cfg.hidden_size < target_cfg.hidden_size
    assert draft_cfg.num_params() * 2 < target_cfg.num_params()
    assert load_tokenizer(target_path).get_vocab() == load_tokenizer(draft_path).get_vocab()
    # Not flat: a clear spread over the vocabulary and top-2 gaps far above fp32 noise.
    logits = np.asarray(dense(draft, PROMPT, cfg=draft_cfg))
    top2 = np.sort(logits, axis=-1)[:, -2:]
    assert logits.std(axis=-1).min() > 0.5
    assert np.median(top2[:, 1] - top2[:, 0]) > 0.05


def test_tiny_checkpoint_vocab(tmp_path, tiny_tokenizer):
    path = write_tiny_checkpoint(tmp_path / "big", "mistral", vocab_size=576,
                                 tokenizer=tiny_tokenizer)
    cfg, params = load_checkpoint(path, dtype=jnp.float32)
    assert cfg.vocab_size == 576 and params["embed"].shape == (576, 64)
    assert cfg.eos_token_ids == (EOS_ID, IM_END_ID) and cfg.sliding_window == 16
    with pytest.raises(ValueError, match="smaller than the tokenizer"):
        write_tiny_checkpoint(tmp_path / "small", vocab_size=300, tokenizer=tiny_tokenizer)


# ----------------------------------------------------------------------------- tokenizer
def test_tokenizer_round_trip(tiny_checkpoint, tiny_tokenizer):
    tok = load_tokenizer(tiny_checkpoint)
    assert len(tok) == TOKENIZER_VOCAB_SIZE
    for text in ["Hello, world!", "def f(x):\n    return x ** 2  # ✓ ünï 中文", "  a\tb\n\n"]:
        ids = tok.encode(text, add_special_tokens=False)
        assert ids == tiny_tokenizer.encode(text, add_special_tokens=False)
        assert max(ids) < TOKENIZER_VOCAB_SIZE
        assert tok.decode(ids) == text
    assert tok.eos_token_id == EOS_ID and tok.pad_token_id is not None


def test_chat_template(tiny_checkpoint):
    tok = load_tokenizer(tiny_checkpoint)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    ids = apply_chat_template(tok, messages)
    assert tok.decode(ids) == ("<|im_start|>system\nBe brief.<|im_end|>\n"
                               "<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n")
    assert ids.count(tok.convert_tokens_to_ids("<|im_start|>")) == 3
    assert ids.count(IM_END_ID) == 2


def test_tokenizer_errors(tmp_path, tiny_checkpoint):
    with pytest.raises(ValueError, match="no tokenizer"):
        load_tokenizer(tmp_path)
    tok = load_tokenizer(tiny_checkpoint)
    tok.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        apply_chat_template(tok, [{"role": "user", "content": "hi"}])


def test_dtype_name_must_be_supported(tmp_path):
    cfg = tiny_config("llama")
    params = jax.tree_util.tree_map(lambda a: a.astype(jnp.int8),
                                    init_params(cfg, dtype=jnp.float32))
    with pytest.raises(ValueError, match="cannot save params of dtype int8"):
        save_checkpoint(tmp_path, cfg, params)
