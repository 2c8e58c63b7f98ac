"""Speculation policies behind one small protocol (policies/base.py), chosen by name."""

from __future__ import annotations

from typing import Any

from jspec.policies.base import BatchView, DraftPlan, DraftStats, Policy, StepOutcome
from jspec.policies.adaedl import AdaEDLPolicy
from jspec.policies.adaspec import AdaSpecPolicy
from jspec.policies.auto import AutoPolicy
from jspec.policies.dsd import DSDPolicy
from jspec.policies.dsde import DSDEPolicy
from jspec.policies.heuristic import HeuristicPolicy
from jspec.policies.nightjar import NightjarPolicy
from jspec.policies.specrouter import SpecRouterPolicy
from jspec.policies.static import OffPolicy, StaticPolicy
from jspec.policies.ucb import UCBPolicy

POLICIES: dict[str, type[Policy]] = {
    cls.name: cls for cls in (AutoPolicy, StaticPolicy, OffPolicy, NightjarPolicy, DSDEPolicy,
                              AdaSpecPolicy, DSDPolicy, UCBPolicy, AdaEDLPolicy, HeuristicPolicy,
                              SpecRouterPolicy)
}


def make_policy(name: str, max_gamma: int, **options: Any) -> Policy:
    """Build a policy by name. ``max_gamma`` is the engine's Γmax (num_speculative_tokens)."""
    try:
        cls = POLICIES[name]
    except KeyError:
        raise ValueError(
            f"unknown policy {name!r}; known policies: {', '.join(sorted(POLICIES))}"
        ) from None
    try:
        return cls(max_gamma=max_gamma, **options)
    except TypeError as e:
        raise ValueError(f"bad options for policy {name!r}: {e}") from None


__all__ = ["BatchView", "DraftPlan", "DraftStats", "Policy", "StepOutcome", "POLICIES",
           "make_policy"]
