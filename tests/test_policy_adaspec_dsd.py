"""AdaSpec and DSD against hand-computed values (pure numpy, no model, no JAX).

The hand-made profile has linear costs so every number below can be checked on paper:
target_step(B, q, L) = 10 + B·q and draft_step(B, L) = 1 for any B, q, L (bilinear in (B, q), so
the profile's multilinear interpolation and extrapolation reproduce it exactly). With B = n = 2
decoding sequences:

* a plan of γ for both: T(γ) = γ·1 + 10 + 2·(1 + 2γ/2) = 12 + 3γ (= profile.step_time(2, γ, L));
* verifying K tokens in total after D draft forwards: T = D + 12 + K.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from jspec.policies.adaspec import AdaSpecPolicy, cumulative_confidence
from jspec.policies.base import expected_tokens
from jspec.policies.dsd import DSDPolicy
from jspec.policies.profile import StepProfile
from policy_helpers import linear_profile, make_outcome, make_stats, make_view, synthetic_profile


def adaspec(**kw) -> AdaSpecPolicy:
    """AdaSpec as the paper states it (no calibration, probe or optimism: the deviations of the module
    docstring's (d) have their own tests below), by default on the hand profile."""
    kw.setdefault("max_gamma", 4)
    kw.setdefault("calibrate", False)
    kw.setdefault("probe_tokens", 0)
    kw.setdefault("confidence_z", 0.0)
    kw.setdefault("verifier", True)
    kw.setdefault("stop_price", "paper")
    kw.setdefault("profile", linear_profile())
    return AdaSpecPolicy(**kw)


def device_drafts(confidences, gamma: int, stop_confidence: float) -> int:
    """The device rule (jspec/device_steps.py): token j (0-based) is drafted iff j < γ and the
    product of the confidences of the tokens before it is ≥ stop_confidence."""
    product, drafted = 1.0, 0
    for j, q in enumerate(confidences):
        if j >= gamma or product < stop_confidence:
            break
        drafted += 1
        product *= q
    return drafted


VIEW = make_view(2, max_gamma=4)  # n = B = 2, contexts 100


# ---------------------------------------------------------------------------- AdaSpec model
def test_profile_is_the_hand_model():
    p = linear_profile()
    assert p.target_step(2, 3, 100) == pytest.approx(16.0)
    assert p.target_step(300, 2.5, 5000) == pytest.approx(760.0)  # extrapolated, still exact
    assert [p.step_time(2, g, 100) for g in range(4)] == pytest.approx([12, 15, 18, 21])


def test_cumulative_confidence_on_known_confidences():
    conf = [[0.9, 0.8, 0.5], [0.5, 0.5, 0.5]]
    c = cumulative_confidence(np.array(conf), [3, 3])
    assert c == pytest.approx(np.array([[0.9, 0.72, 0.36], [0.5, 0.25, 0.125]]))


@pytest.mark.parametrize("batch,ctx", [(2, 100), (3, 640), (512, 100_000), (1, 5)])
def test_vectorised_target_costs_match_the_profile(batch, ctx):
    # select() reads T from one vectorised pass; it must equal the profile's own lookups,
    # inside and past the grid (synthetic profile: query lengths 1..8, extrapolated past 8)
    pol = AdaSpecPolicy(max_gamma=4, profile=synthetic_profile())
    view = make_view(batch, max_gamma=4, context_lens=[ctx] * batch)
    costs = pol.target_costs(view, 12 * batch)
    expected = [pol.profile.target_step(batch, 1 + k / batch, ctx) for k in range(12 * batch + 1)]
    assert costs == pytest.approx(expected, rel=1e-9, abs=1e-12)


def test_cumulative_confidence_ignores_undrafted_positions():
    c = cumulative_confidence(np.array([[0.5, 0.5, 0.9], [np.nan, 0.7, 0.7]]), [2, 0])
    assert c == pytest.approx(np.array([[0.5, 0.25, 0.0], [0.0, 0.0, 0.0]]))


# ---------------------------------------------------------------------------- adaptive drafter
def test_drafter_stop_point_with_the_prior():
    pol = adaspec()
    assert pol.mean_confidence == 0.6
    # predicted N(γ) = 2·Σ 0.6^j = 2, 3.2, 3.92, 4.352; E = N/(12 + 3γ): rises to γ = 2 only
    assert [pol.predicted_efficiency(VIEW, g) for g in range(4)] == pytest.approx(
        [2 / 12, 3.2 / 15, 3.92 / 18, 4.352 / 21])
    plan = pol.plan(VIEW)
    assert plan.gammas.tolist() == [2, 2]
    # τ = (T(2) − T(0))/(2·2) = 1.5; threshold = τ·E*/c̄ = 1.5·(3.92/18)/0.6
    threshold = 1.5 * (3.92 / 18) / 0.6
    assert plan.stop_confidence.tolist() == pytest.approx([threshold] * 2)  # 0.5444
    assert plan.stop_entropy is None
    # device: token 1 needs q(x_0) ≥ 0.5444
    assert device_drafts([0.9, 0.8, 0.7], 2, threshold) == 2  # capped by γ* = 2
    assert device_drafts([0.5, 0.9, 0.9], 2, threshold) == 1


def test_drafter_after_observing_confidence():
    pol = adaspec()
    # running mean over verified positions, NaN ignored: (0.9 + 0.7)/2
    pol.observe(make_outcome(VIEW, [2, 0], [1, 0],
                             confidence=[[0.9, 0.7], [np.nan, np.nan]]))
    assert pol.mean_confidence == pytest.approx(0.8)
    # N = 2·Σ 0.8^j = 2, 3.6, 4.88, 5.904, 6.7232; T = 12..24; E peaks at γ = 3
    assert [pol.predicted_efficiency(VIEW, g) for g in range(5)] == pytest.approx(
        [2 / 12, 3.6 / 15, 4.88 / 18, 5.904 / 21, 6.7232 / 24])
    plan = pol.plan(VIEW)
    assert plan.gammas.tolist() == [3, 3]
    threshold = 1.5 * (5.904 / 21) / 0.8  # τ = (21 − 12)/(3·2) = 1.5; = 0.52714
    assert plan.stop_confidence[0] == pytest.approx(threshold)
    # products before tokens 0, 1, 2:
    assert device_drafts([0.9, 0.8, 0.5], 3, threshold) == 3  # 1, 0.9, 0.72
    assert device_drafts([0.9, 0.5, 0.9], 3, threshold) == 2  # 1, 0.9, 0.45 < 0.527: stop
    assert device_drafts([0.8, 0.8, 0.8], 3, threshold) == 3  # confidences at c̄ draft all γ*
    pol.observe(make_outcome(VIEW, [1, 1], [1, 1], confidence=[[0.2], [0.2]]))
    assert pol.mean_confidence == pytest.approx((1.6 + 0.4) / 4)


def test_calibration_rescales_confidence_to_judged_acceptance():
    pol = adaspec(calibrate=True)
    # row 0 accepted all 3 (3 judged tokens), row 1 accepted 1 and was rejected at its 2nd
    # (2 judged); the 3rd token of row 1 is unjudged and does not count
    pol.observe(make_outcome(VIEW, [3, 3], [3, 1], confidence=[[0.5] * 3, [0.5] * 3]))
    assert (pol.judged_accepted, pol.judged_confidence) == (4.0, 2.5)
    kappa = (4 + 4) / (2.5 + 4)  # 4 tokens of κ = 1 as the prior
    assert pol.calibration == pytest.approx(kappa)
    assert pol.mean_confidence == 0.5 and pol.predicted_confidence == pytest.approx(0.5 * kappa)
    assert pol.calibrated([0.5, 0.9]) == pytest.approx([0.5 * kappa, 1.0])
    # confidence 0.5 but every token accepted: κ → 2, c̄' → 1 and the drafter goes to Γmax,
    # where the paper's rule (c̄ = 0.5: E = 2/12, 3/15, 3.5/18) stops at γ = 1
    paper = adaspec()
    for p in (pol, paper):
        for _ in range(50):
            p.observe(make_outcome(VIEW, [3, 3], [3, 3], confidence=[[0.5] * 3, [0.5] * 3]))
    assert pol.predicted_confidence == pytest.approx(1.0, abs=0.02)
    plan = pol.plan(VIEW)
    assert plan.gammas.tolist() == [4, 4] and paper.plan(VIEW).gammas.tolist() == [1, 1]
    best = pol.predicted_efficiency(VIEW, 4)
    tau = (pol.step_time(VIEW, 8, 4) - pol.step_time(VIEW, 0, 0)) / 8
    assert plan.stop_confidence[0] == pytest.approx(
        tau * best / (pol.predicted_confidence * pol.calibration ** 3), rel=1e-6)  # κ^(γ*−1)
    # the verifier ranks calibrated products: with κ ≈ 2 a 0.5-confidence token is a sure one
    lengths = pol.select(VIEW, make_stats([[0.5] * 4, [0.5] * 4]))
    assert lengths.tolist() == [4, 4]
    assert paper.select(VIEW, make_stats([[0.5] * 4, [0.5] * 4])).tolist() != [4, 4]


def test_probe_drafts_until_confidence_was_seen():
    """A prior under which γ = 0 wins is corrected: the first steps draft one token, verify it
    whatever the verifier would say, and the observed confidence takes over."""
    pol = adaspec(confidence_prior=0.1, probe_tokens=4)
    stuck = adaspec(confidence_prior=0.1)  # the paper's rule: no probe
    assert stuck.plan(VIEW).gammas.tolist() == [0, 0]  # E(1) = 2.2/15 < E(0) = 2/12
    for gamma in (1, 4):  # after the first probe c̄ = 0.9 asks for Γmax; still a probe
        plan = pol.plan(VIEW)
        assert plan.gammas.tolist() == [gamma] * 2 and plan.stop_confidence.tolist() == [0, 0]
        assert pol.select(VIEW, make_stats([[0.1], [0.1]])) is None  # keep everything
        pol.observe(make_outcome(VIEW, [1, 1], [1, 1], confidence=[[0.9], [0.9]]))
    assert pol.conf_count == 4 and pol.mean_confidence == pytest.approx(0.9)
    plan = pol.plan(VIEW)  # probing is over: the drafter's own choice, with its stop rule
    assert plan.gammas.tolist() == [4, 4] and plan.stop_confidence[0] > 0
    assert pol.select(VIEW, make_stats([[0.9] * 4, [0.1] * 4])) is not None


def test_adaspec_state_keeps_the_calibration_and_loads_older_states():
    pol = adaspec(calibrate=True)
    pol.observe(make_outcome(VIEW, [2, 2], [2, 0], confidence=[[0.6, 0.6], [0.6, 0.6]]))
    state = json.loads(json.dumps(pol.state_dict()))
    fresh = adaspec(calibrate=True)
    fresh.load_state_dict(state)
    assert fresh.calibration == pol.calibration != 1.0
    del state["judged_accepted"], state["judged_confidence"]
    older = adaspec(calibrate=True)
    older.load_state_dict(state)
    assert older.calibration == 1.0 and older.mean_confidence == pol.mean_confidence


def fixed_cost_profile() -> StepProfile:
    """Speculating at all costs 14 (γ = 0 → 1), each further token 1: T(B = 2) = 12, 26, 27,
    28, 29, like the engine-measured profile of the built-in pair at B = 1 (module docstring
    (e))."""
    batch, query, ctx = [1, 4], [1, 2, 5], [100, 1000]
    target = [[[10.0 + b * 1.0] * 2, [25.0 + b * 0.5] * 2, [28.0 + b * 0.5] * 2] for b in batch]
    return StepProfile("t", "d", "hand", "none", batch, query, ctx, [1], target,
                       np.zeros((len(batch), len(ctx))), np.ones((1, len(batch))))


def test_a_fixed_cost_of_speculating_does_not_stop_the_walk_at_zero():
    pol = adaspec(profile=fixed_cost_profile(), confidence_prior=0.9)
    t = [pol.step_time(VIEW, 2 * g, g) for g in range(5)]
    assert t == pytest.approx([12, 26, 27, 28, 29])
    e = [pol.predicted_efficiency(VIEW, g) for g in range(5)]
    assert e[1] < e[0] < e[4]  # not unimodal: the paper's walk from γ = 0 would stop at 0
    plan = pol.plan(VIEW)
    assert plan.gammas.tolist() == [4, 4]
    # τ: the marginal cost of a token once drafting has begun, (T(4) − T(1))/(3·2) = 0.5,
    # not (T(4) − T(0))/(4·2) = 2.125 with the fixed cost spread over the tokens
    assert plan.stop_confidence[0] == pytest.approx(0.5 * e[4] / 0.9, rel=1e-5)
    # when speculation's best still loses to plain decoding, γ = 0
    assert adaspec(profile=fixed_cost_profile(), confidence_prior=0.3).plan(VIEW) \
        .gammas.tolist() == [0, 0]


def test_optimism_speculates_while_the_evidence_is_thin():
    """c̄ = 0.5 says γ = 0 on the fixed-cost profile (E(4) = 3.875/29 < 2/12); after 16 tokens
    its bound 0.5 + 2·√(0.25/16) = 0.75 says γ = 4 (E(4) = 6.1/29), after 10000 it does not."""
    pol = adaspec(profile=fixed_cost_profile(), confidence_z=2.0)
    pol.conf_sum, pol.conf_count = 8.0, 16
    assert pol.predicted_confidence == pytest.approx(0.75)
    assert pol.plan(VIEW).gammas.tolist() == [4, 4]
    pol.conf_sum, pol.conf_count = 5000.0, 10000
    assert pol.predicted_confidence == pytest.approx(0.51)
    assert pol.plan(VIEW).gammas.tolist() == [0, 0]
    assert adaspec(profile=fixed_cost_profile(), confidence_prior=0.5).plan(VIEW) \
        .gammas.tolist() == [0, 0]  # the paper's rule: γ = 0 from the prior, never revisited


# ---------------------------------------------------------------------------- verifier
def test_elimination_order_takes_the_last_kept_token():
    # c: r0 = 0.9, 0.27, 0.243; r1 = 0.5, 0.2, 0.1 (column 4: not drafted, must be ignored)
    stats = make_stats([[0.9, 0.3, 0.9, 0.01], [0.5, 0.4, 0.5, 0.01]], num_drafted=[3, 3])
    lengths, order = adaspec().eliminate(VIEW, stats)
    # D = 3, T = 15 + K.  N0 = 2 + 1.413 + 0.8 = 4.213, E = 4.213/21 = 0.2006
    #   remove r1's 0.1  -> 4.113/20 = 0.2057 (rises)
    #   remove r1's 0.2  -> 3.913/19 = 0.2059 (rises): r1's tail is now its LAST KEPT token
    #   remove r0's 0.243 -> 3.670/18 = 0.2039 (falls): stop
    # Taking r1's last DRAFTED token (0.1) again would remove 0.1 twice more and end at [3, 0].
    assert order == [(1, 3), (1, 2)]
    assert lengths.tolist() == [3, 1]
    pol = adaspec()
    assert pol.select(VIEW, stats).tolist() == [3, 1]
    assert pol.num_removed == 2


def test_elimination_stops_when_nothing_is_left():
    # c: r0 = 0.05, 0.0025; r1 = 0.01, 0.0001; D = 2, T = 14 + K: every removal raises E
    # 2.0626/18 -> 2.0625/17 -> 2.06/16 -> 2.05/15 -> 2/14
    stats = make_stats([[0.05, 0.05], [0.01, 0.01]])
    lengths, order = adaspec().eliminate(VIEW, stats)
    assert order == [(1, 2), (0, 2), (1, 1), (0, 1)]
    assert lengths.tolist() == [0, 0]
    empty = make_stats(np.zeros((2, 4)), num_drafted=[0, 0])
    lengths, order = adaspec().eliminate(VIEW, empty)
    assert lengths.tolist() == [0, 0] and order == []


def test_confident_drafts_are_kept():
    stats = make_stats([[0.9, 0.9], [0.8, 0.8]])  # c: 0.9, 0.81 / 0.8, 0.64
    # E = 5.15/18 = 0.286; removing 0.64 gives 4.51/17 = 0.265: keep everything
    assert adaspec().select(VIEW, stats).tolist() == [2, 2]


# ---------------------------------------------------------------------------- SLO
def test_slo_falls_back_to_no_speculation():
    plan = adaspec(tpot_slo=14.0).plan(VIEW)  # T(1) = 15 > 14: E(1) = −1
    assert plan.gammas.tolist() == [0, 0]
    assert plan.stop_confidence.tolist() == [0.0, 0.0]
    pol = adaspec(tpot_slo=16.0)  # T(2) = 18 > 16: the walk stops at γ = 1
    assert pol.predicted_efficiency(VIEW, 2) == -1.0
    assert pol.predicted_efficiency(VIEW, 0) == pytest.approx(2 / 12)  # γ = 0 never breaks it
    plan = pol.plan(VIEW)
    assert plan.gammas.tolist() == [1, 1]
    assert plan.stop_confidence[0] == 0.0  # γ* = 1: the one token is never stopped


def test_slo_in_the_verifier():
    stats = make_stats([[0.9, 0.9], [0.8, 0.8]])  # D = 2, T = 14 + K; K ≤ 1 meets 15.5
    lengths, order = adaspec(tpot_slo=15.5).eliminate(VIEW, stats)
    # E stays −1 for K = 4, 3, 2 (removal goes on), K = 1 gives 2.9/15; K = 0 (2/14) is worse
    assert order == [(1, 2), (1, 1), (0, 2)]
    assert lengths.tolist() == [1, 0]
    # even K = 0 breaks 13 (the draft time is spent): everything goes, with no −1 left
    assert adaspec(tpot_slo=13.0).select(VIEW, stats).tolist() == [0, 0]


# ---------------------------------------------------------------------------- DSD
def test_dsd_goodput_argmax():
    # T(γ) = 12 + 3γ, goodput = 2·E(γ)/T(γ)
    # α = 0.5: E = 1, 1.5, 1.75, 1.875, 1.9375 -> E/T = .0833 .1000 .0972 .0893 .0807: γ* = 1
    # α = 0.8: E = 1, 1.8, 2.44, 2.952, 3.3616 -> E/T = .0833 .1200 .1356 .1406 .1401: γ* = 3
    low = DSDPolicy(max_gamma=4, profile=linear_profile(), alpha0=0.5, confidence_z=0)
    assert low.goodputs(VIEW) == pytest.approx(
        [2 * e / t for e, t in zip([1, 1.5, 1.75, 1.875, 1.9375], [12, 15, 18, 21, 24])])
    assert low.plan(VIEW).gammas.tolist() == [1, 1]
    high = DSDPolicy(max_gamma=4, profile=linear_profile(), alpha0=0.8, confidence_z=0)
    assert high.plan(VIEW).gammas.tolist() == [3, 3]
    assert expected_tokens(0.8, 4) == pytest.approx((1 - 0.8 ** 5) / 0.2)
    assert expected_tokens(1.0, 3) == 4.0  # α = 1 needs no special case


def test_dsd_pays_for_the_prompt_tokens_its_drafts_displace():
    """On the run's own line (target 10 ms + 1 ms per token of width, a draft forward 1 ms),
    a γ whose drafts take waiting prompt tokens' budget is charged 1 ms for each."""
    import dataclasses

    pol = DSDPolicy(max_gamma=4, profile=linear_profile(), alpha0=0.6, confidence_z=0)
    view = make_view(2, max_gamma=4)
    for w in (2, 4, 6, 8, 10, 2, 4, 6, 8, 10):
        out = make_outcome(view, [w // 2 - 1] * 2, [0, 0])
        pol.observe(dataclasses.replace(out, num_padded_tokens=w, step_time=0.011 + 1e-3 * w,
                                        draft_time=0.001, model_forwards=1))
    gammas = np.arange(5)
    free = pol.step_times(view, gammas)
    waiting = dataclasses.replace(view, lookahead_tokens=8, prefill_backlog_tokens=3)
    # 2 rows x γ drafted tokens; a plain step gives 3 of the 8 reserved to the prompts
    displaced = np.array([0, 0, 0, 1, 3])
    assert pol.step_times(waiting, gammas) == pytest.approx(free + 1e-3 * displaced, rel=1e-6)
    assert free == pytest.approx(0.01 + 1e-3 * 2 * (pol.padded_gamma(gammas) + 1)
                                 + 1e-3 * gammas, rel=1e-6)


def test_dsd_plans_with_an_upper_bound_until_acceptance_was_seen():
    """α0 = 0.3 says γ = 0 on the fixed-cost profile; the bound (1 with no evidence) says γ = 4,
    and once many judged tokens confirm a low α, γ = 0 again."""
    plain = DSDPolicy(max_gamma=4, profile=fixed_cost_profile(), alpha0=0.3, confidence_z=0)
    assert plain.plan(VIEW).gammas.tolist() == [0, 0]
    pol = DSDPolicy(max_gamma=4, profile=fixed_cost_profile(), alpha0=0.3)
    assert pol.planning_alpha == 1.0 and pol.plan(VIEW).gammas.tolist() == [4, 4]
    for _ in range(400):  # per sequence: 0 of 4 accepted, then 3 of 4 (2 + 8 judged in all)
        pol.observe(make_outcome(VIEW, [4, 4], [0, 0], num_verified=[4, 4]))
        pol.observe(make_outcome(VIEW, [4, 4], [3, 3], num_verified=[4, 4]))
    # the EMA remembers about ten steps of judged tokens: 2 and 8 alternately, decayed by 0.9
    assert pol.judged_tokens == pytest.approx((8 + 0.9 * 2) / (1 - 0.81), rel=1e-3)
    assert pol.planning_alpha < pol.alpha + 0.2
    assert pol.plan(VIEW).gammas.tolist() == [0, 0]
    state = json.loads(json.dumps(pol.state_dict()))
    del state["judged_tokens"]  # a state saved before the count existed still loads
    older = DSDPolicy(max_gamma=4, profile=fixed_cost_profile())
    older.load_state_dict(state)
    assert older.judged_tokens == 0 and older.alpha == pol.alpha


def test_dsd_evidence_ages_while_nothing_is_verified():
    """A low rate measured on badly drafting requests plans γ = 0; while steps verify nothing
    the judged tokens behind it decay (idle_decay per step), the bound widens, and the policy
    speculates again; with idle_decay=0 it never does."""
    pols = [DSDPolicy(max_gamma=4, profile=fixed_cost_profile(), alpha0=0.3, idle_decay=d)
            for d in (0.002, 0.0)]
    for pol in pols:
        for _ in range(50):  # rates 0 and 0.5 in turn: α ≈ 0.25
            pol.observe(make_outcome(VIEW, [4, 4], [0, 0], num_verified=[4, 4]))
            pol.observe(make_outcome(VIEW, [4, 4], [1, 1], num_verified=[4, 4]))
        assert pol.plan(VIEW).gammas.tolist() == [0, 0]
    ageing, frozen = pols
    steps = 0
    while not ageing.plan(VIEW).gammas.any():
        ageing.observe(make_outcome(VIEW, [0, 0], [0, 0]))  # plain steps: nothing verified
        frozen.observe(make_outcome(VIEW, [0, 0], [0, 0]))
        steps += 1
        assert steps < 5000, "the bound never widened"
    assert 100 < steps < 3000, steps  # hundreds of plain steps, not a few
    assert ageing.alpha == frozen.alpha  # the rate itself is the same: only its evidence aged
    assert not frozen.plan(VIEW).gammas.any()


def test_dsd_ema_update():
    view = make_view(2, max_gamma=4)
    judged = DSDPolicy(profile=linear_profile(), alpha0=0.5, ema=0.1)
    verified = DSDPolicy(profile=linear_profile(), alpha0=0.5, ema=0.1, rate="verified")
    out = make_outcome(view, [4, 4], [2, 1])  # 3 accepted of 8 verified, 2 rejections
    assert judged.step_rate(out) == pytest.approx(3 / 5)
    assert verified.step_rate(out) == pytest.approx(3 / 8)
    judged.observe(out)
    verified.observe(out)
    assert judged.alpha == pytest.approx(0.9 * 0.5 + 0.1 * 0.6)  # 0.51
    assert verified.alpha == pytest.approx(0.9 * 0.5 + 0.1 * 0.375)  # 0.4875
    judged.observe(make_outcome(view, [4, 4], [4, 4]))  # all accepted: rate 1
    assert judged.alpha == pytest.approx(0.9 * 0.51 + 0.1)
    judged.observe(make_outcome(view, [0, 0], [0, 0]))  # nothing verified: unchanged
    assert judged.alpha == pytest.approx(0.9 * 0.51 + 0.1)
    assert judged.num_updates == 2


# ---------------------------------------------------------------------------- shared behaviour
@pytest.mark.parametrize("cls", [AdaSpecPolicy, DSDPolicy])
def test_missing_profile_is_a_clear_error(cls, tmp_path):
    policy = cls(max_gamma=4)  # an engine hands it a profile (tests/test_autoprofile.py)
    assert policy.needs_profile and policy.profile is None
    with pytest.raises(ValueError, match="has no step-time profile.*jspec profile"):
        policy.plan(make_view(2))
    with pytest.raises(ValueError, match="jspec profile"):
        cls(max_gamma=4, profile=str(tmp_path / "nope.json"))


@pytest.mark.parametrize("kw", [dict(max_gamma=-1), dict(tpot_slo=0), dict(tpot_slo="fast"),
                                dict(confidence_prior=0.0), dict(confidence_prior=1.5),
                                dict(verifier="yes"), dict(calibrate=1), dict(probe_tokens=-1),
                                dict(probe_tokens=2.5), dict(confidence_z=-1)])
def test_adaspec_bad_options(kw):
    kw.setdefault("max_gamma", 4)
    with pytest.raises(ValueError):
        AdaSpecPolicy(profile=linear_profile(), **kw)


@pytest.mark.parametrize("kw", [dict(max_gamma=2.5), dict(alpha0=1.5), dict(ema=0),
                                dict(ema=True), dict(rate="mean"), dict(idle_decay=1.5),
                                dict(idle_decay=-0.1)])
def test_dsd_bad_options(kw):
    kw.setdefault("max_gamma", 4)
    with pytest.raises(ValueError):
        DSDPolicy(profile=linear_profile(), **kw)


def test_profile_path_is_loaded(tmp_path):
    path = tmp_path / "p.json"
    linear_profile().save(path)
    assert adaspec(profile=str(path)).plan(VIEW).gammas.tolist() == [2, 2]
    assert DSDPolicy(max_gamma=4, profile=str(path), alpha0=0.8, confidence_z=0).plan(VIEW).gammas.tolist() \
        == [3, 3]


def test_extrapolated_batch_and_context_do_not_crash():
    view = make_view(300, batch_size=512, max_gamma=4, context_lens=[100_000] * 300)
    for pol in (AdaSpecPolicy(max_gamma=4, profile=synthetic_profile(), tpot_slo=0.5),
                DSDPolicy(max_gamma=4, profile=synthetic_profile())):
        plan = pol.plan(view)
        assert plan.gammas.shape == (300,)
        assert 0 <= plan.gammas.min() and plan.gammas.max() <= 4
    stats = make_stats(np.full((300, 4), 0.7))
    lengths = AdaSpecPolicy(max_gamma=4, profile=synthetic_profile()).select(view, stats)
    assert lengths.shape == (300,) and (lengths >= 0).all() and (lengths <= 4).all()


@pytest.mark.parametrize("make", [lambda: adaspec(), lambda: DSDPolicy(max_gamma=4,
                                                                       profile=linear_profile())])
def test_offloaded_draft_and_zero_gamma_plan_zeros(make):
    pol = make()
    assert pol.plan(make_view(3, draft_resident=False)).gammas.tolist() == [0, 0, 0]
    assert pol.possible_gammas() == {0, 1, 2, 3, 4}
    zero = type(pol)(max_gamma=0, profile=linear_profile())
    assert zero.plan(make_view(2)).gammas.tolist() == [0, 0]


def test_verifier_switch():
    assert adaspec().wants_select  # Alg. 2 as published
    assert not adaspec(verifier=False).wants_select
    assert not AdaSpecPolicy(max_gamma=4).wants_select  # the default: a removal saves no time


def test_the_default_stop_rule_prices_a_token_at_the_draft_forward_alone():
    """The engine verifies every row at the plan's γ bucket: a row stopping early saves only
    the draft's forwards, shared by the n rows. Hand profile: draft_step = 1, n = 2, so
    τ = 1/2 where the paper's τ (draft and target) is 1.5."""
    pol = adaspec(stop_price="draft")
    plan = pol.plan(VIEW)
    assert plan.gammas.tolist() == [2, 2]  # the plan itself is priced as before
    assert plan.stop_confidence.tolist() == pytest.approx([0.5 * (3.92 / 18) / 0.6] * 2)
    with pytest.raises(ValueError, match="stop_price"):
        adaspec(stop_price="ragged")


def test_state_dict_json_round_trip():
    pol = adaspec()
    pol.plan(VIEW)
    pol.observe(make_outcome(VIEW, [2, 1], [1, 1], confidence=[[0.9, 0.7], [0.5, np.nan]]))
    state = json.loads(json.dumps(pol.state_dict()))
    fresh = adaspec()
    fresh.load_state_dict(state)
    assert fresh.mean_confidence == pytest.approx(0.7)
    assert fresh.state_dict() == pol.state_dict()
    with pytest.raises(ValueError):
        fresh.load_state_dict({"bogus": 1})

    dsd = DSDPolicy(max_gamma=4, profile=linear_profile())
    dsd.observe(make_outcome(VIEW, [4, 4], [2, 1]))
    state = json.loads(json.dumps(dsd.state_dict()))
    fresh_dsd = DSDPolicy(max_gamma=4, profile=linear_profile())
    fresh_dsd.load_state_dict(state)
    assert fresh_dsd.state_dict() == dsd.state_dict()
    with pytest.raises(ValueError):
        fresh_dsd.load_state_dict({"alpha": 2.0, "num_updates": 0})


def test_auto_is_dsd_under_its_own_name():
    from jspec.policies import make_policy
    from jspec.policies.auto import AutoPolicy
    from jspec.policies.dsd import DSDPolicy

    p = make_policy("auto", 4, profile=synthetic_profile())
    assert isinstance(p, AutoPolicy) and isinstance(p, DSDPolicy)
    assert (p.measured, p.confidence_z, p.rate) == (True, 2.0, "judged")
    p.alpha, p.num_updates, p.judged_tokens = 0.7, 12, 40.0
    state = json.loads(json.dumps(p.state_dict()))
    assert state["policy"] == "auto"
    q = make_policy("auto", 4, profile=synthetic_profile())
    q.load_state_dict(state)
    assert (q.alpha, q.num_updates, q.judged_tokens) == (0.7, 12, 40.0)
    with pytest.raises(ValueError, match="belongs to policy 'nightjar', not 'auto'"):
        q.load_state_dict({"policy": "nightjar", "alpha": 0.5, "num_updates": 1})
    with pytest.raises(ValueError, match="auto state needs keys"):
        q.load_state_dict({"policy": "auto", "contexts": {}})
    with pytest.raises(ValueError, match="confidence_z"):
        make_policy("auto", 4, confidence_z="high")
