"""Array-only pytree dataclasses (metadata, KV pools, step results).

Every field is a data leaf, so instances pass through ``jit`` as arguments and results, and a new
batch of the same shapes never recompiles. Lives at the bottom of the import graph because the
kernels, the models and the engine all use it.
"""

from __future__ import annotations

import dataclasses

import jax


def array_dataclass(cls):
    cls = dataclasses.dataclass(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    return jax.tree_util.register_dataclass(cls, data_fields=names, meta_fields=[])
