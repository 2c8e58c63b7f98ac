"""AdaEDL: stop drafting when an entropy-based estimate of the next token's acceptance falls low.

AdaEDL (Agrawal, Jeon, Lee, arXiv 2410.18351; a baseline of the DSDE paper, §II-B and §IV)
bounds the acceptance probability of a draft token from the entropy H of the draft
distribution it is sampled from, as 1 − sqrt(λ_e·H), and stops drafting as soon as that estimate
falls below a threshold λ. The paper's entropy scale λ_e is 0.2.

On device (jspec/device_steps.py) token j is drafted iff j < γ_i, the confidence product rule
holds and entropy_j ≤ stop_entropy_i, so the rule is handed over as an entropy threshold H*:

    stop  ⇔  1 − sqrt(λ_e·H) < λ
          ⇔  sqrt(λ_e·H) > 1 − λ
          ⇔  λ_e·H > (1 − λ)²        (both sides ≥ 0 when λ ≤ 1, so squaring keeps the order)
          ⇔  H > H* = (1 − λ)² / λ_e.

Hence γ_i = max_gamma for every sequence and stop_entropy_i = H*: the draft continues while
H ≤ H*, exactly the complement of the stop rule. λ is restricted to [0, 1]: λ = 1 gives H* = 0
(draft only fully certain tokens); λ > 1 would stop everything and is no useful setting. The
engine passes H* as float32; the float32 rounding of H* (relative 6e-8) is far below the noise
of the entropy itself.

λ: the default 0.4 gives H* = 0.36/0.2 = 1.8 nats, about the entropy of a uniform choice among
e^1.8 ≈ 6 tokens: past that the draft is guessing and a token's expected acceptance (estimated
0.4) no longer pays for a draft forward plus its verify slot at typical draft/target cost ratios.

λ adaptation (``adapt``, off by default). AdaEDL adapts λ from the historical acceptance rate
(DSDE §IV-D describes it as "incorporating the historical acceptance rate"), but the paper's text
is not available here, so the exact update is ours and off by default; the fixed rule above is
the paper's. With ``adapt=True`` each request keeps its own λ_i, starting at ``lam``:
after a step in which it verified v > 0 tokens and a of them were accepted,

    λ_i ← clip((1 − β)·λ_i + β·(1 − a/v), lam_min, lam_max)

i.e. λ_i is an EMA (rate β = ``beta``) of the observed rejection rate. Direction: a sequence whose
drafts are mostly accepted lowers λ_i (raises H*, drafts further); one whose drafts keep failing
stops earlier. The default λ = 0.4 is the fixed point at a 60% acceptance rate. If a sequence
planned γ > 0 but drafted nothing (its first token was already above H*), there is no acceptance
to learn from and λ_i would stay stuck high, so it relaxes toward ``lam`` with the same rate.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from jspec.policies.base import BatchView, DraftPlan, Policy, StepOutcome


def entropy_threshold(lam: float, lam_e: float) -> float:
    """H* = (1 − λ)²/λ_e: the stop rule 1 − sqrt(λ_e·H) < λ triggers iff H > H* (λ ≤ 1)."""
    return (1.0 - lam) ** 2 / lam_e


def _unit(name: str, value: Any, lo_open: bool = False) -> float:
    v = float(value)
    if not (0.0 < v <= 1.0 if lo_open else 0.0 <= v <= 1.0):
        raise ValueError(f"{name} must be in {'(0, 1]' if lo_open else '[0, 1]'}, got {value!r}")
    return v


class AdaEDLPolicy(Policy):
    """Entropy-based early draft stopping, run on device through ``DraftPlan.stop_entropy``.

    Options: ``lam`` (λ, 0.4; the initial λ_i when adapting), ``lam_e`` (λ_e, 0.2), ``adapt``
    (False), ``beta`` (EMA rate of the adaptation, 0.1), ``lam_min``/``lam_max`` (bounds of the
    adapted λ_i, 0.05/0.95).
    """

    name = "adaedl"
    draft_stops = True

    def __init__(self, max_gamma: int = 4, lam: float = 0.4, lam_e: float = 0.2,
                 adapt: bool = False, beta: float = 0.1, lam_min: float = 0.05,
                 lam_max: float = 0.95):
        super().__init__(max_gamma)
        self.lam = _unit("lam", lam)
        if not float(lam_e) > 0.0 or math.isinf(float(lam_e)):
            raise ValueError(f"lam_e must be a finite number > 0, got {lam_e!r}")
        self.lam_e = float(lam_e)
        if not isinstance(adapt, bool):
            raise ValueError(f"adapt must be a bool, got {adapt!r}")
        self.adapt = adapt
        self.beta = _unit("beta", beta, lo_open=True)
        self.lam_min = _unit("lam_min", lam_min)
        self.lam_max = _unit("lam_max", lam_max)
        if not self.lam_min <= self.lam <= self.lam_max:
            raise ValueError(f"need lam_min <= lam <= lam_max, got {lam_min}, {lam}, {lam_max}")
        self._lams: dict[str, float] = {}  # per-request λ_i, only when adapting

    def possible_gammas(self) -> set[int]:
        return {0, self.max_gamma}

    def lam_of(self, request_id: str) -> float:
        return self._lams.get(request_id, self.lam)

    def plan(self, view: BatchView) -> DraftPlan:
        live = set(view.request_ids)
        for rid in [r for r in self._lams if r not in live]:
            del self._lams[rid]  # finished requests: bounded memory
        n = view.num_decode
        gamma = self.max_gamma if view.draft_resident else 0
        thresholds = np.array([entropy_threshold(self.lam_of(r), self.lam_e)
                               for r in view.request_ids], np.float64)
        return DraftPlan(gammas=np.full(n, gamma, np.int32), stop_entropy=thresholds)

    def observe(self, outcome: StepOutcome) -> None:
        if not self.adapt:
            return
        for i, rid in enumerate(outcome.request_ids):
            if int(outcome.gammas[i]) == 0:
                continue  # did not speculate (draft offloaded): nothing to learn
            verified = int(outcome.num_verified[i])
            lam = self.lam_of(rid)
            if verified > 0:
                target = 1.0 - int(outcome.num_accepted[i]) / verified
            else:
                target = self.lam  # stopped before the first token: relax toward the prior
            lam = (1.0 - self.beta) * lam + self.beta * target
            self._lams[rid] = min(max(lam, self.lam_min), self.lam_max)

    def state_dict(self) -> dict[str, Any]:
        return {"max_gamma": self.max_gamma, "lams": dict(self._lams)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.check_state(state)
        self._lams = {rid: float(v) for rid, v in state["lams"].items()}
