"""EAGLE-3 draft heads on disk: the two layouts they are published in <-> (EagleConfig, params).

What the published formats are, as read in the projects that write and serve them:

SafeAILab/EAGLE (``eagle/model/cnets.py``, the EAGLE-3 ``Model``) defines the head. ``fc``, a
Linear without bias, fuses three of the target's hidden states, concatenated, from
3 x ``target_hidden_size`` inputs (3 x ``hidden_size`` when the config has no
``target_hidden_size``) to the head's ``hidden_size``. One decoder layer, ``midlayer``, takes the
token embedding normed by ``input_layernorm`` and the hidden state normed by ``hidden_norm``,
concatenated in that order, so its ``q_proj``, ``k_proj`` and ``v_proj`` take 2 x hidden inputs;
the residual stream starts from the hidden state before its norm; ``o_proj``,
``post_attention_layernorm`` and the gate/up/down MLP are a Llama layer's. Then a final ``norm``
and ``lm_head`` with ``draft_vocab_size`` rows. Two buffers map the reduced draft vocabulary:
``d2t`` (int64, one per draft id) holds an offset, target id = draft id + d2t[draft id], and
``t2d`` (bool, one per target token) marks the target tokens the draft vocabulary has.
``embed_tokens`` is the target's embedding, frozen. The config is a Hugging Face Llama config
with ``architectures`` ["LlamaForCausalLMEagle3"] (SGLang's class name as well),
``num_hidden_layers`` 1, ``vocab_size`` the target's vocabulary and ``draft_vocab_size``; the
heads SafeAILab publishes (yuhuili/EAGLE3-*) ship ``pytorch_model.bin``. Its targets capture
the hidden states entering layers 2, L // 2 and L - 3 (hard-coded in its modeling_*_kv.py).

vLLM (``vllm/model_executor/models/llama_eagle3.py``) reads the same names, renaming
``midlayer.`` to ``layers.0.``: ``d2t`` becomes ``draft_id_to_target_id`` and is applied as
arange(draft vocab) + d2t, ``t2d`` is skipped, ``embed_tokens.weight`` is optional (without it
the target's embedding is shared), ``draft_vocab_size`` defaults to ``vocab_size``, and
``norm_before_residual`` (config, default false) starts the residual stream from the normed
hidden state instead. A target captures, for each listed layer k, the residual stream entering
layer k, appended in layer order while the layers run (``llama.py``), so fc's three input blocks
are in ascending layer order whatever order the config lists. The layer ids come from the draft
config's top-level ``eagle_aux_hidden_state_layer_ids``, else the model's default
(2, L // 2, L - 3); ``eagle_aux_layer_semantics: "sglang"`` adds 1 to them
(``v1/worker/gpu/spec_decode/eagle/eagle3_utils.py``).

SGLang (``python/sglang/srt/models/llama_eagle3.py``) loads the same tensors (``d2t`` as
offsets: hot ids = d2t + arange; ``t2d`` ignored). Its targets take the ids of the draft
config's ``eagle_config.eagle_aux_hidden_state_layer_ids`` as "the output of layer k" and
capture the input of layer k + 1 (``set_eagle3_layers_to_capture``); with none, the inputs of
layers 2, L // 2 and L - 3. SpecForge writes those nested ids in that numbering.

speculators (vllm-project/speculators: ``models/eagle3``, ``convert/eagle/eagle3_converter.py``)
and vLLM's reader of its configs (``vllm/transformers_utils/configs/speculators/``): config.json
has ``speculators_model_type`` "eagle3", the layer's Llama config under
``transformer_layer_config`` (its ``vocab_size`` the target's), ``draft_vocab_size``,
``norm_before_residual``, ``target_hidden_size`` (null: the head's hidden size),
``eagle_aux_hidden_state_layer_ids`` (vLLM's numbering) and ``speculators_config`` (proposal
methods, verifier). The tensors are SafeAILab's with ``layers.0.`` for ``midlayer.`` (the
converter renames them). vLLM reads a missing ``norm_before_residual`` as true, speculators'
own default is false.

What jspec does with them: both layouts load into one runtime pytree (module ``models/eagle.py``
runs it); either can be written. Weights are stored [in, out] as in models/params.py::

    fc          [3 * Ht, H]
    embed       [V, H]             only when the checkpoint has embed_tokens (own_embed)
    layer/
      hidden_norm [H]   attn_norm [H] (input_layernorm)   mlp_norm [H] (post_attention_layernorm)
      wqkv      [2H, q + 2 kv]     q, k, v fused; input concat(normed embedding, normed hidden)
      wo        [q, H]   w_gate_up [H, 2I] (gate then up)   w_down [I, H]
    final_norm  [H]
    lm_head     [H, Vd]
    d2t         int32 [Vd]         the ABSOLUTE target id of each draft id

Refused, each with a ValueError naming the head's directory: a config that is not an EAGLE-3
head (plain models; EAGLE-1/2 heads, which have no fc and a different layer); more than one
layer; a layer other than Llama's (model_type, attention or MLP biases); a hidden size,
vocabulary or layer count that does not fit the target; ``norm_before_fc`` (gpt-oss heads'
extra norm); weights only in ``pytorch_model.bin`` (no torch pickles are read here); missing,
misshapen, non-float (quantized) or unexpected tensors (a bias we would drop, say); a ``d2t``
that leaves the target's vocabulary or maps two draft ids to one target id (then the draft
distribution over the target vocabulary would not be the head's, and the rejection rule would
not be lossless). A speculators config without ``norm_before_residual`` is refused too: vLLM and
speculators read it differently.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from typing import Any, Mapping

import jax.numpy as jnp
import numpy as np

from jspec.models import loader
from jspec.models.config import ModelConfig

LAYOUTS = ("eagle3", "speculators")
NUM_AUX_LAYERS = 3  # fc takes 3 x Ht inputs in every published head
EAGLE3_ARCHITECTURE = "LlamaForCausalLMEagle3"  # written in the eagle3 layout
SPECULATORS_ARCHITECTURE = "Eagle3Speculator"  # speculators' default for its eagle3 config
# Layer tensors by their canonical (speculators / vLLM) prefix; the eagle3 layout's is midlayer.
_CANON_PREFIX = "layers.0."
_FILE_PREFIX = {"eagle3": "midlayer.", "speculators": "layers.0."}
# Tensors a published head may carry that the forward does not use: t2d (the inverse of d2t;
# vLLM and SGLang skip it), the target's norm and head that speculators trains against (not
# saved by its current versions) and rotary caches of older exports.
_IGNORED = ("t2d", "verifier_lm_head.weight", "verifier_norm.weight")
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
_FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")
_INT_DTYPES = ("I8", "I16", "I32", "I64", "U8", "U16", "U32", "U64")


@dataclasses.dataclass(frozen=True)
class EagleConfig:
    """An EAGLE-3 head as the engine needs it (models/eagle.py)."""

    layer: ModelConfig  # the head's decoder layer; vocab_size is the TARGET's vocabulary
    draft_vocab_size: int  # Vd (== layer.vocab_size when there is no reduced vocabulary)
    target_hidden_size: int  # Ht: fc takes 3 * Ht inputs
    aux_layers: tuple[int, ...]  # target layers whose INPUT residual stream fc takes, ascending
    own_embed: bool  # the checkpoint has embed_tokens; else the target's embedding is shared
    norm_before_residual: bool  # the residual stream starts from the normed hidden state
    layout: str  # "eagle3" (SafeAILab/EAGLE, SGLang) or "speculators"


# ----------------------------------------------------------------------------- aux layers
def default_aux_layers(num_target_layers: int) -> tuple[int, ...]:
    """The target layers whose input an EAGLE-3 head takes when its config names none.

    vLLM's, SGLang's, speculators' and SafeAILab's default is (2, L // 2, L - 3), which is three
    distinct ascending layers only from L = 7 on: below, vLLM would capture a repeated layer once
    (fewer than three states for fc) or name a layer that does not exist. Published heads
    target deeper models, so for L < 7 (tiny test targets) this spreads the three over the
    layers instead: (0, (L - 1) // 2, L - 1), distinct from L = 3 on; with one or two layers a
    repetition is unavoidable (jspec's forward captures a repeated layer into each slot)."""
    if isinstance(num_target_layers, bool) or not isinstance(num_target_layers, int) \
            or num_target_layers < 1:
        raise ValueError(f"the target's number of layers must be a positive integer, got "
                         f"{num_target_layers!r}")
    n = num_target_layers
    if n >= 7:
        return (2, n // 2, n - 3)
    return (0, (n - 1) // 2, n - 1)


def _int_list(value: Any, name: str) -> list[int]:
    if not isinstance(value, (list, tuple)) or not all(
            isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise ValueError(f"{name} must be a list of integers, got {value!r}")
    return list(value)


def _aux_layers(d: Mapping[str, Any], nested: Mapping[str, Any], num_layers: int
                ) -> tuple[int, ...]:
    """The captured layers, as inputs of the target's layers, from either spelling."""
    semantics = d.get("eagle_aux_layer_semantics")
    if semantics not in (None, "vllm", "sglang"):
        raise ValueError(f"eagle_aux_layer_semantics {semantics!r} is not supported; "
                         "supported: 'vllm', 'sglang'")
    found: list[tuple[str, list[int], list[int]]] = []  # (key, as written, as layer inputs)
    top = d.get("eagle_aux_hidden_state_layer_ids")
    if top:  # vLLM's numbering unless the config says SGLang's
        ids = _int_list(top, "eagle_aux_hidden_state_layer_ids")
        shift = 1 if semantics == "sglang" else 0
        found.append(("eagle_aux_hidden_state_layer_ids", ids, [i + shift for i in ids]))
    inner = nested.get("eagle_aux_hidden_state_layer_ids")
    if inner:  # written by SGLang / SpecForge: the output of layer k, the input of layer k + 1
        ids = _int_list(inner, "eagle_config.eagle_aux_hidden_state_layer_ids")
        shift = 0 if semantics == "vllm" else 1
        found.append(("eagle_config.eagle_aux_hidden_state_layer_ids", ids,
                      [i + shift for i in ids]))
    if not found:
        return default_aux_layers(num_layers)
    for key, written, inputs in found:
        if len(inputs) != NUM_AUX_LAYERS:
            raise ValueError(f"{key} {written} names {len(inputs)} layers; an EAGLE-3 head's fc "
                             f"takes {NUM_AUX_LAYERS}")
        for i, layer in zip(written, inputs):
            if not 0 <= layer < num_layers:
                raise ValueError(
                    f"{key} {written}: {i} selects the input of layer {layer}, outside the "
                    f"target's {num_layers} layers (0..{num_layers - 1})")
        if num_layers >= NUM_AUX_LAYERS and len(set(inputs)) < len(inputs):
            raise ValueError(f"{key} {written} names a layer twice; vLLM and SGLang capture "
                             "each layer once, so no published head takes a repeated one")
    if len(found) == 2 and sorted(found[0][2]) != sorted(found[1][2]):
        raise ValueError(
            f"{found[0][0]} {found[0][1]} and {found[1][0]} {found[1][1]} name different "
            f"layers (the inputs of layers {sorted(found[0][2])} and {sorted(found[1][2])}; the "
            "nested ids count layer outputs, as SGLang does)")
    inputs = found[0][2]
    return tuple(sorted(inputs))


# ----------------------------------------------------------------------------- config
def _layout_of(d: Mapping[str, Any]) -> str:
    kind = d.get("speculators_model_type")
    if kind is not None:
        if kind == "eagle3":
            return "speculators"
        if kind == "eagle":
            raise ValueError("speculators_model_type 'eagle' is an EAGLE-1/2 head; EAGLE-1/2 "
                             "heads are not supported, only EAGLE-3 heads")
        raise ValueError(f"speculators_model_type {kind!r} is not supported; supported: "
                         "'eagle3'")
    archs = d.get("architectures")
    archs = [a for a in archs if isinstance(a, str)] if isinstance(archs, list) else []
    if any("eagle3" in a.lower() for a in archs):
        return "eagle3"
    if any("eagle" in a.lower() for a in archs):
        raise ValueError(f"config.json architectures {archs} is an EAGLE-1/2 head; EAGLE-1/2 "
                         "heads are not supported, only EAGLE-3 heads")
    raise ValueError(
        f"config.json is not an EAGLE-3 head: architectures {archs} (expected "
        f"{EAGLE3_ARCHITECTURE} or Eagle3LlamaForCausalLM, or speculators_model_type 'eagle3'); "
        "plain models and EAGLE-1/2 heads are not EAGLE-3 heads")


def _positive_int(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


def eagle_config_from_hf(d: Mapping[str, Any], target: ModelConfig) -> EagleConfig:
    """An EAGLE-3 head's config.json (either layout) -> EagleConfig, checked against the
    target. ``own_embed`` is a property of the weights, not of config.json: False here,
    ``load_eagle`` sets it from the file."""
    if not isinstance(d, Mapping):
        raise ValueError(f"config.json must be a JSON object, got {type(d).__name__}")
    layout = _layout_of(d)
    if layout == "speculators":
        layer_dict = d.get("transformer_layer_config")
        where = "transformer_layer_config."
        if not isinstance(layer_dict, Mapping):
            raise ValueError("a speculators config.json needs transformer_layer_config, the "
                             "head's layer config (an object)")
        if "norm_before_residual" not in d:
            raise ValueError("the speculators config.json has no norm_before_residual: vLLM "
                             "reads a missing flag as true and speculators as false; set it")
        nested: Mapping[str, Any] = {}
    else:
        layer_dict, where = d, ""
        nested = d.get("eagle_config") or {}
        if not isinstance(nested, Mapping):
            raise ValueError(f"eagle_config must be an object, got {nested!r}")
        if nested.get("use_aux_hidden_state", True) is not True:
            raise ValueError("eagle_config.use_aux_hidden_state false (a head without fc, "
                             "drafting from the last hidden state only) is not supported")
    if d.get("norm_before_fc"):
        raise ValueError("norm_before_fc=True (an RMSNorm over fc's input, as gpt-oss heads "
                         "have) is not supported")
    norm_before_residual = d.get("norm_before_residual", False)
    if not isinstance(norm_before_residual, bool):
        raise ValueError(f"norm_before_residual must be true or false, got "
                         f"{norm_before_residual!r}")

    model_type = layer_dict.get("model_type") or "llama"
    if model_type != "llama":
        raise ValueError(f"{where}model_type {model_type!r}: only heads with a Llama decoder "
                         "layer (model_type 'llama') are supported")
    layers = layer_dict.get("num_hidden_layers")
    if layers != 1:
        raise ValueError(f"{where}num_hidden_layers is {layers!r}; only one-layer EAGLE-3 heads "
                         "are supported")
    # The published heads' lm_head is their own (draft vocabulary rows); vLLM reads it whatever
    # tie_word_embeddings says, and so does this loader.
    hf = dict(layer_dict, model_type="llama", tie_word_embeddings=False)
    try:
        layer = ModelConfig.from_hf_dict(hf)
    except (TypeError, ValueError, OverflowError) as e:
        raise ValueError(f"the head's layer config ({where or 'config.json'}): {e}") from None
    if layer.qkv_bias or layer.o_bias:
        raise ValueError(f"{where}attention_bias=True heads are not supported")
    if layer.vocab_size != target.vocab_size:
        raise ValueError(f"{where}vocab_size is {layer.vocab_size}, but the target's vocabulary "
                         f"has {target.vocab_size} tokens")

    ht = d.get("target_hidden_size")
    ht = layer.hidden_size if ht is None else _positive_int(ht, "target_hidden_size")
    if ht != target.hidden_size:
        raise ValueError(f"fc.weight takes {3 * ht} inputs = 3 x hidden {ht}, but the target's "
                         f"hidden_size is {target.hidden_size}")
    vd = d.get("draft_vocab_size")
    vd = layer.vocab_size if vd is None else _positive_int(vd, "draft_vocab_size")
    if vd > layer.vocab_size:
        raise ValueError(f"draft_vocab_size {vd} is larger than the target's vocabulary of "
                         f"{layer.vocab_size}")
    aux = _aux_layers(d, nested, target.num_layers)
    return EagleConfig(layer=layer, draft_vocab_size=vd, target_hidden_size=ht, aux_layers=aux,
                       own_embed=False, norm_before_residual=norm_before_residual,
                       layout=layout)


def _config_dict(ecfg: EagleConfig, layout: str, dtype_name: str) -> dict[str, Any]:
    """config.json of ``ecfg`` in ``layout``."""
    layer = ecfg.layer.to_hf_dict()
    layer.update(num_hidden_layers=1, tie_word_embeddings=False, torch_dtype=dtype_name)
    aux = [int(i) for i in ecfg.aux_layers]
    if layout == "eagle3":
        out = dict(layer, architectures=[EAGLE3_ARCHITECTURE])
        out.update(
            draft_vocab_size=ecfg.draft_vocab_size,
            target_hidden_size=ecfg.target_hidden_size,
            norm_before_residual=ecfg.norm_before_residual,
            # the same layers in both numberings: vLLM reads the top-level ids as layer inputs,
            # SGLang and SpecForge read the nested ones as layer outputs
            eagle_aux_hidden_state_layer_ids=aux,
            eagle_config={"eagle_aux_hidden_state_layer_ids": [i - 1 for i in aux],
                          "use_aux_hidden_state": True},
        )
        return out
    layer.pop("architectures", None)
    ht = ecfg.target_hidden_size
    return {
        "architectures": [SPECULATORS_ARCHITECTURE],
        "speculators_model_type": "eagle3",
        "transformer_layer_config": layer,
        "draft_vocab_size": ecfg.draft_vocab_size,
        "norm_before_residual": ecfg.norm_before_residual,
        "target_hidden_size": None if ht == ecfg.layer.hidden_size else ht,
        "eagle_aux_hidden_state_layer_ids": aux,
        # vLLM requires the proposal methods and the verifier's entry (its speculators reader);
        # speculative_tokens becomes vLLM's default number of drafted tokens
        "speculators_config": {
            "algorithm": "eagle3",
            "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3,
                                  "accept_tolerance": 0.0, "verifier_accept_k": 1}],
            "verifier": {"architectures": [], "name_or_path": None},
        },
        "torch_dtype": dtype_name,
    }


def _read_config(path: str) -> Any:
    file = os.path.join(path, loader.CONFIG_FILE)
    if not os.path.isfile(file):
        raise ValueError(f"EAGLE head {path}: no {loader.CONFIG_FILE}")
    try:
        with open(file, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"EAGLE head {path}: {loader.CONFIG_FILE} is not valid JSON: {e}"
                         ) from None


def is_eagle_checkpoint(path) -> bool:
    """Whether the directory's config.json says EAGLE-3 head (either layout). Never raises:
    anything unreadable is not one."""
    try:
        with open(os.path.join(os.fspath(path), loader.CONFIG_FILE), encoding="utf-8") as f:
            d = json.load(f)
    except (OSError, TypeError, ValueError):  # ValueError: bad JSON or bad UTF-8
        return False
    if not isinstance(d, dict):
        return False
    if d.get("speculators_model_type") == "eagle3":
        return True
    archs = d.get("architectures")
    return isinstance(archs, list) and any(
        isinstance(a, str) and "eagle3" in a.lower() for a in archs)


# ----------------------------------------------------------------------------- tensors
def _hf_shapes(ecfg: EagleConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of the head, canonical names (``layers.0.``), torch Linear [out, in]."""
    lc = ecfg.layer
    h, i, q, kv = lc.hidden_size, lc.intermediate_size, lc.q_size, lc.kv_size
    p = _CANON_PREFIX
    shapes = {
        "fc.weight": (h, 3 * ecfg.target_hidden_size),
        p + "hidden_norm.weight": (h,),
        p + "input_layernorm.weight": (h,),
        p + "self_attn.q_proj.weight": (q, 2 * h),
        p + "self_attn.k_proj.weight": (kv, 2 * h),
        p + "self_attn.v_proj.weight": (kv, 2 * h),
        p + "self_attn.o_proj.weight": (h, q),
        p + "post_attention_layernorm.weight": (h,),
        p + "mlp.gate_proj.weight": (i, h),
        p + "mlp.up_proj.weight": (i, h),
        p + "mlp.down_proj.weight": (h, i),
        "norm.weight": (h,),
        "lm_head.weight": (ecfg.draft_vocab_size, h),
        "d2t": (ecfg.draft_vocab_size,),
    }
    if ecfg.own_embed:
        shapes["embed_tokens.weight"] = (lc.vocab_size, h)
    return shapes


def _runtime_shapes(ecfg: EagleConfig) -> dict[str, Any]:
    lc = ecfg.layer
    h, i, q, kv = lc.hidden_size, lc.intermediate_size, lc.q_size, lc.kv_size
    shapes: dict[str, Any] = {
        "fc": (3 * ecfg.target_hidden_size, h),
        "layer": {"hidden_norm": (h,), "attn_norm": (h,), "wqkv": (2 * h, q + 2 * kv),
                  "wo": (q, h), "mlp_norm": (h,), "w_gate_up": (h, 2 * i), "w_down": (i, h)},
        "final_norm": (h,),
        "lm_head": (h, ecfg.draft_vocab_size),
        "d2t": (ecfg.draft_vocab_size,),
    }
    if ecfg.own_embed:
        shapes["embed"] = (lc.vocab_size, h)
    return shapes


def _check_d2t(absolute: np.ndarray, vocab: int) -> None:
    """Every draft id lands in the target's vocabulary, no two on the same target id."""
    bad = np.flatnonzero((absolute < 0) | (absolute >= vocab))
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"d2t maps draft id {i} to target id {int(absolute[i])} (draft id + "
                         f"offset {int(absolute[i]) - i}), outside the target's vocabulary of "
                         f"{vocab} ({bad.size} draft ids do)")
    ids, counts = np.unique(absolute, return_counts=True)
    if ids.size != absolute.size:
        raise ValueError(f"d2t maps {int(counts.max())} draft ids to target id "
                         f"{int(ids[np.argmax(counts)])}; each draft id needs its own target id")


class _Source(loader._TensorSource):
    """The loader's safetensors reader (one file or an index's shards), with dtypes."""

    def dtype(self, name: str) -> str:
        return self._files[self._where[name]].get_slice(name).get_dtype()

    def raw(self, name: str) -> np.ndarray:
        try:
            return self._files[self._where[name]].get_tensor(name)
        except Exception as e:  # SafetensorError has no stable import path across versions
            raise ValueError(f"cannot read tensor {name!r}: {e}") from None


def _open_weights(path: str, stack: contextlib.ExitStack) -> _Source:
    if not any(os.path.isfile(os.path.join(path, f))
               for f in (loader.WEIGHTS_FILE, loader.INDEX_FILE)):
        pickles = [f for f in ("pytorch_model.bin", "pytorch_model.bin.index.json")
                   if os.path.isfile(os.path.join(path, f))]
        if pickles:
            raise ValueError(
                f"EAGLE head {path}: its weights are {pickles[0]}, a torch pickle; jspec reads "
                f"no torch pickles: convert it to {loader.WEIGHTS_FILE} (torch.load, then "
                "safetensors.torch.save_file)")
        raise ValueError(f"EAGLE head {path}: no weights: expected {loader.WEIGHTS_FILE} or "
                         f"{loader.INDEX_FILE}")
    try:
        return _Source(path, stack)
    except ValueError as e:
        raise ValueError(f"EAGLE head {path}: {e}") from None


def _canonical_names(source: _Source) -> dict[str, str]:
    """canonical name -> name in the file (``midlayer.`` is vLLM's ``layers.0.``, and both
    loaders take either spelling)."""
    names: dict[str, str] = {}
    for name in sorted(source.names()):
        prefix = _FILE_PREFIX["eagle3"]
        canon = _CANON_PREFIX + name[len(prefix):] if name.startswith(prefix) else name
        if canon in names:
            raise ValueError(f"it holds both {names[canon]!r} and {name!r}")
        names[canon] = name
    return names


def load_eagle(path: str | os.PathLike, target: ModelConfig, dtype=jnp.bfloat16
               ) -> tuple[EagleConfig, dict]:
    """Read an EAGLE-3 head directory (either layout) for ``target`` into (EagleConfig, runtime
    params): float params as jax arrays of ``dtype``, ``d2t`` int32 absolute target ids."""
    path = loader.require_directory(path, "EAGLE head directory")
    d = _read_config(path)
    try:
        ecfg = eagle_config_from_hf(d, target)
    except ValueError as e:
        raise ValueError(f"EAGLE head {path}: {e}") from None
    np_dtype = np.dtype(jnp.dtype(dtype))
    with contextlib.ExitStack() as stack:
        source = _open_weights(path, stack)
        try:
            params = _read_params(source, ecfg, target, np_dtype)
        except ValueError as e:
            raise ValueError(f"EAGLE head {path}: {e}") from None
    ecfg = dataclasses.replace(ecfg, own_embed="embed" in params)
    return ecfg, _to_jnp(params)


def _read_params(source: _Source, ecfg: EagleConfig, target: ModelConfig, np_dtype) -> dict:
    files = _canonical_names(source)
    own_embed = "embed_tokens.weight" in files
    h = ecfg.layer.hidden_size
    if not own_embed and h != target.hidden_size:
        raise ValueError(f"it has no embed_tokens.weight, and its hidden_size {h} is not the "
                         f"target's {target.hidden_size}, so the target's embedding cannot be "
                         "shared")
    ecfg = dataclasses.replace(ecfg, own_embed=own_embed)
    expected = _hf_shapes(ecfg)
    # no d2t: the draft vocabulary is the target's, in order (vLLM's and SGLang's reading)
    optional = {"d2t"} if ecfg.draft_vocab_size == ecfg.layer.vocab_size else set()
    missing = [n for n in expected if n not in files and n not in optional]
    if missing:
        names = ", ".join(_FILE_PREFIX[ecfg.layout] + n[len(_CANON_PREFIX):]
                          if n.startswith(_CANON_PREFIX) else n for n in missing)
        raise ValueError(f"missing tensors: {names}")
    unknown = [files[n] for n in files if n not in expected and n not in _IGNORED
               and not n.endswith(_IGNORED_SUFFIXES)]
    if unknown:
        shown = ", ".join(unknown[:8]) + (f" and {len(unknown) - 8} more" if len(unknown) > 8
                                          else "")
        raise ValueError(f"unexpected tensors {shown}: not part of a one-layer Llama EAGLE-3 "
                         "head (a bias, a second layer, an input norm); refusing rather than "
                         "computing without them")
    for name, shape in expected.items():  # every shape before reading anything
        if name not in files:
            continue
        file_name, found = files[name], tuple(source.shape(files[name]))
        kind = source.dtype(file_name)
        if name == "d2t":
            if kind not in _INT_DTYPES:
                raise ValueError(f"d2t has dtype {kind}; it holds integer offsets")
        elif kind not in _FLOAT_DTYPES:
            raise ValueError(f"tensor {file_name!r} has dtype {kind}; only float weights (F32, "
                             "F16, BF16) are supported, no quantized heads")
        if found == shape:
            continue
        if name == "fc.weight" and len(found) == 2 and found[1] != shape[1]:
            inputs = found[1]
            split = (f" = 3 x hidden {inputs // 3}" if inputs % 3 == 0 else "")
            raise ValueError(f"fc.weight takes {inputs} inputs{split}, but the target's "
                             f"hidden_size is {ecfg.target_hidden_size}")
        if name == "lm_head.weight" and len(found) == 2 and found[0] != shape[0]:
            raise ValueError(f"lm_head.weight has {found[0]} rows, but draft_vocab_size is "
                             f"{ecfg.draft_vocab_size}")
        if name == "d2t":
            raise ValueError(f"d2t has shape {list(found)}, but draft_vocab_size is "
                             f"{ecfg.draft_vocab_size} (one offset per draft id)")
        raise ValueError(f"tensor {file_name!r} has shape {list(found)}, expected "
                         f"{list(shape)} from config.json")

    vd = ecfg.draft_vocab_size
    if "d2t" in files:
        absolute = np.arange(vd, dtype=np.int64) + source.raw(files["d2t"]).astype(np.int64)
        _check_d2t(absolute, ecfg.layer.vocab_size)
    else:
        absolute = np.arange(vd, dtype=np.int64)

    def get(name: str) -> np.ndarray:
        return source.get(files[name], np_dtype)

    p = _CANON_PREFIX
    wqkv = np.concatenate([get(p + f"self_attn.{x}_proj.weight").T for x in "qkv"], axis=1)
    gate_up = np.concatenate([get(p + "mlp.gate_proj.weight").T,
                              get(p + "mlp.up_proj.weight").T], axis=1)
    params: dict[str, Any] = {
        "fc": get("fc.weight").T,
        "layer": {
            "hidden_norm": get(p + "hidden_norm.weight"),
            "attn_norm": get(p + "input_layernorm.weight"),
            "wqkv": wqkv,
            "wo": get(p + "self_attn.o_proj.weight").T,
            "mlp_norm": get(p + "post_attention_layernorm.weight"),
            "w_gate_up": gate_up,
            "w_down": get(p + "mlp.down_proj.weight").T,
        },
        "final_norm": get("norm.weight"),
        "lm_head": get("lm_head.weight").T,
        "d2t": absolute.astype(np.int32),
    }
    if own_embed:
        params["embed"] = get("embed_tokens.weight")
    return params


def _to_jnp(tree):
    if isinstance(tree, dict):
        return {k: _to_jnp(v) for k, v in tree.items()}
    return jnp.asarray(np.ascontiguousarray(tree))


# ----------------------------------------------------------------------------- writing
def _float_dtype_name(params: dict) -> str:
    """The params' one float dtype, by its config.json name."""
    leaves = [params["fc"], params["final_norm"], params["lm_head"], *params["layer"].values()]
    if "embed" in params:
        leaves.append(params["embed"])
    dtypes = {np.dtype(a.dtype) for a in leaves}
    if len(dtypes) != 1:
        raise ValueError(f"the head's float params must share one dtype, got "
                         f"{sorted(str(t) for t in dtypes)}")
    dt = dtypes.pop()
    for name, np_dt in loader._DTYPE_NAMES.items():
        if dt == np.dtype(np_dt):
            return name
    raise ValueError(f"cannot save params of dtype {dt}; supported: "
                     f"{', '.join(loader._DTYPE_NAMES)}")


def _check_params(ecfg: EagleConfig, params: Any) -> None:
    expected = _runtime_shapes(ecfg)
    if not isinstance(params, Mapping) or not isinstance(params.get("layer"), Mapping):
        raise ValueError("params must be a dict with a 'layer' dict (the runtime layout)")
    if ("embed" in params) != ecfg.own_embed:
        raise ValueError(f"own_embed is {ecfg.own_embed}, but params "
                         f"{'have' if 'embed' in params else 'have no'} 'embed'")
    for key, shape in expected.items():
        group = shape if isinstance(shape, dict) else {key: shape}
        where = params["layer"] if isinstance(shape, dict) else params
        for name, want in group.items():
            label = f"layer/{name}" if isinstance(shape, dict) else name
            if name not in where:
                raise ValueError(f"params have no {label!r}")
            found = tuple(getattr(where[name], "shape", ()))
            if found != want:
                raise ValueError(f"params {label!r} has shape {list(found)}, expected "
                                 f"{list(want)} from the EagleConfig")
    if not np.issubdtype(np.dtype(params["d2t"].dtype), np.integer):
        raise ValueError(f"params 'd2t' must hold integer target ids, got dtype "
                         f"{params['d2t'].dtype}")


def _params_to_hf(ecfg: EagleConfig, params: dict, layout: str) -> dict[str, np.ndarray]:
    """Runtime params -> the published tensors: names of ``layout``, [out, in], d2t as int64
    offsets, t2d as a bool mask over the target's vocabulary."""
    lc = ecfg.layer
    q, kv, inter = lc.q_size, lc.kv_size, lc.intermediate_size
    c = np.ascontiguousarray
    lp = {k: np.asarray(v) for k, v in params["layer"].items()}
    p = _FILE_PREFIX[layout]
    absolute = np.asarray(params["d2t"]).astype(np.int64)
    t2d = np.zeros(lc.vocab_size, dtype=bool)
    t2d[absolute] = True
    out = {"fc.weight": c(np.asarray(params["fc"]).T)}
    if ecfg.own_embed:
        out["embed_tokens.weight"] = c(np.asarray(params["embed"]))
    out.update({
        p + "hidden_norm.weight": c(lp["hidden_norm"]),
        p + "input_layernorm.weight": c(lp["attn_norm"]),
        p + "self_attn.q_proj.weight": c(lp["wqkv"][:, :q].T),
        p + "self_attn.k_proj.weight": c(lp["wqkv"][:, q:q + kv].T),
        p + "self_attn.v_proj.weight": c(lp["wqkv"][:, q + kv:].T),
        p + "self_attn.o_proj.weight": c(lp["wo"].T),
        p + "post_attention_layernorm.weight": c(lp["mlp_norm"]),
        p + "mlp.gate_proj.weight": c(lp["w_gate_up"][:, :inter].T),
        p + "mlp.up_proj.weight": c(lp["w_gate_up"][:, inter:].T),
        p + "mlp.down_proj.weight": c(lp["w_down"].T),
        "norm.weight": c(np.asarray(params["final_norm"])),
        "lm_head.weight": c(np.asarray(params["lm_head"]).T),
        "d2t": absolute - np.arange(ecfg.draft_vocab_size, dtype=np.int64),
        "t2d": t2d,
    })
    return out


def save_eagle(path: str | os.PathLike, ecfg: EagleConfig, params: dict,
               layout: str = "eagle3") -> None:
    """Write the head in a published layout: config.json and model.safetensors (tensors in the
    params' float dtype). ``layout`` may differ from ``ecfg.layout`` (a conversion)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout {layout!r} is not supported; supported: {', '.join(LAYOUTS)}")
    _check_params(ecfg, params)
    _check_d2t(np.asarray(params["d2t"]).astype(np.int64), ecfg.layer.vocab_size)
    dtype_name = _float_dtype_name(params)
    tensors = _params_to_hf(ecfg, params, layout)
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    loader._write_json(os.path.join(path, loader.CONFIG_FILE),
                       _config_dict(ecfg, layout, dtype_name))
    loader._remove_stale_weights(path)
    loader._save_safetensors(tensors, os.path.join(path, loader.WEIGHTS_FILE))


# ----------------------------------------------------------------------------- tiny heads
def _random_params(ecfg: EagleConfig, seed: int, dtype, std: float) -> dict:
    """Random runtime params for ``ecfg``: normal(0, std) weights, norms near 1, and a d2t
    onto a random sorted subset of the target's vocabulary (all of it, in order, when the
    draft vocabulary is the target's)."""
    rng = np.random.default_rng(seed)
    shapes = _runtime_shapes(ecfg)

    def make(name: str, shape: tuple) -> jnp.ndarray:
        if name.endswith("norm"):
            a = 1.0 + 0.1 * rng.standard_normal(shape)
        else:
            a = std * rng.standard_normal(shape)
        return jnp.asarray(a.astype(np.float32), dtype=dtype)

    params: dict[str, Any] = {k: make(k, s) for k, s in shapes.items()
                              if k not in ("layer", "d2t")}
    params["layer"] = {k: make(k, s) for k, s in shapes["layer"].items()}
    v, vd = ecfg.layer.vocab_size, ecfg.draft_vocab_size
    ids = np.arange(v) if vd == v else np.sort(rng.choice(v, size=vd, replace=False))
    params["d2t"] = jnp.asarray(ids, dtype=jnp.int32)
    return params


def layer_config_for(target: ModelConfig) -> ModelConfig:
    """A head's decoder layer for ``target`` as EAGLE-3 builds it: a Llama layer of the
    target's width, heads and MLP size (no biases), over the target's vocabulary."""
    return ModelConfig(
        model_type="llama", vocab_size=target.vocab_size, hidden_size=target.hidden_size,
        num_layers=1, num_heads=target.num_heads, num_kv_heads=target.num_kv_heads,
        head_dim=target.head_dim, intermediate_size=target.intermediate_size,
        rms_norm_eps=target.rms_norm_eps, rope_theta=target.rope_theta,
        rope_scaling=target.rope_scaling,
        max_position_embeddings=target.max_position_embeddings,
        bos_token_id=target.bos_token_id, eos_token_ids=target.eos_token_ids)


def write_tiny_eagle(path: str | os.PathLike, target: ModelConfig, *, seed: int = 0,
                     draft_vocab_size: int | None = None, layout: str = "eagle3",
                     own_embed: bool = False, aux_layers: tuple[int, ...] | None = None,
                     dtype="float32") -> EagleConfig:
    """A random EAGLE-3 head for ``target`` written to ``path`` in the published ``layout``;
    returns its EagleConfig (what ``load_eagle`` reads back). The head's layer has the target's
    width, heads and MLP size; ``draft_vocab_size`` below the target's vocabulary maps a random
    sorted subset of it (d2t); ``aux_layers`` defaults to ``default_aux_layers``."""
    from jspec.models.tiny import TINY_INIT_STD

    if layout not in LAYOUTS:
        raise ValueError(f"layout {layout!r} is not supported; supported: {', '.join(LAYOUTS)}")
    try:
        np_dtype = np.dtype(jnp.dtype(dtype))
    except TypeError:
        raise ValueError(f"dtype {dtype!r} is not a dtype") from None
    names = {np.dtype(t): n for n, t in loader._DTYPE_NAMES.items()}
    if np_dtype not in names:
        raise ValueError(f"dtype {dtype!r} is not supported; supported: "
                         f"{', '.join(loader._DTYPE_NAMES)}")
    vocab = target.vocab_size
    vd = vocab if draft_vocab_size is None else _positive_int(draft_vocab_size,
                                                                "draft_vocab_size")
    if vd > vocab:
        raise ValueError(f"draft_vocab_size {vd} is larger than the target's vocabulary of "
                         f"{vocab}")
    layer = layer_config_for(target)
    aux = (default_aux_layers(target.num_layers) if aux_layers is None
           else tuple(_int_list(aux_layers, "aux_layers")))
    draft = EagleConfig(layer=layer, draft_vocab_size=vd, target_hidden_size=target.hidden_size,
                        aux_layers=aux, own_embed=own_embed, norm_before_residual=False,
                        layout=layout)
    # what a reader makes of the config: checks the aux layers before anything is written
    ecfg = dataclasses.replace(
        eagle_config_from_hf(_config_dict(draft, layout, names[np_dtype]), target),
        own_embed=own_embed)
    save_eagle(path, ecfg, _random_params(ecfg, seed, np_dtype, TINY_INIT_STD), layout)
    return ecfg
