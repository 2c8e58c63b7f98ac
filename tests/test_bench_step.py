"""`jspec bench step` and the per-step record it reads: shapes, stage accounting, prefill chunks,
and the engine computing only the signals its policy declares."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import make_engine, run_to_completion
from jspec.bench.step import measure_decode, measure_prefill, measure_sustained
from jspec.sampling_params import SamplingParams
from jspec.policies import make_policy
from jspec.step_state import STAGES


@pytest.fixture(scope="module")
def static_engine(engine_models):
    target, draft, _ = engine_models
    return make_engine(target, draft, policy=make_policy("static", 7, gamma=3), warmup=False)


def test_measure_decode_replays_the_step_it_timed(static_engine):
    engine = static_engine
    row = measure_decode(engine, batch=3, context=10, steps=3)
    # 3 decoding rows -> row bucket 4; γ = 3 -> γ bucket 4: a decode-only step is exactly
    # rows x (1 + γ bucket) tokens wide
    assert row["batch"] == 3 and row["gamma"] == 4
    assert row["tokens"] == 4 * (1 + 4) == engine.rc.verify_tokens(12, 4, 4, False)
    assert row["target_forward_ms"] > 0 and row["draft_ms"] > 0
    for spread in (row["loop_step_ms"], row["loop_forward_ms"]):
        assert 0 < spread["p10"] <= spread["p50"] <= spread["p90"]
    assert row["loop_overhead"] > 0
    shares = row["stage_share"]
    assert set(shares) == set(STAGES)
    assert sum(shares.values()) == pytest.approx(1.0, abs=1e-6)
    assert shares["draft"] > 0 and shares["verify"] > 0
    assert not engine.time_stages and not engine.has_unfinished_requests()


def test_measure_decode_times_the_lookup_as_the_draft(engine_models):
    """With n-gram lookup the draft stage is the host lookup, replayed on the same sequences."""
    target, _, _ = engine_models
    engine = make_engine(target, None, policy=make_policy("static", 7, gamma=3), warmup=False,
                         speculative_method="ngram", prompt_lookup_min=1)
    row = measure_decode(engine, batch=3, context=10, steps=3)
    assert row["gamma"] == 4 and row["draft_ms"] > 0
    assert engine.metrics.catch_up_tokens == 0  # nothing to catch up: no draft model


def test_a_sustained_loop_replaces_finished_sequences_and_leaves_none(static_engine):
    engine = static_engine
    context = engine.limits.max_model_len - 12  # 11 tokens of room: a sequence ends quickly
    r = measure_sustained(engine, batch=2, context=context, seconds=1.5)
    assert r["sequences"] > 2 and r["steps"] > 3 and r["seconds"] == 1.5  # replaced as they end
    assert 0 < r["step_ms"]["p10"] <= r["step_ms"]["p50"] <= r["step_ms"]["p90"]
    assert 0.0 <= r["slow_share"] <= 1.0
    assert not engine.has_unfinished_requests()


def test_measure_prefill_counts_the_engine_chunks(static_engine):
    engine = static_engine
    budget = engine.rc.max_num_batched_tokens  # 64 in the test shapes
    r = measure_prefill(engine, 100)
    assert r["chunks"] == -(-100 // budget) == 2
    assert r["prompt_tokens"] == 100 and r["target_forward_ms"] > 0
    assert not engine.has_unfinished_requests()


def test_every_step_yields_one_record_prefill_only_steps_included(engine_models):
    target, draft, _ = engine_models
    engine = make_engine(target, draft, policy=make_policy("static", 7, gamma=2), warmup=False)
    seen = []
    engine.add_step_listener(seen.append)
    run_to_completion(engine, [list(range(3, 100))], SamplingParams(max_tokens=6, temperature=0))
    assert len(seen) == engine.metrics.num_steps
    first = seen[0]  # 97 prompt tokens over a 64-token budget: a prefill-only step first
    assert first.num_decode == 0 and first.num_prefill_tokens == 64 and first.gamma_bucket == 0
    assert sum(o.num_prefill_tokens for o in seen) == 97 == engine.metrics.num_prefill_tokens
    assert sum(int(o.num_emitted.sum()) for o in seen) + 1 == 6  # the prefill's own token
    assert engine.metrics.stage_time["verify"] == pytest.approx(
        sum(o.stage_times["verify"] for o in seen))
    # the forward's width, padding included (Nightjar's prefill cost fit reads it): a token
    # bucket for a step with prefill, exactly rows x (1 + γ bucket) for a decode-only one
    rc = engine.rc
    assert first.num_padded_tokens == rc.token_bucket(64)
    for o in seen:
        expect = (rc.token_bucket(o.num_tokens) if o.num_prefill_tokens
                  else rc.seq_bucket(o.batch_size) * (1 + o.gamma_bucket))
        assert o.num_padded_tokens == expect >= o.num_tokens


@pytest.mark.parametrize("policy, present", [("static", set()), ("dsde", {"kl"})])
def test_only_declared_signals_are_computed(engine_models, policy, present):
    target, draft, _ = engine_models
    pol = make_policy(policy, 7)
    assert pol.signals == present
    engine = make_engine(target, draft, policy=pol, warmup=False)
    assert engine.runner.signals == tuple(sorted(present))
    outcomes = []
    engine.add_step_listener(outcomes.append)
    run_to_completion(engine, [[5, 6, 7, 8]], SamplingParams(max_tokens=12, temperature=0))
    verified = [o for o in outcomes if o.num_decode and o.num_verified.sum()]
    assert verified, "the policy never drafted"
    for o in verified:
        for name in ("accept_prob", "kl", "draft_entropy", "confidence"):
            row = getattr(o, name)[0, :int(o.num_verified[0])]
            assert np.isnan(row).all() != (name in present), name
