"""The decoder as a Flax linen module: parameter declarations (names, shapes, initializers) and
the dense causal forward used for training.

Serving does not go through the module: ``jspec.models.transformer.forward`` runs the same layer code
as a pure function over the same parameter pytree (``params_for_serving`` below), which is what
lets the engine jit it per shape bucket, donate the KV pool and move params with ``device_put``.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from jspec.models.config import ModelConfig
from jspec.models.params import param_shapes
from jspec.models.transformer import dense_forward


class Decoder(nn.Module):
    """Llama-family decoder. ``Decoder(cfg).init(key, tokens)["params"]`` has the runtime layout
    of ``jspec.models.params`` (a tied model declares no ``lm_head``; it is ``embed.T``)."""

    cfg: ModelConfig
    param_dtype: Any = jnp.float32
    init_std: float = 0.02

    def setup(self):
        shapes = param_shapes(self.cfg)
        normal = nn.initializers.normal(self.init_std)

        def layer_init(key, layer_shapes):
            keys = jax.random.split(key, len(layer_shapes))
            return {name: (jnp.ones(shape, self.param_dtype) if name.endswith("norm")
                           else jnp.zeros(shape, self.param_dtype) if name.startswith("b")
                           else normal(k, shape, self.param_dtype))
                    for k, (name, shape) in zip(keys, sorted(layer_shapes.items()))}

        self.embed = self.param("embed", normal, shapes["embed"], self.param_dtype)
        self.layers = self.param("layers", layer_init, shapes["layers"])
        self.final_norm = self.param("final_norm", nn.initializers.ones, shapes["final_norm"],
                                     self.param_dtype)
        if not self.cfg.tie_word_embeddings:
            self.lm_head = self.param("lm_head", normal, shapes["lm_head"], self.param_dtype)

    def __call__(self, tokens: jax.Array, return_hidden: bool = False):
        """tokens [T] -> logits [T, vocab] (float32); causal, one sequence."""
        params = {"embed": self.embed, "layers": self.layers, "final_norm": self.final_norm,
                  "lm_head": self.embed.T if self.cfg.tie_word_embeddings else self.lm_head}
        return dense_forward(params, tokens, cfg=self.cfg, return_hidden=return_hidden)


def params_for_serving(cfg: ModelConfig, module_params: dict) -> dict:
    """Module params -> the runtime pytree (materializes the tied head as a [hidden, vocab] copy,
    the layout the serving matmul wants)."""
    params = dict(module_params)
    if cfg.tie_word_embeddings:
        params["lm_head"] = jnp.asarray(params["embed"]).T
    return params


def params_for_module(cfg: ModelConfig, params: dict) -> dict:
    """Runtime pytree -> module params (drops the tied head copy)."""
    params = dict(params)
    if cfg.tie_word_embeddings:
        params.pop("lm_head", None)
    return params
