"""Speculation policies behind one small protocol (policies/base.py), chosen by name."""

from __future__ import annotations

import inspect
import numbers
from typing import Any

from policies.base import BatchView, DraftPlan, DraftStats, Policy, StepOutcome
from policies.adaedl import AdaEDLPolicy
from policies.adaspec import AdaSpecPolicy
from policies.auto import AutoPolicy
from policies.dsd import DSDPolicy
from policies.dsde import DSDEPolicy
from policies.heuristic import HeuristicPolicy
from policies.nightjar import NightjarPolicy
from policies.specrouter import SpecRouterPolicy
from policies.static import OffPolicy, StaticPolicy
from policies.ucb import UCBPolicy

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
    for key, value in options.items():
        _check_option_type(cls, name, key, value)
    try:
        return cls(max_gamma=max_gamma, **options)
    except TypeError as e:
        raise ValueError(f"bad options for policy {name!r}: {e}") from None


def _option_type(cls, key: str) -> type | None:
    """int or float when the constructor's parameter ``key`` takes only numbers of that kind
    (from its default or its annotation, e.g. ``int | None``); None when it takes more."""
    param = inspect.signature(cls.__init__).parameters.get(key)
    if param is None:
        return None
    if type(param.default) in (int, float):
        return type(param.default)
    annotation = param.annotation if isinstance(param.annotation, str) else ""
    kinds = {part.strip() for part in annotation.split("|")} - {"None"}
    if kinds == {"int"}:
        return int
    if kinds in ({"float"}, {"float", "int"}):
        return float
    return None


def _check_option_type(cls, name: str, key: str, value: Any) -> None:
    """A numeric option given something else fails here, naming the option, instead of deep in
    the policy with ``invalid literal for int()``."""
    expected = _option_type(cls, key)
    if expected is None or value is None:
        return
    numeric = isinstance(value, numbers.Real) and not isinstance(value, bool)
    if expected is int and not (numeric and float(value).is_integer()):
        raise ValueError(f"policy {name!r} option {key}={value!r}: expected an integer")
    if expected is float and not numeric:
        raise ValueError(f"policy {name!r} option {key}={value!r}: expected a number")


__all__ = ["BatchView", "DraftPlan", "DraftStats", "Policy", "StepOutcome", "POLICIES",
           "make_policy"]
