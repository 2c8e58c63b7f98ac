"""DSD: per-step goodput maximisation under a geometric acceptance model (papers.md, "Baselines").

Every draft token is accepted independently with probability α, and a step emits the accepted
prefix plus one bonus/correction token, so a sequence drafting γ tokens yields

    E(γ) = Σ_{j=0..γ} α^j = (1 − α^(γ+1)) / (1 − α)        (E(0) = 1: plain decoding)

tokens. With T(γ) = profile.step_time(B, γ, L) (B = all rows of the step, L = mean context of the
decoding sequences; γ draft forwards plus a target forward over γ+1 tokens per row) the plan is

    γ* = argmax_{γ ∈ 0..max_gamma} n·E(γ) / T(γ)

for the n decoding sequences, the same γ* for all (ties go to the smaller γ). The sum form is used
so α = 1 needs no special case.

α is an EMA (rate ``ema``, default 0.1: about the last ten steps, each already an average over
the batch) of each step's per-token acceptance rate, starting at ``alpha0`` (0.6, AdaSpec's
confidence prior). The rate (``rate``):

* "judged" (default): accepted / (accepted + rejections), rejections = sequences that accepted
  fewer tokens than they verified. Tokens behind the first rejection are discarded unjudged, so
  they say nothing about α; this ratio's expectation is exactly α under the geometric model
  (E[accepted] = α(1−α^γ)/(1−α), P(rejection) = 1 − α^γ).
* "verified": accepted / verified, the literal ratio. It counts the unjudged tail as rejections
  and underestimates α (α = 0.8, γ = 4 reads 0.59), making the policy too timid.

A step with nothing verified leaves α unchanged, so while γ* = 0 α stays frozen; γ* only comes
back when the load (B) makes speculation pay at that α. Options: ``profile`` (default: the one
the engine measures at start-up, jspec/autoprofile.py), ``alpha0``, ``ema``, ``rate``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from policies.base import BatchView, DraftPlan, Policy, StepOutcome
from policies.profile import StepProfile, load_profile

_RATES = ("judged", "verified")


def _unit(name: str, value: Any, low_open: bool) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not ok or not (0.0 < value <= 1.0 if low_open else 0.0 <= value <= 1.0):
        raise ValueError(f"{name} must be a number in {'(0, 1]' if low_open else '[0, 1]'}, "
                         f"got {value!r}")
    return float(value)


def expected_tokens(alpha: float, gamma: int) -> float:
    """E(γ) = Σ_{j=0..γ} α^j: tokens emitted by one sequence drafting γ (geometric acceptance)."""
    return float(np.sum(float(alpha) ** np.arange(gamma + 1)))


class DSDPolicy(Policy):
    """Goodput-maximising γ with an EMA acceptance rate (see the module docstring)."""

    name = "dsd"
    needs_profile = True

    def __init__(self, max_gamma: int = 4, profile: "str | StepProfile | None" = None,
                 alpha0: float = 0.6, ema: float = 0.1, rate: str = "judged"):
        super().__init__(max_gamma)
        self.profile = load_profile(self.name, profile)
        self.alpha0 = _unit("alpha0", alpha0, low_open=False)
        self.ema = _unit("ema", ema, low_open=True)
        if rate not in _RATES:
            raise ValueError(f"rate must be one of {_RATES}, got {rate!r}")
        self.rate = rate
        self.alpha = self.alpha0
        self.num_updates = 0

    def goodputs(self, view: BatchView) -> np.ndarray:
        """Predicted goodput n·E(γ)/T(γ) for γ = 0..max_gamma."""
        batch = max(view.batch_size, view.num_decode, 1)
        ctx = float(np.mean(view.context_lens)) if view.num_decode else 1.0
        gammas = np.arange(self.max_gamma + 1)
        tokens = np.array([expected_tokens(self.alpha, g) for g in gammas])
        return view.num_decode * tokens / self.step_profile.step_times(batch, gammas, ctx)

    def plan(self, view: BatchView) -> DraftPlan:
        n = view.num_decode
        if not view.draft_resident or n == 0 or self.max_gamma == 0:
            return DraftPlan(gammas=np.zeros(n, np.int32))
        gamma = int(np.argmax(self.goodputs(view)))  # first maximum: ties to the smaller γ
        return DraftPlan(gammas=np.full(n, gamma, np.int32))

    def step_rate(self, outcome: StepOutcome) -> float | None:
        """This step's per-token acceptance rate (module docstring), None if nothing verified."""
        verified = np.asarray(outcome.num_verified, np.int64)
        accepted = np.minimum(np.asarray(outcome.num_accepted, np.int64), verified)
        if verified.sum() == 0:
            return None
        if self.rate == "verified":
            return float(accepted.sum() / verified.sum())
        judged = accepted.sum() + np.count_nonzero(accepted < verified)
        return float(accepted.sum() / judged)

    def observe(self, outcome: StepOutcome) -> None:
        r = self.step_rate(outcome)
        if r is not None:
            self.alpha = (1.0 - self.ema) * self.alpha + self.ema * r
            self.num_updates += 1

    def state_dict(self) -> dict[str, Any]:
        return {"alpha": self.alpha, "num_updates": self.num_updates}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if set(state) != {"alpha", "num_updates"}:
            raise ValueError(f"dsd state needs keys ['alpha', 'num_updates'], got {sorted(state)}")
        self.alpha = _unit("alpha", state["alpha"], low_open=False)
        self.num_updates = int(state["num_updates"])
