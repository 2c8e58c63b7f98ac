"""`auto`: the policy for users who do not want to choose one.

It plans as DSD does (policies/dsd.py): every step, the γ that maximises the decoding rows'
predicted goodput n·E(γ)/T(γ), E from the acceptance the run has judged (at an upper confidence
bound, so thin evidence speculates and learns) and T from the run's own measured step-time model,
and plain decoding in a step where prompts wait for the token budget (``BatchView.prefill_bound``).
γ = 0 is always a candidate, so it decodes plainly where speculation would lose. Unlike ``dsd`` it
needs no step-time profile, so an engine does not measure one at start-up: until the run's steps
tell the target's cost per token from its fixed cost and a draft forward has been timed (after
the first prompt and the first drafting step) it drafts Γmax tokens, speculating to learn as the
confidence bound does; a profile given as an option is used until then instead.

Why DSD's rule rather than Nightjar's bandit (policies/nightjar.py): on the built-in pair's
headline (docs/benchmarks.md, "Headline") this rule's rounds at saturation were 0.995-1.06× the
same round's static γ = 4 and its worst p90 TPOT below saturation 1.05× the same round's best
static, while Nightjar's saturated rounds were 0.90-0.96×: at saturation its arms lie within 10% of
each other and the bandit's choice among them is noise. A rule that predicts from two quantities
measured on every step (the acceptance and the step-time line) decides the same way on the same
evidence, and in the simulator its worst of 20 seeds is at least 0.97 of the best fixed arm in
every environment ("Policies in a simulated environment"). Options are DSD's; learned state is
saved and loaded like DSD's (``--policy-state``), under the name ``auto``.

It is the default of `LLM`, `jspec generate` and `jspec serve`. On the headline's code workload,
where static γ = 4 is already right, its means over three runs were 0.976-1.015× static's
throughput at saturation and 0.88-1.06× its p90 TPOT at low load; on ShareGPT conversations,
where the draft agrees less, 1.10× the best fixed choice at saturation (docs/benchmarks.md,
"`auto`, the default, against static γ = 4"). It compiles a γ bucket more than static
(``possible_gammas``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from jspec.policies.base import BatchView, DraftPlan
from jspec.policies.drafter_choice import DrafterChoice, plain_plan
from jspec.policies.dsd import DSDPolicy
from jspec.policies.measured_time import StepLine


class AutoPolicy(DSDPolicy):
    name = "auto"
    # no start-up profile: until the run's own steps price every γ, it speculates at Γmax
    needs_profile = False
    _choice: DrafterChoice | None = None  # with drafters without a model (set_lookups)

    @property
    def reads_lookups(self) -> bool:
        return bool(self.lookups)

    def set_lookups(self, indices) -> None:
        super().set_lookups(indices)
        self._choice = DrafterChoice(self.alpha0, self.confidence_z, self.idle_decay) \
            if self.lookups else None
        self._line = StepLine(with_draft=self.model is not None,
                              drafting_steps=self.model is None)

    @property
    def model(self) -> int | None:
        """The draft model's pool index (the pool's first model), None without one."""
        models = [i for i in range(len(self.pool)) if i not in self.lookups]
        return models[0] if models else None

    def possible_gammas(self) -> set[int]:
        """Every γ but 1 (where Γmax ≥ 2), so that the engine compiles no γ = 1 bucket: a plan of
        γ = 1 runs in γ = 2's bucket, verified as wide as γ = 2 and drafted with one forward,
        and is priced so (``padded_gamma``): where γ = 1 is best, it costs one more verified
        token per row. The bucket cost a quarter of start-up: `jspec serve`'s defaults compile
        85 shape buckets with it, 63 without (67 s against 51 s cold, 2-vCPU AMD EPYC)."""
        if self.max_gamma < 2:
            return super().possible_gammas()
        return set(range(self.max_gamma + 1)) - {1}

    def possible_drafters(self) -> set[int]:
        if not self.lookups:
            return set()
        return set(self.lookups) | ({self.model} if self.model is not None else set())

    def goodputs(self, view: BatchView) -> np.ndarray:
        """DSD's predicted goodput per γ; before the run can price every γ, Γmax ranks first
        (DSD's plan keeps its own rules for γ = 0: offloaded draft, prefill-bound step)."""
        if self.can_predict:
            return super().goodputs(view)
        return (np.arange(self.max_gamma + 1) == self.max_gamma).astype(np.float64)

    def plan(self, view: BatchView) -> DraftPlan:
        if self._choice is None:
            return super().plan(view)
        n = view.num_decode
        if n == 0 or self.max_gamma == 0 or view.prefill_bound:
            return plain_plan(n)
        model = self.model if view.draft_resident else None
        buckets = tuple(b for b in (self.gamma_buckets or range(self.max_gamma + 1)) if b > 0)
        return self._choice.plan(view, model, self.lookups, buckets, self._step_time())

    def _step_time(self):
        """T(w, f, d): a step whose verify is w tokens wide, in which the draft model runs f
        forwards and (d) any row drafts, from the run's own whole-step line (``StepLine``: with
        lookups alone its third term is the cost of a drafting step); None for all until it
        can tell the costs apart."""
        line, per_step = self._line, self._line.drafting_steps

        def step_time(width, forwards, drafts):  # scalars or arrays of candidates
            beta = line.coefficients()  # solved once per plan, if it prices a step at all
            if beta is None:
                return None
            a, b, c = beta if len(beta) == 3 else (*beta, 0.0)
            third = drafts if per_step else forwards  # forwards: 0 where no model drafts
            return a + b * np.asarray(width, np.float64) + c * np.asarray(third, np.float64)

        return step_time

    def observe(self, outcome) -> None:
        super().observe(outcome)
        if self._choice is not None:
            self._choice.observe(outcome)
            self._line.observe(outcome)
            # solved now rather than by the next plan: the engine records a step while the
            # device runs the next one, and plans while it waits
            self._line.coefficients()

    def state_dict(self) -> dict[str, Any]:
        out = {"policy": self.name, **super().state_dict()}
        if self._choice is not None:
            out["drafters"] = self._choice.state_dict()
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not isinstance(state, dict):
            raise ValueError(f"auto state must be a dict, got {type(state).__name__}")
        if state.get("policy") != self.name:
            raise ValueError(f"state belongs to policy {state.get('policy')!r}, not 'auto'")
        drafters = state.get("drafters")
        if drafters is not None and self._choice is not None:
            self._choice.load_state_dict(drafters)
        super().load_state_dict({k: v for k, v in state.items()
                                 if k not in ("policy", "drafters")})
