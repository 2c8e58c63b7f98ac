"""The shipped default pair (models/default_pair): what the README and its model card promise
about it, checked on the files themselves. Teacher-forced agreement on held-out code guards against shipping a draft
that was not distilled from this target (the full acceptance run is `jspec bench pair`)."""

from __future__ import annotations

import os

from jspec.default_models import (SHIPPED_DIR, default_pair, default_pool, shipped_intermediate,
                                   shipped_pair)


def test_the_pair_ships_and_is_the_default():
    assert shipped_pair() is not None, f"no trained pair under {SHIPPED_DIR}"
    assert default_pair() == shipped_pair()
    assert (SHIPPED_DIR / "README.md").exists()  # the model card


def test_sizes_dtype_and_cost_ratio():
    from safetensors import safe_open

    from jspec.models.config import ModelConfig
    from jspec.models.train import forward_flops_per_token

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


def test_the_pool_ships_a_middle_model_within_the_size_budget():
    """SpecRouter's built-in pool: draft < mid < target in size and cost, one vocabulary, and
    everything shipped (weights, tokenizers, cards) within 40 MB."""
    from jspec.models.config import ModelConfig
    from jspec.models.train import forward_flops_per_token

    mid_dir = shipped_intermediate()
    assert mid_dir is not None, f"no middle model under {SHIPPED_DIR}"
    target_dir, pool = default_pool()
    assert pool == {"draft": shipped_pair()[1], "mid": mid_dir}
    cfgs = [ModelConfig.from_json_file(os.path.join(d, "config.json"))
            for d in (pool["draft"], mid_dir, target_dir)]
    sizes = [c.num_params() for c in cfgs]
    flops = [forward_flops_per_token(c) for c in cfgs]
    assert sizes == sorted(sizes) and flops == sorted(flops) and len(set(sizes)) == 3
    assert len({c.vocab_size for c in cfgs}) == 1
    shipped = sum(f.stat().st_size for f in SHIPPED_DIR.rglob("*") if f.is_file())
    assert shipped <= 40_000_000, shipped


def test_tokenizer_is_shared_and_round_trips():
    from jspec.models.loader import load_tokenizer

    target_dir, draft_dir = shipped_pair()
    t, d = load_tokenizer(target_dir), load_tokenizer(draft_dir)
    text = 'def f(x):\n    """Return x."""\n    return x  # é\n'
    assert t.encode(text) == d.encode(text) and t.decode(t.encode(text)) == text


def test_draft_agrees_with_target_on_held_out_code():
    import jax.numpy as jnp

    from jspec.models.corpus import (discover, heldout_function_prompts, pack, read_texts,
                               split_files, tokenize_documents)
    from jspec.models.loader import load_checkpoint, load_tokenizer
    from jspec.models.modeling import params_for_module
    from jspec.models.train import greedy_agreement

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
    # the middle model was distilled from this target too (the model card: it agrees about as
    # well as the draft, not better, after its short training run)
    m_cfg, m_params = load_checkpoint(shipped_intermediate(), dtype=jnp.float32)
    mid_agree = greedy_agreement(m_cfg, params_for_module(m_cfg, m_params), t_cfg,
                                 params_for_module(t_cfg, t_params), windows, batch_size=4,
                                 dtype=jnp.float32)
    assert mid_agree >= 0.55, mid_agree
    assert heldout_function_prompts(3)  # the prompts `jspec bench pair` measures on exist


def test_every_chain_of_the_built_in_pool_is_lossless():
    """LLM(policy="specrouter") with no models runs the built-in pool; every chain of it
    (random per step, with random γ) gives the target's greedy tokens exactly (fp32)."""
    import numpy as np

    from jspec.llm import build_engine
    from jspec.sampling_params import SamplingParams
    from test_chains import RandomChainPolicy

    kw = dict(dtype="float32", max_num_seqs=2, max_model_len=256, warmup=False,
              num_speculative_tokens=4)
    engine = build_engine(policy="specrouter", **kw)
    assert engine.limits.draft_pool == ("draft", "mid")
    target_dir, pool = default_pool()
    class CyclingChains(RandomChainPolicy):  # every chain in turn, random γ
        def plan(self, view):
            plan = super().plan(view)
            self.turn = getattr(self, "turn", -1) + 1
            plan.chain = sorted(self.possible_chains())[self.turn % 4]
            return plan

    chains = build_engine(target_dir, list(pool.values()), policy_obj=CyclingChains(4, 1), **kw)
    plain = build_engine(target_dir, None, **kw)
    sp = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    prompts = ["def fibonacci(n):", "import os\n\ndef list_files(path):"]
    for i, p in enumerate(prompts):
        chains.add_request(str(i), p, sp)
        plain.add_request(str(i), p, sp)
    out = {}
    for eng, name in ((chains, "chains"), (plain, "plain")):
        while eng.has_unfinished_requests():
            for o in eng.step():
                if o.finished:
                    out[(name, o.request_id)] = o.token_ids
    for i in range(len(prompts)):
        assert out[("chains", str(i))] == out[("plain", str(i))]
    assert len(chains.metrics.chain_histogram) == 4
    assert chains.block_manager.num_used_blocks == 0
    assert np.isfinite(chains.metrics.intermediate_time)
