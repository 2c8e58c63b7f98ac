"""Every registered policy end to end on the tiny engine models: greedy output stays exactly the
target-only output, decisions show up in the metrics, learned state survives a restart."""

from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import make_engine, run_to_completion
from jspec.sampling_params import SamplingParams
from policies import POLICIES, make_policy
from policies.profile import StepProfile, model_signature, synthetic_profile

GREEDY = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
MAX_GAMMA = 7  # conftest.ENGINE_KW: shapes shared with the other engine tests


def _profile(target, draft) -> StepProfile:
    """A synthetic cost model where drafting is nearly free (so the cost-aware policies do
    speculate with the tiny random draft, whose confidences are low), labelled for the test
    models (policies check the labels)."""
    p = synthetic_profile(target_cost=0.02, draft_cost=1e-6, per_token=1e-7)
    p.target, p.draft = model_signature(target.cfg), model_signature(draft.cfg)
    return p


def _policy(name, target, draft):
    options = {"profile": _profile(target, draft)} if name in ("adaspec", "dsd") else {}
    return make_policy(name, MAX_GAMMA, **options)


@pytest.fixture(scope="module")
def prompts(mixed_prompts):
    return mixed_prompts[:10]


@pytest.fixture(scope="module")
def reference(engine_models, prompts):
    target, _, _ = engine_models
    outs = run_to_completion(make_engine(target, None), prompts, GREEDY)
    return [outs[str(i)].token_ids for i in range(len(prompts))]


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_policy_is_lossless_end_to_end(name, engine_models, prompts, reference, capsys):
    target, draft, _ = engine_models
    engine = make_engine(target, draft, policy=_policy(name, target, draft))
    outs = run_to_completion(engine, prompts, GREEDY)
    for i in range(len(prompts)):
        assert outs[str(i)].token_ids == reference[i], f"{name}: prompt {i} differs"
    m = engine.metrics
    hist = m.as_dict()["gamma_histogram_by_batch"]
    assert sum(sum(h) for h in hist.values()) == int(m.gamma_histogram.sum()) > 0
    assert all(int(b) & (int(b) - 1) == 0 for b in hist)  # power-of-two buckets
    with capsys.disabled():  # the per-step decision overhead, for the record (not asserted)
        print(f"\n  policy {name:<9}: {m.policy_time / max(m.policy_calls, 1) * 1e6:8.1f} µs per "
              f"step = {m.policy_time / m.step_time:.3%} of step time; acceptance "
              f"{m.acceptance_rate:.2f}; γ histogram {m.gamma_histogram.tolist()}")


def test_policy_state_survives_a_restart(engine_models, prompts, tmp_path):
    target, draft, _ = engine_models
    engine = make_engine(target, draft, policy=make_policy("nightjar", MAX_GAMMA, seed=3))
    run_to_completion(engine, prompts[:4], GREEDY)
    path = tmp_path / "nightjar.json"
    engine.save_policy_state(str(path))
    saved = json.loads(path.read_text())
    assert saved["policy"] == "nightjar" and saved["state"]
    fresh = make_engine(target, draft, policy=make_policy("nightjar", MAX_GAMMA, seed=3))
    fresh.load_policy_state(str(path))
    assert json.dumps(fresh.policy.state_dict(), sort_keys=True) == json.dumps(
        engine.policy.state_dict(), sort_keys=True)
    other = make_engine(target, draft, policy=make_policy("ucb", MAX_GAMMA))
    with pytest.raises(ValueError, match="belongs to policy 'nightjar'"):
        other.load_policy_state(str(path))
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ValueError, match="not JSON"):
        fresh.load_policy_state(str(tmp_path / "bad.json"))


def test_profile_for_other_models_is_refused(engine_models):
    target, draft, _ = engine_models
    with pytest.raises(ValueError, match="re-run `jspec profile`"):
        make_engine(target, draft, policy=make_policy("dsd", MAX_GAMMA,
                                                      profile=synthetic_profile()))
    with pytest.raises(ValueError, match="needs a step-time profile"):
        make_policy("adaspec", MAX_GAMMA)


def test_unknown_policy_lists_every_policy():
    with pytest.raises(ValueError) as e:
        make_policy("nope", 4)
    for name in POLICIES:
        assert name in str(e.value)
    assert np.all([POLICIES[n].name == n for n in POLICIES])
