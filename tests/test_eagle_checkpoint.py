"""EAGLE-3 heads on disk (models/eagle_checkpoint.py): the published layouts, the runtime pytree,
and every refusal with its message."""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import save_file

from jspec.models.config import ModelConfig
from jspec.models.eagle_checkpoint import (
    EagleConfig,
    _random_params,
    default_aux_layers,
    eagle_config_from_hf,
    is_eagle_checkpoint,
    load_eagle,
    save_eagle,
    write_tiny_eagle,
)
from jspec.models.tiny import TOKENIZER_VOCAB_SIZE, tiny_config

TARGET = tiny_config("llama")  # 2 layers, hidden 64, 4 heads of 16, 2 kv heads, vocab 512
DEEP = tiny_config("llama", num_layers=8)
H, V = TARGET.hidden_size, TARGET.vocab_size
Q, KV, I = TARGET.q_size, TARGET.kv_size, TARGET.intermediate_size


def tensors_of(path) -> dict[str, np.ndarray]:
    with safe_open(os.path.join(path, "model.safetensors"), framework="np") as f:
        return {name: f.get_tensor(name) for name in f.keys()}


def rewrite_tensors(path, edit) -> None:
    """Apply ``edit`` to the head's tensors (a dict, in place) and write them back."""
    tensors = tensors_of(path)
    edit(tensors)
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})


def read_config(path) -> dict:
    with open(os.path.join(path, "config.json")) as f:
        return json.load(f)


def write_config(path, cfg: dict) -> None:
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)


def edit_config(path, **changes) -> None:
    write_config(path, dict(read_config(path), **changes))


def assert_trees_identical(a, b):
    assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


# ----------------------------------------------------------------------------- aux layers
def test_default_aux_layers_is_vllms_from_seven_layers_on():
    assert default_aux_layers(32) == (2, 16, 29)  # Llama-3.1-8B
    assert default_aux_layers(80) == (2, 40, 77)
    assert default_aux_layers(7) == (2, 3, 4)


def test_default_aux_layers_spreads_over_shallow_targets():
    # vLLM's formula repeats a layer below 7 layers ((2, 3, 3) at 6) or leaves the model
    assert default_aux_layers(6) == (0, 2, 5)
    assert default_aux_layers(4) == (0, 1, 3)
    assert default_aux_layers(3) == (0, 1, 2)
    # fewer than three layers: a repetition is unavoidable
    assert default_aux_layers(2) == (0, 0, 1)
    assert default_aux_layers(1) == (0, 0, 0)
    for n in range(3, 200):
        aux = default_aux_layers(n)
        assert len(set(aux)) == 3 and list(aux) == sorted(aux) and 0 <= aux[0] and aux[-1] < n
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="positive integer"):
            default_aux_layers(bad)


# ----------------------------------------------------------------------------- round trips
@pytest.mark.parametrize("layout", ["eagle3", "speculators"])
@pytest.mark.parametrize("own_embed", [False, True])
def test_round_trip_is_bit_identical(tmp_path, layout, own_embed):
    written = write_tiny_eagle(tmp_path / "a", TARGET, seed=3, draft_vocab_size=100,
                               layout=layout, own_embed=own_embed)
    ecfg, params = load_eagle(tmp_path / "a", TARGET, dtype=jnp.float32)
    assert ecfg == written and ecfg.layout == layout and ecfg.own_embed is own_embed
    save_eagle(tmp_path / "b", ecfg, params, layout=layout)
    again_cfg, again = load_eagle(tmp_path / "b", TARGET, dtype=jnp.float32)
    assert again_cfg == ecfg
    assert_trees_identical(again, params)
    first, second = tensors_of(tmp_path / "a"), tensors_of(tmp_path / "b")
    assert first.keys() == second.keys()
    for name in first:
        assert first[name].dtype == second[name].dtype
        np.testing.assert_array_equal(first[name], second[name])
    assert read_config(tmp_path / "a") == read_config(tmp_path / "b")


def test_round_trip_in_bfloat16(tmp_path):
    write_tiny_eagle(tmp_path / "a", TARGET, dtype="bfloat16", draft_vocab_size=64)
    assert read_config(tmp_path / "a")["torch_dtype"] == "bfloat16"
    assert tensors_of(tmp_path / "a")["fc.weight"].dtype == ml_dtypes.bfloat16
    ecfg, params = load_eagle(tmp_path / "a", TARGET)  # bfloat16 by default
    assert params["fc"].dtype == jnp.bfloat16 and params["layer"]["wqkv"].dtype == jnp.bfloat16
    assert params["d2t"].dtype == jnp.int32
    save_eagle(tmp_path / "b", ecfg, params)
    assert_trees_identical(load_eagle(tmp_path / "b", TARGET)[1], params)


def test_conversion_between_layouts_keeps_the_head(tmp_path):
    write_tiny_eagle(tmp_path / "e3", DEEP, draft_vocab_size=200, seed=1, aux_layers=(1, 3, 6))
    ecfg, params = load_eagle(tmp_path / "e3", DEEP, dtype=jnp.float32)
    save_eagle(tmp_path / "spec", ecfg, params, layout="speculators")
    spec_cfg, spec_params = load_eagle(tmp_path / "spec", DEEP, dtype=jnp.float32)
    assert spec_cfg == dataclasses.replace(ecfg, layout="speculators")
    assert spec_cfg.aux_layers == (1, 3, 6)
    assert_trees_identical(spec_params, params)


def test_norm_before_residual_and_a_wider_target_round_trip(tmp_path):
    # a head narrower than its target: fc takes 3 x Ht, the embedding is the head's own
    layer = dataclasses.replace(TARGET, hidden_size=32, num_layers=1, model_type="llama",
                                tie_word_embeddings=False)
    ecfg = EagleConfig(layer=layer, draft_vocab_size=50, target_hidden_size=H,
                       aux_layers=(0, 0, 1), own_embed=True, norm_before_residual=True,
                       layout="eagle3")
    params = _random_params(ecfg, seed=0, dtype=np.float32, std=0.1)
    for layout in ("eagle3", "speculators"):
        save_eagle(tmp_path / layout, ecfg, params, layout=layout)
        got_cfg, got = load_eagle(tmp_path / layout, TARGET, dtype=jnp.float32)
        assert got_cfg == dataclasses.replace(ecfg, layout=layout)
        assert got_cfg.norm_before_residual and got_cfg.target_hidden_size == H
        assert got["fc"].shape == (3 * H, 32)
        assert_trees_identical(got, params)
    assert read_config(tmp_path / "speculators")["target_hidden_size"] == H


# ----------------------------------------------------------------------------- layouts
def test_eagle3_layout_has_the_published_names_and_shapes(tmp_path):
    write_tiny_eagle(tmp_path, TARGET, draft_vocab_size=96)
    tensors = tensors_of(tmp_path)
    p = "midlayer."
    expected = {
        "fc.weight": (H, 3 * H),
        p + "hidden_norm.weight": (H,),
        p + "input_layernorm.weight": (H,),
        p + "self_attn.q_proj.weight": (Q, 2 * H),
        p + "self_attn.k_proj.weight": (KV, 2 * H),
        p + "self_attn.v_proj.weight": (KV, 2 * H),
        p + "self_attn.o_proj.weight": (H, Q),
        p + "post_attention_layernorm.weight": (H,),
        p + "mlp.gate_proj.weight": (I, H),
        p + "mlp.up_proj.weight": (I, H),
        p + "mlp.down_proj.weight": (H, I),
        "norm.weight": (H,),
        "lm_head.weight": (96, H),
        "d2t": (96,),
        "t2d": (V,),
    }
    assert {name: t.shape for name, t in tensors.items()} == expected
    assert tensors["d2t"].dtype == np.int64 and tensors["t2d"].dtype == np.bool_
    assert tensors["fc.weight"].dtype == np.float32
    # t2d marks exactly the target tokens d2t reaches
    reached = np.arange(96) + tensors["d2t"]
    assert np.array_equal(np.flatnonzero(tensors["t2d"]), np.sort(reached))
    cfg = read_config(tmp_path)
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"]
    assert cfg["num_hidden_layers"] == 1 and cfg["vocab_size"] == V
    assert cfg["draft_vocab_size"] == 96 and cfg["target_hidden_size"] == H
    # the same layers in vLLM's numbering (inputs) and SGLang's (outputs)
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [0, 0, 1]
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [-1, -1, 0]
    assert is_eagle_checkpoint(tmp_path)


def test_speculators_layout_has_the_published_names_and_config(tmp_path):
    write_tiny_eagle(tmp_path, DEEP, layout="speculators", own_embed=True)
    tensors = tensors_of(tmp_path)
    assert tensors["layers.0.self_attn.q_proj.weight"].shape == (Q, 2 * H)
    assert tensors["embed_tokens.weight"].shape == (V, H)
    assert not any(name.startswith("midlayer.") for name in tensors)
    cfg = read_config(tmp_path)
    assert cfg["speculators_model_type"] == "eagle3"
    assert cfg["transformer_layer_config"]["num_hidden_layers"] == 1
    assert cfg["transformer_layer_config"]["vocab_size"] == V
    assert cfg["draft_vocab_size"] == V and cfg["norm_before_residual"] is False
    assert cfg["target_hidden_size"] is None
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    assert cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"] >= 1
    assert is_eagle_checkpoint(tmp_path)


def test_either_layer_prefix_loads(tmp_path):
    # vLLM renames midlayer. to layers.0. for every head; a speculators config over
    # midlayer. tensors loads the same
    write_tiny_eagle(tmp_path / "a", TARGET, draft_vocab_size=64)
    ecfg, params = load_eagle(tmp_path / "a", TARGET, dtype=jnp.float32)
    save_eagle(tmp_path / "b", ecfg, params, layout="speculators")
    rewrite_tensors(tmp_path / "b", lambda t: t.update(
        {k.replace("layers.0.", "midlayer."): t.pop(k) for k in list(t)}))
    assert_trees_identical(load_eagle(tmp_path / "b", TARGET, dtype=jnp.float32)[1], params)


def test_sharded_weights_load(tmp_path):
    write_tiny_eagle(tmp_path, TARGET, draft_vocab_size=64)
    tensors = tensors_of(tmp_path)
    _, params = load_eagle(tmp_path, TARGET, dtype=jnp.float32)
    os.remove(os.path.join(tmp_path, "model.safetensors"))
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[:7],
              "model-00002-of-00002.safetensors": names[7:]}
    for file, part in shards.items():
        save_file({n: tensors[n] for n in part}, os.path.join(tmp_path, file))
    index = {"weight_map": {n: f for f, part in shards.items() for n in part}}
    with open(os.path.join(tmp_path, "model.safetensors.index.json"), "w") as f:
        json.dump(index, f)
    assert_trees_identical(load_eagle(tmp_path, TARGET, dtype=jnp.float32)[1], params)


# ----------------------------------------------------------------------------- runtime pytree
def test_runtime_layout(tmp_path):
    write_tiny_eagle(tmp_path, TARGET, draft_vocab_size=80)
    tensors = tensors_of(tmp_path)
    ecfg, params = load_eagle(tmp_path, TARGET, dtype=jnp.float32)
    lp = params["layer"]
    assert params["fc"].shape == (3 * H, H) and params["lm_head"].shape == (H, 80)
    assert lp["wqkv"].shape == (2 * H, Q + 2 * KV) and lp["w_gate_up"].shape == (H, 2 * I)
    p = "midlayer."
    np.testing.assert_array_equal(np.asarray(params["fc"]), tensors["fc.weight"].T)
    np.testing.assert_array_equal(np.asarray(lp["wqkv"][:, :Q]),
                                  tensors[p + "self_attn.q_proj.weight"].T)
    np.testing.assert_array_equal(np.asarray(lp["wqkv"][:, Q:Q + KV]),
                                  tensors[p + "self_attn.k_proj.weight"].T)
    np.testing.assert_array_equal(np.asarray(lp["wqkv"][:, Q + KV:]),
                                  tensors[p + "self_attn.v_proj.weight"].T)
    np.testing.assert_array_equal(np.asarray(lp["w_gate_up"][:, I:]),
                                  tensors[p + "mlp.up_proj.weight"].T)
    np.testing.assert_array_equal(np.asarray(lp["attn_norm"]),
                                  tensors[p + "input_layernorm.weight"])
    np.testing.assert_array_equal(np.asarray(lp["mlp_norm"]),
                                  tensors[p + "post_attention_layernorm.weight"])
    np.testing.assert_array_equal(np.asarray(params["lm_head"]), tensors["lm_head.weight"].T)
    # norms near 1, weights small
    assert abs(float(jnp.mean(lp["hidden_norm"])) - 1) < 0.1
    assert ecfg.layer.num_layers == 1 and ecfg.layer.vocab_size == V


def test_d2t_offsets_become_absolute_target_ids(tmp_path):
    write_tiny_eagle(tmp_path, TARGET, draft_vocab_size=4)
    offsets = np.array([0, 5, 9, 100], np.int64)  # draft id i is target id i + offset
    rewrite_tensors(tmp_path, lambda t: t.update(d2t=offsets))
    _, params = load_eagle(tmp_path, TARGET, dtype=jnp.float32)
    assert params["d2t"].dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(params["d2t"]), [0, 6, 11, 103])
    # written back as offsets
    save_eagle(tmp_path / "b", *load_eagle(tmp_path, TARGET, dtype=jnp.float32))
    np.testing.assert_array_equal(tensors_of(tmp_path / "b")["d2t"], offsets)


def test_d2t_of_any_integer_dtype_is_read(tmp_path):
    write_tiny_eagle(tmp_path, TARGET, draft_vocab_size=3)
    rewrite_tensors(tmp_path, lambda t: t.update(d2t=np.array([1, 1, 7], np.int32)))
    _, params = load_eagle(tmp_path, TARGET)
    np.testing.assert_array_equal(np.asarray(params["d2t"]), [1, 2, 9])


def test_a_tiny_draft_vocabulary_is_a_sorted_subset(tmp_path):
    write_tiny_eagle(tmp_path, TARGET, draft_vocab_size=50, seed=5)
    d2t = np.asarray(load_eagle(tmp_path, TARGET)[1]["d2t"])
    assert len(set(d2t.tolist())) == 50 and np.all(np.diff(d2t) > 0)
    assert d2t[0] >= 0 and d2t[-1] < V


def test_no_d2t_means_the_whole_vocabulary_in_order(tmp_path):
    write_tiny_eagle(tmp_path, TARGET)  # draft vocabulary = the target's
    rewrite_tensors(tmp_path, lambda t: (t.pop("d2t"), t.pop("t2d")))
    edit_config(tmp_path, draft_vocab_size=None)
    ecfg, params = load_eagle(tmp_path, TARGET)
    assert ecfg.draft_vocab_size == V
    np.testing.assert_array_equal(np.asarray(params["d2t"]), np.arange(V))


@pytest.mark.parametrize("own_embed", [False, True])
def test_own_embed(tmp_path, own_embed):
    written = write_tiny_eagle(tmp_path, TARGET, own_embed=own_embed, draft_vocab_size=64)
    assert ("embed_tokens.weight" in tensors_of(tmp_path)) is own_embed
    ecfg, params = load_eagle(tmp_path, TARGET)
    assert written.own_embed is own_embed and ecfg.own_embed is own_embed
    assert ("embed" in params) is own_embed
    if own_embed:
        assert params["embed"].shape == (V, H) and params["embed"].dtype == jnp.bfloat16


def test_aux_layers_from_either_numbering(tmp_path):
    write_tiny_eagle(tmp_path, DEEP, aux_layers=(6, 1, 3))  # any order: captured in layer order
    assert load_eagle(tmp_path, DEEP)[0].aux_layers == (1, 3, 6)
    cfg = read_config(tmp_path)
    # SGLang / SpecForge: only the nested ids, as layer outputs
    del cfg["eagle_aux_hidden_state_layer_ids"]
    cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [1, 3, 6]
    assert eagle_config_from_hf(cfg, DEEP).aux_layers == (2, 4, 7)
    # vLLM's semantics switch for SGLang-trained heads
    spec = {"eagle_aux_hidden_state_layer_ids": [1, 3, 6], "eagle_aux_layer_semantics": "sglang"}
    cfg.pop("eagle_config")
    assert eagle_config_from_hf(dict(cfg, **spec), DEEP).aux_layers == (2, 4, 7)
    # none: the default
    assert eagle_config_from_hf(cfg, DEEP).aux_layers == default_aux_layers(8)


# ----------------------------------------------------------------------------- refusals
def test_refuses_a_head_for_a_narrower_target(tmp_path):
    wide = tiny_config("llama", hidden_size=384, num_heads=6, head_dim=64, num_kv_heads=2)
    write_tiny_eagle(tmp_path, wide)
    narrow = tiny_config("llama", hidden_size=256)
    with pytest.raises(ValueError, match=rf"EAGLE head {tmp_path}: fc.weight takes 1152 inputs "
                                         r"= 3 x hidden 384, but the target's hidden_size is 256"):
        load_eagle(tmp_path, narrow)


def test_refuses_an_fc_that_does_not_match_its_config(tmp_path):
    write_tiny_eagle(tmp_path, TARGET)
    rewrite_tensors(tmp_path, lambda t: t.update({"fc.weight": np.zeros((H, 96), np.float32)}))
    with pytest.raises(ValueError, match="fc.weight takes 96 inputs = 3 x hidden 32, but the "
                                         "target's hidden_size is 64"):
        load_eagle(tmp_path, TARGET)


def test_refuses_another_vocabulary(tmp_path):
    write_tiny_eagle(tmp_path, TARGET, draft_vocab_size=64)
    with pytest.raises(ValueError, match="vocab_size is 512, but the target's vocabulary has "
                                         "600 tokens"):
        load_eagle(tmp_path, tiny_config("llama", vocab_size=600))
    write_tiny_eagle(tmp_path / "s", TARGET, layout="speculators")
    with pytest.raises(ValueError, match="transformer_layer_config.vocab_size is 512"):
        load_eagle(tmp_path / "s", tiny_config("llama", vocab_size=600))


def test_refuses_aux_layers_outside_the_target(tmp_path):
    write_tiny_eagle(tmp_path, DEEP)  # default (2, 4, 5) of an 8-layer target
    with pytest.raises(ValueError, match=r"EAGLE head .*: eagle_aux_hidden_state_layer_ids "
                                         r"\[2, 4, 5\]: 2 selects the input of layer 2, outside "
                                         r"the target's 2 layers \(0..1\)"):
        load_eagle(tmp_path, TARGET)
    edit_config(tmp_path, eagle_aux_hidden_state_layer_ids=[1, 2, 8])
    with pytest.raises(ValueError, match=r"\[1, 2, 8\]: 8 selects the input of layer 8"):
        load_eagle(tmp_path, DEEP)
    with pytest.raises(ValueError, match="outside the target's 2 layers"):
        write_tiny_eagle(tmp_path / "w", TARGET, aux_layers=(0, 1, 2))


def test_refuses_other_aux_layer_counts_repeats_and_disagreement(tmp_path):
    write_tiny_eagle(tmp_path, DEEP)
    edit_config(tmp_path, eagle_aux_hidden_state_layer_ids=[1, 4])
    with pytest.raises(ValueError, match=r"\[1, 4\] names 2 layers; an EAGLE-3 head's fc takes 3"):
        load_eagle(tmp_path, DEEP)
    edit_config(tmp_path, eagle_aux_hidden_state_layer_ids=[1, 4, 4])
    with pytest.raises(ValueError, match="names a layer twice"):
        load_eagle(tmp_path, DEEP)
    # SGLang's nested ids count outputs: the same numbers name other layers
    edit_config(tmp_path, eagle_aux_hidden_state_layer_ids=[1, 3, 6],
                eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 3, 6]})
    with pytest.raises(ValueError, match="name different layers"):
        load_eagle(tmp_path, DEEP)
    edit_config(tmp_path, eagle_aux_hidden_state_layer_ids=["a", 1, 2], eagle_config={})
    with pytest.raises(ValueError, match="must be a list of integers"):
        load_eagle(tmp_path, DEEP)
    edit_config(tmp_path, eagle_aux_hidden_state_layer_ids=[1, 2, 3],
                eagle_aux_layer_semantics="other")
    with pytest.raises(ValueError, match="eagle_aux_layer_semantics 'other' is not supported"):
        load_eagle(tmp_path, DEEP)


def test_refuses_d2t_outside_the_target_vocabulary(tmp_path):
    write_tiny_eagle(tmp_path, TARGET, draft_vocab_size=4)
    rewrite_tensors(tmp_path, lambda t: t.update(d2t=np.array([0, 0, 0, V - 2], np.int64)))
    with pytest.raises(ValueError, match=r"d2t maps draft id 3 to target id 513 \(draft id \+ "
                                         r"offset 510\), outside the target's vocabulary of 512"):
        load_eagle(tmp_path, TARGET)
    rewrite_tensors(tmp_path, lambda t: t.update(d2t=np.array([0, -2, 0, 0], np.int64)))
    with pytest.raises(ValueError, match="draft id 1 to target id -1"):
        load_eagle(tmp_path, TARGET)


def test_refuses_d2t_mapping_two_draft_ids_to_one_target_id(tmp_path):
    write_tiny_eagle(tmp_path, TARGET, draft_vocab_size=4)
    rewrite_tensors(tmp_path, lambda t: t.update(d2t=np.array([5, 4, 0, 0], np.int64)))
    with pytest.raises(ValueError, match="d2t maps 2 draft ids to target id 5"):
        load_eagle(tmp_path, TARGET)


def test_refuses_d2t_of_the_wrong_shape_or_dtype(tmp_path):
    write_tiny_eagle(tmp_path, TARGET, draft_vocab_size=4)
    rewrite_tensors(tmp_path, lambda t: t.update(d2t=np.zeros(5, np.int64)))
    with pytest.raises(ValueError, match=r"d2t has shape \[5\], but draft_vocab_size is 4"):
        load_eagle(tmp_path, TARGET)
    rewrite_tensors(tmp_path, lambda t: t.update(d2t=np.zeros(4, np.float32)))
    with pytest.raises(ValueError, match="d2t has dtype F32; it holds integer offsets"):
        load_eagle(tmp_path, TARGET)


def test_refuses_lm_head_rows_other_than_the_draft_vocabulary(tmp_path):
    write_tiny_eagle(tmp_path, TARGET, draft_vocab_size=64)
    rewrite_tensors(tmp_path, lambda t: t.update({"lm_head.weight": np.zeros((V, H),
                                                                             np.float32)}))
    with pytest.raises(ValueError, match="lm_head.weight has 512 rows, but draft_vocab_size "
                                         "is 64"):
        load_eagle(tmp_path, TARGET)


def test_refuses_missing_tensors_and_lists_them(tmp_path):
    write_tiny_eagle(tmp_path, TARGET, draft_vocab_size=64)
    rewrite_tensors(tmp_path, lambda t: [t.pop(n) for n in
                                         ("midlayer.self_attn.k_proj.weight", "norm.weight",
                                          "d2t")])
    with pytest.raises(ValueError, match=r"missing tensors: midlayer.self_attn.k_proj.weight, "
                                         r"norm.weight, d2t"):
        load_eagle(tmp_path, TARGET)


def test_refuses_unexpected_tensors(tmp_path):
    write_tiny_eagle(tmp_path, TARGET)
    rewrite_tensors(tmp_path, lambda t: t.update({"fc.bias": np.zeros(H, np.float32)}))
    with pytest.raises(ValueError, match="unexpected tensors fc.bias"):
        load_eagle(tmp_path, TARGET)


def test_refuses_misshapen_and_quantized_weights(tmp_path):
    write_tiny_eagle(tmp_path, TARGET)
    rewrite_tensors(tmp_path, lambda t: t.update(
        {"midlayer.self_attn.q_proj.weight": np.zeros((Q, H), np.float32)}))
    with pytest.raises(ValueError, match=r"'midlayer.self_attn.q_proj.weight' has shape "
                                         r"\[64, 64\], expected \[64, 128\]"):
        load_eagle(tmp_path, TARGET)
    rewrite_tensors(tmp_path, lambda t: t.update(
        {"midlayer.self_attn.q_proj.weight": np.zeros((Q, 2 * H), np.int8)}))
    with pytest.raises(ValueError, match="has dtype I8; only float weights"):
        load_eagle(tmp_path, TARGET)


def test_refuses_a_plain_model(tmp_path):
    write_config(tmp_path, TARGET.to_hf_dict())
    assert not is_eagle_checkpoint(tmp_path)
    with pytest.raises(ValueError, match=r"config.json is not an EAGLE-3 head: architectures "
                                         r"\['LlamaForCausalLM'\]"):
        load_eagle(tmp_path, TARGET)


@pytest.mark.parametrize("config", [
    {"architectures": ["EagleLlamaForCausalLM"], "model_type": "llama"},
    {"speculators_model_type": "eagle", "transformer_layer_config": {}},
])
def test_refuses_eagle1_heads(tmp_path, config):
    write_config(tmp_path, config)
    assert not is_eagle_checkpoint(tmp_path)
    with pytest.raises(ValueError, match="EAGLE-1/2 heads are not supported"):
        load_eagle(tmp_path, TARGET)


def test_refuses_torch_pickles(tmp_path):
    write_tiny_eagle(tmp_path, TARGET)
    os.rename(os.path.join(tmp_path, "model.safetensors"),
              os.path.join(tmp_path, "pytorch_model.bin"))
    with pytest.raises(ValueError, match="weights are pytorch_model.bin, a torch pickle; jspec "
                                         "reads no torch pickles: convert it to "
                                         "model.safetensors"):
        load_eagle(tmp_path, TARGET)
    os.remove(os.path.join(tmp_path, "pytorch_model.bin"))
    with pytest.raises(ValueError, match="no weights: expected model.safetensors"):
        load_eagle(tmp_path, TARGET)


@pytest.mark.parametrize("layout", ["eagle3", "speculators"])
def test_refuses_more_than_one_layer(tmp_path, layout):
    write_tiny_eagle(tmp_path, TARGET, layout=layout)
    cfg = read_config(tmp_path)
    (cfg["transformer_layer_config"] if layout == "speculators" else cfg)["num_hidden_layers"] = 2
    write_config(tmp_path, cfg)
    with pytest.raises(ValueError, match="num_hidden_layers is 2; only one-layer EAGLE-3 heads"):
        load_eagle(tmp_path, TARGET)


def test_refuses_a_head_without_its_own_embedding_narrower_than_the_target(tmp_path):
    layer = dataclasses.replace(TARGET, hidden_size=32, num_layers=1)
    ecfg = EagleConfig(layer=layer, draft_vocab_size=V, target_hidden_size=H,
                       aux_layers=(0, 0, 1), own_embed=False, norm_before_residual=False,
                       layout="eagle3")
    save_eagle(tmp_path, ecfg, _random_params(ecfg, seed=0, dtype=np.float32, std=0.1))
    with pytest.raises(ValueError, match="no embed_tokens.weight, and its hidden_size 32 is not "
                                         "the target's 64"):
        load_eagle(tmp_path, TARGET)


def test_refuses_layers_we_do_not_compute(tmp_path):
    write_tiny_eagle(tmp_path, TARGET)
    base = read_config(tmp_path)
    for change, message in [
        ({"attention_bias": True}, "attention_bias=True heads are not supported"),
        ({"model_type": "qwen3"}, "model_type 'qwen3': only heads with a Llama decoder layer"),
        ({"norm_before_fc": True}, "norm_before_fc=True"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
        ({"eagle_config": {"use_aux_hidden_state": False}}, "use_aux_hidden_state false"),
        ({"draft_vocab_size": V + 1}, "draft_vocab_size 513 is larger than the target's"),
        ({"draft_vocab_size": "many"}, "draft_vocab_size must be a positive integer"),
        ({"hidden_size": "wide"}, "the head's layer config"),
        ({"num_attention_heads": None}, "the head's layer config"),
        ({"norm_before_residual": "yes"}, "norm_before_residual must be true or false"),
    ]:
        write_config(tmp_path, dict(base, **change))
        with pytest.raises(ValueError, match=message):
            load_eagle(tmp_path, TARGET)


def test_refuses_a_speculators_config_without_norm_before_residual(tmp_path):
    write_tiny_eagle(tmp_path, TARGET, layout="speculators")
    cfg = read_config(tmp_path)
    del cfg["norm_before_residual"]
    write_config(tmp_path, cfg)
    with pytest.raises(ValueError, match="no norm_before_residual: vLLM reads a missing flag as "
                                         "true and speculators as false"):
        load_eagle(tmp_path, TARGET)
    write_config(tmp_path, dict(cfg, norm_before_residual=True, transformer_layer_config=None))
    with pytest.raises(ValueError, match="needs transformer_layer_config"):
        load_eagle(tmp_path, TARGET)


def test_refuses_unreadable_directories(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_eagle(tmp_path / "nowhere", TARGET)
    with pytest.raises(ValueError, match=f"EAGLE head {tmp_path}: no config.json"):
        load_eagle(tmp_path, TARGET)
    (tmp_path / "config.json").write_text("{not json")
    assert not is_eagle_checkpoint(tmp_path)
    with pytest.raises(ValueError, match="config.json is not valid JSON"):
        load_eagle(tmp_path, TARGET)
    (tmp_path / "config.json").write_text("[1, 2]")
    assert not is_eagle_checkpoint(tmp_path)
    with pytest.raises(ValueError, match="config.json must be a JSON object"):
        load_eagle(tmp_path, TARGET)
    write_tiny_eagle(tmp_path / "head", TARGET)
    (tmp_path / "head" / "model.safetensors").write_bytes(b"\x00" * 10)
    with pytest.raises(ValueError, match="cannot read safetensors file"):
        load_eagle(tmp_path / "head", TARGET)
    assert not is_eagle_checkpoint(tmp_path / "nowhere") and not is_eagle_checkpoint(None)


def test_save_refuses_params_that_do_not_fit(tmp_path):
    ecfg = write_tiny_eagle(tmp_path / "a", TARGET, draft_vocab_size=8)
    _, params = load_eagle(tmp_path / "a", TARGET, dtype=jnp.float32)
    bad = dict(params, fc=params["fc"][:, :10])
    with pytest.raises(ValueError, match=r"params 'fc' has shape \[192, 10\], expected "
                                         r"\[192, 64\]"):
        save_eagle(tmp_path / "b", ecfg, bad)
    with pytest.raises(ValueError, match="own_embed is False, but params have 'embed'"):
        save_eagle(tmp_path / "b", ecfg, dict(params, embed=jnp.zeros((V, H))))
    layer = {k: v for k, v in params["layer"].items() if k != "wo"}
    with pytest.raises(ValueError, match="params have no 'layer/wo'"):
        save_eagle(tmp_path / "b", ecfg, dict(params, layer=layer))
    with pytest.raises(ValueError, match="d2t maps draft id 0 to target id 600"):
        save_eagle(tmp_path / "b", ecfg, dict(params, d2t=jnp.arange(8) + 600))
    with pytest.raises(ValueError, match="layout 'hf' is not supported"):
        save_eagle(tmp_path / "b", ecfg, params, layout="hf")
    with pytest.raises(ValueError, match="share one dtype"):
        save_eagle(tmp_path / "b", ecfg, dict(params, lm_head=params["lm_head"].astype(
            jnp.bfloat16)))


def test_write_tiny_eagle_refuses_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="draft_vocab_size 513 is larger"):
        write_tiny_eagle(tmp_path, TARGET, draft_vocab_size=V + 1)
    with pytest.raises(ValueError, match="layout 'x' is not supported"):
        write_tiny_eagle(tmp_path, TARGET, layout="x")
    with pytest.raises(ValueError, match="dtype 'int8' is not supported"):
        write_tiny_eagle(tmp_path, TARGET, dtype="int8")
    with pytest.raises(ValueError, match="aux_layers must be a list of integers"):
        write_tiny_eagle(tmp_path, TARGET, aux_layers=5)
    assert not os.path.exists(tmp_path / "config.json")  # nothing written before the checks


def test_tiny_heads_fit_every_tiny_family(tmp_path):
    for family in ("llama", "qwen2", "mistral"):
        target = tiny_config(family)
        ecfg = write_tiny_eagle(tmp_path / family, target, draft_vocab_size=32)
        assert ecfg.layer.model_type == "llama" and ecfg.layer.vocab_size == TOKENIZER_VOCAB_SIZE
        assert load_eagle(tmp_path / family, target)[0] == ecfg
        assert isinstance(ecfg.layer, ModelConfig)
