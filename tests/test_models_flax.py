"""The Flax module declares exactly the runtime parameter layout and computes the same logits."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jspec.models.modeling import Decoder, params_for_module, params_for_serving
from jspec.models.params import init_params, param_shapes
from jspec.models.tiny import tiny_config
from jspec.models.transformer import dense_forward


@pytest.mark.parametrize("model_type,tied", [("qwen2", True), ("llama", False)])
def test_module_params_match_runtime_layout_and_logits(model_type, tied):
    cfg = tiny_config(model_type, vocab_size=96, tie_word_embeddings=tied)
    tokens = jnp.arange(11) % cfg.vocab_size
    variables = Decoder(cfg).init(jax.random.PRNGKey(0), tokens)
    serving = params_for_serving(cfg, variables["params"])
    shapes = jax.tree_util.tree_map(lambda a: a.shape, serving)
    expected = param_shapes(cfg)
    assert jax.tree_util.tree_structure(shapes, is_leaf=lambda x: isinstance(x, tuple)) == \
        jax.tree_util.tree_structure(expected, is_leaf=lambda x: isinstance(x, tuple))
    assert jax.tree_util.tree_leaves(shapes, is_leaf=lambda x: isinstance(x, tuple)) == \
        jax.tree_util.tree_leaves(expected, is_leaf=lambda x: isinstance(x, tuple))
    # a model built by our initializer runs through the module unchanged
    params = init_params(cfg, seed=1, std=0.2)
    via_module = Decoder(cfg).apply({"params": params_for_module(cfg, params)}, tokens)
    np.testing.assert_allclose(np.asarray(via_module),
                               np.asarray(dense_forward(params, tokens, cfg=cfg)), atol=1e-5)
