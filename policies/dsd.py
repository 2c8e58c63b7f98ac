"""DSD: per-step goodput maximisation under a geometric acceptance model (Liu et al., "Optimizing
Speculative Decoding for Serving Large Language Models Using Goodput", arXiv 2406.14066).

Every draft token is accepted independently with probability α, and a step emits the accepted
prefix plus one bonus/correction token, so a sequence drafting γ tokens yields

    E(γ) = Σ_{j=0..γ} α^j = (1 − α^(γ+1)) / (1 − α)        (E(0) = 1: plain decoding)

tokens. With T(γ) = profile.step_time(B, γ, L) (B = all rows of the step, L = mean context of the
decoding sequences; γ draft forwards plus a target forward over γ+1 tokens per row) the plan is

    γ* = argmax_{γ ∈ 0..max_gamma} n·E(γ) / T(γ)

for the n decoding sequences, the same γ* for all (ties go to the smaller γ). The sum form is used
so α = 1 needs no special case. The objective is the decoding rows' goodput, which is the
engine's only while decoding is what holds it back: in a step where prompts wait for the token
budget (``BatchView.prefill_bound``: as many requests queued for prefill as there are decoding
rows) the engine's throughput is the pace of its steps, and the plan is γ = 0 (in the
simulator's prefill-bursts this lifted DSD from 0.92 of the best fixed arm to above 1.1;
docs/benchmarks.md, "Policies in a simulated environment").

α is an EMA (rate ``ema``, default 0.1: about the last ten steps, each already an average over
the batch) of each step's per-token acceptance rate, starting at ``alpha0`` (0.6, AdaSpec's
confidence prior). The rate (``rate``):

* "judged" (default): accepted / (accepted + rejections), rejections = sequences that accepted
  fewer tokens than they verified. Tokens behind the first rejection are discarded unjudged, so
  they say nothing about α; this ratio's expectation is exactly α under the geometric model
  (E[accepted] = α(1−α^γ)/(1−α), P(rejection) = 1 − α^γ).
* "verified": accepted / verified, the literal ratio. It counts the unjudged tail as rejections
  and underestimates α (α = 0.8, γ = 4 reads 0.59), making the policy too timid.

A step with nothing verified leaves α unchanged, so while γ* = 0 α stays frozen. With the prior
α0 = 0.6 and the engine-measured step costs of the built-in pair (a γ > 0 step at B = 1 costs
2.6-3x a plain one), γ = 0 wins from the first step and α, truly about 0.85 there, is never
seen: DSD decoded plainly at 1 request/s where γ = 5 is best. So the plan uses an upper
confidence bound, α + z·√(α(1 − α)/n) (``confidence_z``, default 2), capped at 1, where n is
the number of judged tokens the EMA remembers (each update decays it by 1 − ``ema``, as the EMA
decays old rates, so n stays near ten steps' worth: the EMA's own noise never shrinks below
that, and a bound over all tokens ever seen once froze α at a noisy 0.57 where the judged
tokens said 0.87). With no evidence it speculates and learns, and γ = 0 is chosen when even the
bound says speculation loses (``confidence_z=0``: the plain EMA, as the baseline is usually
stated). While nothing is verified the evidence ages (``idle_decay``, default 0.002: n shrinks by
that share per decoding step with nothing verified, a half-life of ~350 steps), so the bound
widens until a step speculates again: a rate measured on a few requests that drafted badly
(acceptance 0.27 at B = 2 in the simulator's load-step, where requests drafted at 0.75 on
average) would otherwise stop speculation for good, through every later load.

Options: ``profile`` (default: the one the engine measures at start-up, jspec/autoprofile.py),
``alpha0``, ``ema``, ``rate``, ``confidence_z``, ``idle_decay``, ``measured`` (True: the
baseline's linear time model fitted on the run's own steps once they tell the target's cost per
token from its fixed cost, policies/measured_time.py; False: the profile throughout).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from jspec.policies.base import (BatchView, DraftPlan, Policy, StepOutcome, expected_tokens,
                           gamma_range, judged_acceptance, option_bool, option_number,
                           upper_bound)
from jspec.policies.measured_time import MeasuredTime
from jspec.policies.profile import StepProfile, load_profile

_RATES = ("judged", "verified")


def _unit(name: str, value: Any, low_open: bool) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not ok or not (0.0 < value <= 1.0 if low_open else 0.0 <= value <= 1.0):
        raise ValueError(f"{name} must be a number in {'(0, 1]' if low_open else '[0, 1]'}, "
                         f"got {value!r}")
    return float(value)


class DSDPolicy(Policy):
    """Goodput-maximising γ with an EMA acceptance rate (see the module docstring)."""

    name = "dsd"
    needs_profile = True

    def __init__(self, max_gamma: int = 4, profile: "str | StepProfile | None" = None,
                 alpha0: float = 0.6, ema: float = 0.1, rate: str = "judged",
                 confidence_z: float = 2.0, measured: bool = True, idle_decay: float = 0.002):
        super().__init__(max_gamma)
        self.profile = load_profile(self.name, profile)
        self.alpha0 = _unit("alpha0", alpha0, low_open=False)
        self.ema = _unit("ema", ema, low_open=True)
        if rate not in _RATES:
            raise ValueError(f"rate must be one of {_RATES}, got {rate!r}")
        self.rate = rate
        self.confidence_z = option_number(self.name, "confidence_z", confidence_z)
        self.idle_decay = option_number(self.name, "idle_decay", idle_decay, 0.0, 1.0)
        self.alpha = self.alpha0
        self.num_updates = 0
        self.judged_tokens = 0.0  # judged draft tokens the EMA remembers (the bound's n)
        self.measured = option_bool(self.name, "measured", measured)
        self._time = MeasuredTime()  # the run's own linear time model

    @property
    def planning_alpha(self) -> float:
        """α plus ``confidence_z`` standard errors over ``judged_tokens`` tokens, at most 1."""
        return upper_bound(self.alpha, self.judged_tokens, self.confidence_z)

    def goodputs(self, view: BatchView) -> np.ndarray:
        """Predicted goodput n·E(γ)/T(γ) for γ = 0..max_gamma."""
        gammas = gamma_range(self.max_gamma + 1)
        tokens = expected_tokens(self.planning_alpha, gammas)
        return view.num_decode * tokens / self.step_times(view, gammas)

    def step_times(self, view: BatchView, gammas: np.ndarray) -> np.ndarray:
        """T(γ): the profile's, or with ``measured`` (once the steps seen tell a from b) the
        linear time model measured on this run: the target's a + b·w over the decode rows'
        width w = n·(γ' + 1), γ' the compiled bucket γ runs in (``padded_gamma``: γ = 3 in a
        bucket of 4 verifies as wide as γ = 4), plus γ draft forwards at their measured cost
        (the profile's until a draft has run; the draft loop stops after γ). A prefill chunk in
        the step costs the same whatever γ; counted in T it would dilute speculation's cost and
        favour it exactly when the chunk is large; the prompt tokens its drafts keep out of
        the step count (``BatchView.displaced_prompt_tokens``), a later step runs them."""
        n = view.num_decode
        width = n * (self.padded_gamma(gammas) + 1) + view.displaced_prompt_tokens(n * gammas)
        return self._times(view, width, gammas, gammas)

    def _times(self, view: BatchView, width, forwards, profile_gammas):
        """The step's time with a target forward ``width`` tokens wide and ``forwards`` draft
        forwards (the run's linear model once fitted), else the profile's at
        ``profile_gammas``."""
        target = self._time.target(width) if self.measured else None
        per_forward = None if target is None else self._time.draft_forward()
        if per_forward is not None:
            return target + forwards * per_forward
        batch = max(view.batch_size, view.num_decode, 1)
        ctx = float(np.mean(view.context_lens)) if view.num_decode else 1.0
        if target is None:
            return self.step_profile.step_times(batch, profile_gammas, ctx)
        return target + forwards * self.step_profile.draft_step(batch, ctx)

    @property
    def can_predict(self) -> bool:
        """Whether step times can be predicted: a profile, or the run's own fitted model."""
        return self.profile is not None or (self.measured and self._time.ready)

    def plan_goodput(self, view: BatchView, gammas: np.ndarray) -> float:
        """Predicted goodput of a per-sequence plan: Σ_i E(γ_i) over the step's time, its target
        forward as wide as every row at the bucket of the plan's longest draft, and as many
        draft forwards as that draft. The profile, measured at uniform γ, is read at the plan's
        mean γ."""
        gammas = np.asarray(gammas, np.int64)
        tokens = float(expected_tokens(self.planning_alpha, gammas).sum())
        mean = float(gammas.mean()) if gammas.size else 0.0
        longest = int(gammas.max(initial=0))
        width = (gammas.size * (int(self.padded_gamma(longest)) + 1)
                 + float(view.displaced_prompt_tokens(int(gammas.sum()))))
        seconds = self._times(view, width, longest, mean)
        return tokens / float(seconds)

    def plan(self, view: BatchView) -> DraftPlan:
        n = view.num_decode
        if not view.draft_resident or n == 0 or self.max_gamma == 0 or view.prefill_bound:
            return DraftPlan(gammas=np.zeros(n, np.int32))
        gamma = int(np.argmax(self.goodputs(view)))  # first maximum: ties to the smaller γ
        return DraftPlan(gammas=np.full(n, gamma, np.int32))

    def step_rate(self, outcome: StepOutcome, judged: tuple[int, int] | None = None
                  ) -> float | None:
        """This step's per-token acceptance rate (module docstring), None if nothing verified;
        ``judged``: the step's ``judged_acceptance``, when the caller has it."""
        if self.rate == "verified":
            verified = int(np.asarray(outcome.num_verified, np.int64).sum())
            accepted = int(np.minimum(outcome.num_accepted, outcome.num_verified).sum())
            return accepted / verified if verified else None
        accepted, judged = judged_acceptance(outcome) if judged is None else judged
        return accepted / judged if judged else None

    def observe(self, outcome: StepOutcome) -> None:
        self._time.observe(outcome)
        judged = judged_acceptance(outcome)
        r = self.step_rate(outcome, judged)
        if r is None:
            if outcome.num_decode:  # decoding went on unobserved: the evidence ages
                self.judged_tokens *= 1.0 - self.idle_decay
            return
        self.alpha = (1.0 - self.ema) * self.alpha + self.ema * r
        self.num_updates += 1
        self.judged_tokens = (1.0 - self.ema) * self.judged_tokens + judged[1]

    def state_dict(self) -> dict[str, Any]:
        return {"alpha": self.alpha, "num_updates": self.num_updates,
                "judged_tokens": self.judged_tokens}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # judged_tokens is newer: a state saved before it has none (the bound is wide again)
        if not {"alpha", "num_updates"} <= set(state) <= {"alpha", "num_updates",
                                                          "judged_tokens"}:
            raise ValueError(f"{self.name} state needs keys ['alpha', 'num_updates'] (and "
                             f"optionally 'judged_tokens'), got {sorted(state)}")
        self.alpha = _unit("alpha", state["alpha"], low_open=False)
        self.num_updates = int(state["num_updates"])
        self.judged_tokens = float(state.get("judged_tokens", 0.0))
