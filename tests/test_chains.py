"""Multi-level chains over a pool of drafts (SpecRouter): lossless, reproducible, no leaks, and
each pool model's KV bookkeeping right."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import ENGINE_VOCAB, make_engine, run_to_completion
from jspec.device_steps import DraftResult, intermediate_accept
from jspec.runner import LoadedModel, compile_events
from jspec.sampler import processed_logprobs, rejection_sample
from jspec.sampling_params import SamplingParams
from jspec.policies.base import DraftPlan, Policy
from test_sampling import _sampling_tensors, chi2_rejects

MAX_TOKENS = 20
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)


class RandomChainPolicy(Policy):
    """Test policy: a random chain of the pool (target alone included) and random γ_i ≤ 3 per
    step, so every chain meets every kind of history (lagging models, switches). One drafting
    γ bucket (4, shared with the other engine tests) keeps the compile count down."""

    name = "random-chain"

    def __init__(self, max_gamma: int, seed: int = 0):
        super().__init__(max_gamma)
        self.rng = np.random.default_rng(seed)

    def possible_gammas(self):
        return {0, 3}

    def possible_chains(self):
        n = len(self.pool)
        return ({()} | {(i,) for i in range(n)}
                | {(i, j) for i in range(n) for j in range(i + 1, n)})

    def plan(self, view):
        chains = sorted(self.possible_chains())
        chain = chains[self.rng.integers(len(chains))]
        return DraftPlan(gammas=self.rng.integers(0, 4, view.num_decode), chain=chain)


@pytest.fixture(scope="module")
def pool(engine_models):
    """[small unrelated draft, agreeing draft]: sorted by size, the engine names them so."""
    _, agreeing, small = engine_models
    return [agreeing, small]  # given out of order on purpose: the engine sorts by size


def test_pool_is_sorted_and_checked(engine_models, pool):
    target, _, _ = engine_models
    engine = make_engine(target, pool, policy_options=(("chain", "small-draft>draft"),
                                                       ("gamma", 3)), warmup=False)
    assert [m.name for m in engine.runner.pool] == ["small-draft", "draft"]
    assert engine.chains == frozenset({(0, 1)})
    assert engine.limits.draft_pool == ("small-draft", "draft")
    # counters started afresh (after a benchmark's warm-up) still name the chains
    assert engine.reset_metrics().chain_label((0, 1)) == "small-draft>draft>target"
    other = LoadedModel(dataclasses.replace(pool[1].cfg, vocab_size=ENGINE_VOCAB * 2),
                        pool[1].params, "x")
    with pytest.raises(ValueError, match=r"draft 'x' vocabulary \(512 tokens\)"):
        make_engine(target, [pool[0], other])
    with pytest.raises(ValueError, match="not in the draft pool"):
        make_engine(target, pool, policy_options=(("chain", "small-draft>mid"),))
    with pytest.raises(ValueError, match="cannot run"):  # a larger model drafting for a smaller
        make_engine(target, pool, policy_options=(("chain", "draft>small-draft"),))
    with pytest.raises(ValueError, match="pool of 2 drafts"):
        make_engine(target, pool, elastic_memory=True)


def test_every_chain_greedy_equals_target(engine_models, pool, ten_prompts, greedy_reference):
    """Random chains and γ per step (target alone, each draft alone, small -> mid -> target):
    output identical to target-only greedy decoding, nothing compiled after warm-up, every
    chain played, no block leaked."""
    target, _, _ = engine_models
    engine = make_engine(target, pool, policy=RandomChainPolicy(7, seed=3))
    before = compile_events()
    outs = run_to_completion(engine, ten_prompts, GREEDY)
    assert compile_events() == before
    assert [outs[str(i)].token_ids for i in range(len(ten_prompts))] == greedy_reference
    assert set(engine.metrics.chain_histogram) == {
        "target", "small-draft>target", "draft>target", "small-draft>draft>target"}
    assert engine.block_manager.num_used_blocks == 0
    assert engine.metrics.intermediate_time > 0


def test_copies_of_the_target_accept_everything(engine_models, ten_prompts, greedy_reference):
    """A pool whose two models are the target itself: the middle level must accept every token
    the first drafts and the target every token of the middle's draft. Any slip in a pool
    model's KV bookkeeping (a stale or missing position after rollback, a lagging model fed the
    wrong tokens) would show as a rejection."""
    target, _, _ = engine_models
    a, b = (LoadedModel(target.cfg, target.params, n) for n in ("a", "b"))
    engine = make_engine(target, [a, b], policy_options=(("chain", "a>b"), ("gamma", 3)))
    records = []
    engine.add_step_listener(records.append)
    outs = run_to_completion(engine, ten_prompts, GREEDY)
    assert [outs[str(i)].token_ids for i in range(len(ten_prompts))] == greedy_reference
    chain_steps = [o for o in records if o.chain == (0, 1)]
    assert chain_steps
    for o in chain_steps:
        np.testing.assert_array_equal(o.intermediate_accepted, o.num_drafted)
        np.testing.assert_array_equal(o.num_accepted, o.num_verified)
    assert engine.metrics.acceptance_rate == 1.0


def test_chain_sampling_is_seeded_and_reproducible(engine_models, pool, ten_prompts):
    target, _, _ = engine_models
    sp = [SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, seed=40 + i,
                         ignore_eos=True) for i in range(len(ten_prompts))]
    runs = []
    for _ in range(2):
        engine = make_engine(target, pool, policy_options=(("chain", "small-draft>draft"),
                                                           ("gamma", 3)))
        outs = run_to_completion(engine, ten_prompts, sp)
        runs.append([outs[str(i)].token_ids for i in range(len(ten_prompts))])
    assert runs[0] == runs[1]


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (1.3, 8, 0.95)])
def test_two_level_verification_preserves_the_target_distribution(temperature, top_k, top_p):
    """Small drafts γ tokens from q, the middle model verifies them (its own streams) and the
    target verifies the middle's draft with q = p_mid: the first emitted token follows the
    processed target distribution (chi-square at the 0.001 level, with the power to see a 2%
    shift), and the middle level's draft follows p_mid."""
    vocab, rows, gamma = 12, 40_000, 3
    rng = np.random.default_rng(11)
    p_logits = rng.normal(0, 1.0, (gamma + 1, vocab)).astype(np.float32)
    m_logits = (p_logits + rng.normal(0, 0.8, (gamma + 1, vocab))).astype(np.float32)
    q_logits = (m_logits[:gamma] + rng.normal(0, 0.8, (gamma, vocab))).astype(np.float32)
    st = _sampling_tensors(rows, temperature, top_k, top_p)

    def proc(logits):
        out = np.exp(np.asarray(processed_logprobs(jnp.asarray(logits)[None], st)[0]))
        return out / out.sum(-1, keepdims=True)

    q_proc = proc(q_logits)
    tokens = np.stack([rng.choice(vocab, rows, p=q_proc[j]) for j in range(gamma)], axis=1)
    zeros = jnp.zeros((rows, gamma), jnp.float32)
    draft = DraftResult(jnp.asarray(tokens, jnp.int32),
                        jnp.broadcast_to(q_logits, (rows, gamma, vocab)),
                        jnp.full((rows,), gamma, jnp.int32), zeros, zeros)

    @jax.jit
    def two_levels(m_logits, p_logits, draft, st):
        mid, verdict = intermediate_accept(m_logits, draft, st)
        final = rejection_sample(p_logits, mid.logits, mid.tokens, mid.num_drafted, st)
        return mid, verdict, final

    mid, verdict, final = two_levels(jnp.broadcast_to(m_logits, (rows, gamma + 1, vocab)),
                                     jnp.broadcast_to(p_logits, (rows, gamma + 1, vocab)),
                                     draft, st)
    accepted_mid = np.asarray(verdict.accepted)
    assert 0.05 < (accepted_mid > 0).mean() < 0.98  # the middle level accepts and rejects
    np.testing.assert_array_equal(np.asarray(mid.num_drafted),
                                  np.minimum(accepted_mid + 1, gamma))
    # the middle model's draft is an exact sample of p_mid at its first position
    assert not chi2_rejects(np.bincount(np.asarray(mid.tokens[:, 0]), minlength=vocab),
                            proc(m_logits)[0])
    first = np.bincount(np.asarray(final.tokens[:, 0]), minlength=vocab)
    target = proc(p_logits)[0]
    assert (target > 0.01).sum() >= 4
    assert not chi2_rejects(first, target)
    accepted = np.asarray(final.num_accepted)
    assert 0.05 < (accepted > 0).mean() < 0.98  # the target accepts and rejects too
    shifted = target.copy()
    top = np.argsort(target)[::-1]
    shifted[top[0]] -= 0.02
    shifted[top[1]] += 0.02
    assert chi2_rejects(first, shifted)


def test_build_engine_takes_a_pool_of_checkpoint_dirs(tiny_pair, tmp_path):
    """``draft=[dir, dir]`` (and the CLI's repeated --draft): models named by their
    directories, sorted by size; a pool model with another vocabulary is refused by name."""
    from jspec.cli_common import add_model_arguments
    from jspec.llm import build_engine
    from jspec.models.loader import load_tokenizer
    from jspec.models.tiny import write_tiny_checkpoint
    from jspec.models.train import TINY_INTERMEDIATE

    target, draft = tiny_pair
    tok = load_tokenizer(target)
    mid = write_tiny_checkpoint(tmp_path / "mid", "llama", seed=3, tokenizer=tok,
                                **TINY_INTERMEDIATE)
    engine = build_engine(target, [mid, draft], policy="specrouter", warmup=False,
                          dtype="float32", max_num_seqs=2, max_model_len=64)
    assert engine.limits.draft_pool == ("draft", "mid")
    assert engine.policy.pool == ("draft", "mid")
    assert (0, 1) in engine.chains and () in engine.chains
    wide = write_tiny_checkpoint(tmp_path / "wide", "llama", seed=4, tokenizer=tok,
                                 vocab_size=len(tok) + 8, **TINY_INTERMEDIATE)
    with pytest.raises(ValueError, match="draft 'wide' vocabulary"):
        build_engine(target, [draft, wide], warmup=False, dtype="float32")
    import argparse

    parser = argparse.ArgumentParser()
    add_model_arguments(parser)
    args = parser.parse_args(["--target", target, "--draft", draft, "--draft", mid])
    assert args.draft == [draft, mid]
