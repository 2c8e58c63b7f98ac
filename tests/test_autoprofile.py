"""The step-time profile an engine measures of itself (jspec/autoprofile.py): cost-aware policies
run with no options, the profile is cached per cost signature and reused, and measuring leaves
the engine as it was."""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest

from conftest import make_engine, run_to_completion
from jspec import autoprofile
from jspec.sampling_params import SamplingParams
from jspec.policies import make_policy
from jspec.policies.profile import StepProfile, model_signature

GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
MAX_GAMMA = 7  # conftest.ENGINE_KW


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("JSPEC_CACHE", str(tmp_path))
    return tmp_path / "profiles"


@pytest.fixture(scope="module")
def reference(engine_models, mixed_prompts):
    target, _, _ = engine_models
    outs = run_to_completion(make_engine(target, None), mixed_prompts[:6], GREEDY)
    return [outs[str(i)].token_ids for i in range(6)]


def test_dsd_without_options_measures_caches_and_stays_lossless(engine_models, mixed_prompts,
                                                               reference, cache, capsys):
    target, draft, _ = engine_models
    engine = make_engine(target, draft, policy=make_policy("dsd", MAX_GAMMA))
    profile = engine.policy.profile
    assert isinstance(profile, StepProfile)
    assert (profile.target, profile.draft) == (model_signature(target.cfg),
                                               model_signature(draft.cfg))
    # the grid: powers of two up to max_num_seqs (8), every γ, one context, two catch-up lags
    assert profile.batch_sizes == [1, 2, 4, 8]
    assert profile.query_lens == list(range(1, MAX_GAMMA + 2))
    assert profile.catch_up_lens == list(autoprofile.CATCH_UP_LENS)
    assert np.all(profile.target_time > 0) and np.all(profile.draft_time > 0)
    # a lag of 2 is what the draft loop's first forward absorbs (0 s of catch-up is the truth
    # there); a lag of 8 needs a catch-up forward at every batch size
    assert np.all(profile.catch_up_time >= 0) and np.all(profile.catch_up_time[-1] > 0)
    assert "measured the step-time profile for policy 'dsd'" in capsys.readouterr().err
    assert len(list(cache.glob("*.json"))) == 1
    # the engine is as it was: nothing running, no step counted, no profiling request left
    assert not engine.has_unfinished_requests() and engine.metrics.num_steps == 0
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_usable_blocks
    assert engine.policy.name == "dsd" and engine.last_outcome is None
    assert engine.time_stages is False  # it synced between stages only while measuring
    outs = run_to_completion(engine, mixed_prompts[:6], GREEDY)
    assert [outs[str(i)].token_ids for i in range(6)] == reference


def test_a_second_engine_reuses_the_cached_profile(engine_models, cache, monkeypatch):
    target, draft, _ = engine_models
    first = make_engine(target, draft, policy=make_policy("adaspec", MAX_GAMMA))

    def refuse(*args, **kwargs):
        raise AssertionError("measured again despite the cache")

    monkeypatch.setattr(autoprofile, "measure", refuse)
    second = make_engine(target, draft, policy=make_policy("dsd", MAX_GAMMA))
    np.testing.assert_array_equal(second.policy.profile.target_time,
                                  first.policy.profile.target_time)
    # another batch shape is another cost signature: not served from this cache entry
    key = autoprofile.cache_key(second)
    # nor is another machine sharing the cache directory (a home on a network file system)
    assert autoprofile.host_signature().endswith(f" x{len(os.sched_getaffinity(0))}")
    with monkeypatch.context() as m:
        m.setattr(autoprofile, "host_signature", lambda: "Other CPU (family 6 model 85) x2")
        assert autoprofile.cache_key(second) != key
    assert autoprofile.cache_key(second) == key
    second.config = dataclasses.replace(second.config, max_num_seqs=4)
    assert autoprofile.cache_key(second) != key


def test_a_damaged_cache_entry_is_measured_again(engine_models, cache, capsys):
    target, draft, _ = engine_models
    make_engine(target, draft, policy=make_policy("dsd", MAX_GAMMA))
    (entry,) = cache.glob("*.json")
    entry.write_text("{")
    engine = make_engine(target, draft, policy=make_policy("dsd", MAX_GAMMA))
    err = capsys.readouterr().err
    assert "ignoring cached step profile" in err and "measured the step-time profile" in err
    assert StepProfile.load(entry).batch_sizes == engine.policy.profile.batch_sizes


def test_cache_off_measures_without_writing(engine_models, cache, monkeypatch):
    target, draft, _ = engine_models
    monkeypatch.setenv("JSPEC_PROFILE_CACHE", "off")
    engine = make_engine(target, draft, policy=make_policy("dsd", MAX_GAMMA))
    assert isinstance(engine.policy.profile, StepProfile) and not cache.exists()


def test_a_given_profile_is_not_replaced(engine_models, cache):
    from policy_helpers import synthetic_profile

    target, draft, _ = engine_models
    given = synthetic_profile()
    given.target, given.draft = model_signature(target.cfg), model_signature(draft.cfg)
    engine = make_engine(target, draft, policy=make_policy("dsd", MAX_GAMMA, profile=given))
    assert engine.policy.profile is given and not cache.exists()



def test_nightjar_measures_a_profile_for_its_prior_unless_told_not_to(engine_models, cache):
    target, draft, _ = engine_models
    engine = make_engine(target, draft, policy=make_policy("nightjar", MAX_GAMMA))
    assert isinstance(engine.policy.profile, StepProfile) and len(list(cache.glob("*.json"))) == 1
    plain = make_engine(target, draft, policy=make_policy("nightjar", MAX_GAMMA, prior=False))
    assert plain.policy.profile is None and not plain.policy.needs_profile


def test_catch_up_is_timed_on_the_lag_alone(engine_models, cache, monkeypatch):
    """Each catch-up point times a draft that lags ``lag`` tokens, never one that has yet to
    read a fresh sequence's prompt (which the grid's replacements would otherwise leave it)."""
    target, draft, _ = engine_models
    engine = make_engine(target, draft)  # static: no profile of its own
    seen = []
    step = autoprofile._catch_up_step

    def spy(engine, forced, lag):
        outcome = step(engine, forced, lag)
        seen.append((lag, outcome.batch_size, outcome.catch_up_tokens))
        return outcome

    monkeypatch.setattr(autoprofile, "_catch_up_step", spy)
    profile = autoprofile.measure(engine)
    assert [b for lag, b, _ in seen if lag == autoprofile.CATCH_UP_LENS[0]] \
        == profile.batch_sizes
    for lag, batch, tokens in seen:
        assert tokens <= batch * lag, (lag, batch, tokens)
    assert any(tokens > 0 for _, _, tokens in seen)


def test_an_engine_not_warmed_up_measures_before_its_first_request(
        engine_models, mixed_prompts, cache, monkeypatch):
    """Measuring times compiled steps: an engine built without its warm-up (the CLIs and
    benchmarks warm up themselves, with a progress bar, then call ``ensure_profile``) measures
    before its first request when nobody does."""
    target, draft, _ = engine_models
    monkeypatch.setenv("JSPEC_PROFILE_CACHE", "off")
    engine = make_engine(target, draft, policy=make_policy("dsd", MAX_GAMMA), warmup=False)
    assert engine.policy.profile is None
    engine.add_request("0", mixed_prompts[0], GREEDY)
    assert isinstance(engine.policy.profile, StepProfile)
    assert engine.has_unfinished_requests() and engine.metrics.num_steps == 0
