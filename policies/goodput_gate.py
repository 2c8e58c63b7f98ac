"""Plain decoding when speculation does not pay: a gate for policies that only choose lengths.

DSDE (the DSDE paper, §III) sets each sequence's speculation length between SL_min = 2 and
SL_max from the stability of the KL signal, so it speculates whatever speculation costs. Where a
verified token costs nearly what a decoded one does (a saturated batch on a memory-bound target
that has become compute-bound) every γ > 0 loses to plain decoding, and DSDE ran at 0.75× the
best fixed arm in the simulator's saturation-no-pay (docs/benchmarks.md, "Adaptation that never
collapses"). The product promises never to be slower than plain decoding, so such a policy's
plan passes through this gate: the plan runs if its predicted goodput beats plain decoding's,
else every sequence decodes plainly this step.

The prediction is DSD's (policies/dsd.py): the geometric acceptance model at an upper
confidence bound of the judged acceptance rate, over the run's own linear step-time model
(policies/measured_time.py), the profile until that model can be fitted. The bound is
optimistic, so the gate opens when evidence is thin; and the decision is taken again every step
from the current batch, so a load that falls opens it again: it cannot lock itself shut on a
sample taken under other conditions. While it is shut no acceptance is observed and the rate
stays where it was. Given no profile (a policy planned outside an engine), the gate stays open
until the run's own model is fitted.

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

    def apply(self, view: BatchView, plan: DraftPlan) -> DraftPlan:
        gammas = np.asarray(plan.gammas)
        if gammas.size and view.prefill_bound:
            return DraftPlan(gammas=np.zeros_like(gammas), chain=plan.chain)
        if gammas.size == 0 or not gammas.any() or not self._model.can_predict:
            return plan  # outside an engine, with no profile: speculate until steps are timed
        plain = self._model.plan_goodput(view, np.zeros_like(gammas))
        if self._model.plan_goodput(view, gammas) >= plain:
            return plan
        return DraftPlan(gammas=np.zeros_like(gammas), chain=plan.chain)

    def observe(self, outcome: StepOutcome) -> None:
        self._model.observe(outcome)

    def state_dict(self) -> dict[str, Any]:
        return self._model.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._model.load_state_dict(state)
