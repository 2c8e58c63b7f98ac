"""The precision of a dot by its operands' dtype.

XLA on a GPU computes float32 dots in TF32 by default (inputs rounded to 10 mantissa bits,
relative errors near 1e-3), so a model served in float32 would not compute in float32 there:
the lossless checks, which compare float32 runs token for token, and the kernels' comparisons
with their references (tolerance 1e-5) would both measure TF32's rounding. ``HIGHEST`` asks for
IEEE float32 products. On CPU every float32 dot is IEEE already and the flag changes nothing;
bfloat16 dots keep the default (tensor cores, float32 accumulation).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def dot_precision(dtype) -> jax.lax.Precision | None:
    """``Precision.HIGHEST`` for float32 operands, None (the default) otherwise."""
    return jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None
