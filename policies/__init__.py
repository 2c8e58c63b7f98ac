"""Speculation policies behind one small protocol (policies/base.py), chosen by name."""

from __future__ import annotations

import difflib
import inspect
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


def make_policy(name: str, max_gamma: int, /, **options: Any) -> Policy:
    """Build a policy by name. ``max_gamma`` is the engine's Γmax (num_speculative_tokens)."""
    try:
        cls = POLICIES[name]
    except KeyError:
        raise ValueError(
            f"unknown policy {name!r}; known policies: {', '.join(sorted(POLICIES))}"
        ) from None
    check_options(name, options)
    try:
        return cls(max_gamma=max_gamma, **options)
    except TypeError as e:  # an option value of a type the policy cannot use
        raise ValueError(f"bad option value for policy {name!r}: {e}") from None


def policy_options(name: str) -> tuple[str, ...]:
    """The options policy ``name`` takes: its constructor's keywords besides ``max_gamma``
    (which is the engine's num_speculative_tokens)."""
    parameters = inspect.signature(POLICIES[name]).parameters.values()
    return tuple(p.name for p in parameters if p.name != "max_gamma"
                 and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))


def check_options(name: str, options: dict[str, Any]) -> None:
    """A ValueError naming an option policy ``name`` does not take, the options it does take,
    and the nearest one when the name looks misspelt."""
    accepted = policy_options(name)
    for key in options:
        if key in accepted:
            continue
        if key == "max_gamma":
            raise ValueError(f"max_gamma is not an option of policy {name!r}: the engine's "
                             f"num_speculative_tokens (--num-speculative-tokens) sets it")
        close = difflib.get_close_matches(key, accepted, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        owners = [] if close else [p for p in POLICIES if key in policy_options(p)]
        if owners:  # e.g. gamma=3 under the default policy (auto), which chooses γ itself
            hint = (f"; {key!r} is an option of polic{'y' if len(owners) == 1 else 'ies'} "
                    f"{', '.join(map(repr, owners))}")
        takes = (f"its options are {', '.join(accepted)}" if accepted
                 else "it takes no options")
        raise ValueError(f"unknown option {key!r} for policy {name!r}{hint} ({takes})")


__all__ = ["BatchView", "DraftPlan", "DraftStats", "Policy", "StepOutcome", "POLICIES",
           "make_policy", "policy_options"]
