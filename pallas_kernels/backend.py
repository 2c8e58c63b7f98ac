"""The one place that decides which implementation of each kernel runs.

Backends
    ``pallas``     the Pallas kernels compiled for the GPU through Triton
                   (``jspec.kernels.gpu_lowering``: JAX 0.10 also offers Mosaic GPU, which wants
                   kernels written against its own warpgroup/TMA model, Hopper and newer only;
                   Triton takes the portable ``pallas_call`` our kernels are written in), with
                   the settings `jspec bench kernels --tune` recorded for this GPU model, or
                   the defaults (``gpu_lowering.settings``).
    ``interpret``  the same kernels through Pallas' interpreter: any platform, slow; this is how
                   the CPU tests check the kernels against the references.
    ``reference``  pure JAX: attention reads each sequence's pages once per query tile
                   (``ragged_paged_attention_tiled``), migration the jnp reference.
    ``auto``       on a GPU, ``pallas`` for each kernel that lowers through Triton, compiles
                   and runs at the engine's shapes, and ``reference`` with a warning naming the
                   kernel and the reason for any that does not; ``reference`` on CPU and TPU.

Each kernel is judged on its own (``select`` returns a ``Kernels``): a model whose head_dim the
attention kernel cannot take still migrates blocks with the Pallas kernel. Forcing ``pallas``
where a kernel cannot run is a ``ValueError`` naming the kernel and the reason, raised when the
engine starts rather than at the kernel's first compile.

TPU: the kernels read K/V pages straight from HBM with dynamic indices, which Mosaic TPU does
not lower (it wants explicit DMAs into VMEM), so on TPU ``auto`` means ``reference`` and asking
for ``pallas`` is an error. ``EngineConfig.kernel_backend`` (``--kernel-backend``) forces a
choice; the environment variable ``JSPEC_KERNEL_BACKEND`` does the same where no config is at
hand (a config value other than ``auto`` wins).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
from typing import Callable, Iterable

import jax

from jspec.kernels import gpu_lowering, kv_migration
from jspec.kernels import ragged_paged_attention as rpa
from jspec.kernels.gpu_lowering import KERNELS, KernelShape

BACKENDS = ("auto", "pallas", "interpret", "reference")
log = logging.getLogger(__name__)
# what ``select`` judges when the caller names no shapes: a Qwen2.5-0.5B-like layer
DEFAULT_SHAPE = KernelShape(num_heads=14, kv_heads=2, head_dim=64, block_size=16, num_layers=2,
                            dtype="bfloat16")


def platform() -> str:
    return jax.default_backend()


@dataclasses.dataclass(frozen=True)
class Kernels:
    """The concrete backend ('pallas', 'interpret' or 'reference') of each kernel."""

    attention: str
    migration: str

    def __str__(self) -> str:
        if self.attention == self.migration:
            return self.attention
        return f"attention {self.attention}, migration {self.migration}"


def _check_name(name: str) -> str:
    if name not in BACKENDS:
        raise ValueError(f"kernel backend {name!r} is unknown; choose from {', '.join(BACKENDS)}")
    return name


def select(name: str = "auto", shapes: Iterable[KernelShape] = ()) -> Kernels:
    """``name`` (or ``JSPEC_KERNEL_BACKEND`` when ``name`` is 'auto') -> each kernel's backend
    for a model (or models) of ``shapes`` (default ``DEFAULT_SHAPE``), or a ValueError saying
    why a forced backend cannot run here."""
    name = _check_name(name)
    if name == "auto":
        name = _check_name(os.environ.get("JSPEC_KERNEL_BACKEND", "auto").strip().lower())
    if name in ("interpret", "reference"):
        return Kernels(name, name)
    plat = platform()
    if plat != "gpu":
        if name == "auto":
            return Kernels("reference", "reference")
        if plat == "tpu":
            raise ValueError("kernel backend 'pallas' targets GPUs (Triton lowering); on TPU use "
                             "'reference' (or 'interpret' for testing)")
        raise ValueError(f"kernel backend 'pallas' needs a GPU and JAX runs on {plat.upper()} "
                         "here; use 'interpret' to run the Pallas kernels on CPU (slow, for "
                         "testing) or 'reference'")
    shapes = tuple(dict.fromkeys(shapes)) or (DEFAULT_SHAPE,)
    chosen = {}
    for kernel in KERNELS:
        why = _problem(kernel, shapes)
        if why is not None and name == "pallas":
            raise ValueError(f"kernel backend 'pallas': the {kernel} kernel cannot run on this "
                             f"GPU: {why}")
        if why is not None:
            log.warning("the Pallas %s kernel cannot run on this GPU, so %s uses the jnp "
                        "reference: %s", kernel, kernel, why)
        chosen[kernel] = "pallas" if why is None else "reference"
    return Kernels(**chosen)


def _problem(kernel: str, shapes: tuple[KernelShape, ...]) -> str | None:
    """The first reason ``kernel`` cannot run at one of ``shapes`` on this GPU, or None."""
    for shape in shapes:
        why = gpu_lowering.problem(kernel, shape, run=True)
        if why is not None:
            return f"{why} (model shape: {shape})"
    return None


def attention_fn(backend: str) -> Callable:
    """The attention implementation for a concrete backend (``Kernels.attention``), with the
    reference's signature."""
    if backend == "reference":
        # the pure-JAX path: one K/V gather per query tile (the per-token function is the oracle)
        return rpa.ragged_paged_attention_tiled
    if backend == "interpret":
        return functools.partial(rpa.ragged_paged_attention, interpret=True)
    if backend == "pallas":
        return gpu_lowering.attention()
    raise ValueError(f"attention for backend {backend!r}: select() it first")


def migration_fn(backend: str) -> Callable:
    """``f(k_pool, v_pool, pairs) -> (k_pool, v_pool)`` for a concrete backend
    (``Kernels.migration``), jitted with the pools donated; pools may be segmented
    (``jspec.kernels.segments``). Validate the pairs with ``kv_migration.validate_pairs``
    first."""
    if backend == "reference":
        return jax.jit(kv_migration.migrate_blocks_reference, donate_argnums=(0, 1))
    if backend == "interpret":
        return jax.jit(functools.partial(kv_migration.migrate_blocks_kernel, interpret=True),
                       donate_argnums=(0, 1))
    if backend == "pallas":
        return gpu_lowering.migration()
    raise ValueError(f"migration for backend {backend!r}: select() it first")
