"""Sampling under speculation preserves the target distribution, and seeds reproduce."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import make_engine, run_to_completion
from jspec.sampler import (SIGNALS, SamplingTensors, greedy_tokens, processed_logprobs,
                           rejection_sample, row_uniforms, sample_tokens, verify_signals)
from jspec.sampling_params import SamplingParams
from jspec.models.transformer import dense_forward


def chi2_critical(df: int, z: float = 3.09) -> float:
    """Upper quantile of chi-square (Wilson-Hilferty); z = 3.09 is the 0.999 quantile."""
    a = 2.0 / (9.0 * df)
    return df * (1.0 - a + z * math.sqrt(a)) ** 3


def chi2_rejects(counts: np.ndarray, probs: np.ndarray, min_expected: float = 5.0) -> bool:
    """Goodness-of-fit at the 0.001 level; categories with small expectation are pooled."""
    n = counts.sum()
    expected = probs * n
    big = expected >= min_expected
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    keep = exp > 0
    if (obs[~keep] > 0).any():
        return True  # samples where the target has no mass
    obs, exp = obs[keep], exp[keep]
    stat = ((obs - exp) ** 2 / exp).sum()
    return stat > chi2_critical(len(obs) - 1)


def _sampling_tensors(n, temperature, top_k, top_p, seed0=0):
    return SamplingTensors(
        temperature=jnp.full((n,), temperature, jnp.float32),
        top_k=jnp.full((n,), top_k, jnp.int32),
        top_p=jnp.full((n,), top_p, jnp.float32),
        seeds=jnp.arange(seed0, seed0 + n, dtype=jnp.uint32),
        counters=jnp.zeros((n,), jnp.int32),
    )


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (1.3, 8, 0.95)])
@pytest.mark.parametrize("gamma", [1, 3])
def test_rejection_sampler_first_token_is_target_distributed(temperature, top_k, top_p, gamma):
    """With q ≠ p, the token emitted at the first position (accepted draft, residual sample or
    bonus) must follow the processed target distribution; a 2% shift must be detectable."""
    vocab, rows = 12, 40_000
    rng = np.random.default_rng(gamma)
    p_logits = rng.normal(0, 1.0, (gamma + 1, vocab)).astype(np.float32)
    q_logits = (p_logits[:gamma] + rng.normal(0, 1.0, (gamma, vocab))).astype(np.float32)
    st = _sampling_tensors(rows, temperature, top_k, top_p)
    p_proc = np.exp(np.asarray(processed_logprobs(jnp.asarray(p_logits)[None], st)[0]))
    q_proc = np.exp(np.asarray(processed_logprobs(jnp.asarray(q_logits)[None], st)[0]))
    # the draft samples each position from its own processed q (a context-free toy draft)
    draft_tokens = np.stack([rng.choice(vocab, rows, p=q_proc[j] / q_proc[j].sum())
                             for j in range(gamma)], axis=1).astype(np.int32)
    result = jax.jit(rejection_sample)(
        jnp.broadcast_to(p_logits, (rows, gamma + 1, vocab)),
        jnp.broadcast_to(q_logits, (rows, gamma, vocab)),
        jnp.asarray(draft_tokens), jnp.full((rows,), gamma, jnp.int32), st)
    first = np.asarray(result.tokens[:, 0])
    counts = np.bincount(first, minlength=vocab)
    target = p_proc[0] / p_proc[0].sum()
    assert (target > 0.01).sum() >= 4  # a distribution worth testing
    assert not chi2_rejects(counts, target)
    # accepted drafts really happen, and rejections too (both paths exercised)
    accepted = np.asarray(result.num_accepted)
    assert 0.05 < (accepted > 0).mean() < 0.98
    # power: the same test rejects a distribution shifted by 2% of mass
    shifted = target.copy()
    top = np.argsort(target)[::-1]
    shifted[top[0]] -= 0.02
    shifted[top[1]] += 0.02
    assert chi2_rejects(counts, shifted)


def test_row_uniforms_are_uniform_independent_and_count_free():
    """The counter-based generator: uniform on (0, 1] over seeds and steps (chi-square on 32
    bins, with the power to see a ±10% tilt), no correlation between neighbouring seeds, streams or
    draws, and number j the same whatever count was asked for."""
    n = 4096
    st = SamplingTensors(temperature=jnp.ones((n,)), top_k=jnp.zeros((n,), jnp.int32),
                         top_p=jnp.ones((n,)), seeds=jnp.arange(n, dtype=jnp.uint32) // 4,
                         counters=jnp.arange(n, dtype=jnp.int32) % 4)
    u = np.asarray(row_uniforms(st, stream=1, count=8))
    assert u.shape == (n, 8) and (u > 0).all() and (u <= 1).all()
    counts = np.histogram(u.ravel(), bins=32, range=(0, 1))[0]
    assert not chi2_rejects(counts, np.full(32, 1 / 32))
    tilted = np.linspace(0.9, 1.1, 32)
    assert chi2_rejects(counts, tilted / tilted.sum())
    other = np.asarray(row_uniforms(st, stream=2, count=8))
    for a, b in [(u[:-1, 0], u[1:, 0]), (u[:, 0], u[:, 1]), (u[:, 0], other[:, 0])]:
        assert abs(np.corrcoef(a, b)[0, 1]) < 0.06
    np.testing.assert_array_equal(np.asarray(row_uniforms(st, stream=1, count=3)), u[:, :3])


def test_sample_tokens_draws_what_rejection_sampling_without_drafts_draws():
    """Plain decoding's sampler is a specialisation: same tokens, greedy and random rows."""
    vocab, rows = 40, 64
    rng = np.random.default_rng(3)
    logits = jnp.asarray(rng.normal(0, 2.0, (rows, vocab)), jnp.float32)
    st = SamplingTensors(
        temperature=jnp.asarray(rng.choice([0.0, 0.7, 1.0, 1.4], rows), jnp.float32),
        top_k=jnp.asarray(rng.choice([0, 5, 20], rows), jnp.int32),
        top_p=jnp.asarray(rng.choice([1.0, 0.9, 0.5], rows), jnp.float32),
        seeds=jnp.arange(rows, dtype=jnp.uint32), counters=jnp.full((rows,), 7, jnp.int32))
    plain = sample_tokens(logits, st)
    full = rejection_sample(logits, jnp.zeros((rows, 0, vocab)), jnp.zeros((rows, 0), jnp.int32),
                            jnp.zeros((rows,), jnp.int32), st)
    np.testing.assert_array_equal(np.asarray(plain.tokens), np.asarray(full.tokens))
    assert plain.tokens.shape == (rows, 1) and not np.asarray(plain.num_accepted).any()
    greedy = np.asarray(st.temperature) == 0
    np.testing.assert_array_equal(np.asarray(plain.tokens)[greedy, 0],
                                  np.asarray(logits).argmax(-1)[greedy])


def test_greedy_tokens_are_numpys_argmax_first_of_ties_and_in_range():
    rng = np.random.default_rng(3)
    logits = rng.normal(size=(6, 3, 50)).astype(np.float32)
    logits[0, 0, [7, 30]] = 9.0  # a tie: the first index
    logits[1, 1, :] = -np.inf  # nothing finite: id 0, as argmax gives
    logits[2, 2, 10:] = -np.inf
    ids = np.asarray(greedy_tokens(jnp.asarray(logits)))
    assert ids.dtype == np.int32
    np.testing.assert_array_equal(ids, logits.argmax(-1))
    assert ids[0, 0] == 7 and ids[1, 1] == 0
    logits[3, 0, 4] = np.nan
    ids = np.asarray(greedy_tokens(jnp.asarray(logits)))
    assert 0 <= ids[3, 0] < 50


def test_rejection_sampler_greedy_rows_follow_argmax():
    vocab, gamma = 10, 4
    rng = np.random.default_rng(0)
    p = rng.normal(size=(3, gamma + 1, vocab)).astype(np.float32)
    q = rng.normal(size=(3, gamma, vocab)).astype(np.float32)
    argmax = p.argmax(-1)
    drafts = np.stack([argmax[0, :gamma],  # all accepted -> bonus
                       np.r_[argmax[1, :2], (argmax[1, 2] + 1) % vocab, argmax[1, 3]],
                       argmax[2, :gamma]]).astype(np.int32)
    st = _sampling_tensors(3, 0.0, 0, 1.0)
    res = rejection_sample(jnp.asarray(p), jnp.asarray(q), jnp.asarray(drafts),
                           jnp.asarray([gamma, gamma, 1], jnp.int32), st)
    assert res.num_accepted.tolist() == [4, 2, 1]
    assert res.tokens[0].tolist() == argmax[0].tolist()
    assert res.tokens[1, :3].tolist() == argmax[1, :3].tolist()
    assert res.tokens[2, :2].tolist() == argmax[2, :2].tolist()  # stopped draft: bonus at 1


def test_verify_signals_match_numpy_and_compute_only_what_is_asked():
    vocab, gamma = 10, 4
    rng = np.random.default_rng(1)
    p = rng.normal(size=(3, gamma + 1, vocab)).astype(np.float32)
    q = rng.normal(size=(3, gamma, vocab)).astype(np.float32)
    drafts = rng.integers(0, vocab, size=(3, gamma)).astype(np.int32)
    sig = verify_signals(jnp.asarray(p.reshape(-1, vocab)), jnp.asarray(q), jnp.asarray(drafts),
                         SIGNALS)
    ps = np.exp(p[:, :gamma]) / np.exp(p[:, :gamma]).sum(-1, keepdims=True)
    qs = np.exp(q) / np.exp(q).sum(-1, keepdims=True)
    np.testing.assert_allclose(sig["accept_prob"], np.minimum(ps, qs).sum(-1), rtol=1e-5)
    np.testing.assert_allclose(sig["kl"], (ps * np.log(ps / qs)).sum(-1), rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(sig["draft_entropy"], -(qs * np.log(qs)).sum(-1), rtol=1e-5)
    np.testing.assert_allclose(sig["confidence"],
                               np.take_along_axis(qs, drafts[..., None], -1)[..., 0], rtol=1e-5)
    only = verify_signals(jnp.asarray(p), jnp.asarray(q), jnp.asarray(drafts), ("kl",))
    assert set(only) == {"kl"}
    with pytest.raises(ValueError, match="unknown signals"):
        verify_signals(jnp.asarray(p), jnp.asarray(q), jnp.asarray(drafts), ("tv",))


# ----------------------------------------------------------------------------- end to end
def _exact_two_token_marginals(target, prompt, temperature):
    """Exact distributions of the 1st and 2nd sampled tokens (temperature only)."""
    cfg = target.cfg
    width = 128
    fwd = jax.jit(lambda p, t: dense_forward(p, t, cfg=cfg))
    tokens = np.zeros(width, np.int32)
    tokens[:len(prompt)] = prompt
    logits1 = np.asarray(fwd(target.params, jnp.asarray(tokens))[len(prompt) - 1])
    p1 = np.asarray(jax.nn.softmax(jnp.asarray(logits1) / temperature))
    batch = np.tile(tokens, (cfg.vocab_size, 1))
    batch[:, len(prompt)] = np.arange(cfg.vocab_size)
    logits2 = np.asarray(jax.vmap(lambda t: fwd(target.params, t)[len(prompt)])(
        jnp.asarray(batch)))
    p2_given = np.asarray(jax.nn.softmax(jnp.asarray(logits2) / temperature, axis=-1))
    return p1, p1 @ p2_given


def test_engine_sampling_matches_target_distribution(engine_models):
    """Through the whole engine (draft sampling on device, verification, commit over
    several steps): the first two sampled tokens follow the target's exact marginals, with and without
    speculation."""
    target, draft, _ = engine_models
    prompt = [5, 17, 99, 3, 250, 41, 8]
    temperature = 1.5  # flatten the tiny model's peaked distributions so more tokens are seen
    p1, p2 = _exact_two_token_marginals(target, prompt, temperature)
    n = 1600
    # only the first two tokens are tested: the first from prefill, the second from a decode
    # step (with speculation a verified draft or its correction: a third token to go keeps
    # the engine drafting there, it clips γ to what max_tokens leaves)
    params = [SamplingParams(max_tokens=3, temperature=temperature, seed=i, ignore_eos=True)
              for i in range(n)]
    for engine in (make_engine(target, None), make_engine(target, draft,
                                                          policy_options=(("gamma", 3),))):
        outs = run_to_completion(engine, [prompt] * n, params)
        tokens = np.array([outs[str(i)].token_ids for i in range(n)])
        assert not chi2_rejects(np.bincount(tokens[:, 0], minlength=p1.size), p1)
        assert not chi2_rejects(np.bincount(tokens[:, 1], minlength=p2.size), p2)
        assert engine.block_manager.num_used_blocks == 0
    assert engine.metrics.spec_decode_num_accepted_tokens > 0


def test_seeded_sampling_is_reproducible_and_batch_independent(engine_models, mixed_prompts):
    target, draft, _ = engine_models
    sp = [SamplingParams(max_tokens=12, temperature=0.8, top_p=0.95, top_k=50, seed=100 + i,
                         ignore_eos=True) for i in range(8)]
    prompts = mixed_prompts[:8]
    engine = make_engine(target, draft, policy_options=(("gamma", 3),))
    first = run_to_completion(engine, prompts, sp)
    engine2 = make_engine(target, draft, policy_options=(("gamma", 3),))
    second = run_to_completion(engine2, prompts, sp)
    assert [first[str(i)].token_ids for i in range(8)] == \
        [second[str(i)].token_ids for i in range(8)]
    # alone in the batch, a seeded request samples the same tokens
    engine2.add_request("alone", prompts[3], sp[3])
    alone = None
    while engine2.has_unfinished_requests():
        for out in engine2.step():
            alone = out
    assert alone.token_ids == first["3"].token_ids
    # and a different seed gives a different continuation
    engine2.add_request("other", prompts[3], SamplingParams(
        max_tokens=12, temperature=0.8, top_p=0.95, top_k=50, seed=7, ignore_eos=True))
    while engine2.has_unfinished_requests():
        for out in engine2.step():
            alone = out
    assert alone.token_ids != first["3"].token_ids


def test_rows_that_filter_nothing_skip_the_sort_with_the_same_logprobs():
    """The vocabulary sort runs only when some row has top-k or top-p; a row with neither gets
    exactly the same log-probabilities whether or not another row of its step filters (and
    they are its tempered log-softmax)."""
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.normal(size=(3, 2, 64)).astype(np.float32) * 3)
    plain = _sampling_tensors(3, np.array([0.7, 1.0, 0.0]), 0, 1.0)
    mixed = _sampling_tensors(3, np.array([0.7, 1.0, 0.8]), np.array([0, 0, 5]),
                              np.array([1.0, 1.0, 0.9]))
    alone = np.asarray(processed_logprobs(logits, plain))
    beside = np.asarray(processed_logprobs(logits, mixed))
    np.testing.assert_array_equal(alone[:2], beside[:2])
    temps = np.array([0.7, 1.0])[:, None, None]
    expected = np.asarray(jax.nn.log_softmax(logits[:2] / temps, axis=-1))
    np.testing.assert_allclose(alone[:2], expected, rtol=1e-6, atol=1e-6)
    # the filtering row keeps its 5 largest logits at most (top-p 0.9 of those)
    assert ((beside[2] > -1e30).sum(axis=-1) <= 5).all()
