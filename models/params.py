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
may convert the params to "out_in" (``lay_out``): every projection weight ``[.., out,
in]``, the checkpoint's own layout, multiplied as ``x @ W.T``, and a tied head that is ``embed``
itself. Which one multiplies faster depends on the CPU's matmul library: on a 2-vCPU AMD Zen 3
"out_in" runs Qwen2.5-0.5B-shaped bf16 projections 1.2-2.5x faster at 2-64 rows, with the same
bits (jspec/weight_layout.py measures it per machine; docs/benchmarks.md, "Weight layout").

An engine may also give every layer its own buffers (``lay_out``, ``cfg.layer_buffers``
"per_layer"): ``layers`` becomes a tuple of one dict per layer with the same names and the
leading axis dropped, and the forward runs the layers unrolled. XLA:CPU copies each layer's
weights out of a stacked array before multiplying them; when the layers do not stay in the
caches those copies cost a third of a Qwen2.5-0.5B-shaped forward on a 2-vCPU AMD Zen 3, at the
price of compiling every layer apart (about 4x the compile time for 24 layers).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jspec.models.config import LAYER_BUFFERS, WEIGHT_LAYOUTS, ModelConfig


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


def projection_shapes(cfg: ModelConfig) -> list[tuple[int, ...]]:
    """The (depth, width) of every product of the forward: each projection's ``[in, out]`` and
    the output head's."""
    shapes = param_shapes(cfg)
    return [shapes["layers"][name][1:] for name in _PROJECTIONS] + [shapes["lm_head"]]


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


def lay_out(params: dict, cfg: ModelConfig, layout: str | None = None,
            buffers: str | None = None) -> tuple[dict, ModelConfig]:
    """``params`` (laid out as ``cfg`` says) and ``cfg`` converted to the weight ``layout``
    (projection weights' last two axes swapped, the output head transposed; a tied model's
    "out_in" head is ``embed`` itself, no second copy) and the layer ``buffers`` ("stacked" or
    "per_layer"); None keeps ``cfg``'s. The values are unchanged; only how they lie in memory
    differs. A layer at a time is converted, so the new params and the old (until the caller
    drops them) are what is held."""
    layout = layout or cfg.weight_layout
    buffers = buffers or cfg.layer_buffers
    if layout not in WEIGHT_LAYOUTS:
        raise ValueError(f"weight layout must be one of {WEIGHT_LAYOUTS}, got {layout!r}")
    if buffers not in LAYER_BUFFERS:
        raise ValueError(f"layer buffers must be one of {LAYER_BUFFERS}, got {buffers!r}")
    if (layout, buffers) == (cfg.weight_layout, cfg.layer_buffers):
        return params, cfg
    swap = layout != cfg.weight_layout

    def moved(name, a):
        return jnp.swapaxes(a, -1, -2).copy() if swap and name in _PROJECTIONS else a

    layers = params["layers"]
    if buffers == "per_layer":
        def layer(i):
            return layers[i] if cfg.layer_buffers == "per_layer" else {
                k: v[i] for k, v in layers.items()}
        layers = tuple({k: moved(k, a) for k, a in layer(i).items()}
                       for i in range(cfg.num_layers))
    elif cfg.layer_buffers == "per_layer":
        layers = {k: moved(k, jnp.stack([lp[k] for lp in layers])) for k in layers[0]}
    else:
        layers = {k: moved(k, a) for k, a in layers.items()}
    head = params["lm_head"]
    if swap:
        tied_out_in = cfg.tie_word_embeddings and layout == "out_in"
        head = params["embed"] if tied_out_in else jnp.swapaxes(head, 0, 1).copy()
    return ({**params, "layers": layers, "lm_head": head},
            dataclasses.replace(cfg, weight_layout=layout, layer_buffers=buffers))


def params_nbytes(params: dict) -> int:
    return sum(int(np.prod(a.shape)) * a.dtype.itemsize for a in jax.tree_util.tree_leaves(params))
