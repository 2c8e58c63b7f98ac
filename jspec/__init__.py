"""jspec: a JAX LLM serving engine with load-adaptive, lossless speculative decoding.

The public names are imported lazily (module ``__getattr__``), so ``import jspec`` and
``jspec --help`` do not pay for importing JAX.

Importing jspec before JAX starts its backend sets XLA's CPU bf16 flag (``jspec.platform``:
without it bf16 is ~3x slower than fp32 on CPU); ``JSPEC_CPU_BF16=off`` opts out.

>>> from jspec import LLM, SamplingParams
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from jspec.layout import install_checkout_finder as _install_checkout_finder
from jspec.platform import configure_cpu_bf16 as _configure_cpu_bf16

__version__ = "0.1.0"

# jspec.models, jspec.policies, ... in a source checkout used without an install (jspec.layout)
_install_checkout_finder()

# Before anything starts JAX's backend (which reads XLA_FLAGS once); imports no JAX.
_configure_cpu_bf16()

# public name -> module that defines it
_EXPORTS = {
    "LLM": "jspec.llm",
    "SamplingParams": "jspec.sampling_params",
    "RequestOutput": "jspec.outputs",
    "SpecStats": "jspec.outputs",
    "EngineConfig": "jspec.config",
    "LLMEngine": "jspec.engine",
    "AsyncLLMEngine": "jspec.async_engine",
}

__all__ = sorted(_EXPORTS) + ["__version__"]

if TYPE_CHECKING:  # for type checkers and IDEs; never executed
    from jspec.async_engine import AsyncLLMEngine
    from jspec.config import EngineConfig
    from jspec.engine import LLMEngine
    from jspec.llm import LLM
    from jspec.outputs import RequestOutput, SpecStats
    from jspec.sampling_params import SamplingParams


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'jspec' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
