"""Every registered policy end to end on the tiny engine models: greedy output stays exactly the
target-only output, decisions show up in the metrics, learned state survives a restart."""

from __future__ import annotations

import json
import pathlib

import pytest

from conftest import make_engine, run_to_completion
from jspec.sampling_params import SamplingParams
from jspec.policies import POLICIES, make_policy
from policy_helpers import free_draft_profile, synthetic_profile

GREEDY = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
MAX_GAMMA = 7  # conftest.ENGINE_KW: shapes shared with the other engine tests
# The policies the README documents and `--policy` offers, written out here so that dropping or
# renaming one in the registry (or registering an undocumented one) fails a test.
DOCUMENTED = ("auto", "static", "off", "nightjar", "dsde", "adaspec", "dsd", "ucb", "adaedl",
              "heuristic", "specrouter")


def _policy(name, target, draft):
    options = ({"profile": free_draft_profile(target.cfg, draft.cfg)}
               if name in ("adaspec", "dsd") else {})
    if name == "adaspec":  # its verifier trims verify lengths between draft and verify: the
        options["verifier"] = True  # engine's one path through Policy.select
    if name == "adaedl":
        # the default λ = 0.4 stops at H* = 1.8 nats, below every draft entropy of these random
        # models (about 2.6 to 5 nats): nothing would be drafted and losslessness not tested.
        # λ = 0.05 gives H* = 4.5: drafts that the entropy rule cuts short on device.
        options = {"lam": 0.05}
    return make_policy(name, MAX_GAMMA, **options)


@pytest.fixture(scope="module")
def prompts(ten_prompts):
    return ten_prompts


@pytest.fixture(scope="module")
def reference(greedy_reference):
    return greedy_reference  # conftest: GREEDY's outputs from the target alone


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_policy_is_lossless_end_to_end(name, engine_models, prompts, reference, capsys):
    target, draft, _ = engine_models
    engine = make_engine(target, draft, policy=_policy(name, target, draft))
    outs = run_to_completion(engine, prompts, GREEDY)
    for i in range(len(prompts)):
        assert outs[str(i)].token_ids == reference[i], f"{name}: prompt {i} differs"
    # the policy prices its plans at the γ buckets the engine compiled
    assert engine.planner.policy.gamma_buckets == tuple(engine.gamma_buckets)
    m = engine.metrics
    hist = m.as_dict()["gamma_histogram_by_batch"]
    assert sum(sum(h) for h in hist.values()) == int(m.gamma_histogram.sum()) > 0
    assert all(int(b) & (int(b) - 1) == 0 for b in hist)  # power-of-two buckets
    # lossless only means something if the policy did speculate: drafts were verified, some
    # accepted (the draft agrees with the target about 60% of the time), and γ > 0 was planned
    if name == "off":
        assert m.spec_decode_num_draft_tokens == 0 and m.gamma_histogram[1:].sum() == 0
    else:
        assert m.spec_decode_num_draft_tokens > 0, f"{name} never drafted"
        assert m.spec_decode_num_accepted_tokens > 0, f"{name}: nothing accepted"
        assert m.gamma_histogram[1:].sum() > 0
    if name == "adaedl":  # it plans Γmax and the entropy rule stopped some drafts early
        assert m.spec_decode_num_draft_tokens < MAX_GAMMA * m.spec_decode_num_drafts
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


def test_registry_holds_exactly_the_documented_policies():
    assert sorted(POLICIES) == sorted(DOCUMENTED)
    readme = (pathlib.Path(__file__).resolve().parents[1] / "README.md").read_text()
    section = readme.split("\n## Policies\n", 1)[1].split("\n## ", 1)[0]
    table = {line.split("`")[1] for line in section.splitlines() if line.startswith("| `")}
    assert table == set(DOCUMENTED)  # the README's policy table


@pytest.mark.parametrize("name", DOCUMENTED)
def test_each_policy_builds_by_name(name, engine_models):
    target, draft, _ = engine_models
    policy = _policy(name, target, draft)
    assert type(policy) is POLICIES[name] and policy.name == name
    assert policy.max_gamma == MAX_GAMMA
    gammas = policy.possible_gammas()
    assert gammas <= set(range(MAX_GAMMA + 1)) and gammas
    assert (gammas == {0}) == (name == "off")  # only 'off' never drafts
    with pytest.raises(ValueError, match=f"unknown option 'no_such_option' for policy '{name}'"):
        make_policy(name, MAX_GAMMA, no_such_option=1)


def test_unknown_policy_lists_every_policy():
    with pytest.raises(ValueError) as e:
        make_policy("nope", 4)
    for name in DOCUMENTED:
        assert name in str(e.value)


def test_the_view_carries_the_prefill_backlog(engine_models, prompts):
    """Planner.batch_view fills the prefill backlog from the scheduler: ten prompts under a
    64-token budget leave prompts waiting for prefill beside the first decoding rows."""
    from jspec.policies.static import StaticPolicy

    class Recorder(StaticPolicy):
        name = "static"
        views = []

        def plan(self, view):
            self.views.append(view)
            return super().plan(view)

    target, draft, _ = engine_models
    policy = Recorder(MAX_GAMMA)
    run_to_completion(make_engine(target, draft, policy=policy), prompts, GREEDY)
    waiting = [v for v in policy.views if v.prefill_backlog_requests]
    assert waiting and policy.views[-1].prefill_backlog_requests == 0
    assert all(v.prefill_backlog_tokens >= v.prefill_backlog_requests for v in policy.views)
