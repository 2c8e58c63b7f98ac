"""KV block migration: copy (source block -> destination block) pairs in a paged KV pool, all
layers, K and V, in one launch and in place.

When the pool contracts (Nightjar §5.3: the draft is evicted or the pool shrinks under load),
live blocks above the new end are moved into free blocks below it and the page tables are
rewritten. That is a batch of block copies, done here as one kernel whose outputs alias the
pools (``input_output_aliases``), so nothing else in the pool is read or written.

Why no ordering is needed: the destinations are *free* blocks, so no pair's destination is any
pair's source, and destinations are distinct. Then every source is read before or after any
write without difference (no write touches a source), and no two writes touch the same block, so
the copies commute and the grid steps may run in any order or all at once. ``validate_pairs``
enforces exactly that precondition on the host and raises ``ValueError`` naming the offending
block when a caller passes a destination that is also a source (a chain like 5->7, 7->9 would give
a result that depends on execution order) or the same destination twice. Pairs whose source
equals the destination are allowed only as the padding pair (0, 0): block 0 is the reserved null
block, which no sequence owns, so copying it onto itself changes nothing that matters.

Pool layout (as in ``jspec.models.transformer.KVCache``): [layers, num_blocks, block_size, kv_heads,
head_dim], or a tuple of such segments numbering their blocks on (``jspec.kernels.segments``):
elastic memory's contraction moves blocks from the extension segment into the base one, after
which the extension is dropped. The kernel views one block of one layer as a flat row and copies
it in chunks of a power-of-two length (GPU blocks must be), one grid step per (pair, layer),
reading from the segment that holds the source and writing to the one that holds the
destination.
"""

from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from jspec.kernels import segments as seg


def validate_pairs(pairs: Sequence[tuple[int, int]] | np.ndarray, num_blocks: int) -> np.ndarray:
    """Host-side check of a migration plan; returns it as an int32 [n, 2] array."""
    arr = np.asarray(pairs, dtype=np.int64).reshape(-1, 2)
    if arr.size and (arr.min() < 0 or arr.max() >= num_blocks):
        bad = int(arr[(arr < 0) | (arr >= num_blocks)][0])
        raise ValueError(f"block {bad} is outside the pool (0..{num_blocks - 1})")
    real = arr[(arr[:, 0] != 0) | (arr[:, 1] != 0)]
    if np.any(real[:, 0] == real[:, 1]):
        b = int(real[real[:, 0] == real[:, 1]][0, 0])
        raise ValueError(f"pair ({b}, {b}) copies a block onto itself")
    if np.any(real == 0):
        raise ValueError("block 0 is the reserved null block; it is neither moved nor overwritten")
    dsts, counts = np.unique(real[:, 1], return_counts=True)
    if np.any(counts > 1):
        raise ValueError(f"destination block {int(dsts[counts > 1][0])} appears more than once")
    overlap = np.intersect1d(real[:, 0], real[:, 1])
    if overlap.size:
        raise ValueError(f"block {int(overlap[0])} is both a source and a destination; "
                         "destinations must be free blocks (the copies must not depend on order)")
    return arr.astype(np.int32)


def pad_pairs(pairs: np.ndarray, bucket: int) -> np.ndarray:
    """Pad an [n, 2] plan with null (0, 0) pairs to ``bucket`` rows (one compile per bucket)."""
    if len(pairs) > bucket:
        raise ValueError(f"{len(pairs)} pairs exceed the bucket of {bucket}")
    return np.concatenate([pairs, np.zeros((bucket - len(pairs), 2), np.int32)]).astype(np.int32)


def migrate_blocks_reference(k_pool: seg.Pool, v_pool: seg.Pool, pairs: jax.Array
                             ) -> tuple[seg.Pool, seg.Pool]:
    """Pure-jnp reference: pools with ``pool[:, dst] = pool[:, src]`` for every (src, dst)."""
    src, dst = pairs[:, 0], pairs[:, 1]
    return (seg.write_blocks(k_pool, dst, seg.read_blocks(k_pool, src)),
            seg.write_blocks(v_pool, dst, seg.read_blocks(v_pool, src)))


def _chunk(row: int, limit: int = 4096) -> int:
    """Largest power of two <= limit dividing ``row`` (Triton arrays must be powers of two; 4096
    elements are 32 per thread of a 4-warp program, so a chunk stays in registers)."""
    c = 1
    while row % (c * 2) == 0 and c * 2 <= limit:
        c *= 2
    return c


def _migrate_kernel(pairs_ref, *refs, row: int, chunk: int, num_segments: int):
    """One (pair, layer): copy that layer's K and V rows of the pair's source block onto its
    destination block. ``refs``: the K and V segments in, then the same out (aliased: the same
    buffers), each [layers, blocks, row]."""
    k_out = refs[2 * num_segments:3 * num_segments]
    v_out = refs[3 * num_segments:]
    pair = pl.program_id(0)
    layer = pl.program_id(1)
    src = pairs_ref[pair, 0]
    dst = pairs_ref[pair, 1]
    n0 = k_out[0].shape[1]

    def read(segs, block, off):
        if num_segments == 1:
            return segs[0][layer, block, pl.ds(off, chunk)]
        return jax.lax.cond(block < n0, lambda: segs[0][layer, block, pl.ds(off, chunk)],
                            lambda: segs[1][layer, block - n0, pl.ds(off, chunk)])

    def write(segs, block, off, value):
        if num_segments == 1:
            segs[0][layer, block, pl.ds(off, chunk)] = value
            return

        @pl.when(block < n0)
        def _():
            segs[0][layer, block, pl.ds(off, chunk)] = value

        @pl.when(block >= n0)
        def _():
            segs[1][layer, block - n0, pl.ds(off, chunk)] = value

    def copy(step, carry):
        # chunk-aligned offsets: Triton may then load and store in wide vectors
        off = pl.multiple_of(step * chunk, chunk)
        write(k_out, dst, off, read(k_out, src, off))
        write(v_out, dst, off, read(v_out, src, off))
        return carry

    jax.lax.fori_loop(0, row // chunk, copy, 0)


def migrate_blocks_kernel(k_pool: seg.Pool, v_pool: seg.Pool, pairs: jax.Array, *,
                          interpret: bool = False, compiler_params=None
                          ) -> tuple[seg.Pool, seg.Pool]:
    """The kernel, unjitted (``migrate_blocks`` is it jitted with the pools donated): copy every
    (src, dst) pair of ``pairs`` [n, 2] int32, all layers, K and V, in one launch, in place (the
    outputs alias the pools). Validate the plan with ``validate_pairs`` first; it is trusted.

    The grid is (pairs, layers): a program copies one layer of one block, so a plan of n pairs
    keeps n x layers programs busy however few pairs it has, and a program's indices come
    straight from its grid position: no ``%`` of a traced integer, which JAX 0.10's Triton
    lowering fails on (an i1/i32 mismatch). ``compiler_params``: the GPU lowering's (Triton's
    ``CompilerParams`` select Triton; see ``jspec.kernels.gpu_lowering``)."""
    k_segs, v_segs = seg.segments(k_pool), seg.segments(v_pool)
    nseg = len(k_segs)
    if nseg > 2:
        raise ValueError(f"migration handles a pool of one or two segments, not {nseg}")
    num_layers = k_segs[0].shape[0]
    row = int(np.prod(k_segs[0].shape[2:]))
    flat = [a.reshape(a.shape[0], a.shape[1], row) for a in (*k_segs, *v_segs)]
    kernel = functools.partial(_migrate_kernel, row=row, chunk=_chunk(row), num_segments=nseg)
    out = pl.pallas_call(
        kernel,
        grid=(pairs.shape[0], num_layers),
        in_specs=[pl.no_block_spec] * (1 + 2 * nseg),
        out_specs=[pl.no_block_spec] * (2 * nseg),
        out_shape=[jax.ShapeDtypeStruct(a.shape, a.dtype) for a in flat],
        input_output_aliases={1 + j: j for j in range(2 * nseg)},
        interpret=interpret,
        compiler_params=compiler_params,
        name="kv_migration",
    )(pairs.astype(jnp.int32), *flat)
    out = [o.reshape(a.shape) for o, a in zip(out, (*k_segs, *v_segs))]
    if nseg == 1:
        return out[0], out[1]
    return tuple(out[:nseg]), tuple(out[nseg:])


migrate_blocks = jax.jit(migrate_blocks_kernel, static_argnames=("interpret", "compiler_params"),
                         donate_argnums=(0, 1))
