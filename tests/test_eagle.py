"""EAGLE-3 heads: the target's captured hidden states, the head's paged forward against the
formulas, training with the training-time test, and the head drafting in the engine, alone and
beside a lookup: greedy output equal to the target's alone, sampling that keeps the target's
distribution, and what is refused."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import ENGINE_VOCAB, make_engine, run_to_completion
# the repeating target and its reference outputs are fixtures, used by name
from test_ngram import (CYCLE, GREEDY, _prompts,  # noqa: F401
                        assert_first_two_tokens_follow_the_target, repeating_reference,
                        repeating_target)
from test_mixed_drafters import RowDrafters
from jspec.device_steps import StepOptions, eagle_draft_loop
from jspec.llm import load_eagle_head
from jspec.models.eagle import eagle_dense
from jspec.models.eagle_checkpoint import save_eagle, write_tiny_eagle
from jspec.models.eagle_train import (draft_vocabulary, head_config, held_out_agreement,
                                      init_head, train_head, ttt_logits)
from jspec.models.transformer import KVCache, ModelInput, dense_forward, forward
from jspec.kernels.ragged_paged_attention import AttentionMetadata
from jspec.policies import make_policy
from jspec.runner import widens_one_row_dots


def _cycle_windows(n: int, length: int, seed: int) -> np.ndarray:
    """Token windows as the repeating target writes them: runs through a cycle of CYCLE
    tokens, entered at random tokens, with a random token now and then."""
    rng = np.random.default_rng(seed)
    out = np.zeros((n, length), np.int32)
    for w in range(n):
        tok = int(rng.integers(3, ENGINE_VOCAB))
        for i in range(length):
            out[w, i] = tok
            nxt = tok - tok % CYCLE + (tok % CYCLE + 1) % CYCLE
            tok = int(rng.integers(3, ENGINE_VOCAB)) if rng.random() < 0.1 else min(
                nxt, ENGINE_VOCAB - 1)
    return out


@pytest.fixture(scope="module")
def trained_head(repeating_target, tmp_path_factory):
    """A head trained for the repeating target (``jspec train-eagle``'s recipe, a few hundred
    small steps), written in the published EAGLE-3 layout with a reduced draft vocabulary and
    loaded back the way the engine loads one: (directory, LoadedModel)."""
    target = repeating_target
    windows = _cycle_windows(256, 33, seed=0)
    d2t = draft_vocabulary(windows, 240, ENGINE_VOCAB, always=(2,))
    ecfg = head_config(target.cfg, len(d2t))
    params, _ = train_head(target.cfg, target.params, ecfg, init_head(ecfg, d2t, std=0.1),
                           windows, steps=300, batch_size=8, lr=1e-2, warmup=20, depth=2,
                           progress=False)
    path = tmp_path_factory.mktemp("eagle") / "head"
    save_eagle(path, ecfg, params)
    return path, load_eagle_head(path, jnp.float32, "eagle3", target)


def test_the_target_forward_writes_its_captured_states_at_every_slot(repeating_target):
    """The paged forward with a hidden-state pool holds, at each token's slot, the residual
    streams entering the captured layers, as the dense forward computes them."""
    target = repeating_target
    cfg = target.cfg
    aux = (0, 1, 1)
    tokens = np.arange(5, 29, dtype=np.int32)
    n, block = len(tokens), 8
    kv = KVCache.create(cfg, 6, block, jnp.float32, hidden_width=len(aux) * cfg.hidden_size)
    table = np.array([[2, 5, 1, 0]], np.int32)
    batch = ModelInput(tokens, AttentionMetadata(np.arange(n, dtype=np.int32),
                                                 np.array([0, n], np.int32),
                                                 np.array([n], np.int32), table),
                       np.array([n - 1], np.int32))
    _, kv = jax.jit(lambda p, kv, b: forward(p, kv, b, cfg=cfg, aux_layers=aux))(
        target.params, kv, batch)
    _, want = dense_forward(target.params, jnp.asarray(tokens), cfg=cfg, aux_layers=aux)
    got = np.asarray(kv.h)[table[0, np.arange(n) // block], np.arange(n) % block]
    np.testing.assert_allclose(got, np.asarray(want), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="needs the layers"):
        jax.jit(lambda p, kv, b: forward(p, kv, b, cfg=cfg))(target.params, kv, batch)


def test_training_time_test_passes_are_the_served_heads_drafts(repeating_target,
                                                                trained_head):
    """Pass j of the training-time test at position p is what the served head computes for
    its j-th draft when the target's states end at p - j + 1: the same logits as the
    one-sequence oracle drafting greedily, token for token."""
    target = repeating_target
    _, head = trained_head
    ecfg = head.eagle
    prefix = jnp.asarray(_prompts()[3][:12], jnp.int32)
    depth = 3
    _, aux = dense_forward(target.params, prefix, cfg=target.cfg, aux_layers=ecfg.aux_layers)
    logits, drafts = eagle_dense(head.params, prefix, aux[:-1], cfg=ecfg.layer,
                                 target_vocab=ENGINE_VOCAB, num_draft=depth - 1)
    seq = jnp.concatenate([prefix, drafts])
    _, aux = dense_forward(target.params, seq, cfg=target.cfg, aux_layers=ecfg.aux_layers)
    passes = ttt_logits(head.params, head.params["embed"], aux[:-1], seq[1:], ecfg=ecfg,
                        depth=depth)
    d2t = np.asarray(head.params["d2t"])
    n = len(prefix)
    for j in range(depth):
        np.testing.assert_allclose(np.asarray(passes[j][n - 2 + j]),
                                   np.asarray(logits[n - 2 + j])[d2t], rtol=1e-4, atol=1e-4)


def test_a_trained_head_agrees_with_the_target(repeating_target, trained_head):
    _, head = trained_head
    held = _cycle_windows(16, 33, seed=1)
    agree = held_out_agreement(repeating_target.cfg, repeating_target.params, head.eagle,
                               head.params, held, depth=2)
    # an untrained head agrees on about 1 / 240 of the positions
    assert agree[0] > 0.6 and agree[1] > 0.6, agree


def _decode_drafts(engine, prompt):
    """(tokens before the step, drafted tokens) of every drafting step of one request."""
    engine.add_request("a", prompt, GREEDY)
    out = []
    while engine.has_unfinished_requests():
        running = list(engine.scheduler.running)
        before = list(running[0].token_ids()) if running else None
        engine.step()
        st = engine.last_step
        if before is not None and st is not None and st.gamma and st.draft is not None:
            drafted = int(np.asarray(st.draft.num_drafted)[0])
            if drafted:
                out.append((before, np.asarray(st.draft.tokens)[0, :drafted].tolist()))
    return out


@pytest.mark.parametrize("which", ["trained", "published-random", "narrow"])
def test_the_head_drafts_what_the_reference_formulas_give(repeating_target, trained_head,
                                                         tmp_path, which):
    """Through the engine (paged pools, catch-up, the first forward taking several tokens,
    the draft loop), each greedy draft equals the one-sequence oracle's from the target's
    states: for the trained head, for a random one in the speculators layout with its own
    embedding, and for a random one half the target's width (``jspec train-eagle
    --hidden-size``, the built-in head's shape)."""
    target = repeating_target
    if which == "trained":
        head = trained_head[1]
    elif which == "narrow":
        d2t = np.sort(np.random.default_rng(5).choice(ENGINE_VOCAB, 160, replace=False))
        ecfg = head_config(target.cfg, 160, hidden_size=target.cfg.hidden_size // 2,
                           intermediate_size=48)
        assert ecfg.own_embed and ecfg.layer.num_kv_heads == 1
        save_eagle(tmp_path, ecfg, init_head(ecfg, d2t, seed=5, std=0.1))
        head = load_eagle_head(tmp_path, jnp.float32, "eagle3", target)
        assert head.eagle.layer.hidden_size == target.cfg.hidden_size // 2
    else:
        write_tiny_eagle(tmp_path, target.cfg, seed=3, draft_vocab_size=160,
                         layout="speculators", own_embed=True)
        head = load_eagle_head(tmp_path, jnp.float32, "eagle3", target)
    engine = make_engine(target, head, make_policy("static", 4, gamma=4),
                         async_scheduling=False)
    steps = _decode_drafts(engine, _prompts()[4])
    assert len(steps) > 5
    ecfg = head.eagle
    for before, drafted in steps:
        tokens = jnp.asarray(before, jnp.int32)
        _, aux = dense_forward(target.params, tokens, cfg=target.cfg,
                               aux_layers=ecfg.aux_layers)
        _, want = eagle_dense(head.params, tokens, aux[:-1], cfg=ecfg.layer,
                              target_vocab=ENGINE_VOCAB, num_draft=len(drafted))
        assert drafted == np.asarray(want).tolist(), len(before)


@pytest.mark.parametrize("policy,overrides", [
    ("static", {}),  # asynchronous scheduling and prefix caching on (the defaults)
    ("static", {"async_scheduling": False, "enable_prefix_caching": False}),
    ("static", {"num_kv_blocks": 14}),  # preemption and recompute
    ("rows", {}),  # beside a lookup, row by row
    ("auto", {}),
    ("adaedl", {}),  # drafts stop on the head's entropy, over its reduced vocabulary
], ids=["defaults", "sync-no-cache", "preemption", "with-ngram", "auto-with-ngram", "adaedl"])
def test_greedy_with_the_head_equals_target_only(repeating_target, repeating_reference,
                                                 trained_head, policy, overrides):
    head = trained_head[1]
    if policy in ("static", "adaedl"):
        pol = make_policy(policy, 4, **({"gamma": 4} if policy == "static" else {}))
        method = "eagle3"
    else:
        pol = RowDrafters(4, (0, 1, -1)) if policy == "rows" else make_policy("auto", 4)
        method = "eagle3+ngram"
    engine = make_engine(repeating_target, head, pol, speculative_method=method, **overrides)
    compiled = engine.runner.num_compiled  # after the warm-up
    records = []
    engine.add_step_listener(records.append)
    outs = run_to_completion(engine, _prompts(), GREEDY)
    assert all(np.isfinite(r.draft_entropy[~np.isnan(r.draft_entropy)]).all() for r in records)
    for i, ref in enumerate(repeating_reference):
        assert outs[str(i)].token_ids == ref, f"prompt {i}"
    assert engine.block_manager.num_used_blocks == 0
    assert engine.runner.num_compiled == compiled  # the warm-up compiled every shape it ran
    stats = engine.metrics.drafter_stats["eagle3"]
    assert stats["num_accepted_tokens"] > 0.4 * stats["num_draft_tokens"] > 0, stats
    if "num_kv_blocks" in overrides:
        assert engine.metrics.num_preemptions > 0


def test_sampling_with_the_head_keeps_the_target_distribution(repeating_target, trained_head):
    engine = make_engine(repeating_target, trained_head[1], make_policy("static", 4, gamma=2))
    assert_first_two_tokens_follow_the_target(engine, repeating_target)
    assert engine.metrics.drafter_stats["eagle3"]["num_draft_tokens"] > 0


def test_what_an_engine_with_a_head_refuses(repeating_target, trained_head):
    head = trained_head[1]
    with pytest.raises(ValueError, match="elastic_memory.*EAGLE head"):
        make_engine(repeating_target, head, elastic_memory=True)
    with pytest.raises(ValueError, match="an engine drafts with one"):
        make_engine(repeating_target, [head, dataclasses.replace(head, name="other")])
    with pytest.raises(ValueError, match="tensor-parallel"):
        make_engine(repeating_target, head, tensor_parallel_size=2)
    small = dataclasses.replace(repeating_target, name="small")
    with pytest.raises(ValueError, match="EAGLE head drafts alone"):
        make_engine(repeating_target, [head, small], make_policy("specrouter", 4))


def test_llm_loads_a_head_from_its_directory(tiny_pair, tmp_path):
    """vLLM's spelling, from directories: a head written in the published layout drafts for
    the tiny target, and the output is the target's own greedy output; methods and
    directories that do not fit are refused by name."""
    from conftest import LLM_KW
    from jspec.llm import LLM
    from jspec.models.config import ModelConfig
    from jspec.sampling_params import SamplingParams

    target_dir, draft_dir = tiny_pair
    write_tiny_eagle(tmp_path / "head", ModelConfig.from_json_file(f"{target_dir}/config.json"),
                     seed=1, draft_vocab_size=300)
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    prompts = ["def f(x):", "import os\n"]
    with_head = LLM(target=target_dir, speculative_config={
        "method": "eagle3", "model": str(tmp_path / "head")}, **LLM_KW)
    assert with_head.engine.runner.pool[0].eagle is not None
    plain = LLM(target=target_dir, draft=None, **LLM_KW)
    for a, b in zip(with_head.generate(prompts, greedy), plain.generate(prompts, greedy)):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
    with pytest.raises(ValueError, match="is not an EAGLE-3 head"):
        LLM(target=target_dir, speculative_config={"method": "eagle3", "model": str(draft_dir)})
    with pytest.raises(ValueError, match="method 'eagle' is not supported"):
        LLM(target=target_dir, speculative_config={"method": "eagle",
                                                   "model": str(tmp_path / "head")})


def test_prefix_cached_blocks_carry_the_targets_states_for_the_head(repeating_target,
                                                                    trained_head):
    """A request that reuses an earlier one's cached blocks skips their prefill, target and
    head alike: the head drafts from the states those blocks hold, and greedy output is still
    the target's alone."""
    head = trained_head[1]
    shared = _cycle_windows(1, 40, seed=5)[0].tolist()
    prompts = [shared + [7, 8], shared + [100, 101, 102]]
    reference = run_to_completion(make_engine(repeating_target, None), prompts, GREEDY)
    engine = make_engine(repeating_target, head, make_policy("static", 4, gamma=4),
                         speculative_method="eagle3")
    for i, prompt in enumerate(prompts):  # one after the other: the second finds the first's
        out = run_to_completion(engine, [prompt], GREEDY)["0"]
        assert out.token_ids == reference[str(i)].token_ids, f"prompt {i}"
    stats = engine.metrics.prefix_cache
    assert stats.hits >= 32 and stats.draft_hits[0] >= 32, stats
    assert engine.metrics.drafter_stats["eagle3"]["num_accepted_tokens"] > 0


def _bf16(m):
    """``m`` with its float32 params in bf16."""
    params = jax.tree_util.tree_map(
        lambda a: a.astype(jnp.bfloat16) if a.dtype == jnp.float32 else a, m.params)
    return dataclasses.replace(m, params=params)


def test_a_head_drafts_in_bfloat16(repeating_target, trained_head):
    """bf16 weights and KV (the CPU default): the head's draft-vocabulary logits placed in the
    target's vocabulary compile and run beside the bf16 dots (a scatter fused with them did
    not run on XLA:CPU)."""
    engine = make_engine(_bf16(repeating_target), _bf16(trained_head[1]),
                         make_policy("static", 4, gamma=4), dtype="bfloat16",
                         speculative_method="eagle3")
    outs = run_to_completion(engine, _prompts()[:4], GREEDY)
    assert all(len(o.token_ids) == GREEDY.max_tokens for o in outs.values())
    assert engine.metrics.drafter_stats["eagle3"]["num_accepted_tokens"] > 0


def test_a_one_row_draft_loop_in_bfloat16_drafts_the_same_with_widened_weights(
        repeating_target, trained_head):
    """One sequence in bf16: the head's draft loop over the runner's float32 copy of its dot
    weights (what the runner passes where XLA widens one-row bf16 dots) drafts the same
    tokens, and q up to rounding (its first forward's several-token products are float32
    ones there), as the loop over the bf16 weights."""
    engine = make_engine(_bf16(repeating_target), _bf16(trained_head[1]),
                         make_policy("static", 4, gamma=4), dtype="bfloat16",
                         speculative_method="eagle3", async_scheduling=False)
    engine.add_request("a", _prompts()[4], GREEDY)
    for _ in range(6):
        engine.step()
    st, runner = engine.last_step, engine.runner
    assert st.gamma and st.num_rows == 1
    model = st.proposer.model
    head = runner.pool[model]
    assert widens_one_row_dots("float32") is False
    assert runner.draft_params(model, 2) is head.params
    if not widens_one_row_dots("bfloat16"):  # an XLA that multiplies one bf16 row as it is
        assert runner.draft_params(model, 1) is head.params
        return
    wide = runner.draft_params(model, 1)
    assert wide is runner.draft_params(model, 1)  # made once
    assert wide["lm_head"].dtype == jnp.float32 and wide["layer"]["wqkv"].dtype == jnp.float32
    assert wide["embed"].dtype == head.params["embed"].dtype  # gathered, not multiplied
    opts = StepOptions(head.cfg, runner._attn, num_steps=st.gamma, eagle=head.eagle)
    loop = jax.jit(functools.partial(eagle_draft_loop, opts=opts))
    drafts = []
    for params in (head.params, wide):
        result, _, _ = loop(params, runner.pool_kv[model], runner.target_kv.h,
                            st.draft_inputs, st.sampling)
        drafts.append((np.asarray(result.tokens), np.asarray(result.logits)))
    np.testing.assert_array_equal(drafts[0][0], drafts[1][0])
    finite = np.isfinite(drafts[0][1])
    assert finite.any()
    np.testing.assert_array_equal(finite, np.isfinite(drafts[1][1]))
    np.testing.assert_allclose(drafts[0][1][finite], drafts[1][1][finite], rtol=0.02, atol=0.05)
