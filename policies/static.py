"""Fixed speculation: the same γ for every sequence every step (γ = 0 is plain decoding)."""

from __future__ import annotations

import numpy as np

from jspec.policies.base import BatchView, DraftPlan, Policy, option_int

_LOOKUPS = ("ngram", "suffix")  # drafters without a model (jspec.config.LOOKUP_METHODS)


class StaticPolicy(Policy):
    """``chain``: which pool models draft, as their names joined by '>' in the order they run
    (e.g. "draft>mid": draft drafts, mid verifies, then the target; "mid": mid alone drafts);
    default the pool's first (smallest) model. The fixed-chain baseline of SpecRouter."""

    name = "static"

    def __init__(self, max_gamma: int = 4, gamma: int | None = None, chain: str | None = None):
        super().__init__(max_gamma)
        self.gamma = max_gamma if gamma is None else option_int("static", "gamma", gamma, 0)
        if self.gamma > max_gamma:
            raise ValueError(f"gamma must be in [0, max_gamma={max_gamma}], got {gamma}")
        if chain is not None and (not isinstance(chain, str) or not chain.strip()):
            raise ValueError(f"static option chain must be pool model names joined by '>', "
                             f"got {chain!r}")
        self.chain_names = None if chain is None else tuple(
            n.strip() for n in chain.split(">"))
        self.chain = (0,)  # resolved against the engine's pool in set_pool
        # a chain naming a model beyond the first draft needs the built-in pool's middle model
        self.wants_pool = any(n not in ("draft",) + _LOOKUPS for n in self.chain_names or ())

    def set_pool(self, names: tuple[str, ...]) -> None:
        super().set_pool(names)
        if self.chain_names is None:
            return
        missing = [n for n in self.chain_names if n not in self.pool]
        if missing:
            raise ValueError(f"static option chain names {missing[0]!r}, which is not in the "
                             f"draft pool {list(self.pool)}")
        self.chain = tuple(self.pool.index(n) for n in self.chain_names)

    def possible_gammas(self) -> set[int]:
        return {0, self.gamma}

    def possible_chains(self) -> set[tuple[int, ...]]:
        return {self.chain}

    def plan(self, view: BatchView) -> DraftPlan:
        gamma = self.gamma if view.draft_resident else 0
        return DraftPlan(gammas=np.full(view.num_decode, gamma, dtype=np.int32),
                         chain=self.chain)


class OffPolicy(StaticPolicy):
    """No speculation: plain autoregressive decoding (the draft is never run)."""

    name = "off"

    def __init__(self, max_gamma: int = 0):
        super().__init__(max_gamma=max_gamma, gamma=0)

    def possible_gammas(self) -> set[int]:
        return {0}
