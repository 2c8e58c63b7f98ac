"""The shipped default pair (models/default_pair): what the issue promises about it, checked on
the files themselves. Teacher-forced agreement on held-out code guards against shipping a draft
that was not distilled from this target (the full acceptance run is `jspec bench pair`)."""

from __future__ import annotations

import os

from jspec.default_models import SHIPPED_DIR, default_pair, shipped_pair


def test_the_pair_ships_and_is_the_default():
    assert shipped_pair() is not None, f"no trained pair under {SHIPPED_DIR}"
    assert default_pair() == shipped_pair()
    assert (SHIPPED_DIR / "README.md").exists()  # the model card


def test_sizes_dtype_and_cost_ratio():
    from safetensors import safe_open

    from models.config import ModelConfig
    from models.train import forward_flops_per_token

    target_dir, draft_dir = shipped_pair()
    t = ModelConfig.from_json_file(os.path.join(target_dir, "config.json"))
    d = ModelConfig.from_json_file(os.path.join(draft_dir, "config.json"))
    assert t.num_params() >= 10_000_000 and t.vocab_size == d.vocab_size
    assert forward_flops_per_token(d) <= forward_flops_per_token(t) / 6
    total = 0
    for path in (target_dir, draft_dir):
        f = os.path.join(path, "model.safetensors")
        total += os.path.getsize(f)
        with safe_open(f, "np") as st:
            assert {st.get_slice(k).get_dtype() for k in st.keys()} == {"BF16"}
    assert total <= 25_000_000


def test_tokenizer_is_shared_and_round_trips():
    from models.loader import load_tokenizer

    target_dir, draft_dir = shipped_pair()
    t, d = load_tokenizer(target_dir), load_tokenizer(draft_dir)
    text = 'def f(x):\n    """Return x."""\n    return x  # é\n'
    assert t.encode(text) == d.encode(text) and t.decode(t.encode(text)) == text


def test_draft_agrees_with_target_on_held_out_code():
    import jax.numpy as jnp

    from models.corpus import (discover, heldout_function_prompts, pack, read_texts,
                               split_files, tokenize_documents)
    from models.loader import load_checkpoint, load_tokenizer
    from models.modeling import params_for_module
    from models.train import greedy_agreement

    target_dir, draft_dir = shipped_pair()
    tok = load_tokenizer(target_dir)
    _, held = split_files(discover(include_tests=False))
    windows = pack(tokenize_documents(tok, read_texts(held[:3])), 128, tok.eos_token_id)[:8]
    t_cfg, t_params = load_checkpoint(target_dir, dtype=jnp.float32)
    d_cfg, d_params = load_checkpoint(draft_dir, dtype=jnp.float32)
    agree = greedy_agreement(d_cfg, params_for_module(d_cfg, d_params), t_cfg,
                             params_for_module(t_cfg, t_params), windows, batch_size=4,
                             dtype=jnp.float32)
    assert agree >= 0.55, agree
    assert heldout_function_prompts(3)  # the prompts `jspec bench pair` measures on exist
