"""Plain decoding when speculation does not pay: a gate for policies that only choose lengths.

DSDE (the DSDE paper, §III) sets each sequence's speculation length between SL_min = 2 and
SL_max from the stability of the KL signal, so it speculates whatever speculation costs. Where a
verified token costs nearly what a decoded one does (a saturated batch on a memory-bound target
that has become compute-bound) every γ > 0 loses to plain decoding, and DSDE ran at 0.75× the
best fixed arm in the simulator's saturation-no-pay (docs/benchmarks.md, "Adaptation that never
collapses"). Where a draft costs little (a small batch), the constant floor holds a sequence
that just disagreed with the target at 2 tokens although longer drafts pay, and DSDE ran at
0.93× static γ = 4 in the simulator's low-load. The product promises never to be slower than
plain decoding, and the fixed choices are the bar, so such a policy offers the gate several
candidate plans (DSDE: its rule with each floor in place of SL_min) and the gate runs the one
of highest predicted goodput, plain decoding among them.

The prediction is DSD's (policies/dsd.py): the geometric acceptance model at an upper
confidence bound of the judged acceptance rate, over the run's own linear step-time model
(policies/measured_time.py), the profile until that model can be fitted. The bound is
optimistic, so the gate opens when evidence is thin; and the decision is taken again every step
from the current batch, so a load that falls opens it again: it cannot lock itself shut on a
sample taken under other conditions. While it is shut no acceptance is observed: the rate stays
where it was and its evidence ages (DSD's ``idle_decay``), so a rate measured on a few badly
drafting requests is tried again after a few hundred steps. Given no profile (a policy planned
outside an engine), the gate stays open until the run's own model is fitted.

DSDE spreads rows between the floor and SL_max, and a step verifies every row as wide as its
longest draft, so where one short length for every row is best (γ = 1 at B = 32 on a
compute-bound target) every range up to SL_max is dearer than plain decoding. DSDE therefore also
offers each top below SL_max with the floor raised to it, one length for every row: offered only
floors, the gate decoded plainly there (the simulator's load-step: 0.94 of the best fixed arm on
the worst of 20 seeds, 0.99 with the tops).

A step in which prompts wait for the token budget (``BatchView.prefill_bound``) decodes plainly
whatever the prediction: the engine's pace is then its steps', which speculation only slows.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from jspec.policies.base import BatchView, DraftPlan, StepOutcome
from jspec.policies.dsd import DSDPolicy


class GoodputGate:
    """Passes a plan, or plain decoding where the plan's predicted goodput is lower."""

    def __init__(self, max_gamma: int):
        self._model = DSDPolicy(max_gamma)

    def set_profile(self, profile: Any) -> None:
        self._model.set_profile(profile)

    def choose(self, view: BatchView, candidates: list[np.ndarray]) -> DraftPlan:
        """The candidate per-row γ plan of highest predicted goodput, plain decoding included;
        ties go to the earlier candidate, then to speculation over plain decoding. Before the
        time model can predict, the first candidate."""
        first = np.asarray(candidates[0], np.int32)
        if first.size and view.prefill_bound:
            return DraftPlan(gammas=np.zeros_like(first))
        if first.size == 0 or not self._model.can_predict:
            return DraftPlan(gammas=first)  # no profile yet: speculate until steps are timed
        best = np.zeros_like(first)
        best_goodput = self._model.plan_goodput(view, best)
        for gammas in candidates[::-1]:  # reversed with >=: the earliest of equals wins
            gammas = np.asarray(gammas, np.int32)
            goodput = self._model.plan_goodput(view, gammas)
            if goodput >= best_goodput:
                best, best_goodput = gammas, goodput
        return DraftPlan(gammas=best)

    def observe(self, outcome: StepOutcome) -> None:
        self._model.observe(outcome)

    def state_dict(self) -> dict[str, Any]:
        return self._model.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._model.load_state_dict(state)
