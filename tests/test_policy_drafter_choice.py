"""``auto`` with several drafters (policies/drafter_choice.py): the drafter and length per
sequence that maximise the step's predicted goodput, learned from each sequence's acceptance.
Host-only: views and outcomes built by hand, the step-time model given."""

from __future__ import annotations

import copy
import dataclasses

import numpy as np
import pytest

from policy_helpers import make_outcome, make_view
from jspec.policies import make_policy
from jspec.policies.drafter_choice import DrafterChoice

MODEL, NGRAM = 0, 1
BUCKETS = (1, 2, 4)


def _view(lengths, **kw):
    view = make_view(len(lengths), **kw)
    return dataclasses.replace(view, lookup_lengths={NGRAM: np.asarray(lengths, np.int64)})


def _times(target_per_token: float, draft_forward: float, fixed: float = 0.01):
    """T(w, f) of a step verifying w tokens in which the draft model runs f forwards."""
    return lambda width, forwards, drafts: (fixed + target_per_token * width
                                            + forwards * draft_forward)


def _learn(choice: DrafterChoice, view, drafters, accepted, gamma: int = 4, note=None):
    """A step's outcome; ``note``: the note of the plan it ran (its lookups' estimates)."""
    drafters = np.asarray(drafters)
    out = make_outcome(view, np.where(drafters >= 0, gamma, 0), accepted, plan_note=note)
    choice.observe(dataclasses.replace(out, drafters=drafters))


def test_each_sequence_takes_the_drafter_its_acceptance_favours():
    choice = DrafterChoice(alpha0=0.6, confidence_z=0.0)
    view = _view([4, 4, 0, 0])
    for _ in range(20):  # r0, r1 accept whole lookups; the model's drafts of r2, r3 accept
        _learn(choice, view, [NGRAM, NGRAM, MODEL, MODEL], [4, 4, 3, 3])
        _learn(choice, view, [MODEL, MODEL, -1, -1], [0, 0, 0, 0])
    plan = choice.plan(view, MODEL, (NGRAM,), BUCKETS, _times(1e-4, 2e-4))
    assert plan.drafters.tolist() == [NGRAM, NGRAM, MODEL, MODEL]
    assert plan.gammas.tolist() == [4, 4, 4, 4]


def test_an_expensive_draft_model_is_left_out_and_lookups_draft_alone():
    choice = DrafterChoice(alpha0=0.6, confidence_z=0.0)
    view = _view([4, 0, 3, 0])
    for _ in range(20):
        _learn(choice, view, [NGRAM, MODEL, NGRAM, MODEL], [4, 1, 3, 1])
    # the draft model's forward costs as much as the whole target step: not worth its rows
    plan = choice.plan(view, MODEL, (NGRAM,), BUCKETS, _times(1e-4, 0.05))
    assert MODEL not in plan.drafters.tolist()
    assert plan.drafters.tolist() == [NGRAM, -1, NGRAM, -1]
    assert plan.gammas.tolist() == [4, 0, 4, 0]


def test_a_row_the_draft_model_lags_far_behind_is_not_worth_its_catch_up():
    choice = DrafterChoice(alpha0=0.6, confidence_z=0.0)
    view = dataclasses.replace(_view([0, 0, 0, 0]), pending_draft_tokens=np.array([1, 1, 600, 2]))
    for _ in range(20):
        _learn(choice, view, [MODEL] * 4, [3, 3, 3, 3])
    out = make_outcome(view, [0] * 4, [0] * 4)
    choice.observe(dataclasses.replace(out, catch_up_time=0.02, catch_up_tokens=1000))
    plan = choice.plan(view, MODEL, (NGRAM,), BUCKETS, _times(1e-4, 2e-4))
    assert plan.drafters.tolist() == [MODEL, MODEL, -1, MODEL]  # 600 tokens: 12 ms to catch up


def test_plain_decoding_when_nothing_pays():
    choice = DrafterChoice(alpha0=0.6, confidence_z=0.0)
    view = _view([0, 0, 0, 0])
    for _ in range(20):
        _learn(choice, view, [MODEL] * 4, [0, 0, 0, 0])
    plan = choice.plan(view, MODEL, (NGRAM,), BUCKETS, _times(1e-3, 1e-3))
    assert plan.gammas.tolist() == [0, 0, 0, 0]
    assert plan.drafters.tolist() == [-1] * 4


def test_a_lone_long_lookup_drafts_where_the_engine_verifies_only_what_was_found():
    choice = DrafterChoice(alpha0=0.6, confidence_z=0.0)
    view = _view([4, 0, 0, 0, 0, 0, 0, 0])
    for _ in range(20):  # the lookup's drafts of row 0 accept 90% of their tokens
        _learn(choice, view, [NGRAM] + [-1] * 7, [4] + [0] * 7)
        _learn(choice, view, [NGRAM] + [-1] * 7, [3] + [0] * 7)
    times = _times(1e-3, 1e-3)
    # every row verified Γ + 1 wide: 40 tokens for one row's 4 drafts do not pay (on a copy: a
    # plain plan's gain would let the next steps skip planning)
    plan = copy.deepcopy(choice).plan(view, None, (NGRAM,), BUCKETS, times)
    assert plan.gammas.tolist() == [0] * 8
    # lookups' steps verified at what they found (8 + 4 tokens): row 0 drafts its 4

    def ragged(drafted, g, model_drafts):
        return 8 * (1 + g) if model_drafts else 8 + drafted

    plan = choice.plan(dataclasses.replace(view, verify_width=ragged), None, (NGRAM,), BUCKETS,
                       times)
    assert plan.gammas.tolist() == [4] + [0] * 7
    assert plan.drafters.tolist() == [NGRAM] + [-1] * 7


def test_the_prompt_tokens_drafts_displace_are_the_displaced_budget_while_prompts_wait():
    view = dataclasses.replace(make_view(8), lookahead_tokens=32, prefill_backlog_tokens=20)
    # a plain step gives 20 of the 32 reserved tokens to the waiting prompts: the first 12
    # drafted tokens cost no prompt token, each one after that does
    assert view.displaced_prompt_tokens(np.array([0, 12, 13, 20, 32])).tolist() == \
        [0, 0, 1, 8, 20]
    assert dataclasses.replace(view, prefill_backlog_tokens=0).displaced_prompt_tokens(32) == 0


def test_drafts_in_a_prompts_padding_pay_for_the_prompt_tokens_they_displace():
    """A step with a prompt chunk verifies at a token bucket whose padding drafts could fill
    at no cost of its own; but while prompt tokens wait for the budget, each drafted token
    takes one's place (a later step runs it), so a lookup that rarely hits drafts only where
    nothing waits."""
    choice = DrafterChoice(alpha0=0.6, confidence_z=0.0)
    view = dataclasses.replace(_view([4] * 8, num_prefill_tokens=24),
                               verify_width=lambda drafted, g, model_drafts: 64)
    for _ in range(30):  # about one drafted token in ten is accepted
        _learn(choice, view, [NGRAM] * 8, [1] + [0] * 7)
    times = _times(1e-3, 1e-3)
    free = choice.plan(view, None, (NGRAM,), BUCKETS, times)  # nothing waits: padding is free
    assert (free.gammas > 0).all() and (free.drafters == NGRAM).all()
    waiting = dataclasses.replace(view, lookahead_tokens=32, prefill_backlog_tokens=500)
    plan = choice.plan(waiting, None, (NGRAM,), BUCKETS, times)
    assert plan.gammas.tolist() == [0] * 8


def test_before_steps_can_be_priced_every_drafter_drafts_the_longest():
    choice = DrafterChoice(alpha0=0.6, confidence_z=2.0)
    view = _view([2, 0, 4])
    plan = choice.plan(view, MODEL, (NGRAM,), BUCKETS, lambda g, forwards, drafts: None)
    assert plan.gammas.tolist() == [4, 4, 4]
    assert plan.drafters.tolist() == [MODEL, MODEL, NGRAM]
    # lookups alone: every other step plain, so the line sees steps of both kinds
    # (StepLine.drafting_steps) and can tell what drafting at all adds
    alone = DrafterChoice(alpha0=0.6, confidence_z=2.0)
    plans = [alone.plan(view, None, (NGRAM,), BUCKETS, lambda g, forwards, drafts: None)
             for _ in range(4)]
    assert [p.gammas.tolist() for p in plans] == [[4, 0, 4], [0, 0, 0]] * 2
    assert plans[0].drafters.tolist() == [NGRAM, -1, NGRAM]


def test_auto_plans_per_sequence_only_with_lookups_and_keeps_its_state():
    auto = make_policy("auto", 4)
    auto.set_pool(("draft",))
    auto.set_lookups(())
    assert auto.possible_drafters() == set() and not auto.reads_lookups
    assert auto.plan(make_view(3)).drafters is None  # DSD's plan, one γ for all
    auto = make_policy("auto", 4)
    auto.set_pool(("draft", "ngram", "suffix"))
    auto.set_lookups((1, 2))
    assert auto.possible_drafters() == {0, 1, 2} and auto.reads_lookups
    view = dataclasses.replace(make_view(2), lookup_lengths={1: np.array([3, 0]),
                                                             2: np.array([0, 0])})
    plan = auto.plan(view)
    assert plan.drafters.tolist() == [0, 0] and plan.gammas.tolist() == [4, 4]
    out = dataclasses.replace(make_outcome(view, [4, 4], [4, 0]), drafters=np.array([1, 0]))
    auto.observe(out)
    state = auto.state_dict()
    assert set(state["drafters"]["rate"]) == {"0", "1"}
    again = make_policy("auto", 4)
    again.set_pool(("draft", "ngram", "suffix"))
    again.set_lookups((1, 2))
    again.load_state_dict(state)
    assert again._choice.rate == pytest.approx(auto._choice.rate)
    lookups_only = make_policy("auto", 4)
    lookups_only.set_pool(("ngram",))
    lookups_only.set_lookups((0,))
    assert lookups_only.model is None and lookups_only.possible_drafters() == {0}


def test_step_line_tells_the_draft_models_cost_from_whole_steps():
    from jspec.policies.measured_time import StepLine

    line = StepLine(with_draft=True)
    rng = np.random.default_rng(0)
    view = make_view(4)

    def step(width, forwards):
        out = make_outcome(view, [forwards] * 4, [0] * 4, num_padded_tokens=width,
                           step_time=0.004 + 2e-5 * width + 1e-3 * forwards
                           + rng.normal(0, 1e-5))
        return dataclasses.replace(out, model_forwards=forwards)

    for _ in range(10):  # only steps that ran the model: its cost cannot be told apart yet
        line.observe(step(int(rng.integers(8, 64)), 4))
    assert line.coefficients() is None
    for _ in range(10):
        line.observe(step(int(rng.integers(8, 64)), int(rng.integers(0, 2)) * 2))
    a, b, c = line.coefficients()
    assert a == pytest.approx(0.004, rel=0.05) and b == pytest.approx(2e-5, rel=0.05)
    assert c == pytest.approx(1e-3, rel=0.05)


def test_step_line_keeps_the_draft_models_cost_while_the_model_idles():
    """Once told, the draft model's cost per forward outlives the steps it was told from: a
    line that forgot it would leave the policy unable to price any step, and `auto` would
    explore the model again at its longest draft, the costliest step there is. Nor does it
    drift while the model idles: the target's fixed cost moving meanwhile is not the model's."""
    from jspec.policies.measured_time import StepLine

    line = StepLine(with_draft=True)
    rng = np.random.default_rng(1)
    view = make_view(4)

    def step(width, forwards, a=0.004):
        out = make_outcome(view, [forwards] * 4, [0] * 4, num_padded_tokens=width,
                           step_time=a + 2e-5 * width + 1e-3 * forwards + rng.normal(0, 1e-5))
        return dataclasses.replace(out, model_forwards=forwards)

    for _ in range(20):
        line.observe(step(int(rng.integers(8, 64)), int(rng.integers(0, 2)) * 2))
        line.coefficients()  # solved every step, as a plan does
    assert line.coefficients()[2] == pytest.approx(1e-3, rel=0.05)
    for _ in range(500):  # the model idles while the target's fixed cost moves
        line.observe(step(int(rng.integers(8, 64)), 0, a=0.006))
        a, b, c = line.coefficients()
        assert c == pytest.approx(1e-3, rel=0.15)  # never the fixed cost's move
    assert a == pytest.approx(0.006, rel=0.05) and b == pytest.approx(2e-5, rel=0.05)


def test_step_line_tells_what_drafting_adds_to_a_step_with_lookups_alone():
    """With lookups alone the line's third term is a step's drafting at all: such a step's
    host work no longer overlaps the device's, a cost its width does not show."""
    from jspec.policies.measured_time import StepLine

    line = StepLine(with_draft=False, drafting_steps=True)
    rng = np.random.default_rng(2)
    view = make_view(2)
    for _ in range(40):
        drafted = int(rng.integers(0, 2)) * int(rng.integers(1, 5))
        width = 2 + 2 * drafted + int(rng.integers(0, 3))
        line.observe(make_outcome(view, [drafted] * 2, [0, 0], num_drafted=[drafted] * 2,
                                  num_padded_tokens=width,
                                  step_time=0.003 + 1e-4 * width + 0.002 * (drafted > 0)))
    assert line.coefficients() == pytest.approx((0.003, 1e-4, 0.002), rel=1e-3)


def test_a_drafter_left_out_is_tried_again_as_its_evidence_ages():
    """The draft model drafted badly for a while; while only the lookup drafts, the judged
    tokens behind the model's rate age (idle_decay), its bound widens, and its rate at the
    bound rises back towards being tried. Without ageing it stays where it was."""
    ageing, frozen = (DrafterChoice(alpha0=0.6, confidence_z=2.0, idle_decay=d)
                      for d in (0.002, 0.0))
    view = _view([4, 4])
    for choice in (ageing, frozen):
        for _ in range(30):
            _learn(choice, view, [MODEL, MODEL], [0, 1])
        for _ in range(500):  # the lookup drafts every row
            _learn(choice, view, [NGRAM, NGRAM], [4, 4])
    assert ageing.rate[MODEL] == frozen.rate[MODEL]  # the rate itself did not move
    assert ageing.judged[MODEL] < 0.5 * frozen.judged[MODEL]
    assert ageing.drafter_rate(MODEL) > frozen.drafter_rate(MODEL) + 0.05


SUFFIX = 2


def test_a_lookups_own_estimate_drafts_a_row_its_record_would_not():
    """Suffix decoding's chained frequencies (``BatchView.lookup_probs``) predict each row's
    draft: a row whose output turned repetitive (estimate ~1 per token) drafts 4 tokens with the
    lookup at once, though the drafter's record (and the row's own) says half its tokens fail
    and the draft model has accepted everything of that row; a row whose estimate is low
    leaves the lookup for the model."""
    choice = DrafterChoice(alpha0=0.6, confidence_z=0.0)
    view = _view([0, 0])
    for _ in range(20):  # suffix drafts of both rows accepted half; the model's all
        _learn(choice, view, [SUFFIX, SUFFIX], [1, 1], gamma=2)
        _learn(choice, view, [MODEL, MODEL], [4, 4])
    probs = np.array([[1.0, 1.0, 0.99, 0.99], [0.3, 0.1, np.nan, np.nan]])
    view = dataclasses.replace(view, lookup_lengths={SUFFIX: np.array([4, 2])},
                               lookup_probs={SUFFIX: probs})
    times = _times(1e-4, 5e-4)
    plan = choice.plan(view, MODEL, (SUFFIX,), BUCKETS, times)
    assert plan.drafters.tolist() == [SUFFIX, MODEL] and plan.gammas.tolist() == [4, 4]
    # without the estimate the record rules: the model takes both rows
    blind = dataclasses.replace(view, lookup_probs={})
    assert choice.plan(blind, MODEL, (SUFFIX,), BUCKETS, times).drafters.tolist() == [MODEL] * 2


def test_a_lookups_estimates_are_calibrated_by_what_they_accepted():
    """Estimates that promise more than the target accepts lose weight: after rows predicted
    at ~1 per token accepted one token in four, the same estimate no longer beats the model."""
    choice = DrafterChoice(alpha0=0.6, confidence_z=0.0)
    probs = np.array([[1.0, 1.0, 1.0, 1.0]])
    view = dataclasses.replace(_view([0]), lookup_lengths={SUFFIX: np.array([4])},
                               lookup_probs={SUFFIX: probs})
    for _ in range(10):
        _learn(choice, view, [MODEL], [3])
    times = _times(1e-4, 1e-4)
    assert choice.plan(view, MODEL, (SUFFIX,), BUCKETS, times).drafters.tolist() == [SUFFIX]
    assert choice.calibration(SUFFIX, 4).tolist() == [1.0] * 4
    for _ in range(30):
        plan = choice.plan(view, MODEL, (SUFFIX,), BUCKETS, times)
        if plan.drafters[0] != SUFFIX:
            break
        _learn(choice, view, [SUFFIX], [1], note=plan.note)
    # per depth: the first token was always accepted, the second never, the rest never judged
    first, second, *rest = choice.calibration(SUFFIX, 4)
    assert first == pytest.approx(1.0) and second < 0.5 and rest == [1.0, 1.0]
    assert choice.plan(view, MODEL, (SUFFIX,), BUCKETS, times).drafters.tolist() == [MODEL]
    state = choice.state_dict()  # the calibration is saved with the rates
    fresh = DrafterChoice(alpha0=0.6, confidence_z=0.0)
    fresh.load_state_dict(state)
    assert fresh.calibration(SUFFIX, 4) == pytest.approx(choice.calibration(SUFFIX, 4))
    # a row verified past its estimates (its draft redrawn after the survey) teaches only the
    # depths the estimates cover
    before = choice.calibration(SUFFIX, 4)
    estimates = {view.request_ids[0]: (SUFFIX, np.array([0.5, np.nan, np.nan, np.nan]))}
    _learn(choice, view, [SUFFIX], [3], note={"predicted": estimates})
    after = choice.calibration(SUFFIX, 4)
    assert np.isfinite(after).all() and after[0] > before[0]
    assert after[1] == pytest.approx(before[1], rel=0.01)  # older evidence decayed, no more
    # a state saved with one factor for whole drafts: the factor of the first depth
    fresh.load_state_dict({**state, "calibration": {str(SUFFIX): [1.0, 4.0]}})
    assert fresh.calibration(SUFFIX, 2) == pytest.approx([5 / 8, 1.0])



@pytest.mark.parametrize("seed", range(6))
def test_a_plan_over_a_few_rows_on_python_floats_is_the_plan_over_arrays(seed):
    """``_choose_few`` (a few rows, on Python floats) and ``_choose`` (on [candidates, rows]
    arrays) plan the same steps: random evidence, surveys with and without estimates, draft
    models far behind, ragged and padded verify widths, prompts waiting; and so they do with
    the tables the next evidence prepares for the next plan."""
    rng = np.random.default_rng(seed)
    buckets, lookups = (1, 2, 4, 8), (NGRAM, SUFFIX)
    plans = 0
    for _ in range(60):
        n = int(rng.integers(1, 9))
        choice = DrafterChoice(alpha0=float(rng.uniform(0.3, 0.9)), confidence_z=1.0)
        view = make_view(n, max_gamma=8, pending=rng.choice([1, 2, 40, 900], n),
                         prefill_backlog_tokens=int(rng.choice([0, 30])))
        view = dataclasses.replace(view, lookahead_tokens=int(rng.integers(0, 9 * n)))
        for _ in range(int(rng.integers(0, 12))):  # evidence per (row, drafter)
            drafted = rng.choice([-1, MODEL, NGRAM, SUFFIX], n)
            accepted = np.where(drafted >= 0, rng.integers(0, 5, n), 0)
            _learn(choice, view, drafted, accepted)
        if rng.random() < 0.7:
            out = make_outcome(view, [0] * n, [0] * n)
            choice.observe(dataclasses.replace(out, catch_up_time=float(rng.uniform(0, 0.02)),
                                               catch_up_tokens=1000))
        found = {d: rng.integers(0, 9, n) for d in lookups if rng.random() < 0.8}
        probs = {}
        if SUFFIX in found:
            chained = np.cumprod(rng.uniform(0.2, 1.0, (n, 8)), axis=1)
            chained[np.arange(8)[None, :] >= found[SUFFIX][:, None]] = np.nan
            chained[rng.random(n) < 0.3] = np.nan  # rows without an estimate
            probs[SUFFIX] = chained
            choice._calibration[SUFFIX] = (rng.uniform(0, 5, 8), rng.uniform(0, 5, 8))
        view = dataclasses.replace(view, lookup_lengths=found, lookup_probs=probs)
        if rng.random() < 0.5:
            view = dataclasses.replace(view, verify_width=lambda drafted, g, model_drafts:
                                       n * (1 + g) if model_drafts else 8 * -(-(n + drafted) // 8))
        a, b, c = rng.uniform(1e-3, 1e-2), rng.uniform(1e-5, 1e-3), rng.uniform(0, 3e-3)
        per_step = rng.random() < 0.5

        def step_time(width, forwards, drafts):
            return a + b * np.asarray(width, np.float64) + c * np.asarray(
                drafts if per_step else forwards, np.float64)

        model = MODEL if rng.random() < 0.7 else None
        cands = choice._candidates(buckets, model is not None)
        verify_width = view.verify_width or (lambda drafted, g, model_drafts: n * (1 + g))
        plain = step_time(verify_width(0, 0, False), 0, False)
        args = (view, model, lookups, buckets, cands, step_time, verify_width, plain)
        # the second time, from the tables the evidence in between prepared (``_ready``)
        for prepared in (False, True):
            if prepared:
                drafted = rng.choice([-1, MODEL, NGRAM, SUFFIX], n)
                _learn(choice, view, drafted, np.where(drafted >= 0, rng.integers(0, 5, n), 0))
                assert set(choice._ready[1]) == set(view.request_ids)
            (g, best, gain), (g_few, best_few, gain_few) = choice._choose(*args), \
                choice._choose_few(*args)
            assert g_few == g and (best_few is None) == (best is None)
            assert gain_few == pytest.approx(gain, rel=1e-9, abs=1e-15)
            if best is not None:
                plans += 1
                assert best_few[1].tolist() == best[1].tolist() and best_few[2] == best[2]
                assert best_few[0] == pytest.approx(best[0], rel=1e-12)
    assert plans >= 40  # most cases draft: the comparison covers the drafting paths


def test_planning_that_has_not_paid_runs_every_plan_every_steps():
    """Plans that draft nothing predict no gain, less than planning takes: the steps after one
    decode plainly without a plan, surveying no lookup, until ``plan_every`` steps have passed.
    Once rows accept their drafts, the next plan drafts with a predicted gain far above its
    cost, and every step plans again."""
    choice = DrafterChoice(alpha0=0.6, confidence_z=0.0)
    view = make_view(2)
    for _ in range(20):  # the lookup's drafts are all rejected
        _learn(choice, view, [NGRAM, NGRAM], [0, 0])
    surveys = []

    def surveyed_view():
        def survey():
            surveys.append(1)
            return {NGRAM: np.array([4, 4])}, {NGRAM: np.full((2, 4), np.nan)}
        return dataclasses.replace(view, survey=survey)

    times = _times(0.1, 0.0, fixed=1.0)  # seconds: a drafting plan's gain dwarfs any plan's cost
    every = choice.plan_every
    plans = [choice.plan(surveyed_view(), None, (NGRAM,), BUCKETS, times)
             for _ in range(2 * every)]
    assert all(p.gammas.tolist() == [0, 0] for p in plans)
    assert len(surveys) == 2  # the first step's plan, and the one plan_every steps later
    for _ in range(40):  # now they are all accepted
        _learn(choice, view, [NGRAM, NGRAM], [4, 4])
    plans = [choice.plan(surveyed_view(), None, (NGRAM,), BUCKETS, times)
             for _ in range(2 * every)]
    first = next(i for i, p in enumerate(plans) if p.gammas.any())
    assert first < every
    assert all(p.gammas.tolist() == [4, 4] for p in plans[first:])
    assert len(surveys) == 2 + len(plans) - first  # skipped before it, planned from it on
