"""The one place that decides which implementation of the kernels runs.

Backends
    ``pallas``     the Pallas kernels compiled for the GPU. JAX 0.10 offers two GPU lowerings for
                   Pallas: Triton and Mosaic GPU. Mosaic GPU wants kernels written against its
                   own warpgroup/TMA model (Hopper and newer only); the Triton lowering takes the
                   portable ``pallas_call`` our kernels are written in and runs on every CUDA GPU
                   JAX supports, so that is the path used here (``_gpu_compiler_params``).
    ``interpret``  the same kernels through Pallas' interpreter: any platform, slow; this is how
                   the CPU tests check the kernels against the references.
    ``reference``  pure JAX: attention reads each sequence's pages once per query tile
                   (``ragged_paged_attention_tiled``), migration the jnp reference.
    ``auto``       ``pallas`` on a GPU when a probe compile of both kernels succeeds (otherwise
                   ``reference`` with a warning saying why), ``reference`` on CPU and TPU.

TPU: the kernels read K/V pages straight from HBM with dynamic indices, which Mosaic TPU does
not lower (it wants explicit DMAs into VMEM), so on TPU ``auto`` means ``reference`` and asking
for ``pallas`` is an error. ``EngineConfig.kernel_backend`` (``--kernel-backend``) forces a
choice; the environment variable ``JSPEC_KERNEL_BACKEND`` does the same where no config is at
hand (a config value other than ``auto`` wins).
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Callable

import jax

from jspec.kernels import kv_migration
from jspec.kernels import ragged_paged_attention as rpa

BACKENDS = ("auto", "pallas", "interpret", "reference")
log = logging.getLogger(__name__)


def platform() -> str:
    return jax.default_backend()


def _gpu_compiler_params():
    from jax.experimental.pallas import triton as plgpu

    return plgpu.CompilerParams(num_warps=4, num_stages=2)


def _check_name(name: str) -> str:
    if name not in BACKENDS:
        raise ValueError(f"kernel backend {name!r} is unknown; choose from {', '.join(BACKENDS)}")
    return name


def resolve(name: str = "auto") -> str:
    """``name`` (or ``JSPEC_KERNEL_BACKEND`` when ``name`` is 'auto') -> a concrete backend, or a
    ValueError saying why it cannot run here."""
    name = _check_name(name)
    if name == "auto":
        name = _check_name(os.environ.get("JSPEC_KERNEL_BACKEND", "auto").strip().lower())
    plat = platform()
    if name == "auto":
        if plat == "gpu":
            return "pallas" if _gpu_probe() is None else "reference"
        return "reference"
    if name == "pallas":
        if plat == "cpu":
            raise ValueError("kernel backend 'pallas' needs a GPU and JAX runs on CPU here; use "
                             "'interpret' to run the Pallas kernels on CPU (slow, for testing) "
                             "or 'reference'")
        if plat == "tpu":
            raise ValueError("kernel backend 'pallas' targets GPUs (Triton lowering); on TPU use "
                             "'reference' (or 'interpret' for testing)")
        error = _gpu_probe()
        if error is not None:
            raise ValueError(f"the Pallas kernels do not compile on this GPU: {error}")
    return name


@functools.lru_cache(maxsize=1)
def _gpu_probe() -> str | None:
    """Compile both kernels once on tiny shapes; None on success, else the error text."""
    import jax.numpy as jnp

    try:
        pool = jnp.zeros((1, 4, 16, 1, 64), jnp.bfloat16)
        md = rpa.AttentionMetadata(
            positions=jnp.zeros((16,), jnp.int32), cu_q_lens=jnp.array([0, 1], jnp.int32),
            kv_lens=jnp.array([1], jnp.int32), page_table=jnp.ones((1, 2), jnp.int32))
        q = jnp.zeros((16, 2, 64), jnp.bfloat16)
        fn = jax.jit(functools.partial(rpa.ragged_paged_attention, sm_scale=0.125,
                                       compiler_params=_gpu_compiler_params()),
                     static_argnums=(3,))
        jax.block_until_ready(fn(q, pool, pool, 0, md))
        pairs = jnp.array([[1, 2]], jnp.int32)
        jax.block_until_ready(kv_migration.migrate_blocks(pool, jnp.zeros_like(pool), pairs))
    except Exception as e:  # noqa: BLE001 - any lowering/compile failure means "not here"
        log.warning("Pallas kernels unavailable on this GPU, using the jnp reference: %s", e)
        return f"{type(e).__name__}: {e}"
    return None


def attention_fn(backend: str) -> Callable:
    """The attention implementation for a *resolved* backend, with the reference's signature."""
    if backend == "reference":
        # the pure-JAX path: one K/V gather per query tile (the per-token function is the oracle)
        return rpa.ragged_paged_attention_tiled
    if backend == "interpret":
        return functools.partial(rpa.ragged_paged_attention, interpret=True)
    if backend == "pallas":
        return functools.partial(rpa.ragged_paged_attention,
                                 compiler_params=_gpu_compiler_params())
    raise ValueError(f"attention for backend {backend!r}: resolve() it first")


def migration_fn(backend: str) -> Callable:
    """``f(k_pool, v_pool, pairs) -> (k_pool, v_pool)`` for a resolved backend, jitted with the
    pools donated; pools may be segmented (``jspec.kernels.segments``). Validate the pairs with
    ``kv_migration.validate_pairs`` first."""
    if backend == "reference":
        return jax.jit(kv_migration.migrate_blocks_reference, donate_argnums=(0, 1))
    if backend in ("interpret", "pallas"):
        return jax.jit(functools.partial(kv_migration.migrate_blocks_kernel,
                                         interpret=backend == "interpret"), donate_argnums=(0, 1))
    raise ValueError(f"migration for backend {backend!r}: resolve() it first")
