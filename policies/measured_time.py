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

import math
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

    def line(self) -> tuple[float, float] | None:
        """The target's (a, b): seconds at width 0 and per token of width; None until the fit
        can tell them apart."""
        return self._target.line()

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
# the draft model's cost is told only from a fit in which both kinds of step are this recent
# (steps since each was last seen); otherwise the one told last is kept
_RECENT = 1


class StepLine:
    """A decoding step's time less its catch-up as a + b·w + c·F, fitted online by least
    squares over exponentially decayed sums: w the verify forward's padded width, F the draft
    model's forwards in the step (``StepOutcome.draft_forwards``; 0 when it did not run).

    Where the draft loop's device time lands among a step's stages depends on what syncs
    (unsynced, it shows up in the target's pass), so its cost is read from whole steps with and
    without it rather than from the draft stage's clock. ``with_draft`` False: no draft model,
    the line a + b·w alone.

    ``drafting_steps`` (an engine whose drafters are lookups alone): F is 1 for a step in which
    any row drafted, 0 otherwise, so c is what drafting adds to a step beyond its width. Such a
    step commits the one before it first and is committed before the next one starts
    (``jspec/overlap.py``), so the host's work no longer overlaps the device's: ~2 ms of a
    3-ms B = 1 step on the 2-vCPU AMD EPYC, where the width adds next to nothing.

    It is updated and solved once per step between the device's passes, so it keeps plain
    floats and solves its 2×2 or 3×3 system by elimination: numpy's per-call overhead was
    ~60 µs of each step's plan at B = 1."""

    def __init__(self, with_draft: bool, decay: float = _DRAFT_DECAY,
                 drafting_steps: bool = False):
        self.with_draft = with_draft or drafting_steps
        self.drafting_steps = drafting_steps
        self.decay = decay
        k = 3 if self.with_draft else 2
        self.xx = [[0.0] * k for _ in range(k)]
        self.xy = [0.0] * k
        self.kinds = [0.0, 0.0]  # decayed steps without and with the draft model
        self.since = [0, 0]  # steps since a step without and with the draft model
        self._solved: tuple[float, ...] | None = None
        self._stale = True  # observed since the last solve
        self._draft_cost: float | None = None  # c, when last told from the steps

    def observe(self, outcome: StepOutcome) -> None:
        w = float(outcome.num_padded_tokens)
        if w <= 0 or outcome.step_time <= 0:
            return
        if self.drafting_steps:
            forwards = float(np.max(outcome.num_drafted, initial=0) > 0)
        else:
            forwards = float(outcome.draft_forwards) if self.with_draft else 0.0
        x = (1.0, w, forwards)[:len(self.xy)]
        # the draft model's catch-up is priced per row by the policy that uses this line
        y = outcome.step_time - outcome.catch_up_time
        d = self.decay
        for i, xi in enumerate(x):
            row = self.xx[i]
            for j, xj in enumerate(x):
                row[j] = d * row[j] + xi * xj
            self.xy[i] = d * self.xy[i] + xi * y
        self.kinds = [d * c for c in self.kinds]
        self.kinds[forwards > 0] += 1.0
        self.since = [k + 1 for k in self.since]
        self.since[forwards > 0] = 0
        self._stale = True

    def coefficients(self) -> tuple[float, ...] | None:
        """(a, b[, c]) once the steps seen tell them apart, else None."""
        if self._stale:
            self._solved, self._stale = self._solve(), False
        return self._solved

    def _solve(self) -> tuple[float, ...] | None:
        xx, xy = self.xx, self.xy
        n = xx[0][0]
        if n < _MIN_STEPS:
            return None
        mean_w = xx[0][1] / n
        if xx[1][1] / n - mean_w * mean_w <= (_MIN_REL_SPREAD * mean_w) ** 2:
            return None
        if not self.with_draft:
            return _least_squares([row[:2] for row in xx[:2]], xy[:2])
        c = self._draft_cost
        if min(self.kinds) >= _MIN_KIND and (c is None or max(self.since) <= _RECENT):
            beta = _least_squares(xx, xy)
            if beta is not None:
                self._draft_cost = beta[2]
            return beta
        # Steps of one kind only lately (the draft model idle, say): its cost per forward is
        # the one told last, and the line is fitted to the steps less that cost. Without this
        # the fit would give up, and the policy would explore the model again at its longest
        # draft, the costliest step there is; and a fit over the idle kind's ageing steps would
        # tell its cost from the other kind's new ones, taking any move of the target's fixed
        # cost since for the model's (a move from 4 to 6 ms made a 1-ms draft cost 0.03 ms).
        if c is None:
            return None
        line = _least_squares([row[:2] for row in xx[:2]],
                              [xy[0] - c * xx[0][2], xy[1] - c * xx[1][2]])
        return None if line is None else (*line, c)


def _least_squares(xx: list[list[float]], xy: list[float]) -> tuple[float, ...] | None:
    """The coefficients (each at least 0) that solve the normal equations xx·β = xy of a small
    least-squares fit, by elimination in units where the columns are comparable (a 1 and a
    width of hundreds); None where they cannot be told apart."""
    k = len(xy)
    scale = [math.sqrt(xx[i][i]) for i in range(k)]
    if min(scale) <= 0.0:
        return None
    m = [[xx[i][j] / (scale[i] * scale[j]) for j in range(k)] + [xy[i] / scale[i]]
         for i in range(k)]
    for col in range(k):  # Gaussian elimination with partial pivoting
        pivot = max(range(col, k), key=lambda r: abs(m[r][col]))
        if abs(m[pivot][col]) < 1e-12:
            return None  # singular: the steps seen cannot tell the terms apart
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(col + 1, k):
            f = m[r][col] / m[col][col]
            for j in range(col, k + 1):
                m[r][j] -= f * m[col][j]
    beta = [0.0] * k
    for i in range(k - 1, -1, -1):
        beta[i] = (m[i][k] - sum(m[i][j] * beta[j] for j in range(i + 1, k))) / m[i][i]
    return tuple(max(b / s, 0.0) for b, s in zip(beta, scale))
