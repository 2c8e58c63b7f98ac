"""Nightjar (policies/nightjar.py): Eq. (3) and Algorithm 1's counters against hand-computed
values, then behaviour on synthetic load-dependent environments (no model, no JAX)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from policies.base import batch_bucket
from policies.nightjar import NightjarPolicy
from policies.profile import StepProfile, synthetic_profile
from policy_helpers import SyntheticEnv, make_outcome, make_view

# goodput (tokens/s) per γ = 0..4: at B = 1 speculation wins and γ = 4 is best; at B = 32 the
# step is compute-bound, every drafted token costs more than it brings, and γ = 0 is best
TABLE = {1: [100, 140, 165, 180, 190], 32: [1000, 850, 750, 650, 600]}


def _const_profile(seconds: float) -> StepProfile:
    """A step profile whose catch-up cost is ``seconds`` for every (L, B)."""
    return StepProfile("t", "d", "cpu", "none", batch_sizes=[1, 64], query_lens=[1],
                       context_lens=[128], catch_up_lens=[1, 64],
                       target_time=np.full((2, 1, 1), 0.01), draft_time=np.full((2, 1), 0.001),
                       catch_up_time=np.full((2, 2), seconds))


def _set_context(policy: NightjarPolicy, batch_size: int, goodput, prev_gamma, counts=None):
    """Put a context in a known state: an open exploitation bin with g̃ = ``goodput``."""
    state = policy.state_dict()
    arms = policy.max_gamma + 1
    state["contexts"][str(batch_bucket(batch_size))] = {
        "counts": list(counts) if counts is not None else [10] * arms,
        "goodput": [float(g) for g in goodput], "j": 5, "H": 16, "b": 2, "tau": 1,
        "mode": "exploit", "explore_arm": 0}
    state["prev_gamma"] = prev_gamma
    policy.load_state_dict(state)


def _gamma(policy, view) -> int:
    gammas = policy.plan(view).gammas
    assert len(set(gammas.tolist())) == 1  # one arm for the whole step
    return int(gammas[0])


def _drive(policy, env, batch_sizes, views=None):
    """Plan and observe one step per entry of ``batch_sizes``; returns the γ of each step."""
    views = views if views is not None else {}
    played = []
    for b in batch_sizes:
        view = views.setdefault(b, make_view(b))
        gamma = _gamma(policy, view)
        policy.observe(env.outcome(view, gamma))
        played.append(gamma)
    return np.array(played)


# ----------------------------------------------------------------------------- Eq. (3)
def test_eq3_without_switching_term_picks_the_best_goodput():
    # 1/g̃ = [1/100, 1/90, 1/110, 1/120, 1/125] = [.01, .01111, .00909, .00833, .008] -> γ = 4
    g = [100, 90, 110, 120, 125]
    view = make_view(1, pending=[8])
    p = NightjarPolicy(4, profile=_const_profile(0.01))
    _set_context(p, 1, g, prev_gamma=2)  # γ_{t−1} > 0: the indicator is off
    np.testing.assert_allclose(p.scores(view), [0.01, 1 / 90, 1 / 110, 1 / 120, 0.008])
    assert _gamma(p, view) == 4
    off = NightjarPolicy(4, profile=_const_profile(0.01), switching_cost=False)
    _set_context(off, 1, g, prev_gamma=0)  # γ_{t−1} = 0, but the term is disabled
    assert _gamma(off, view) == 4


def test_eq3_switching_term_flips_the_choice_only_after_gamma_zero():
    # c_prefill = 0.01 s; after γ_{t−1} = 0 every γ > 0 pays 0.01/γ:
    #   γ=0: .01   γ=1: .01111+.01 = .02111   γ=2: .00909+.005 = .01409
    #   γ=3: .00833+.00333 = .01167   γ=4: .008+.0025 = .0105   -> γ = 0 (stay off)
    g = [100, 90, 110, 120, 125]
    view = make_view(1, pending=[8])
    p = NightjarPolicy(4, profile=_const_profile(0.01))
    _set_context(p, 1, g, prev_gamma=0)
    np.testing.assert_allclose(p.scores(view),
                               [0.01, 1 / 90 + 0.01, 1 / 110 + 0.005, 1 / 120 + 0.01 / 3, 0.0105])
    assert _gamma(p, view) == 0
    _set_context(p, 1, g, prev_gamma=3)  # speculating already: no switch, γ = 4 as before
    assert _gamma(p, view) == 4


def test_eq3_switching_term_favours_longer_drafts():
    # g̃ = [50, 100, 120, 119, 118], c = 0.002. Without the term: 1/120 = .008333 is smallest
    # -> γ = 2. After γ = 0: γ=1: .01+.002 = .012, γ=2: .008333+.001 = .009333,
    # γ=3: .008403+.000667 = .009070, γ=4: .008475+.0005 = .008975, γ=0: .02 -> γ = 4
    g = [50, 100, 120, 119, 118]
    view = make_view(1, pending=[8])
    p = NightjarPolicy(4, profile=_const_profile(0.002))
    _set_context(p, 1, g, prev_gamma=1)
    assert _gamma(p, view) == 2
    _set_context(p, 1, g, prev_gamma=0)
    assert _gamma(p, view) == 4


def test_c_prefill_from_profile_uses_lmax_and_decode_batch():
    # synthetic_profile's catch-up is 0.002 + 0.00004·L·B (bilinear, so interpolation is exact):
    # L_max = 9, B = 2 decoding sequences -> 0.002 + 0.00004·18 = 0.00272 s
    p = NightjarPolicy(4, profile=synthetic_profile())
    assert p.c_prefill(make_view(2, batch_size=5, pending=[3, 9])) == pytest.approx(0.00272)


def test_c_prefill_online_estimate_from_observed_catch_up():
    p = NightjarPolicy(4)
    view = make_view(2, pending=[9, 5])
    assert p.c_prefill(view) == 0.0  # nothing observed yet: no evidence of a cost
    p.observe(make_outcome(view, [2, 2], [1, 1], catch_up_tokens=40, catch_up_time=0.02))
    # 0.02 s / 40 tokens = 0.0005 s/token; the view lags (9−1) + (5−1) = 12 tokens -> 0.006 s
    assert p.c_prefill(view) == pytest.approx(0.006)
    p.observe(make_outcome(view, [2, 2], [1, 1], catch_up_tokens=10, catch_up_time=0.01))
    # decayed sums: (0.95·0.02 + 0.01) / (0.95·40 + 10) = 0.029 / 48 s/token, times 12 tokens
    assert p.c_prefill(view) == pytest.approx(0.029 / 48 * 12)
    p.observe(make_outcome(view, [0, 0], [0, 0]))  # no catch-up: the estimate is unchanged
    assert p.c_prefill(view) == pytest.approx(0.029 / 48 * 12)
    # and it enters Eq. (3) after γ = 0 (the last observed step ran γ = 0)
    _set_context(p, 2, [100, 90, 110, 120, 125], prev_gamma=0)
    c = 0.029 / 48 * 12
    np.testing.assert_allclose(p.scores(view), [0.01, 1 / 90 + c, 1 / 110 + c / 2,
                                                1 / 120 + c / 3, 0.008 + c / 4])


def test_unvisited_arms_come_first_lowest_gamma_first():
    p = NightjarPolicy(4)
    view = make_view(1)
    _set_context(p, 1, [100, 0, 120, 0, 90], prev_gamma=2, counts=[3, 0, 2, 0, 1])
    assert _gamma(p, view) == 1  # τ = 1 of a 4-step bin (H = 16): the bin stays open
    p.observe(make_outcome(view, [1], [1], step_time=0.01))
    assert p.context_stats()[1]["counts"] == [3, 1, 2, 0, 1]
    assert _gamma(p, view) == 3


# ----------------------------------------------------------------------------- Algorithm 1
def test_bin_and_block_counters_follow_algorithm_1():
    """(j, H, b, τ) after a known number of steps in one context (lines 16-22).

    start                                       (1, 1, 1, 1)
    step 1: τ=2 > √1 -> bin ends, b=2 > √1 -> block ends: j=2, H=2^1=2, b=1      (2, 2, 1, 1)
    step 2: τ=2 > √2≈1.41 -> b=2 > 1.41 -> j=3, H=4, b=1                         (3, 4, 1, 1)
    step 3: τ=2, 2 > √4=2? no                                                    (3, 4, 1, 2)
    step 4: τ=3 > 2 -> b=2, τ=1; 2 > 2? no                                       (3, 4, 2, 1)
    step 5:                                                                      (3, 4, 2, 2)
    step 6: τ=3 > 2 -> b=3 > 2 -> j=4, H=8, b=1                                  (4, 8, 1, 1)
    H=8, √8≈2.83: bins of 2 steps (τ=3 ends), 2 bins (b=3 ends): steps 7-10      (5, 16, 1, 1)
    H=16, √16=4: bins of 4 steps; steps 11, 12, 13 -> τ=4                        (5, 16, 1, 4)
    step 14: τ=5 > 4 -> b=2, τ=1                                                 (5, 16, 2, 1)
    4 bins of 4 steps: block 5 is steps 11-26                                    (6, 32, 1, 1)
    H=32, √32≈5.66: bins of 5 steps, 5 bins: block 6 is steps 27-51              (7, 64, 1, 1)
    """
    p = NightjarPolicy(2, seed=1)
    env = SyntheticEnv(lambda b, g: 100.0 + g, seed=1)

    def counters(b=1):
        s = p.context_stats()[batch_bucket(b)]
        return s["j"], s["H"], s["b"], s["tau"]

    expected = {1: (2, 2, 1, 1), 2: (3, 4, 1, 1), 3: (3, 4, 1, 2), 4: (3, 4, 2, 1),
                5: (3, 4, 2, 2), 6: (4, 8, 1, 1), 10: (5, 16, 1, 1)}
    for step in range(1, 11):
        _drive(p, env, [1])
        if step in expected:
            assert counters() == expected[step], f"after step {step}"
    # block 5, bin 1 (b = 1: exploration with probability 1/√1 = 1) spans steps 11-14; steps of
    # another context in the middle neither move B = 1's counters nor change the bin's arm
    arms = list(_drive(p, env, [1, 1, 1]))
    assert counters() == (5, 16, 1, 4)
    _drive(p, env, [32, 32, 32])
    assert counters() == (5, 16, 1, 4) and counters(32) == (3, 4, 1, 2)
    arms += list(_drive(p, env, [1]))
    assert counters() == (5, 16, 2, 1)
    assert p.context_stats()[1]["mode"] is None  # the next bin's type is drawn at its first step
    assert len(set(arms)) == 1, "an exploration bin plays one arm throughout"
    _drive(p, env, [1] * 12)  # rest of block 5: steps 15-26
    assert counters() == (6, 32, 1, 1)
    _drive(p, env, [1] * 25)  # block 6: steps 27-51
    assert counters() == (7, 64, 1, 1)
    assert sum(p.context_stats()[1]["counts"]) == 51


def test_offloaded_draft_forces_zero_and_does_not_advance_counters():
    p = NightjarPolicy(4)
    view = make_view(3, batch_size=6, draft_resident=False)
    for _ in range(5):
        assert p.plan(view).gammas.tolist() == [0, 0, 0]
        p.observe(make_outcome(view, [0, 0, 0], [0, 0, 0], step_time=0.03))  # 3 tokens / 0.03 s
    s = p.context_stats()[8]
    assert (s["j"], s["H"], s["b"], s["tau"]) == (1, 1, 1, 1)
    assert s["counts"] == [5, 0, 0, 0, 0] and s["goodput"][0] == pytest.approx(100.0)
    assert p.prev_gamma == 0


def test_possible_gammas_and_empty_view():
    p = NightjarPolicy(5)
    assert p.possible_gammas() == {0, 1, 2, 3, 4, 5}
    assert p.plan(make_view(0)).gammas.shape == (0,)


# ----------------------------------------------------------------------------- behaviour
def test_learns_the_best_gamma_for_each_batch_size():
    p = NightjarPolicy(4, seed=0)
    env = SyntheticEnv(lambda b, g: TABLE[b][g], noise=0.05, seed=0)
    sizes = [1, 32] * 1000  # the context changes every step (mid-bin changes included)
    played = _drive(p, env, sizes)
    for b, best in ((1, 4), (32, 0)):
        assert p.greedy_gamma(b) == best
        last = played[np.array(sizes) == b][-300:]
        counts = np.bincount(last, minlength=5)
        assert counts.argmax() == best and counts[best] >= 0.5 * len(last), counts


def test_picks_zero_where_speculation_loses():
    p = NightjarPolicy(4, seed=2)
    env = SyntheticEnv(lambda b, g: 500.0 - 50.0 * g, noise=0.05, seed=2)
    played = _drive(p, env, [16] * 1000)
    assert p.greedy_gamma(16) == 0
    # Algorithm 1 keeps exploring (each block restarts at b = 1, exploration probability 1),
    # so about a third of late steps are exploration; exploitation plays γ = 0
    assert np.mean(played[-500:] == 0) >= 0.5


def test_average_regret_falls_over_time():
    p = NightjarPolicy(4, seed=0)
    env = SyntheticEnv(lambda b, g: TABLE[b][g], noise=0.05, seed=0)
    sizes = np.array([1, 32] * 1000)
    played = _drive(p, env, sizes)
    regret = np.array([(max(TABLE[b]) - TABLE[b][g]) / max(TABLE[b])
                       for b, g in zip(sizes, played)])
    first, last = regret[:200].mean(), regret[-800:].mean()
    assert last < 0.75 * first, (first, last)


def test_follows_a_load_surge_to_a_new_context():
    # light load (B = 2) favours γ = 4; the surge (B = 48, bucket 64) makes γ = 0 best
    table = {2: [100, 140, 165, 180, 190], 48: [1000, 850, 750, 650, 600]}
    p = NightjarPolicy(4, seed=3)
    env = SyntheticEnv(lambda b, g: table[b][g], noise=0.05, seed=3)
    before = _drive(p, env, [2] * 600)
    after = _drive(p, env, [48] * 600)
    assert np.bincount(before[-200:], minlength=5).argmax() == 4
    assert np.bincount(after[-300:], minlength=5).argmax() == 0
    assert p.greedy_gamma(48) == 0 and p.greedy_gamma(2) == 4  # the light-load context is kept


def test_moves_to_the_new_best_arm_when_rewards_flip():
    # same batch size, the reward function changes (verification got expensive): γ = 4 -> γ = 0.
    # g̃ is a cumulative average, so recovery takes about as long as the old regime lasted
    tables = {"calm": [100, 140, 165, 180, 190], "surge": [200, 150, 130, 110, 90]}
    regime = {"now": "calm"}
    p = NightjarPolicy(4, seed=1)
    env = SyntheticEnv(lambda b, g: tables[regime["now"]][g], noise=0.05, seed=1)
    before = _drive(p, env, [4] * 300)
    assert p.greedy_gamma(4) == 4 and np.bincount(before[-100:], minlength=5).argmax() == 4
    regime["now"] = "surge"
    after = _drive(p, env, [4] * 1700)
    assert p.greedy_gamma(4) == 0
    assert np.bincount(after[-300:], minlength=5).argmax() == 0


# ----------------------------------------------------------------------------- state, options
def test_state_round_trip_through_json_gives_identical_decisions():
    p = NightjarPolicy(4, seed=5)
    env = SyntheticEnv(lambda b, g: TABLE[b][g], noise=0.05, seed=5)
    sizes = [1, 32, 32, 1, 1] * 100
    _drive(p, env, sizes)
    # mid-bin state with an online catch-up estimate and γ_{t−1} = 0 on record
    view = make_view(2, pending=[6, 2])
    p.observe(make_outcome(view, [0, 0], [0, 0], catch_up_tokens=12, catch_up_time=0.004))
    state = json.loads(json.dumps(p.state_dict()))
    q = NightjarPolicy(4, seed=99)  # a different seed: the RNG state must come from the state
    q.load_state_dict(state)
    assert json.dumps(q.state_dict(), sort_keys=True) == json.dumps(p.state_dict(),
                                                                     sort_keys=True)
    env_p = SyntheticEnv(lambda b, g: TABLE[b][g], noise=0.05, seed=7)
    env_q = SyntheticEnv(lambda b, g: TABLE[b][g], noise=0.05, seed=7)
    more = [1, 32, 32, 1, 1] * 60
    np.testing.assert_array_equal(_drive(p, env_p, more), _drive(q, env_q, more))


def test_load_state_dict_rejects_other_arms_and_garbage():
    state = NightjarPolicy(4).state_dict()
    with pytest.raises(ValueError, match="max_gamma=4"):
        NightjarPolicy(3).load_state_dict(state)
    with pytest.raises(ValueError, match="malformed nightjar state"):
        NightjarPolicy(4).load_state_dict({"max_gamma": 4, "contexts": {"1": {"j": 1}}})
    with pytest.raises(ValueError, match="belongs to policy 'ucb'"):
        NightjarPolicy(4).load_state_dict({**state, "policy": "ucb"})


@pytest.mark.parametrize("kwargs, message", [
    ({"max_gamma": -1}, "max_gamma must be an integer >= 0"),
    ({"max_gamma": "4"}, "max_gamma must be an integer >= 0"),
    ({"seed": -1}, "seed must be an integer >= 0"),
    ({"seed": 1.5}, "seed must be an integer >= 0"),
    ({"switching_cost": "yes"}, "switching_cost must be true or false"),
    ({"profile": 3}, "profile must be a path"),
    ({"profile": "/nonexistent/profile.json"}, "cannot read step profile"),
])
def test_bad_options_raise_clear_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        NightjarPolicy(**{"max_gamma": 4, **kwargs})


def test_policies_do_not_import_jax():
    code = ("import sys\n"
            "import policies.nightjar, policies.ucb, policies.heuristic\n"
            "assert 'jax' not in sys.modules and 'jspec' not in sys.modules\n")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[1])
