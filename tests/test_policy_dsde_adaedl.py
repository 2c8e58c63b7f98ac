"""DSDE (the DSDE paper, §III) and AdaEDL policies: pure numpy, no model, no JAX."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from jspec.policies.adaedl import AdaEDLPolicy, entropy_threshold
from jspec.policies.dsde import (DSDEPolicy, calibrate_sl_max, predict_sl, scale_factor,
                           weighted_variance, wvir)
from policy_helpers import linear_profile, make_outcome, make_view

D = 0.85


def ref_weighted_variance(values_oldest_first, delta):
    """Independent form: E_w[x²] − E_w[x]², walking i = 1 (newest) .. N (oldest)."""
    num = num2 = den = 0.0
    for i, x in enumerate(reversed(values_oldest_first), start=1):
        a = delta ** (i - 1)
        num += a * x
        num2 += a * x * x
        den += a
    return num2 / den - (num / den) ** 2


def feed(policy, view, kls_per_seq, accepted=None, gammas=None):
    """One step in which sequence i verified exactly ``kls_per_seq[i]`` (a list of KLs)."""
    g = view.max_gamma
    kl = np.full((view.num_decode, g), np.nan)
    for i, ks in enumerate(kls_per_seq):
        kl[i, :len(ks)] = ks
    verified = [len(ks) for ks in kls_per_seq]
    accepted = accepted if accepted is not None else [0] * view.num_decode
    gammas = gammas if gammas is not None else verified
    policy.observe(make_outcome(view, gammas, accepted, kl=kl, num_verified=verified,
                                num_drafted=verified))


# ---------------------------------------------------------------------------------------------
# DSDE signals on known values

# 12 KLs, oldest first: two 2s, nine 0s, then a 1 (newest).
KL12 = [2.0, 2.0] + [0.0] * 9 + [1.0]


def test_weighted_variance_and_wvir_by_hand():
    # Short window (newest 10): x_1 = 1 (weight δ^0 = 1), x_2..x_10 = 0.
    #   S10 = Σ_{k=0..9} 0.85^k = (1 − 0.85^10)/0.15 = (1 − 0.196874)/0.15 = 5.354171
    #   μ_w = 1/S10;  Var_w = E_w[x²] − μ_w² = 1/S10 − 1/S10² = (S10 − 1)/S10² = 0.151887
    s10 = (1 - D ** 10) / (1 - D)
    assert s10 == pytest.approx(5.354171, abs=1e-6)
    var_short = (s10 - 1) / s10 ** 2
    assert var_short == pytest.approx(0.151887, abs=1e-6)
    # Long window (all 12): adds x_11 = x_12 = 2, weights 0.85^10 = 0.196874, 0.85^11 = 0.167343.
    #   S12 = (1 − 0.85^12)/0.15 = 5.718388
    #   Σ α·x  = 1 + 2·(0.196874 + 0.167343) = 1.728435  -> μ_w    = 0.302259
    #   Σ α·x² = 1 + 4·(0.196874 + 0.167343) = 2.456871  -> E_w[x²] = 0.429644
    #   Var_w = 0.429644 − 0.302259² = 0.338283
    s12 = (1 - D ** 12) / (1 - D)
    m1 = 1 + 2 * (D ** 10 + D ** 11)
    m2 = 1 + 4 * (D ** 10 + D ** 11)
    var_long = m2 / s12 - (m1 / s12) ** 2
    assert var_long == pytest.approx(0.338283, abs=1e-6)
    # WVIR = 0.151887 / 0.338283 = 0.448994
    assert weighted_variance(KL12[-10:], D) == pytest.approx(var_short, rel=1e-12)
    assert weighted_variance(KL12, D) == pytest.approx(var_long, rel=1e-12)
    assert wvir(KL12) == pytest.approx(0.448994, abs=1e-6)


def test_weighted_variance_matches_independent_formula():
    rng = np.random.default_rng(0)
    for n in (2, 5, 10, 17, 30):
        x = rng.exponential(0.3, n).tolist()
        assert weighted_variance(x, D) == pytest.approx(ref_weighted_variance(x, D), rel=1e-9)
    # 40 values: the long window only sees the newest 30, the short one the newest 10
    x = rng.exponential(0.3, 40).tolist()
    expected = ref_weighted_variance(x[-10:], D) / ref_weighted_variance(x[-30:], D)
    assert wvir(x) == pytest.approx(expected, rel=1e-9)


def test_wvir_edge_cases():
    assert wvir([]) == 1.0  # nothing to compare
    assert wvir([0.7]) == 1.0  # one value: no variance
    assert wvir([0.3] * 20) == 1.0  # constant history: 0/0 -> neutral
    assert wvir([0.1, 0.5, 0.2]) == pytest.approx(1.0)  # ≤ 10 values: both windows identical
    assert wvir([1.0] * 5 + [0.0] * 10) == 0.0  # stable recently, unstable before


def test_scale_factor():
    # last step's KLs 0.1 and 0.3: μ = 0.2, SF = e^0.4 − 1 = 1.491825 − 1 = 0.491825
    assert scale_factor(np.mean([0.1, 0.3])) == pytest.approx(0.491825, abs=1e-6)
    assert scale_factor(0.0) == 0.0


def test_predict_sl_known_values():
    # SL_max = 8, SL_min = 2, ΔSL = 6
    assert predict_sl(0.5, 1.0, 8, 2) == pytest.approx(5.0)  # (1 − 0.5)·6 + 2
    assert predict_sl(0.25, 2.0, 8, 2) == pytest.approx(5.0)  # penalty 0.5 again
    assert predict_sl(0.0, 3.0, 8, 2) == 8.0  # perfect draft: SL_max
    assert predict_sl(1.0, 1.0, 8, 2) == pytest.approx(2.0)  # penalty exactly 1: SL_min
    assert predict_sl(2.0, 0.9, 8, 2) == 2.0  # penalty 1.8 > 1: SL_min


# ---------------------------------------------------------------------------------------------
# DSDE plans


def test_sl_and_batch_cap_on_three_sequences():
    pol = DSDEPolicy(max_gamma=8, warmup_steps=0)  # no calibration: SL_max = max_gamma = 8
    view = make_view(3, max_gamma=8)
    # r0: no history -> SL_max = 8
    # r1: one step, KL = ln(1.5)/2 = 0.202733 -> SF = 0.5, WVIR = 1 (one value) -> SL = 5
    # r2: KL = 2 -> SF = e^4 − 1 = 53.6 -> penalty > 1 -> SL_min = 2
    feed(pol, view, [[], [math.log(1.5) / 2], [2.0]])
    sls = [predict_sl(pol.penalty(r), 1.0, pol.sl_max, pol.sl_min) for r in view.request_ids]
    assert sls == pytest.approx([8.0, 5.0, 2.0], abs=1e-5)
    # cap = (8 + 5 + 2)/3 = 5 -> γ = min(SL_i, 5) = [5, 5, 2]
    plan = pol.plan(view)
    assert plan.gammas.tolist() == [5, 5, 2]
    assert plan.stop_entropy is None and plan.stop_confidence is None
    # without the cap every sequence keeps its own SL
    nocap = DSDEPolicy(max_gamma=8, warmup_steps=0, batch_cap=False)
    feed(nocap, view, [[], [math.log(1.5) / 2], [2.0]])
    assert nocap.plan(view).gammas.tolist() == [8, 5, 2]


def test_rounding_half_up():
    pol = DSDEPolicy(max_gamma=8, warmup_steps=0, batch_cap=False)
    view = make_view(2, max_gamma=8)
    # SF = 0.6 -> SL = 0.4·6 + 2 = 4.4 -> 4;  SF = 0.4 -> SL = 0.6·6 + 2 = 5.6 -> 6
    feed(pol, view, [[math.log(1.6) / 2], [math.log(1.4) / 2]])
    assert pol.plan(view).gammas.tolist() == [4, 6]


def test_sl_max_calibration_on_known_warmup():
    pol = DSDEPolicy(max_gamma=8, warmup_steps=2)
    view = make_view(2, max_gamma=8)
    # during warm-up every sequence drafts warmup_gamma = max_gamma
    assert pol.plan(view).gammas.tolist() == [8, 8]
    feed(pol, view, [[0.1, 0.2, 0.3, 0.4], []], accepted=[3, 0], gammas=[8, 8])
    # a step where nothing was verified does not count as a warm-up step
    feed(pol, view, [[], []], gammas=[0, 0])
    assert not pol.calibrated and pol.plan(view).gammas.tolist() == [8, 8]
    feed(pol, view, [[0.5], [1.0, 0.0]], accepted=[0, 2], gammas=[8, 8])
    # KLs 0.1 0.2 0.3 0.4 0.5 1.0 0.0: μ_pre = 2.5/7 = 0.357143, KLD_pre,max = 1.0; SL_A,max = 3
    # SL_max = 3·(1 + 0.357143/(1 + 1e-6)) = 3·1.357143 = 4.071428
    assert pol.calibrated
    assert pol.sl_max == pytest.approx(4.071428, abs=1e-5)
    # a new sequence starts at SL_max: round(4.07) = 4
    assert pol.plan(make_view(request_ids=["new"], max_gamma=8)).gammas.tolist() == [4]


def test_sl_max_clamped():
    assert calibrate_sl_max(8, 0.5, 1.0, 1e-6, 2, 8) == 8.0  # 8·1.5 = 12 > max_gamma
    assert calibrate_sl_max(0, 0.5, 1.0, 1e-6, 2, 8) == 2.0  # nothing accepted: floor at SL_min
    assert calibrate_sl_max(3, 0.0, 0.0, 1e-6, 2, 8) == 3.0  # perfect draft: 0/ε = 0


def test_new_sequence_gets_sl_max_and_joins_the_cap():
    pol = DSDEPolicy(max_gamma=8, warmup_steps=0)
    view = make_view(request_ids=["old"], max_gamma=8)
    feed(pol, view, [[2.0]])  # "old" -> SL_min = 2
    both = make_view(request_ids=["old", "new"], max_gamma=8)
    # "new" has SL_max = 8; cap = (2 + 8)/2 = 5 -> [2, 5]
    assert pol.plan(both).gammas.tolist() == [2, 5]


def test_nan_positions_and_num_verified_are_respected():
    pol = DSDEPolicy(max_gamma=4, warmup_steps=0)
    view = make_view(2, max_gamma=4)
    kl = np.array([[0.1, np.nan, 0.3, np.nan],
                   [0.2, 0.4, 0.6, 0.8]])
    # r1 verified only 2 positions: values past it are not KLs of verified tokens
    pol.observe(make_outcome(view, [4, 4], [1, 1], kl=kl, num_verified=[4, 2]))
    seqs = pol.state_dict()["sequences"]
    assert seqs["r0"]["kls"] == pytest.approx([0.1, 0.3])
    assert seqs["r0"]["last_mean"] == pytest.approx(0.2)
    assert seqs["r1"]["kls"] == pytest.approx([0.2, 0.4])
    # an all-NaN row leaves the history (and last step's mean) alone
    pol.observe(make_outcome(view, [4, 4], [0, 0]))
    assert pol.state_dict()["sequences"]["r0"]["last_mean"] == pytest.approx(0.2)
    assert np.isfinite(pol.plan(view).gammas).all()


def test_memory_bound():
    pol = DSDEPolicy(max_gamma=4, warmup_steps=0)
    view = make_view(3, max_gamma=4)
    for _ in range(15):  # 60 KLs per sequence; only the newest long_window = 30 are kept
        feed(pol, view, [[0.1, 0.2, 0.3, 0.4]] * 3)
    assert all(len(s["kls"]) == 30 for s in pol.state_dict()["sequences"].values())
    pol.plan(make_view(request_ids=["r1"], max_gamma=4))  # r0 and r2 finished
    assert set(pol.state_dict()["sequences"]) == {"r1"}


def test_draft_not_resident_gives_zeros():
    for warmup in (0, 3):
        pol = DSDEPolicy(max_gamma=4, warmup_steps=warmup)
        plan = pol.plan(make_view(3, max_gamma=4, draft_resident=False))
        assert plan.gammas.tolist() == [0, 0, 0]
    assert DSDEPolicy(max_gamma=4).plan(make_view(0, max_gamma=4)).gammas.shape == (0,)


def test_possible_gammas_cover_plans():
    # the paper's floor SL_min = 2; with the gate any floor down to 0 may be chosen
    assert DSDEPolicy(max_gamma=6, gate=False).possible_gammas() == {0, 2, 3, 4, 5, 6}
    pol = DSDEPolicy(max_gamma=6, warmup_steps=1)
    assert pol.possible_gammas() == set(range(7))
    rng = np.random.default_rng(1)
    view = make_view(5, max_gamma=6)
    for _ in range(40):
        plan = pol.plan(view)
        assert set(plan.gammas.tolist()) <= pol.possible_gammas()
        feed(pol, view, [rng.exponential(0.3, int(g)).tolist() for g in plan.gammas],
             accepted=[int(g) // 2 for g in plan.gammas], gammas=plan.gammas)
    assert DSDEPolicy(max_gamma=1).possible_gammas() == {0, 1}  # sl_min defaults to min(2, Γ)


def test_stable_sequence_drafts_more_than_erratic_one():
    pol = DSDEPolicy(max_gamma=8, warmup_steps=2, batch_cap=False)
    view = make_view(2, max_gamma=8)
    rng = np.random.default_rng(2)
    for _ in range(30):
        g = pol.plan(view).gammas
        stable = [0.05] * int(g[0])
        erratic = (rng.random(int(g[1])) * rng.choice([0.01, 3.0], int(g[1]))).tolist()
        feed(pol, view, [stable, erratic], accepted=[int(g[0]), 0], gammas=g)
    g = pol.plan(view).gammas
    assert g[0] > g[1]


def _run(pol, view, rng, steps):
    for _ in range(steps):
        g = pol.plan(view).gammas
        feed(pol, view, [rng.exponential(0.4, int(x)).tolist() for x in g],
             accepted=[int(x) // 2 for x in g], gammas=g)


@pytest.mark.parametrize("steps", [2, 12])  # mid warm-up and after calibration
def test_dsde_state_dict_json_round_trip(steps):
    view = make_view(4, max_gamma=8)
    pol = DSDEPolicy(max_gamma=8, warmup_steps=5)
    _run(pol, view, np.random.default_rng(3), steps)
    state = json.loads(json.dumps(pol.state_dict()))
    clone = DSDEPolicy(max_gamma=8, warmup_steps=5)
    clone.load_state_dict(state)
    assert clone.state_dict() == pol.state_dict()
    # identical plans now and after identical further steps
    _run(pol, view, np.random.default_rng(4), 6)
    _run(clone, view, np.random.default_rng(4), 6)
    assert clone.plan(view).gammas.tolist() == pol.plan(view).gammas.tolist()
    assert clone.state_dict() == pol.state_dict()
    with pytest.raises(ValueError, match="max_gamma"):
        DSDEPolicy(max_gamma=4).load_state_dict(state)


@pytest.mark.parametrize("opts", [
    {"warmup_steps": -1}, {"warmup_steps": 1.5}, {"warmup_gamma": 9}, {"sl_min": 9},
    {"sl_min": -1}, {"delta": 0.0}, {"delta": 1.5}, {"short_window": 0},
    {"short_window": 10, "long_window": 5}, {"eps": 0.0}, {"batch_cap": "yes"}, {"gate": "no"},
    {"max_gamma": -1}, {"max_gamma": 1, "sl_min": 2},
])
def test_dsde_bad_options(opts):
    opts = {"max_gamma": 8, **opts}
    with pytest.raises(ValueError):
        DSDEPolicy(**opts)


def test_dsde_gate_shuts_where_speculation_loses_and_the_paper_rule_does_not():
    """With every draft token rejected, a γ = 2 step emits what a plain one does at 18/12 of its
    time: the gate plans plain decoding, the paper's DSDE (gate=False) still drafts SL_min."""
    view = make_view(2, max_gamma=4)
    gated = DSDEPolicy(max_gamma=4, warmup_steps=0)
    paper = DSDEPolicy(max_gamma=4, warmup_steps=0, gate=False)
    assert gated.needs_profile and not paper.needs_profile
    gated.set_profile(linear_profile())
    # no acceptance seen yet: the gate's bound is optimistic and the plan passes
    assert gated.plan(view).gammas.tolist() == paper.plan(view).gammas.tolist() == [4, 4]
    for _ in range(40):
        for pol in (gated, paper):
            g = pol.plan(view).gammas
            if g.any():
                pol.observe(make_outcome(view, g, [0, 0], kl=np.full((2, int(g.max())), 3.0)))
    assert gated.plan(view).gammas.tolist() == [0, 0]
    assert paper.plan(view).gammas.tolist() == [2, 2]  # SL_min: SF·WVIR > 1


def test_dsde_gate_raises_the_floor_where_long_drafts_pay():
    """Drafts the target accepts in full while their KL stays high: the paper's rule holds both
    sequences at SL_min = 2; with drafts this cheap (T(γ) = 12 + 3γ) four tokens emit more per
    second (5/24 against 3/18), so the gate picks the floor 4."""
    view = make_view(2, max_gamma=4)
    gated = DSDEPolicy(max_gamma=4, warmup_steps=0)
    paper = DSDEPolicy(max_gamma=4, warmup_steps=0, gate=False)
    gated.set_profile(linear_profile())
    for _ in range(40):
        for pol in (gated, paper):
            g = pol.plan(view).gammas
            pol.observe(make_outcome(view, g, g, kl=np.full((2, int(g.max())), 3.0)))
    assert paper.plan(view).gammas.tolist() == [2, 2]
    assert gated.plan(view).gammas.tolist() == [4, 4]


def test_dsde_gate_stays_open_without_a_profile_or_a_fitted_model():
    view = make_view(2, max_gamma=4)
    pol = DSDEPolicy(max_gamma=4, warmup_steps=0)
    for _ in range(20):
        pol.observe(make_outcome(view, [4, 4], [0, 0], kl=np.full((2, 4), 3.0)))
    assert pol.plan(view).gammas.tolist() == [2, 2]


# ---------------------------------------------------------------------------------------------
# AdaEDL


def test_adaedl_threshold_known_values():
    # λ = 0.4, λ_e = 0.2: H* = (1 − 0.4)²/0.2 = 0.36/0.2 = 1.8 nats
    assert entropy_threshold(0.4, 0.2) == pytest.approx(1.8)
    # λ = 0.5, λ_e = 0.25: H* = 0.25/0.25 = 1
    assert entropy_threshold(0.5, 0.25) == pytest.approx(1.0)
    assert entropy_threshold(1.0, 0.2) == 0.0  # λ = 1: only certain tokens are drafted
    assert entropy_threshold(0.0, 0.5) == pytest.approx(2.0)  # λ = 0: stop once λ_e·H > 1


@pytest.mark.parametrize("lam,lam_e", [(0.4, 0.2), (0.1, 0.2), (0.7, 0.05), (0.0, 1.0),
                                       (0.95, 2.0)])
def test_adaedl_rule_equivalence(lam, lam_e):
    """The policy's entropy threshold stops exactly where AdaEDL's rule as written does: when
    the acceptance estimate 1 − sqrt(λ_e·H) is below λ."""

    def stop_rule(entropy: float) -> bool:
        return 1.0 - math.sqrt(lam_e * entropy) < lam

    h_star = entropy_threshold(lam, lam_e)
    for h in np.linspace(0.0, 12.0, 2401):
        if abs(h - h_star) < 1e-9:
            continue  # exactly at the boundary float rounding may go either way
        assert (h > h_star) == stop_rule(h), (h, h_star)


def test_adaedl_plan():
    pol = AdaEDLPolicy(max_gamma=5)
    view = make_view(3, max_gamma=5)
    plan = pol.plan(view)
    assert plan.gammas.tolist() == [5, 5, 5]
    assert plan.stop_entropy == pytest.approx([1.8] * 3)
    assert plan.stop_confidence is None
    off = pol.plan(make_view(3, max_gamma=5, draft_resident=False))
    assert off.gammas.tolist() == [0, 0, 0]
    assert pol.possible_gammas() == {0, 5}


def test_adaedl_adapt_updates():
    pol = AdaEDLPolicy(max_gamma=4, adapt=True, lam=0.4, beta=0.1)
    view = make_view(4, max_gamma=4)
    # r0 all 4 accepted: λ = 0.9·0.4 + 0.1·0 = 0.36
    # r1 none of 4 accepted: λ = 0.9·0.4 + 0.1·1 = 0.46
    # r2 planned 4 but drafted nothing: relax toward lam = 0.4 (stays 0.4)
    # r3 γ = 0 (did not speculate): untouched
    pol.observe(make_outcome(view, [4, 4, 4, 0], [4, 0, 0, 0], num_drafted=[4, 4, 0, 0]))
    assert [pol.lam_of(r) for r in view.request_ids] == pytest.approx([0.36, 0.46, 0.4, 0.4])
    assert "r3" not in pol.state_dict()["lams"]
    plan = pol.plan(view)
    assert plan.stop_entropy == pytest.approx([0.64 ** 2 / 0.2, 0.54 ** 2 / 0.2, 1.8, 1.8])
    # clamped to lam_max: a sequence that never gets anything accepted
    for _ in range(200):
        pol.observe(make_outcome(view, [4] * 4, [0] * 4))
    assert pol.lam_of("r1") == pytest.approx(0.95)
    # finished requests are forgotten
    pol.plan(make_view(request_ids=["r0"], max_gamma=4))
    assert set(pol.state_dict()["lams"]) == {"r0"}
    # adapt off: λ never moves
    fixed = AdaEDLPolicy(max_gamma=4)
    fixed.observe(make_outcome(view, [4] * 4, [0] * 4))
    assert fixed.state_dict()["lams"] == {}


def test_adaedl_state_dict_json_round_trip():
    view = make_view(3, max_gamma=4)
    pol = AdaEDLPolicy(max_gamma=4, adapt=True)
    for acc in ([4, 1, 0], [3, 2, 0], [4, 0, 1]):
        pol.observe(make_outcome(view, [4] * 3, acc))
    clone = AdaEDLPolicy(max_gamma=4, adapt=True)
    clone.load_state_dict(json.loads(json.dumps(pol.state_dict())))
    assert clone.plan(view).stop_entropy.tolist() == pol.plan(view).stop_entropy.tolist()
    with pytest.raises(ValueError, match="max_gamma"):
        AdaEDLPolicy(max_gamma=8).load_state_dict(pol.state_dict())


@pytest.mark.parametrize("opts", [
    {"lam": -0.1}, {"lam": 1.5}, {"lam": float("nan")}, {"lam_e": 0.0}, {"lam_e": -1.0},
    {"lam_e": float("inf")}, {"adapt": 1}, {"beta": 0.0}, {"beta": 2.0}, {"lam_min": 0.5},
    {"lam_max": 0.3}, {"max_gamma": -2},
])
def test_adaedl_bad_options(opts):
    opts = {"max_gamma": 4, **opts}
    with pytest.raises(ValueError):
        AdaEDLPolicy(**opts)
