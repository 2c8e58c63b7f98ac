"""A step's time measured on the run itself, for the policies that plan from a step-time model.

DSD and AdaSpec plan from a step-time profile. A profile taken in other conditions than the run's
(another day's machine, a CPU shared with another process, other shapes) can be wrong by more
than any margin a policy could allow, and a policy that trusts it may never play the arm that
would show it wrong: in the simulator a profile of a compute-bound target kept DSD at γ = 0 on
a memory-bound one (0.69× the best fixed arm; docs/benchmarks.md, "Adaptation that never
collapses"). ``MeasuredTime`` is the linear time model of the run: the target's time as
a + b·w over its forward's padded width w, fitted online over every step (``PrefillCost``: steps
with and without prefill chunks spread the widths), and one draft forward's time, averaged over
the steps that drafted. Until the fit can tell a from b (or until a draft has run) the profile
stands in.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from jspec.policies.base import StepOutcome
from jspec.policies.prefill_cost import _MIN_REL_SPREAD, PrefillCost

_DRAFT_DECAY = 0.99  # weight of older draft-loop timings, per step that drafted


class MeasuredTime:
    """The run's target line a + b·w and its draft forward's seconds (module docstring)."""

    def __init__(self, target: PrefillCost | None = None):
        # ``target``: a fit the caller already keeps (Nightjar's reward uses the same line)
        self._target = PrefillCost() if target is None else target
        self._draft = [0.0, 0.0]  # decayed Σ draft-loop seconds, Σ draft forwards

    def observe(self, outcome: StepOutcome) -> None:
        self._target.observe(outcome)
        forwards = outcome.draft_forwards
        if outcome.draft_time > 0 and forwards > 0:
            self._draft = [_DRAFT_DECAY * self._draft[0] + outcome.draft_time,
                           _DRAFT_DECAY * self._draft[1] + forwards]

    def target(self, width) -> np.ndarray | None:
        """The target's seconds at forward width(s) ``width``; None until the fit can tell."""
        line = self._target.line()
        if line is None:
            return None
        a, b = line
        return a + b * np.asarray(width, np.float64)

    @property
    def ready(self) -> bool:
        """Whether the run's own model prices every γ: the target line fitted, a draft timed."""
        return self._target.line() is not None and self.draft_forward() is not None

    def draft_forward(self) -> float | None:
        """One draft forward's seconds; None before a draft has run."""
        seconds, forwards = self._draft
        return seconds / forwards if forwards > 0 else None

    def state_dict(self) -> dict[str, Any]:
        return {"target": self._target.state_dict(), "draft": list(self._draft)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        draft = [float(x) for x in state["draft"]]
        if len(draft) != 2:
            raise ValueError(f"measured time has {len(draft)} draft sums, expected 2")
        self._target.load_state_dict(state["target"])
        self._draft = draft


_MIN_STEPS = 5.0  # decayed steps before a fit is trusted
_MIN_KIND = 2.0  # decayed steps with and without the draft model before its cost is told


class StepLine:
    """A decoding step's time less its catch-up as a + b·w + c·F, fitted online by least
    squares over exponentially decayed sums: w the verify forward's padded width, F the draft
    model's forwards in the step (``StepOutcome.draft_forwards``; 0 when it did not run).

    Where the draft loop's device time lands among a step's stages depends on what syncs
    (unsynced, it shows up in the target's pass), so its cost is read from whole steps with and
    without it rather than from the draft stage's clock. ``with_draft`` False: no draft model,
    the line a + b·w alone."""

    def __init__(self, with_draft: bool, decay: float = _DRAFT_DECAY):
        self.with_draft = with_draft
        self.decay = decay
        k = 3 if with_draft else 2
        self.xx = np.zeros((k, k))
        self.xy = np.zeros(k)
        self.kinds = [0.0, 0.0]  # decayed steps without and with the draft model

    def observe(self, outcome: StepOutcome) -> None:
        w = float(outcome.num_padded_tokens)
        if w <= 0 or outcome.step_time <= 0:
            return
        forwards = float(outcome.draft_forwards) if self.with_draft else 0.0
        x = np.array([1.0, w, forwards][:len(self.xy)])
        self.xx = self.decay * self.xx + np.outer(x, x)
        # the draft model's catch-up is priced per row by the policy that uses this line
        self.xy = self.decay * self.xy + x * (outcome.step_time - outcome.catch_up_time)
        self.kinds = [self.decay * c for c in self.kinds]
        self.kinds[forwards > 0] += 1.0

    def coefficients(self) -> np.ndarray | None:
        """(a, b[, c]) once the steps seen tell them apart, else None."""
        n = self.xx[0, 0]
        if n < _MIN_STEPS:
            return None
        mean_w = self.xx[0, 1] / n
        if self.xx[1, 1] / n - mean_w * mean_w <= (_MIN_REL_SPREAD * mean_w) ** 2:
            return None
        if self.with_draft and min(self.kinds) < _MIN_KIND:
            return None
        scale = np.sqrt(np.diag(self.xx))  # solve in units where the columns are comparable
        try:
            beta = np.linalg.solve(self.xx / np.outer(scale, scale), self.xy / scale) / scale
        except np.linalg.LinAlgError:
            return None
        return np.maximum(beta, 0.0)
