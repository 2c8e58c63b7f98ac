"""Model configuration: one frozen dataclass built from a Hugging Face ``config.json``.

Only decoder-only Llama-family architectures are supported (llama, qwen2, mistral). Anything we
cannot compute exactly like the reference implementation is refused here, at the boundary, with
an error naming the option and what is supported, rather than silently computing something else.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Mapping

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "mistral")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
SUPPORTED_ACTIVATIONS = ("silu",)
WEIGHT_LAYOUTS = ("in_out", "out_in")
LAYER_BUFFERS = ("stacked", "per_layer")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    # Rope scaling as a sorted tuple of (key, value) pairs so the config stays hashable (it is a
    # static argument of every jitted forward). None means plain RoPE.
    rope_scaling: tuple[tuple[str, Any], ...] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2 (and Llama's attention_bias) put a bias on q, k, v
    o_bias: bool = False  # Llama's attention_bias also biases the output projection
    sliding_window: int | None = None  # Mistral: keys older than this many positions are masked
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # how the projection weights are stored in the params (models/params.py): "in_out" (x @ W)
    # or "out_in" (x @ W.T, the checkpoint's layout); a property of the runtime pytree, not of
    # the architecture, chosen per machine by jspec/weight_layout.py
    weight_layout: str = "in_out"
    # how the layers' weights are held (models/params.py): "stacked" (one [L, ...] array per
    # weight, the forward a scan) or "per_layer" (a buffer per layer, the forward unrolled);
    # a property of the runtime pytree, chosen per machine by jspec/weight_layout.py
    layer_buffers: str = "stacked"
    # the fewest rows a projection multiplies: a product over fewer rows (one decoding sequence)
    # is padded to this many; 2 where a CPU multiplies two rows faster than one (its one-row
    # path widens bf16 weights first). Chosen per machine by jspec/weight_layout.py
    min_dot_rows: int = 1

    def __post_init__(self):
        if self.weight_layout not in WEIGHT_LAYOUTS:
            raise ValueError(f"weight_layout must be one of {WEIGHT_LAYOUTS}, got "
                             f"{self.weight_layout!r}")
        if self.layer_buffers not in LAYER_BUFFERS:
            raise ValueError(f"layer_buffers must be one of {LAYER_BUFFERS}, got "
                             f"{self.layer_buffers!r}")
        if not isinstance(self.min_dot_rows, int) or self.min_dot_rows < 1:
            raise ValueError(f"min_dot_rows must be a positive integer, got "
                             f"{self.min_dot_rows!r}")
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model_type {self.model_type!r} is not supported; supported: "
                f"{', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                     "head_dim", "intermediate_size", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1 or None, got {self.sliding_window}")
        if self.rope_scaling is not None:
            rope_type = self.rope_scaling_dict.get("rope_type", "default")
            if rope_type not in SUPPORTED_ROPE_TYPES:
                raise ValueError(
                    f"rope scaling type {rope_type!r} is not supported; supported: "
                    f"{', '.join(SUPPORTED_ROPE_TYPES)}"
                )

    @property
    def rope_scaling_dict(self) -> dict[str, Any]:
        return dict(self.rope_scaling or ())

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def num_params(self) -> int:
        """Parameter count as in the HF checkpoint (a tied head counted once)."""
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        attn = h * (self.q_size + 2 * self.kv_size) + self.q_size * h
        if self.qkv_bias:
            attn += self.q_size + 2 * self.kv_size
        if self.o_bias:
            attn += h
        layer = attn + 3 * h * i + 2 * h
        head = 0 if self.tie_word_embeddings else h * v
        return v * h + self.num_layers * layer + h + head

    # ------------------------------------------------------------------ HF conversion
    @classmethod
    def from_hf_dict(cls, cfg: Mapping[str, Any]) -> "ModelConfig":
        model_type = cfg.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model_type {model_type!r} is not supported; supported: "
                f"{', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        act = cfg.get("hidden_act", "silu")
        if act not in SUPPORTED_ACTIVATIONS:
            raise ValueError(f"hidden_act {act!r} is not supported; supported: silu")
        if cfg.get("mlp_bias", False):
            raise ValueError("mlp_bias=True is not supported; supported: mlp_bias=False")
        if cfg.get("pretraining_tp", 1) not in (1, None):
            raise ValueError("pretraining_tp > 1 is not supported; supported: 1")
        try:
            hidden = int(cfg["hidden_size"])
            heads = int(cfg["num_attention_heads"])
            layers = int(cfg["num_hidden_layers"])
            vocab = int(cfg["vocab_size"])
            inter = int(cfg["intermediate_size"])
        except KeyError as e:
            raise ValueError(f"config.json is missing required field {e.args[0]!r}") from None
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        head_dim = cfg.get("head_dim") or hidden // heads

        # transformers >= 5 keeps theta and scaling together under `rope_parameters`; older
        # configs have `rope_theta` and `rope_scaling` at the top level.
        rope_params = dict(cfg.get("rope_parameters") or {})
        rope_theta = float(rope_params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
        scaling = dict(cfg.get("rope_scaling") or {})
        scaling.update({k: v for k, v in rope_params.items() if k != "rope_theta"})
        if "type" in scaling and "rope_type" not in scaling:
            scaling["rope_type"] = scaling.pop("type")
        scaling.pop("type", None)
        rope_type = scaling.get("rope_type", "default")
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"rope scaling type {rope_type!r} is not supported; supported: "
                f"{', '.join(SUPPORTED_ROPE_TYPES)}"
            )
        rope_scaling = None
        if rope_type != "default":
            rope_scaling = tuple(sorted((k, _freeze(v)) for k, v in scaling.items()))

        sliding_window = None
        if model_type == "mistral":
            sliding_window = cfg.get("sliding_window")
        elif model_type == "qwen2" and cfg.get("use_sliding_window", False):
            raise ValueError(
                "qwen2 with use_sliding_window=True is not supported (per-layer windows); "
                "supported: use_sliding_window=False"
            )

        qkv_bias = model_type == "qwen2" or bool(cfg.get("attention_bias", False))
        o_bias = model_type != "qwen2" and bool(cfg.get("attention_bias", False))
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
        return cls(
            model_type=model_type,
            vocab_size=vocab,
            hidden_size=hidden,
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=int(head_dim),
            intermediate_size=inter,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            sliding_window=None if sliding_window is None else int(sliding_window),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=tuple(int(e) for e in eos_ids),
        )

    @classmethod
    def from_json_file(cls, path: str | os.PathLike) -> "ModelConfig":
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
        except FileNotFoundError:
            raise ValueError(f"no config.json at {os.fspath(path)!r}") from None
        except json.JSONDecodeError as e:
            raise ValueError(f"{os.fspath(path)!r} is not valid JSON: {e}") from None
        return cls.from_hf_dict(data)

    def to_hf_dict(self) -> dict[str, Any]:
        """A config.json that transformers loads as the same architecture."""
        archs = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "mistral": "MistralForCausalLM"}
        scaling = self.rope_scaling_dict if self.rope_scaling else None
        out: dict[str, Any] = {
            "architectures": [archs[self.model_type]],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": scaling,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": (list(self.eos_token_ids) if len(self.eos_token_ids) > 1
                             else (self.eos_token_ids[0] if self.eos_token_ids else None)),
            "torch_dtype": "bfloat16",
        }
        if self.model_type == "llama":
            out["attention_bias"] = self.o_bias
            out["mlp_bias"] = False
        if self.model_type == "mistral":
            out["sliding_window"] = self.sliding_window
        if self.model_type == "qwen2":
            out["use_sliding_window"] = False
            out["sliding_window"] = None
        return out


def _freeze(value: Any) -> Any:
    if isinstance(value, list):
        return tuple(value)
    if isinstance(value, dict):
        return tuple(sorted(value.items()))
    return value
