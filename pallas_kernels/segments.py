"""A paged KV pool stored as segments: one array, or a tuple of arrays whose blocks number on.

Elastic memory (Nightjar §5) grows the target's pool by an extension segment allocated from the
memory the offloaded draft gave back, and drops it again at contraction. Growing one array would
mean allocating the whole larger pool and copying the old one into it, which needs the old pool,
the new pool and nothing freed in between: more memory than the draft gave back. So the pool is
a tuple ``(base, extension)`` while expanded, each ``[layers, n_i, block_size, kv_heads,
head_dim]``, and block id ``b`` lives in the segment whose range holds it (``base`` holds
``0..n_0-1``, the extension ``n_0..n_0+n_1-1``). Page tables, the block manager and the
attention metadata see one id space; only the reads and writes of K/V below split by segment.

A single array is the one-segment case, and every function here costs exactly what plain
indexing costs on it: the unexpanded pool compiles to the same program as before.

Reads from two segments gather from both (index clamped into each) and select, so the pure-jnp
paths read twice the bytes while the pool is expanded. The Pallas attention kernel loads from
both under complementary masks, so each page is read once, from its own segment
(``ragged_paged_attention._load_pages``); the migration kernel branches per row chunk
(``kv_migration._migrate_kernel``).
"""

from __future__ import annotations

from typing import Union

import jax
import jax.numpy as jnp

Pool = Union[jax.Array, tuple]


def segments(pool: Pool) -> tuple:
    """The pool's arrays, base first."""
    return tuple(pool) if isinstance(pool, (tuple, list)) else (pool,)


def num_blocks(pool: Pool) -> int:
    return sum(seg.shape[1] for seg in segments(pool))


def _starts(segs: tuple) -> list[int]:
    starts, n = [], 0
    for seg in segs:
        starts.append(n)
        n += seg.shape[1]
    return starts


def read_blocks(pool: Pool, blocks: jax.Array, layer=None) -> jax.Array:
    """``pool[layer, blocks]`` (or ``pool[:, blocks]`` with ``layer=None``) over the segments.

    ``blocks`` is any integer array of global block ids; the result has the shape plain indexing
    of a one-array pool would give."""
    segs = segments(pool)
    if len(segs) == 1:
        return segs[0][:, blocks] if layer is None else segs[0][layer, blocks]
    out = None
    for seg, start in zip(segs, _starts(segs)):
        n = seg.shape[1]
        local = jnp.clip(blocks - start, 0, n - 1)
        part = seg[:, local] if layer is None else seg[layer, local]
        if out is None:
            out = part
            continue
        inside = blocks >= start
        if layer is None:  # part is [layers, *blocks.shape, ...]
            sel = inside.reshape((1,) + blocks.shape + (1,) * (part.ndim - 1 - blocks.ndim))
        else:
            sel = inside.reshape(blocks.shape + (1,) * (part.ndim - blocks.ndim))
        out = jnp.where(sel, part, out)
    return out


def write_slots(pool: Pool, layer, blocks: jax.Array, offsets: jax.Array,
                values: jax.Array) -> Pool:
    """``pool.at[layer, blocks, offsets].set(values)`` over the segments: each token's K or V
    lands in the segment that holds its block (writes aimed at another segment are dropped)."""
    segs = segments(pool)
    if len(segs) == 1:
        return segs[0].at[layer, blocks, offsets].set(values.astype(segs[0].dtype))
    out = []
    for seg, start in zip(segs, _starts(segs)):
        n = seg.shape[1]
        local = blocks - start
        local = jnp.where((local >= 0) & (local < n), local, n)  # n: out of range, dropped
        out.append(seg.at[layer, local, offsets].set(values.astype(seg.dtype), mode="drop"))
    return tuple(out)


def write_blocks(pool: Pool, blocks: jax.Array, values: jax.Array) -> Pool:
    """``pool.at[:, blocks].set(values)`` over the segments (all layers of whole blocks)."""
    segs = segments(pool)
    if len(segs) == 1:
        return segs[0].at[:, blocks].set(values)
    out = []
    for seg, start in zip(segs, _starts(segs)):
        n = seg.shape[1]
        local = blocks - start
        local = jnp.where((local >= 0) & (local < n), local, n)
        out.append(seg.at[:, local].set(values, mode="drop"))
    return tuple(out)
