"""The parameter pytree every forward function takes, and a random initializer.

Layout (a plain nested dict of arrays; layers are stacked on a leading axis so the forward is one
``lax.scan`` and compiles in time independent of depth)::

    embed        [vocab, hidden]
    layers/
      attn_norm  [L, hidden]
      wqkv       [L, hidden, q_size + 2 * kv_size]   q, k, v projections fused: one matmul
      bqkv       [L, q_size + 2 * kv_size]           only when cfg.qkv_bias
      wo         [L, q_size, hidden]
      bo         [L, hidden]                         only when cfg.o_bias
      mlp_norm   [L, hidden]
      w_gate_up  [L, hidden, 2 * intermediate]       gate and up fused: one matmul
      w_down     [L, intermediate, hidden]
    final_norm   [hidden]
    lm_head      [hidden, vocab]

Weights are stored ``[in, out]`` so every projection is ``x @ W`` (``cfg.weight_layout`` "in_out",
the layout the loader builds and tensor parallelism shards). The output head in particular is kept
as ``[hidden, vocab]`` even for tied-embedding models (a transposed copy of ``embed``). An engine
may convert the params to "out_in" (``with_weight_layout``): every projection weight ``[.., out,
in]``, the checkpoint's own layout, multiplied as ``x @ W.T``, and a tied head that is ``embed``
itself. Which one multiplies faster depends on the CPU's matmul library: on a 2-vCPU AMD Zen 3
"out_in" runs Qwen2.5-0.5B-shaped bf16 projections 1.2-2.5x faster at 2-64 rows, with the same
bits (jspec/weight_layout.py measures it per machine; docs/benchmarks.md, "Weight layout").
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jspec.models.config import WEIGHT_LAYOUTS, ModelConfig


def param_shapes(cfg: ModelConfig) -> dict:
    """Shapes of the runtime pytree (same structure as the params)."""
    L, h, i, v = cfg.num_layers, cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    qkv = cfg.q_size + 2 * cfg.kv_size
    layers = {
        "attn_norm": (L, h),
        "wqkv": (L, h, qkv),
        "wo": (L, cfg.q_size, h),
        "mlp_norm": (L, h),
        "w_gate_up": (L, h, 2 * i),
        "w_down": (L, i, h),
    }
    if cfg.qkv_bias:
        layers["bqkv"] = (L, qkv)
    if cfg.o_bias:
        layers["bo"] = (L, h)
    return {"embed": (v, h), "layers": layers, "final_norm": (h,), "lm_head": (h, v)}


def init_params(cfg: ModelConfig, seed: int = 0, dtype=jnp.float32, std: float = 0.02) -> dict:
    """Random weights (normal(0, std); norms at 1, small random biases), as numpy-backed arrays."""
    rng = np.random.default_rng(seed)
    shapes = param_shapes(cfg)

    def make(path: str, shape: tuple) -> np.ndarray:
        if path.endswith("norm"):
            return (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
        return (std * rng.standard_normal(shape)).astype(np.float32)

    params = {
        "embed": make("embed", shapes["embed"]),
        "layers": {k: make(k, s) for k, s in shapes["layers"].items()},
        "final_norm": make("final_norm", shapes["final_norm"]),
    }
    if cfg.tie_word_embeddings:
        params["lm_head"] = np.ascontiguousarray(params["embed"].T)
    else:
        params["lm_head"] = make("lm_head", shapes["lm_head"])
    return jax.tree_util.tree_map(lambda a: jnp.asarray(a, dtype=dtype), params)


_PROJECTIONS = ("wqkv", "wo", "w_gate_up", "w_down")


def with_weight_layout(params: dict, cfg: ModelConfig, layout: str) -> tuple[dict, ModelConfig]:
    """``params`` (laid out as ``cfg.weight_layout`` says) and ``cfg`` converted to ``layout``:
    the projection weights' last two axes swapped, and the output head transposed (a tied
    model's "out_in" head is ``embed`` itself, no second copy). The values are unchanged; only
    the order in memory differs."""
    if layout not in WEIGHT_LAYOUTS:
        raise ValueError(f"weight layout must be one of {WEIGHT_LAYOUTS}, got {layout!r}")
    if layout == cfg.weight_layout:
        return params, cfg

    def swap(a):
        return jnp.swapaxes(a, -1, -2).copy()

    layers = {k: swap(v) if k in _PROJECTIONS else v for k, v in params["layers"].items()}
    if cfg.tie_word_embeddings and layout == "out_in":
        head = params["embed"]
    else:
        head = swap(params["lm_head"])
    return ({**params, "layers": layers, "lm_head": head},
            dataclasses.replace(cfg, weight_layout=layout))


def params_nbytes(params: dict) -> int:
    return sum(int(np.prod(a.shape)) * a.dtype.itemsize for a in jax.tree_util.tree_leaves(params))
