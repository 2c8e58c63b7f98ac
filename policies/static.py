"""Fixed speculation: the same γ for every sequence every step (γ = 0 is plain decoding)."""

from __future__ import annotations

import numpy as np

from policies.base import BatchView, DraftPlan, Policy


class StaticPolicy(Policy):
    name = "static"

    def __init__(self, max_gamma: int = 4, gamma: int | None = None):
        super().__init__(max_gamma)
        self.gamma = max_gamma if gamma is None else int(gamma)
        if not 0 <= self.gamma <= max_gamma:
            raise ValueError(f"gamma must be in [0, max_gamma={max_gamma}], got {gamma}")

    def possible_gammas(self) -> set[int]:
        return {0, self.gamma}

    def plan(self, view: BatchView) -> DraftPlan:
        gamma = self.gamma if view.draft_resident else 0
        return DraftPlan(gammas=np.full(view.num_decode, gamma, dtype=np.int32))


class OffPolicy(StaticPolicy):
    """No speculation: plain autoregressive decoding (the draft is never run)."""

    name = "off"

    def __init__(self, max_gamma: int = 0):
        super().__init__(max_gamma=max_gamma, gamma=0)

    def possible_gammas(self) -> set[int]:
        return {0}
