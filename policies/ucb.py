"""BanditSpec-style UCB1 over the speculation length (Hou et al., "BanditSpec: Adaptive
Speculative Decoding via Bandit Algorithms", arXiv 2505.15141, as the Nightjar paper's §6
compares it): arms γ ∈ {0..Γmax}, one γ for the whole step, reward = the step's goodput
(emitted tokens / step wall time, ``StepOutcome.goodput``).

    score(γ) = mean(γ) / max_reward + c · sqrt(ln t / n(γ))

t is the number of steps this bandit has learned from and n(γ) the visits of arm γ. Arms never
played come first, lowest γ first; ties go to the lowest γ.

Reward scaling: goodput is in tokens/s, whose scale depends on the model, the hardware and the
load, so means are divided by the largest reward this bandit has seen. Normalised rewards lie in
[0, 1] and c means the same thing on every machine. The sums are kept raw and divided at scoring
time, so every sample is normalised by the same (current) maximum. Default c = 0.5 rather than
UCB1's √2: √2 assumes rewards spread over all of [0, 1], while step goodput normalised by its
maximum varies by a few percent between steps; √2 would keep sampling poor arms for thousands
of steps.

Options: ``c`` (exploration constant, ≥ 0), ``per_batch_bucket`` (False: one bandit, as in
BanditSpec, which ignores the load; True: one bandit per ``batch_bucket(view.batch_size)``).
A step with the draft offloaded is planned as γ = 0 and, being a genuine sample of arm 0, is
learned as one (as Nightjar does); a step observed without a plan credits the γ it ran.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from jspec.policies.base import BatchView, DraftPlan, Policy, StepOutcome, batch_bucket

_ALL = "all"  # the key of the single bandit when per_batch_bucket is False


class UCBPolicy(Policy):
    name = "ucb"

    def __init__(self, max_gamma: int = 4, c: float = 0.5, per_batch_bucket: bool = False):
        super().__init__(max_gamma)
        if isinstance(c, bool) or not isinstance(c, (int, float)) or not math.isfinite(c) or c < 0:
            raise ValueError(f"ucb option c (exploration constant) must be a finite number >= 0, "
                             f"got {c!r}")
        if not isinstance(per_batch_bucket, bool):
            raise ValueError(f"ucb option per_batch_bucket must be true or false, got "
                             f"{per_batch_bucket!r}")
        self.c = float(c)
        self.per_batch_bucket = per_batch_bucket
        # key -> {"counts": [n per γ], "sums": [raw reward sum per γ], "max": largest reward}
        self._bandits: dict[str, dict[str, Any]] = {}

    def _key(self, batch_size: int) -> str:
        return str(batch_bucket(batch_size)) if self.per_batch_bucket else _ALL

    def _bandit(self, key: str) -> dict[str, Any]:
        if key not in self._bandits:
            arms = self.max_gamma + 1
            self._bandits[key] = {"counts": [0] * arms, "sums": [0.0] * arms, "max": 0.0}
        return self._bandits[key]

    # ------------------------------------------------------------------ decisions
    def scores(self, batch_size: int = 1) -> np.ndarray:
        """UCB score per γ for this batch size's bandit (∞ for unvisited arms)."""
        bandit = self._bandits.get(self._key(batch_size)) or {
            "counts": [0] * (self.max_gamma + 1), "sums": [0.0] * (self.max_gamma + 1), "max": 0.0}
        counts = np.asarray(bandit["counts"], np.float64)
        sums = np.asarray(bandit["sums"], np.float64)
        scores = np.full(len(counts), np.inf)
        visited = counts > 0
        if not visited.any():
            return scores
        scale = bandit["max"] if bandit["max"] > 0 else 1.0
        t = counts.sum()
        scores[visited] = (sums[visited] / counts[visited] / scale
                           + self.c * np.sqrt(math.log(t) / counts[visited]))
        return scores

    def plan(self, view: BatchView) -> DraftPlan:
        n = view.num_decode
        key = self._key(view.batch_size)
        if n == 0:
            return DraftPlan(gammas=np.zeros(0, np.int32))
        if view.draft_resident:
            gamma = int(np.argmax(self.scores(view.batch_size)))  # first ∞ = lowest unvisited
        else:
            gamma = 0
        return DraftPlan(gammas=np.full(n, gamma, np.int32), note={"key": key, "gamma": gamma})

    # ------------------------------------------------------------------ learning
    def observe(self, outcome: StepOutcome) -> None:
        decision = outcome.plan_note
        if len(outcome.request_ids) == 0:
            return
        played = int(np.max(outcome.gammas))
        if decision is None:  # a step this policy did not plan: credit what ran
            decision = {"key": self._key(outcome.batch_size), "gamma": played}
        bandit = self._bandit(decision["key"])
        reward = outcome.goodput
        arm = min(decision["gamma"], played)  # a plan the engine clipped ran fewer tokens
        bandit["counts"][arm] += 1
        bandit["sums"][arm] += reward
        bandit["max"] = max(bandit["max"], reward)

    def arm_stats(self) -> dict[str, dict[str, Any]]:
        """Per bandit ('all' or the batch bucket): visits, mean goodput per γ, max reward."""
        out = {}
        for key, b in sorted(self._bandits.items()):
            means = [s / n if n else 0.0 for s, n in zip(b["sums"], b["counts"])]
            out[key] = {"counts": list(b["counts"]), "mean": means, "max": b["max"]}
        return out

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        return {"policy": self.name, "max_gamma": self.max_gamma,
                "per_batch_bucket": self.per_batch_bucket,
                "bandits": {k: {"counts": list(b["counts"]), "sums": list(b["sums"]),
                                "max": b["max"]} for k, b in sorted(self._bandits.items())}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.check_state(state)
        if state.get("per_batch_bucket") != self.per_batch_bucket:
            raise ValueError(f"ucb state was learned with per_batch_bucket="
                             f"{state.get('per_batch_bucket')!r}, this policy has "
                             f"per_batch_bucket={self.per_batch_bucket}")
        arms = self.max_gamma + 1
        try:
            bandits = {}
            for key, b in state["bandits"].items():
                counts = [int(x) for x in b["counts"]]
                sums = [float(x) for x in b["sums"]]
                if len(counts) != arms or len(sums) != arms:
                    raise ValueError(f"bandit {key} has {len(counts)} arms, expected {arms}")
                bandits[str(key)] = {"counts": counts, "sums": sums, "max": float(b["max"])}
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ValueError(f"malformed ucb state: {e}") from None
        self._bandits = bandits
