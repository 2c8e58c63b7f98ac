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
from jspec.policies.prefill_cost import PrefillCost

_DRAFT_DECAY = 0.99  # weight of older draft-loop timings, per step that drafted


class MeasuredTime:
    """The run's target line a + b·w and its draft forward's seconds (module docstring)."""

    def __init__(self, target: PrefillCost | None = None):
        # ``target``: a fit the caller already keeps (Nightjar's reward uses the same line)
        self._target = PrefillCost() if target is None else target
        self._draft = [0.0, 0.0]  # decayed Σ draft-loop seconds, Σ draft forwards

    def observe(self, outcome: StepOutcome) -> None:
        self._target.observe(outcome)
        forwards = int(np.max(outcome.num_drafted, initial=0))
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
