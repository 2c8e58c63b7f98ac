"""Hugging Face checkpoint I/O: ``config.json`` + safetensors <-> (ModelConfig, runtime params).

Only the safetensors format is read and written, through the ``safetensors`` library with numpy
(no torch). bf16 tensors are numpy arrays of ``ml_dtypes.bfloat16`` (the dtype JAX itself uses),
so a bf16 checkpoint is read and written without a float32 detour.

HF stores every projection as a torch Linear weight ``[out, in]``; the runtime layout
(models/params.py) is ``[in, out]``, with q/k/v fused into ``wqkv``, gate/up fused into
``w_gate_up`` and all layers stacked on a leading axis. The conversion is exact (transposes and
concatenations only), so a checkpoint written here loads in transformers unchanged and a
round trip is bit-identical.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import sys
from typing import Any

import jax.numpy as jnp
import ml_dtypes
import numpy as np

from jspec.models.config import ModelConfig

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
GENERATION_CONFIG_FILE = "generation_config.json"
# Files whose presence means "a tokenizer lives here" for AutoTokenizer.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")

_DTYPE_NAMES = {"bfloat16": ml_dtypes.bfloat16, "float32": np.float32, "float16": np.float16}


# ----------------------------------------------------------------------------- name mapping
def _layer_prefix(i: int) -> str:
    return f"model.layers.{i}."


def expected_hf_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a checkpoint of this config must hold, in HF naming and ``[out, in]`` layout.

    A tied model has no ``lm_head.weight`` here (a redundant one in a file is ignored)."""
    h, i = cfg.hidden_size, cfg.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, h)}
    for layer in range(cfg.num_layers):
        p = _layer_prefix(layer)
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "self_attn.q_proj.weight"] = (cfg.q_size, h)
        shapes[p + "self_attn.k_proj.weight"] = (cfg.kv_size, h)
        shapes[p + "self_attn.v_proj.weight"] = (cfg.kv_size, h)
        if cfg.qkv_bias:
            shapes[p + "self_attn.q_proj.bias"] = (cfg.q_size,)
            shapes[p + "self_attn.k_proj.bias"] = (cfg.kv_size,)
            shapes[p + "self_attn.v_proj.bias"] = (cfg.kv_size,)
        shapes[p + "self_attn.o_proj.weight"] = (h, cfg.q_size)
        if cfg.o_bias:
            shapes[p + "self_attn.o_proj.bias"] = (h,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        shapes[p + "mlp.gate_proj.weight"] = (i, h)
        shapes[p + "mlp.up_proj.weight"] = (i, h)
        shapes[p + "mlp.down_proj.weight"] = (h, i)
    shapes["model.norm.weight"] = (h,)
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    return shapes


def params_to_hf(cfg: ModelConfig, params: dict) -> dict[str, np.ndarray]:
    """Runtime pytree -> HF-named numpy tensors (contiguous, in the params' dtype)."""
    layers = {k: np.asarray(v) for k, v in params["layers"].items()}
    q, kv = cfg.q_size, cfg.kv_size
    c = np.ascontiguousarray
    out: dict[str, np.ndarray] = {"model.embed_tokens.weight": c(np.asarray(params["embed"]))}
    for layer in range(cfg.num_layers):
        p = _layer_prefix(layer)
        wqkv = layers["wqkv"][layer]
        out[p + "input_layernorm.weight"] = c(layers["attn_norm"][layer])
        out[p + "self_attn.q_proj.weight"] = c(wqkv[:, :q].T)
        out[p + "self_attn.k_proj.weight"] = c(wqkv[:, q:q + kv].T)
        out[p + "self_attn.v_proj.weight"] = c(wqkv[:, q + kv:].T)
        if cfg.qkv_bias:
            bqkv = layers["bqkv"][layer]
            out[p + "self_attn.q_proj.bias"] = c(bqkv[:q])
            out[p + "self_attn.k_proj.bias"] = c(bqkv[q:q + kv])
            out[p + "self_attn.v_proj.bias"] = c(bqkv[q + kv:])
        out[p + "self_attn.o_proj.weight"] = c(layers["wo"][layer].T)
        if cfg.o_bias:
            out[p + "self_attn.o_proj.bias"] = c(layers["bo"][layer])
        out[p + "post_attention_layernorm.weight"] = c(layers["mlp_norm"][layer])
        gate_up = layers["w_gate_up"][layer]
        out[p + "mlp.gate_proj.weight"] = c(gate_up[:, :cfg.intermediate_size].T)
        out[p + "mlp.up_proj.weight"] = c(gate_up[:, cfg.intermediate_size:].T)
        out[p + "mlp.down_proj.weight"] = c(layers["w_down"][layer].T)
    out["model.norm.weight"] = c(np.asarray(params["final_norm"]))
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = c(np.asarray(params["lm_head"]).T)
    return out


# ----------------------------------------------------------------------------- reading
class _TensorSource:
    """Name -> tensor over one file or the shards of an index, with shapes checked up front."""

    def __init__(self, path: str, stack: contextlib.ExitStack):
        from safetensors import safe_open

        self._files: dict[str, Any] = {}  # file name -> open safe_open handle
        self._where: dict[str, str] = {}  # tensor name -> file name
        single = os.path.join(path, WEIGHTS_FILE)
        index = os.path.join(path, INDEX_FILE)
        if os.path.isfile(single):
            shard_names = [WEIGHTS_FILE]
        elif os.path.isfile(index):
            weight_map = _read_index(index)
            shard_names = sorted(set(weight_map.values()))
            for shard in shard_names:
                if not os.path.isfile(os.path.join(path, shard)):
                    raise ValueError(
                        f"{INDEX_FILE} in {path!r} refers to shard {shard!r}, which does not exist"
                    )
        else:
            others = [f for f in ("pytorch_model.bin", "model.pt") if
                      os.path.exists(os.path.join(path, f))]
            hint = f" (found {others[0]}; only safetensors is supported)" if others else ""
            raise ValueError(
                f"no weights in {path!r}: expected {WEIGHTS_FILE} or {INDEX_FILE}{hint}"
            )
        for shard in shard_names:
            file = os.path.join(path, shard)
            try:
                handle = stack.enter_context(safe_open(file, framework="np"))
                names = list(handle.keys())
            except Exception as e:  # SafetensorError has no stable import path across versions
                raise ValueError(f"cannot read safetensors file {file!r}: {e}") from None
            self._files[shard] = handle
            for name in names:
                self._where[name] = shard

    def names(self) -> set[str]:
        return set(self._where)

    def shape(self, name: str) -> tuple[int, ...]:
        handle = self._files[self._where[name]]
        return tuple(handle.get_slice(name).get_shape())

    def get(self, name: str, np_dtype) -> np.ndarray:
        shard = self._where[name]
        try:
            array = self._files[shard].get_tensor(name)
        except Exception as e:
            raise ValueError(f"cannot read tensor {name!r} from {shard!r}: {e}") from None
        return array.astype(np_dtype, copy=False)


def _read_index(index_file: str) -> dict[str, str]:
    try:
        with open(index_file, encoding="utf-8") as f:
            weight_map = json.load(f)["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise ValueError(f"{index_file!r} is not a valid safetensors index: {e!r}") from None
    if not isinstance(weight_map, dict):
        raise ValueError(f"{index_file!r}: weight_map must be an object of name -> shard file")
    return weight_map


def require_directory(path: str | os.PathLike, what: str) -> str:
    """``path`` as a string if it is a directory; else a ValueError that says what was expected
    and, for a file (a checkpoint's config.json, say), which directory to pass instead."""
    path = os.fspath(path)
    if os.path.isdir(path):
        return path
    if os.path.exists(path):
        parent = os.path.dirname(os.path.abspath(path))
        raise ValueError(f"expected a {what}, but {path!r} is a file; pass its directory "
                         f"{parent!r}")
    raise ValueError(f"{what} {path!r} does not exist")


def load_checkpoint(path: str | os.PathLike, dtype=jnp.bfloat16, on_host: bool = False
                    ) -> tuple[ModelConfig, dict]:
    """Read an HF checkpoint directory into (config, runtime params as jnp arrays of ``dtype``).
    ``on_host``: numpy arrays instead, for a caller that places them itself (tensor parallelism
    sends each device its shard, models/sharding.py, without the whole model on one device).

    Tensors not used by the architecture (e.g. ``rotary_emb.inv_freq``) are ignored; a redundant
    ``lm_head.weight`` in a tied checkpoint is ignored too (the head is the embedding, as in HF).
    """
    path = require_directory(path, "checkpoint directory")
    config_file = os.path.join(path, CONFIG_FILE)
    if not os.path.isfile(config_file):
        raise ValueError(f"no {CONFIG_FILE} in checkpoint directory {path!r}")
    cfg = ModelConfig.from_json_file(config_file)
    np_dtype = np.dtype(jnp.dtype(dtype))

    with contextlib.ExitStack() as stack:
        source = _TensorSource(path, stack)
        expected = expected_hf_shapes(cfg)
        present = source.names()
        for name, shape in expected.items():  # fail before reading anything big
            if name not in present:
                raise ValueError(f"checkpoint {path!r} is missing tensor {name!r}")
            found = source.shape(name)
            if found != shape:
                raise ValueError(
                    f"tensor {name!r} in {path!r} has shape {list(found)}, expected {list(shape)} "
                    f"from {CONFIG_FILE}"
                )
        params = _assemble(cfg, lambda name: source.get(name, np_dtype), np_dtype)
    if on_host:
        return cfg, params
    return cfg, {k: _to_jnp(v) for k, v in params.items()}


def _to_jnp(tree):
    if isinstance(tree, dict):
        return {k: _to_jnp(v) for k, v in tree.items()}
    return jnp.asarray(tree)


def _assemble(cfg: ModelConfig, get, np_dtype) -> dict:
    """Fill preallocated stacked arrays layer by layer (one copy per tensor, no big concats)."""
    L, h, inter = cfg.num_layers, cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.q_size, cfg.kv_size
    qkv = q + 2 * kv
    layers = {
        "attn_norm": np.empty((L, h), np_dtype),
        "wqkv": np.empty((L, h, qkv), np_dtype),
        "wo": np.empty((L, q, h), np_dtype),
        "mlp_norm": np.empty((L, h), np_dtype),
        "w_gate_up": np.empty((L, h, 2 * inter), np_dtype),
        "w_down": np.empty((L, inter, h), np_dtype),
    }
    if cfg.qkv_bias:
        layers["bqkv"] = np.empty((L, qkv), np_dtype)
    if cfg.o_bias:
        layers["bo"] = np.empty((L, h), np_dtype)
    for i in range(L):
        p = _layer_prefix(i)
        layers["attn_norm"][i] = get(p + "input_layernorm.weight")
        layers["wqkv"][i, :, :q] = get(p + "self_attn.q_proj.weight").T
        layers["wqkv"][i, :, q:q + kv] = get(p + "self_attn.k_proj.weight").T
        layers["wqkv"][i, :, q + kv:] = get(p + "self_attn.v_proj.weight").T
        if cfg.qkv_bias:
            layers["bqkv"][i, :q] = get(p + "self_attn.q_proj.bias")
            layers["bqkv"][i, q:q + kv] = get(p + "self_attn.k_proj.bias")
            layers["bqkv"][i, q + kv:] = get(p + "self_attn.v_proj.bias")
        layers["wo"][i] = get(p + "self_attn.o_proj.weight").T
        if cfg.o_bias:
            layers["bo"][i] = get(p + "self_attn.o_proj.bias")
        layers["mlp_norm"][i] = get(p + "post_attention_layernorm.weight")
        layers["w_gate_up"][i, :, :inter] = get(p + "mlp.gate_proj.weight").T
        layers["w_gate_up"][i, :, inter:] = get(p + "mlp.up_proj.weight").T
        layers["w_down"][i] = get(p + "mlp.down_proj.weight").T
    embed = get("model.embed_tokens.weight")
    # The head is kept [hidden, vocab] even when tied (see models/params.py for why).
    head_source = embed if cfg.tie_word_embeddings else get("lm_head.weight")
    return {
        "embed": embed,
        "layers": layers,
        "final_norm": get("model.norm.weight"),
        "lm_head": np.ascontiguousarray(head_source.T),
    }


# ----------------------------------------------------------------------------- writing
def _dtype_name(params: dict) -> str:
    dt = np.dtype(params["embed"].dtype)
    for name, np_dt in _DTYPE_NAMES.items():
        if dt == np.dtype(np_dt):
            return name
    raise ValueError(f"cannot save params of dtype {dt}; supported: {', '.join(_DTYPE_NAMES)}")


def _save_safetensors(tensors: dict[str, np.ndarray], file: str) -> None:
    # "format": "pt" is what transformers expects in the header of a safetensors checkpoint.
    metadata = {"format": "pt"}
    try:
        from safetensors.numpy import save_file

        save_file(tensors, file, metadata=metadata)
    except (TypeError, ValueError, KeyError):
        # Older safetensors cannot write ml_dtypes.bfloat16 from numpy; its flax writer can.
        from safetensors.flax import save_file as save_flax

        save_flax({k: jnp.asarray(v) for k, v in tensors.items()}, file, metadata=metadata)


def _shard(tensors: dict[str, np.ndarray], max_bytes: int) -> list[dict[str, np.ndarray]]:
    """Greedy in-order packing; a tensor larger than the limit gets a shard of its own."""
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name, array in tensors.items():
        if shards[-1] and size + array.nbytes > max_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = array
        size += array.nbytes
    return shards


def _remove_stale_weights(path: str) -> None:
    """A stale single file or index next to new weights would make the loader pick the wrong one."""
    stale = [os.path.join(path, WEIGHTS_FILE), os.path.join(path, INDEX_FILE)]
    stale += glob.glob(os.path.join(path, "model-*-of-*.safetensors"))
    for file in stale:
        if os.path.isfile(file):
            os.remove(file)


def save_checkpoint(
    path: str | os.PathLike,
    cfg: ModelConfig,
    params: dict,
    tokenizer=None,
    max_shard_bytes: int | None = None,
) -> str:
    """Write an HF checkpoint directory (config.json, generation_config.json, safetensors weights
    in the params' dtype, optionally sharded, and the tokenizer if given). Returns the path."""
    path = os.fspath(path)
    if max_shard_bytes is not None and max_shard_bytes < 1:
        raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    os.makedirs(path, exist_ok=True)
    dtype_name = _dtype_name(params)
    tensors = params_to_hf(cfg, params)

    config = cfg.to_hf_dict()
    config["torch_dtype"] = dtype_name
    _write_json(os.path.join(path, CONFIG_FILE), config)
    gen = {"bos_token_id": cfg.bos_token_id}
    if cfg.eos_token_ids:
        gen["eos_token_id"] = (list(cfg.eos_token_ids) if len(cfg.eos_token_ids) > 1
                               else cfg.eos_token_ids[0])
    _write_json(os.path.join(path, GENERATION_CONFIG_FILE), gen)

    _remove_stale_weights(path)
    if max_shard_bytes is None:
        _save_safetensors(tensors, os.path.join(path, WEIGHTS_FILE))
    else:
        shards = _shard(tensors, max_shard_bytes)
        weight_map = {}
        for n, shard in enumerate(shards, start=1):
            name = f"model-{n:05d}-of-{len(shards):05d}.safetensors"
            _save_safetensors(shard, os.path.join(path, name))
            weight_map.update({tensor: name for tensor in shard})
        total = sum(a.nbytes for a in tensors.values())
        _write_json(os.path.join(path, INDEX_FILE),
                    {"metadata": {"total_size": total}, "weight_map": weight_map})
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
    return path


def _write_json(file: str, data: dict) -> None:
    with open(file, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2, sort_keys=True)
        f.write("\n")


# ----------------------------------------------------------------------------- tokenizer
def has_tokenizer(path: str | os.PathLike) -> bool:
    """Whether the directory ``path`` holds tokenizer files."""
    return any(os.path.isfile(os.path.join(path, f)) for f in _TOKENIZER_FILES)


def load_tokenizer(path: str | os.PathLike):
    """``AutoTokenizer.from_pretrained(path)`` (offline), with a clear error when there is none."""
    path = require_directory(path, "tokenizer directory")
    if not has_tokenizer(path):
        raise ValueError(
            f"no tokenizer in {path!r}: expected one of {', '.join(_TOKENIZER_FILES)}"
        )
    AutoTokenizer = import_transformers().AutoTokenizer
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, TypeError, KeyError) as e:
        raise ValueError(f"cannot load the tokenizer in {path!r}: {e}") from None
    # The engine checks prompt lengths against max_model_len with its own error; the
    # tokenizer's limit would only add a warning before it ("sequence length is longer than the
    # specified maximum"). transformers' own value for "no limit":
    tokenizer.model_max_length = int(1e30)
    return tokenizer


def import_transformers():
    """``transformers``, imported without its "PyTorch was not found" notice (jspec uses it for
    tokenizers only, which need no torch). The notice is logged once, at import; the library's
    log level is put back right after, so later warnings of the user's own transformers code
    still show."""
    if "transformers" in sys.modules:
        return sys.modules["transformers"]
    before = os.environ.get("TRANSFORMERS_VERBOSITY")
    os.environ["TRANSFORMERS_VERBOSITY"] = "error"
    try:
        import transformers
    finally:
        if before is None:
            del os.environ["TRANSFORMERS_VERBOSITY"]
        else:
            os.environ["TRANSFORMERS_VERBOSITY"] = before
    log = transformers.utils.logging
    log.set_verbosity(log.log_levels.get((before or "warning").lower(), log.WARNING))
    return transformers


def apply_chat_template(tokenizer, messages: list[dict[str, str]]) -> list[int]:
    """Token ids of ``messages`` rendered with the tokenizer's chat template, ending with the
    assistant generation prompt.

    The template is rendered to text and then encoded without extra special tokens: templates
    spell out their own control tokens (a BOS included), and transformers versions disagree on
    what ``apply_chat_template(tokenize=True)`` returns.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            "the tokenizer has no chat template; pass a plain prompt instead, or use a "
            "tokenizer whose tokenizer_config.json (or chat_template.jinja) defines one"
        )
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return list(tokenizer.encode(text, add_special_tokens=False))
