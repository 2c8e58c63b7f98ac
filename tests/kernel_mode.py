"""Which form of the Pallas kernels tests/test_kernels.py checks against the references.

``JSPEC_KERNEL_TESTS=interpret`` (the default) runs them through Pallas' interpreter, on any
machine; ``JSPEC_KERNEL_TESTS=compiled`` runs the GPU form the engine runs (Triton with the
engine's compiler parameters, ``jspec.kernels.gpu_lowering``), which needs a GPU: without one
the kernel tests are skipped, saying why. ``jspec validate-gpu`` runs them compiled.

The tests are written as the CPU runs them (``interpret=True`` in every kernel call); compiled,
``as_tested`` routes those calls to the GPU form instead, so one set of tests covers both.
"""

from __future__ import annotations

import functools
import os

import pytest

ENV = "JSPEC_KERNEL_TESTS"
MODES = ("interpret", "compiled")


def mode() -> str:
    value = os.environ.get(ENV, "").strip().lower() or "interpret"
    if value not in MODES:
        raise ValueError(f"{ENV}={value!r} is not a kernel test mode; use one of "
                         f"{', '.join(MODES)}")
    return value


COMPILED = mode() == "compiled"
# what the engine-level kernel test asks the engine for
ENGINE_BACKEND = "pallas" if COMPILED else "interpret"


def skip_module_without_gpu() -> None:
    """Skip the calling test module when compiled kernels are asked for and JAX has no GPU
    (rather than failing every test on the refusal to compile for a CPU)."""
    if not COMPILED:
        return
    import jax

    platform = jax.default_backend()
    if platform != "gpu":
        pytest.skip(f"{ENV}=compiled runs the Pallas kernels compiled for a GPU, and JAX runs "
                    f"on {platform.upper()} here; unset {ENV} to run them interpreted",
                    allow_module_level=True)


def as_tested(kernel_fn, kernel: str):
    """``kernel_fn`` (called with ``interpret=True``) as this mode runs it: unchanged when
    interpreted; compiled, the engine's GPU form of ``kernel`` ("attention" or "migration")
    with the same arguments, ``interpret`` dropped."""
    if not COMPILED:
        return kernel_fn
    from jspec.kernels import gpu_lowering

    gpu = {"attention": gpu_lowering.attention,
           "migration": gpu_lowering.migration}[kernel]()

    @functools.wraps(kernel_fn)
    def compiled(*args, interpret: bool = True, **kwargs):
        return gpu(*args, **kwargs)

    return compiled
