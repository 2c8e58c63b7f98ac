"""SpecRouter's chain scheduler against hand-computed values (pure numpy, no model, no JAX).

Unless a test says otherwise: Γmax = W = 4 (a fixed window), a pool of two drafts ("small",
"mid"), one decoding sequence per step (batch bucket 1), no prefill (so decode_time =
step_time).
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from jspec.policies import POLICIES, make_policy
from jspec.policies.base import StepOutcome
from jspec.policies.specrouter import (TARGET, SpecRouterPolicy, chain_effective_time, chain_key,
                                 chain_tokens, pair_key)
from policy_helpers import make_view

G = 4
POOL2 = ("small", "mid")
POOL3 = ("small", "mid", "large")


def router(pool=POOL2, **kw) -> SpecRouterPolicy:
    kw.setdefault("max_gamma", G)
    kw.setdefault("window", kw["max_gamma"])
    kw.setdefault("explore", 0.0)
    p = SpecRouterPolicy(**kw)
    p.set_pool(pool)
    return p


def outcome(chain=(0,), *, batch=1, accept_prob=None, inter_prob=None, draft_time=0.0,
            inter_time=0.0, catch_up_time=0.0, step_time=0.02, accepted=None, verified=None,
            drafted=None, inter_accepted=None, gamma=G) -> StepOutcome:
    """One step of ``batch`` decoding sequences that ran ``chain`` (every row planned ``gamma``;
    () plans 0). Signal rows given as lists are padded with NaN to [batch, Γmax]; a single
    number fills every drafted position."""
    n = batch
    g = gamma if chain else 0
    drafted = np.full(n, g) if drafted is None else np.asarray(drafted)
    verified = drafted.copy() if verified is None else np.asarray(verified)
    accepted = np.zeros(n, np.int64) if accepted is None else np.asarray(accepted)

    def signal(rows, lengths):
        out = np.full((n, G), np.nan)
        if rows is None:
            return out
        if np.isscalar(rows):
            for r in range(n):
                out[r, :lengths[r]] = rows
            return out
        for r, row in enumerate(rows):
            out[r, :len(row)] = row
        return out

    two = len(chain) == 2
    return StepOutcome(
        request_ids=[f"r{i}" for i in range(n)], gammas=np.full(n, g), num_drafted=drafted,
        num_verified=verified, num_accepted=accepted, num_emitted=accepted + 1, batch_size=n,
        step_time=step_time, draft_time=draft_time,
        verify_time=max(step_time - draft_time - inter_time - catch_up_time, 0.0),
        catch_up_time=catch_up_time, catch_up_tokens=0, num_prefill_tokens=0,
        accept_prob=signal(accept_prob, verified), kl=signal(None, verified),
        draft_entropy=signal(None, verified), confidence=signal(None, verified),
        num_tokens=int((1 + verified).sum()), chain=tuple(chain), intermediate_time=inter_time,
        intermediate_accepted=(None if inter_accepted is None or not two
                               else np.asarray(inter_accepted)),
        intermediate_accept_prob=signal(inter_prob, drafted) if two else None)


# Bucket 1, W = 4, per chain (seconds): T_plain 10 ms; T_draft[0] 1 ms and T_draft[1] 3 ms per
# forward; T_inter[1] 4 ms per pass; T_verify 12 ms per pass (each drafting step also carries
# 2 ms of catch-up, which is taken out). α_{0,t} = 0.5, α_{1,t} = 0.8, α_{0,1} = 0.9.
#   T(())     = 10 ms
#   T((0,))   = (4·1 + 12) / (1 + .5 + .25 + .125 + .0625 = 1.9375)              = 8.2581 ms
#   T((1,))   = (4·3 + 12) / (1 + .8 + .64 + .512 + .4096 = 3.3616)              = 7.1395 ms
#   T((0, 1)) = (4·1 + 4 + 12) / (1 + .8 + .64·.9 + .512·.81 + .4096·.729
#                                 = 1 + .8 + .576 + .41472 + .2985984 = 3.0893184) = 6.4739 ms
HAND = {(): 0.010, (0,): 0.016 / 1.9375, (1,): 0.024 / 3.3616, (0, 1): 0.020 / 3.0893184}


def measured_steps(batch=1, plain=0.010, draft=(0.001, 0.003), inter=0.004, verify=0.012,
                   catch_up=0.002):
    """One outcome per chain of POOL2, giving the times above (at ``batch``) and the α above."""
    d0, d1 = draft
    return [
        outcome((), batch=batch, step_time=plain),
        outcome((0,), batch=batch, accept_prob=0.5, draft_time=G * d0, catch_up_time=catch_up,
                step_time=G * d0 + verify + catch_up),
        outcome((1,), batch=batch, accept_prob=0.8, draft_time=G * d1, catch_up_time=catch_up,
                step_time=G * d1 + verify + catch_up),
        outcome((0, 1), batch=batch, accept_prob=0.8, inter_prob=0.9, draft_time=G * d0,
                inter_time=inter, catch_up_time=catch_up,
                step_time=G * d0 + inter + verify + catch_up),
    ]


def measured(**kw) -> SpecRouterPolicy:
    p = router(**kw)
    for o in measured_steps():
        p.observe(o)
    return p


# ---------------------------------------------------------------------------- T_eff
def test_chain_formulas_by_hand():
    assert chain_tokens(4, 0.5) == pytest.approx(1.9375)
    assert chain_tokens(4, 0.8, 0.9) == pytest.approx(3.0893184)
    assert chain_tokens(4, 0.8, 1.0) == pytest.approx(chain_tokens(4, 0.8))  # j passes i through
    assert chain_tokens(3, 0.0) == 1.0 and chain_tokens(3, 1.0) == 4.0
    assert chain_tokens(4, 0.8, 0.0) == pytest.approx(1.8)  # j keeps only its correction token
    assert chain_effective_time(4, 0.001, 0.012, 0.5) == pytest.approx(HAND[(0,)])
    assert chain_effective_time(4, 0.001, 0.012, 0.8, 0.004, 0.9) == pytest.approx(HAND[(0, 1)])


def test_effective_time_of_each_chain_kind():
    p = measured()
    for chain, value in HAND.items():
        assert p.effective_time(chain, 1) == pytest.approx(value, rel=1e-12), chain
    assert math.isinf(p.effective_time((0,), 2))  # nothing measured at bucket 2
    scores = p.chain_scores(1)
    assert list(scores) == [(), (0,), (1,), (0, 1)]
    assert scores[(0, 1)] == pytest.approx(0.0064739, rel=1e-4)


# ---------------------------------------------------------------------------- learning
def test_similarity_ema_with_nans():
    p = router(sim_ema=0.1)
    # nanmean (0.9 + 0.7 + 0.5) / 3 = 0.7, then (1.0 + 0.6 + 0.8) / 3 = 0.8: 0.9·0.7 + 0.1·0.8
    p.observe(outcome((0,), batch=2, accept_prob=[[0.9, 0.7], [0.5]], draft_time=0.004))
    assert p.similarity[pair_key(0, TARGET)] == pytest.approx(0.7)  # the first sample as is
    p.observe(outcome((0,), batch=2, accept_prob=[[1.0, 0.6, 0.8], []], draft_time=0.004))
    assert p.similarity["0>target"] == pytest.approx(0.71)
    p.observe(outcome((0,), batch=2, accept_prob=None, draft_time=0.004))  # no finite value
    assert p.similarity["0>target"] == pytest.approx(0.71)
    assert p.acceptance(0, TARGET) == pytest.approx(0.71)  # identity f
    # a pair step: accept_prob is j's against the target, intermediate_accept_prob i's against j
    p.observe(outcome((0, 1), accept_prob=[[0.6, 0.8]], inter_prob=[[0.3, np.nan, 0.5]]))
    assert p.similarity == pytest.approx({"0>target": 0.71, "1>target": 0.7, "0>1": 0.4})
    p.observe(outcome((0, 1), accept_prob=[[0.9]], inter_prob=None))
    assert p.similarity == pytest.approx({"0>target": 0.71, "1>target": 0.9 * 0.7 + 0.1 * 0.9,
                                          "0>1": 0.4})


def test_time_emas_per_bucket():
    p = router(time_ema=0.3)
    # bucket 1: draft 4 ms / 4 = 1 ms, then 8 ms / 4 = 2 ms: 0.7·1 + 0.3·2 = 1.3 ms per forward
    p.observe(outcome((0,), draft_time=0.004, catch_up_time=0.001, step_time=0.017))
    p.observe(outcome((0,), draft_time=0.008, catch_up_time=0.0, step_time=0.028))
    assert p.draft_time == {0: {1: pytest.approx(0.0013)}}
    # verify: 17 − 4 − 1 = 12 ms, then 28 − 8 = 20 ms: 0.7·12 + 0.3·20 = 14.4 ms
    assert p.verify_time == {1: {G: pytest.approx(0.0144)}}
    # a pair at bucket 4 (three sequences): T_draft[0][4], T_inter[1][4], T_verify[4] only
    p.observe(outcome((0, 1), batch=3, draft_time=0.012, inter_time=0.005, step_time=0.030))
    assert p.draft_time == {0: {1: pytest.approx(0.0013), 4: pytest.approx(0.003)}}
    assert p.inter_time == {1: {4: {G: pytest.approx(0.005)}}}
    assert p.verify_time == {1: {G: pytest.approx(0.0144)}, 4: {G: pytest.approx(0.013)}}
    p.observe(outcome((0, 1), batch=4, draft_time=0.012, inter_time=0.015, step_time=0.035))
    assert p.inter_time[1][4][G] == pytest.approx(0.7 * 0.005 + 0.3 * 0.015)
    assert p.verify_time[4][G] == pytest.approx(0.7 * 0.013 + 0.3 * 0.008)
    # plain steps: T_plain only (at bucket 1 and 8)
    p.observe(outcome((), step_time=0.010))
    p.observe(outcome((), step_time=0.020))
    p.observe(outcome((), batch=5, step_time=0.050))
    assert p.plain_time == {1: pytest.approx(0.7 * 0.010 + 0.3 * 0.020), 8: pytest.approx(0.05)}
    assert p.draft_time[0][1] == pytest.approx(0.0013)  # untouched by plain steps
    assert p.plays == {1: {"0>target": 2, "target": 2}, 4: {"0>1>target": 2},
                       8: {"target": 1}}


# ---------------------------------------------------------------------------- decisions
def test_argmin_by_hand_and_following_a_load_change():
    p = measured()
    plan = p.plan(make_view(1, max_gamma=G))
    assert plan.chain == (0, 1) == min(HAND, key=HAND.get)  # 6.47 ms beats 7.14, 8.26, 10
    assert plan.gammas.tolist() == [G] and p.last_chain == {1: (0, 1)}
    # bucket 32: the target is cheap relative to drafting (a large batch): T_plain 20 ms;
    # T_draft 4 and 8 ms, T_inter 15 ms, T_verify 50 ms:
    #   (0,)  (16 + 50) / 1.9375 = 34.1 ms; (1,) (32 + 50) / 3.3616 = 24.4 ms;
    #   (0,1) (16 + 15 + 50) / 3.0893 = 26.2 ms; () 20 ms
    for o in measured_steps(batch=32, plain=0.020, draft=(0.004, 0.008), inter=0.015,
                            verify=0.050):
        p.observe(o)
    assert p.effective_time((1,), 32) == pytest.approx(0.082 / 3.3616)
    big = p.plan(make_view(32, max_gamma=G))
    assert big.chain == () and big.gammas.tolist() == [0] * 32
    assert p.plan(make_view(1, max_gamma=G)).chain == (0, 1)  # buckets are independent
    assert p.last_chain == {1: (0, 1), 32: ()}
    # the load changes at bucket 1: plain steps become 5 ms (< 6.47): the policy follows
    fast = router(time_ema=1.0)
    for o in measured_steps():
        fast.observe(o)
    assert fast.plan(make_view(1, max_gamma=G)).chain == (0, 1)
    fast.observe(outcome((), step_time=0.005))
    assert fast.plan(make_view(1, max_gamma=G)).chain == ()
    # and back when the target slows down again
    fast.observe(outcome((), step_time=0.009))
    assert fast.plan(make_view(1, max_gamma=G)).chain == (0, 1)


def feed_signals(p: SpecRouterPolicy, chain, batch=1, inter=True):
    p.observe(outcome(chain, batch=batch, accept_prob=0.7, inter_prob=0.8 if inter else None,
                      draft_time=0.004, inter_time=0.003, step_time=0.02 + 0.001 * len(chain)))


def test_unexplored_chains_first_in_fixed_order():
    p = router(POOL3)
    order = []
    for _ in range(7):
        chain = p.plan(make_view(1, max_gamma=G)).chain
        order.append(chain)
        feed_signals(p, chain)
    assert order == [(), (0,), (1,), (2,), (0, 1), (0, 2), (1, 2)]
    assert all(math.isfinite(t) for t in p.chain_scores(1).values())
    # all measured: argmin from now on (explore = 0), the same chain every step
    best = min(p.chain_scores(1).items(), key=lambda kv: kv[1])[0]
    assert {p.plan(make_view(1, max_gamma=G)).chain for _ in range(5)} == {best}
    # a new bucket: the times are per bucket, so the chains are measured there once more,
    # except (1, 2): its times are T_draft[1] (from (1,)), T_inter[2] (from (0, 2)) and
    # T_verify, and the similarities are global, so nothing of it is missing any more
    order = []
    for _ in range(6):
        chain = p.plan(make_view(16, max_gamma=G)).chain
        order.append(chain)
        feed_signals(p, chain, batch=16)
    assert order == [(), (0,), (1,), (2,), (0, 1), (0, 2)]
    assert all(math.isfinite(t) for t in p.chain_scores(16).values())


def test_a_chain_that_never_reports_its_signal_is_not_replayed_forever():
    p = router()
    chains = []
    for _ in range(8):
        chain = p.plan(make_view(1, max_gamma=G)).chain
        chains.append(chain)
        feed_signals(p, chain, inter=False)  # no intermediate_accept_prob: Sim[0>1] missing
    assert chains[:6] == [(), (0,), (1,), (0, 1), (0, 1), (0, 1)]
    assert (0, 1) not in chains[6:] and math.isinf(p.effective_time((0, 1), 1))


def test_explore_draws_uniform_chains_reproducibly():
    def run(seed):
        p = measured(explore=1.0, seed=seed)
        return [p.plan(make_view(1, max_gamma=G)).chain for _ in range(40)]

    first = run(7)
    assert first == run(7)
    assert first != run(8)
    assert set(first) == {(), (0,), (1,), (0, 1)}  # every chain comes up in 40 draws
    # explore = 0 is the argmin every time
    p = measured(explore=0.0)
    assert {p.plan(make_view(1, max_gamma=G)).chain for _ in range(10)} == {(0, 1)}


def test_offloaded_draft_and_zero_window_plan_the_target_alone():
    p = measured()
    plan = p.plan(make_view(3, max_gamma=G, draft_resident=False))
    assert plan.chain == () and plan.gammas.tolist() == [0, 0, 0]
    off = router(max_gamma=0)
    assert off.window == 0 and off.possible_gammas() == {0} and off.possible_chains() == {()}
    plan = off.plan(make_view(2, max_gamma=0))
    assert plan.chain == () and plan.gammas.tolist() == [0, 0]
    assert p.plan(make_view(0, max_gamma=G)).gammas.shape == (0,)


# ---------------------------------------------------------------------------- the window
def test_an_unmeasured_window_is_priced_through_the_measured_ones():
    p = router(window=None)  # W chosen among 1, 2, 4
    assert p.windows == (1, 2, G)
    assert p.verify_estimate(1, 2) is None  # nothing measured at bucket 1
    for o in measured_steps():  # T_plain 10 ms, T_verify[1][4] 12 ms, T_inter[1][1][4] 4 ms
        p.observe(o)
    # verified tokens per row: 1 (plain) -> 10 ms, 5 (W = 4) -> 12 ms; W = 2 verifies 3
    assert p.verify_estimate(1, 2) == pytest.approx(0.011)
    assert p.inter_estimate(1, 1, 2) == pytest.approx(0.004 * 3 / 5)
    p.observe(outcome((0,), accept_prob=0.5, draft_time=0.002, step_time=0.0125, gamma=2))
    assert p.verify_estimate(1, 2) == pytest.approx(0.0105)  # measured now: 12.5 − 2 ms
    # W = 1 lies between the plain step and W = 2 (tokens per row 1, 2, 3)
    assert p.verify_estimate(1, 1) == pytest.approx((0.010 + 0.0105) / 2)


def test_the_window_follows_the_cost_of_verification():
    """Cheap verification (a small batch): the longest window; dear verification (as after a
    load step): a short one, not only Γmax or nothing. α = 0.9 throughout."""
    p = router(POOL2[:1], window=None)
    p.observe(outcome((), step_time=0.010))
    p.observe(outcome((0,), accept_prob=0.9, draft_time=0.004, step_time=0.016))
    # bucket 1, verify 12 ms at W = 4, 10 ms plain: T_eff W = 4 (4 + 12) / 4.0951 = 3.9 ms,
    # W = 2 (2 + 11) / 2.71 = 4.8 ms, W = 1 (1 + 10.5) / 1.9 = 6.1 ms
    assert p.plan(make_view(1, max_gamma=G)).gammas.tolist() == [G]
    # bucket 32: plain 20 ms; W = 4 verifies in 80 ms, W = 1 in 30 ms, draft 1 ms per forward
    p.observe(outcome((), batch=32, step_time=0.020))
    p.observe(outcome((0,), batch=32, accept_prob=0.9, draft_time=0.004, step_time=0.084))
    p.observe(outcome((0,), batch=32, accept_prob=0.9, draft_time=0.001, step_time=0.031,
                      gamma=1))
    # T_eff: () 20 ms; W = 1 (1 + 30) / 1.9 = 16.3 ms; W = 2 (2 + 46.7) / 2.71 = 18.0 ms;
    # W = 4 (4 + 80) / 4.0951 = 20.5 ms
    assert p.plan(make_view(32, max_gamma=G)).gammas.tolist() == [1] * 32
    assert p.effective_time((0,), 32, 1) == pytest.approx(0.031 / 1.9)
    assert p.plan(make_view(1, max_gamma=G)).gammas.tolist() == [G]  # buckets apart


# ---------------------------------------------------------------------------- chains, options
def test_possible_chains_and_gammas():
    p = SpecRouterPolicy(max_gamma=G)  # the default pool: one draft
    assert p.possible_chains() == {(), (0,)} and p.possible_gammas() == {0, 1, 2, G}
    p.set_pool(POOL2)  # set after construction: chains follow the pool
    assert p.possible_chains() == {(), (0,), (1,), (0, 1)}
    p.set_pool(POOL3)
    assert p.possible_chains() == {(), (0,), (1,), (2,), (0, 1), (0, 2), (1, 2)}
    assert router(POOL3, max_levels=1).possible_chains() == {(), (0,), (1,), (2,)}
    assert router(POOL2, window=2).possible_gammas() == {0, 2}
    assert chain_key(()) == "target" and chain_key((0, 2)) == "0>2>target"


def test_a_new_pool_forgets_the_per_model_estimates():
    p = measured()
    p.set_pool(POOL2)  # the same pool: kept
    assert p.similarity
    p.set_pool(("other", "mid"))
    assert not p.similarity and not p.draft_time and not p.plain_time


@pytest.mark.parametrize("key,value", [
    ("window", 0), ("window", 5), ("window", 2.0), ("window", True), ("time_ema", 0),
    ("time_ema", 1.5), ("sim_ema", -0.1), ("sim_ema", "0.1"), ("calibrate", "yes"),
    ("explore", 1.5), ("explore", -0.01), ("seed", -1), ("seed", 1.5), ("max_levels", 0),
    ("max_levels", 3)])
def test_bad_options_name_the_option(key, value):
    with pytest.raises(ValueError, match=f"option {key} "):
        SpecRouterPolicy(max_gamma=G, **{key: value})
    with pytest.raises(ValueError, match=f"option {key} "):
        make_policy("specrouter", G, **{key: value})


def test_registered_by_name():
    assert POLICIES["specrouter"] is SpecRouterPolicy
    p = make_policy("specrouter", 6, window=3)
    assert p.window == 3 and p.signals == frozenset({"accept_prob"})
    adaptive = SpecRouterPolicy(max_gamma=6)  # W chosen per step among the drafting buckets
    assert adaptive.window is None and adaptive.possible_gammas() == {0, 1, 2, 4, 6}
    with pytest.raises(ValueError, match="option window must be 0"):
        SpecRouterPolicy(max_gamma=0, window=2)


# ---------------------------------------------------------------------------- state
def test_state_round_trip_gives_the_same_decisions():
    p = measured(explore=0.5, seed=3, calibrate=True)
    p.plan(make_view(1, max_gamma=G))  # move the generator
    saved = json.loads(json.dumps(p.state_dict()))
    assert saved["policy"] == "specrouter" and saved["pool"] == list(POOL2)
    assert set(saved) == {"policy", "max_gamma", "pool", "window", "draft_time", "inter_time",
                          "verify_time", "plain_time", "similarity", "calibration", "plays",
                          "last_chain", "rng"}
    q = router(explore=0.5, seed=99, calibrate=True)
    q.load_state_dict(saved)
    assert json.dumps(q.state_dict(), sort_keys=True) == json.dumps(saved, sort_keys=True)
    for batch in (1, 1, 2, 1, 1, 1, 1, 1):
        view = make_view(batch, max_gamma=G)
        a, b = p.plan(view), q.plan(view)
        assert a.chain == b.chain and a.gammas.tolist() == b.gammas.tolist()
        feed_signals(p, a.chain, batch=batch)
        feed_signals(q, b.chain, batch=batch)
    for c in HAND:
        assert q.effective_time(c, 1) == p.effective_time(c, 1)


def test_loading_a_state_of_another_pool_or_window_is_refused():
    saved = json.loads(json.dumps(measured().state_dict()))
    with pytest.raises(ValueError, match="draft pool"):
        router(POOL3).load_state_dict(saved)
    with pytest.raises(ValueError, match="window"):
        router(window=2).load_state_dict(saved)
    with pytest.raises(ValueError, match="max_gamma"):
        router(max_gamma=5).load_state_dict(saved)
    with pytest.raises(ValueError, match="belongs to policy 'ucb'"):
        router().load_state_dict({**saved, "policy": "ucb"})
    fresh = router()
    with pytest.raises(ValueError, match="malformed specrouter state"):
        fresh.load_state_dict({**saved, "similarity": {"5>target": 0.5}})  # no model 5
    with pytest.raises(ValueError, match="malformed specrouter state"):
        fresh.load_state_dict({k: v for k, v in saved.items() if k != "plays"})
    assert not fresh.similarity  # a refused state leaves the policy as it was


# ---------------------------------------------------------------------------- calibration
def test_calibrated_acceptance_by_hand():
    p = router(calibrate=True, sim_ema=0.1)
    # step 1: SimScore sample 0.5, 3 of 4 accepted (judged 4): A = 3, P = 0.5·4 = 2
    #   α = 0.5 · (3 + 8) / (2 + 8) = 0.55 (8 pseudo-tokens at ratio 1)
    p.observe(outcome((0,), accept_prob=0.5, accepted=[3], draft_time=0.004))
    assert p.acceptance(0, TARGET) == pytest.approx(0.55)
    # step 2: sample 0.6 (SimScore 0.9·0.5 + 0.1·0.6 = 0.51), 4 of 4 accepted:
    #   A = 0.99·3 + 4 = 6.97, P = 0.99·2 + 0.6·4 = 4.38, α = 0.51 · 14.97 / 12.38
    p.observe(outcome((0,), accept_prob=0.6, accepted=[4], draft_time=0.004))
    assert p.similarity["0>target"] == pytest.approx(0.51)
    assert p.acceptance(0, TARGET) == pytest.approx(0.51 * 14.97 / 12.38)
    assert p.calibration["0>target"] == pytest.approx(
        {"accepted": 6.97, "judged": 0.99 * 4 + 4, "predicted": 4.38})
    # the intermediate level: j accepted 2 of i's 4 (judged 3), sample 0.6: 0.6 · 10 / 9.8;
    # the target level of the pair: j's draft of 3 verified, 1 accepted (judged 2), sample 0.8
    p.observe(outcome((0, 1), accept_prob=0.8, inter_prob=0.6, inter_accepted=[2],
                      verified=[3], accepted=[1]))
    assert p.acceptance(0, 1) == pytest.approx(0.6 * 10 / 9.8)
    assert p.acceptance(1, TARGET) == pytest.approx(0.8 * 9 / (1.6 + 8))
    # clipped to 1; without calibrate the identity
    p.observe(outcome((1,), accept_prob=1.0, accepted=[4]))
    assert p.acceptance(1, TARGET) <= 1.0
    plain = router(calibrate=False)
    plain.load_state_dict(json.loads(json.dumps(p.state_dict())))
    assert plain.acceptance(0, TARGET) == pytest.approx(0.51)
    # T_eff uses the calibrated α
    p.observe(outcome((0,), accept_prob=0.6, accepted=[4], draft_time=0.004, step_time=0.016))
    alpha = p.acceptance(0, TARGET)
    assert p.effective_time((0,), 1) == pytest.approx(
        chain_effective_time(G, p.draft_time[0][1], p.verify_time[1][G], alpha))
    assert alpha != p.similarity["0>target"]
