"""UCB (policies/ucb.py) and HF's assisted-generation heuristic (policies/heuristic.py): scores and
length updates against hand-computed values, behaviour on synthetic environments, state round
trips, option validation (no model, no JAX)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from jspec.policies.heuristic import HeuristicPolicy
from jspec.policies.ucb import UCBPolicy
from policy_helpers import SyntheticEnv, make_outcome, make_view

TABLE = {1: [100, 140, 165, 180, 190], 32: [1000, 850, 750, 650, 600]}


def _reward_step(policy, view, gamma, goodput):
    """Observe a step (not planned by ``policy``) in which every sequence ran ``gamma`` and the
    goodput was ``goodput`` tokens/s."""
    n = view.num_decode
    policy.observe(make_outcome(view, [gamma] * n, [0] * n, num_emitted=[1] * n,
                                step_time=n / goodput))


def _drive(policy, env, batch_sizes):
    views, played = {}, []
    for b in batch_sizes:
        view = views.setdefault(b, make_view(b))
        plan = policy.plan(view)
        gammas = plan.gammas
        assert len(set(gammas.tolist())) == 1
        policy.observe(env.outcome(view, int(gammas[0]), plan.note))
        played.append(int(gammas[0]))
    return np.array(played)


# ----------------------------------------------------------------------------- UCB
def test_ucb_scores_match_hand_computation():
    p = UCBPolicy(2, c=0.5)
    view = make_view(1)
    for gamma, goodput in [(0, 100), (0, 80), (1, 200), (2, 120), (2, 140), (2, 160)]:
        _reward_step(p, view, gamma, goodput)
    # t = 6, ln 6 = 1.791759; rewards normalised by the max seen, 200:
    #   γ=0: n=2, mean 90  -> 0.45 + 0.5·sqrt(1.791759/2) = 0.45 + 0.473255 = 0.923255
    #   γ=1: n=1, mean 200 -> 1.00 + 0.5·sqrt(1.791759)   = 1.00 + 0.669283 = 1.669283
    #   γ=2: n=3, mean 140 -> 0.70 + 0.5·sqrt(1.791759/3) = 0.70 + 0.386411 = 1.086411
    np.testing.assert_allclose(p.scores(1), [0.923255, 1.669283, 1.086411], atol=1e-6)
    np.testing.assert_allclose(p.scores(1), [
        0.45 + 0.5 * math.sqrt(math.log(6) / 2), 1.0 + 0.5 * math.sqrt(math.log(6)),
        0.7 + 0.5 * math.sqrt(math.log(6) / 3)])
    assert p.plan(view).gammas.tolist() == [1]
    stats = p.arm_stats()["all"]
    assert stats["counts"] == [2, 1, 3] and stats["max"] == pytest.approx(200)
    np.testing.assert_allclose(stats["mean"], [90, 200, 140])


def test_ucb_plays_unvisited_arms_first_in_order():
    p = UCBPolicy(3)
    view = make_view(2)
    order = []
    for _ in range(4):
        gamma = int(p.plan(view).gammas[0])
        order.append(gamma)
        _reward_step(p, view, gamma, 100.0 * (gamma + 1))
    assert order == [0, 1, 2, 3]
    assert np.all(np.isfinite(p.scores(2)))
    assert np.isinf(UCBPolicy(3).scores(2)).all()


def test_ucb_converges_to_the_best_arm():
    p = UCBPolicy(4)
    env = SyntheticEnv(lambda b, g: TABLE[b][g], noise=0.05, seed=0)
    played = _drive(p, env, [1] * 1500)
    counts = np.bincount(played[-300:], minlength=5)
    assert counts.argmax() == 4 and counts[4] >= 0.7 * 300, counts


def test_ucb_per_batch_bucket_learns_each_load():
    env = SyntheticEnv(lambda b, g: TABLE[b][g], noise=0.05, seed=1)
    sizes = np.array([1, 32] * 1000)
    p = UCBPolicy(4, per_batch_bucket=True)
    played = _drive(p, env, sizes)
    assert set(p.arm_stats()) == {"1", "32"}
    for b, best in ((1, 4), (32, 0)):
        counts = np.bincount(played[sizes == b][-300:], minlength=5)
        assert counts.argmax() == best, (b, counts)
    shared = UCBPolicy(4)  # BanditSpec's context-free bandit: one set of arms for all loads
    _drive(shared, env, sizes[:200])
    assert set(shared.arm_stats()) == {"all"}


def test_ucb_offloaded_draft_forces_zero_and_learns_arm_zero():
    p = UCBPolicy(4)
    view = make_view(3, draft_resident=False)
    assert p.plan(view).gammas.tolist() == [0, 0, 0]
    p.observe(make_outcome(view, [0, 0, 0], [0, 0, 0], step_time=0.03))
    assert p.arm_stats()["all"]["counts"] == [1, 0, 0, 0, 0]


def test_ucb_state_round_trip_gives_identical_decisions():
    env = SyntheticEnv(lambda b, g: TABLE[b][g], noise=0.05, seed=2)
    p = UCBPolicy(4, c=0.3, per_batch_bucket=True)
    _drive(p, env, [1, 32, 1] * 100)
    q = UCBPolicy(4, c=0.3, per_batch_bucket=True)
    q.load_state_dict(json.loads(json.dumps(p.state_dict())))
    assert json.dumps(q.state_dict(), sort_keys=True) == json.dumps(p.state_dict(),
                                                                     sort_keys=True)
    more = [1, 32, 32] * 50
    a = _drive(p, SyntheticEnv(lambda b, g: TABLE[b][g], noise=0.05, seed=3), more)
    b = _drive(q, SyntheticEnv(lambda b, g: TABLE[b][g], noise=0.05, seed=3), more)
    np.testing.assert_array_equal(a, b)


def test_ucb_load_state_dict_rejects_mismatches():
    state = UCBPolicy(4).state_dict()
    with pytest.raises(ValueError, match="max_gamma=4"):
        UCBPolicy(3).load_state_dict(state)
    with pytest.raises(ValueError, match="per_batch_bucket"):
        UCBPolicy(4, per_batch_bucket=True).load_state_dict(state)
    with pytest.raises(ValueError, match="malformed ucb state"):
        UCBPolicy(4).load_state_dict({**state, "bandits": {"all": {"counts": [1]}}})


@pytest.mark.parametrize("kwargs, message", [
    ({"max_gamma": -2}, "max_gamma must be an integer >= 0"),
    ({"c": -1.0}, "c .exploration constant. must be a finite number >= 0"),
    ({"c": "big"}, "c .exploration constant. must be a finite number >= 0"),
    ({"c": float("inf")}, "c .exploration constant. must be a finite number >= 0"),
    ({"per_batch_bucket": "yes"}, "per_batch_bucket must be true or false"),
])
def test_ucb_bad_options(kwargs, message):
    with pytest.raises(ValueError, match=message):
        UCBPolicy(**{"max_gamma": 4, **kwargs})


# ----------------------------------------------------------------------------- heuristic
def _heuristic_step(policy, view, accepted):
    """Plan, then observe ``accepted[i]`` of each sequence's planned tokens accepted."""
    gammas = policy.plan(view).gammas
    policy.observe(make_outcome(view, gammas, np.minimum(accepted, gammas)))
    return gammas.tolist()


def test_heuristic_starts_at_hf_default_capped_by_max_gamma():
    assert HeuristicPolicy(4).plan(make_view(2)).gammas.tolist() == [4, 4]  # min(20, 4)
    assert HeuristicPolicy(7, initial=3).plan(make_view(1)).gammas.tolist() == [3]
    assert HeuristicPolicy(0).plan(make_view(1)).gammas.tolist() == [0]


def test_heuristic_plus_two_on_full_acceptance_minus_one_otherwise():
    p = HeuristicPolicy(5, initial=2)
    view = make_view(1)
    # planned: 2 (all 2 accepted -> 4), 4 (all -> 6, capped at 5), 5 (3 of 5 -> 4),
    # 4 (0 -> 3), 3 (-> 2), 2 (-> 1), 1 (0 of 1 -> stays at the floor 1), 1 (1 of 1 -> 3)
    planned = [_heuristic_step(p, view, [a])[0] for a in [2, 4, 3, 0, 0, 0, 0, 1]]
    assert planned == [2, 4, 5, 4, 3, 2, 1, 1]
    assert p.lengths() == {"r0": 3}


def test_heuristic_is_per_request_and_forgets_departed_requests():
    p = HeuristicPolicy(6, initial=3)
    view = make_view(request_ids=["a", "b"])
    assert _heuristic_step(p, view, [3, 1]) == [3, 3]  # a: all accepted -> 5; b: -> 2
    assert p.lengths() == {"a": 5, "b": 2}
    assert _heuristic_step(p, make_view(request_ids=["b", "c"]), [0, 3]) == [2, 3]
    assert p.lengths() == {"b": 1, "c": 5}  # "a" left the batch and was dropped
    assert p.plan(make_view(request_ids=["a"])).gammas.tolist() == [3]  # back at the start
    assert p.lengths() == {"a": 3}


def test_heuristic_ignores_steps_with_nothing_verified():
    p = HeuristicPolicy(4, initial=2)
    view = make_view(1)
    p.plan(view)
    p.observe(make_outcome(view, [2], [0], num_drafted=[0], num_verified=[0]))
    assert p.lengths() == {"r0": 2}
    offloaded = make_view(1, draft_resident=False)
    assert p.plan(offloaded).gammas.tolist() == [0]
    p.observe(make_outcome(offloaded, [0], [0]))
    assert p.lengths() == {"r0": 2}


def test_heuristic_state_round_trip_and_validation():
    p = HeuristicPolicy(6, initial=2)
    view = make_view(request_ids=["x", "y", "z"])
    for accepted in ([2, 0, 1], [4, 1, 0], [0, 0, 3]):
        _heuristic_step(p, view, accepted)
    q = HeuristicPolicy(6, initial=2)
    q.load_state_dict(json.loads(json.dumps(p.state_dict())))
    assert q.lengths() == p.lengths()
    assert q.plan(view).gammas.tolist() == p.plan(view).gammas.tolist()
    with pytest.raises(ValueError, match="max_gamma=6"):
        HeuristicPolicy(4).load_state_dict(p.state_dict())
    with pytest.raises(ValueError, match="outside"):
        HeuristicPolicy(6).load_state_dict({"max_gamma": 6, "lengths": {"x": 9}})
    with pytest.raises(ValueError, match="malformed heuristic state"):
        HeuristicPolicy(6).load_state_dict({"max_gamma": 6})


@pytest.mark.parametrize("kwargs, message", [
    ({"max_gamma": -1}, "max_gamma must be an integer >= 0"),
    ({"initial": 0}, "initial must be an integer >= 1"),
    ({"initial": "3"}, "initial must be an integer >= 1"),
])
def test_heuristic_bad_options(kwargs, message):
    with pytest.raises(ValueError, match=message):
        HeuristicPolicy(**{"max_gamma": 4, **kwargs})


def test_possible_gammas_cover_every_planned_gamma():
    assert UCBPolicy(3).possible_gammas() == {0, 1, 2, 3}
    assert HeuristicPolicy(3).possible_gammas() == {0, 1, 2, 3}
