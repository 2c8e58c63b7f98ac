"""Ragged paged attention: the one attention signature every model layer calls.

A step's tokens are a flat ragged batch: sequence ``s`` owns tokens ``cu_q_lens[s]:cu_q_lens[s+1]``
(a prefill chunk, one decode token or a γ+1-token verification window, all alike). Their K/V have
already been written into the paged pool, so every query attends to keys read from the pool
through its sequence's page table, causally by absolute position: key position ``kp`` is
visible to a query at position ``qp`` iff ``kp <= qp`` (and ``kp > qp - window`` with a sliding
window). Stale K/V left behind a rolled-back sequence sits at positions above every live query and
is masked by the same rule, which is why rollback needs no data movement.

This module holds the metadata pytree, the pure-jnp reference and the Pallas kernel.

Reference: walks the keys in chunks of pages with an online softmax (flash-attention style), so
memory stays bounded by ``tokens x chunk`` however long the contexts are, and the loop stops at
the longest live context rather than at the page-table width.

Kernel (``ragged_paged_attention``): one launch for the whole ragged batch. Each sequence's new
tokens are cut into *query tiles* of ``q_block`` tokens; a tile never spans two sequences, so a
batch of T tokens over S sequences has at most ``ceil(T / q_block) + S`` tiles (``S`` when a bound
``max_q_len`` makes the tile that long). A tile's rows are its tokens times the query heads of
one kv head (GQA: each K/V page is read once for the whole group), rounded up to a power of two
(``kernel_tile``). The grid is (tiles, kv_heads, context splits): a program takes one tile, one
kv head and one run of the tile's pages, and loops over that run *inside* the kernel, reading
``pages_per_iter`` pages per iteration (one masked gather of K and one of V) with an online
softmax in float32. When the grid would be small (a lone decode over 2 kv heads is 2 programs
for a GPU of 132 SMs) the context is split over more programs (flash-decoding,
``context_splits``): each writes its run's unnormalised softmax state (acc, max, sum) and
``_combine`` merges them exactly. Tiles past the batch's last one and splits past a context read
nothing. No two programs write the same memory; the wrapper gathers the tiles back into token
order. Prefill chunks, 1-token decode and γ+1-token verification are all just tiles, which is
what lets one launch serve the mixed batches speculative decoding makes. Causality is by
absolute position, exactly as in the reference.

Why loop over pages inside the kernel rather than one grid step per page: a grid step per
(tile, page) would need a reduction of the softmax state over every page; splits bound that to
a few runs. And Pallas interpret mode (the CPU test path) pays per grid step.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jspec.kernels import segments as seg
from jspec.kernels.batch_invariance import ATTENTION_CHUNK, invariant_rows, min_q_block, \
    row_sum
from jspec.kernels.precision import dot_precision
from jspec.kernels.pytree import array_dataclass

_MASKED = -1e30  # finite, so fully masked chunks never produce inf - inf
# where the softmax's exponents are floored: a masked score (-1e30 below the row's maximum) makes
# XLA:CPU's exp produce subnormals, slower per element than normal results, and its exp is
# replaced by 0 anyway. exp(-80) is 1.8e-35: a floored live term stays below float32's
# resolution of the row's sum, which holds exp(0) = 1 for the row's maximum.
_EXP_FLOOR = -80.0


@array_dataclass
class AttentionMetadata:
    """Where each flat token belongs and where its sequence's K/V live.

    positions:  [T] int32, absolute position of each token in its sequence.
    cu_q_lens:  [S+1] int32, cumulative new-token counts; padding tokens sit past cu_q_lens[-1]
                and padding sequences have zero new tokens.
    kv_lens:    [S] int32, context length of each sequence including its new tokens.
    page_table: [S, P] int32, physical block of each logical page (unused entries point at the
                reserved null block 0).
    """

    positions: jax.Array
    cu_q_lens: jax.Array
    kv_lens: jax.Array
    page_table: jax.Array


def token_sequence_ids(cu_q_lens: jax.Array, num_tokens: int) -> jax.Array:
    """Sequence index of every flat token; padding tokens map to the last sequence row."""
    seq = jnp.searchsorted(cu_q_lens[1:], jnp.arange(num_tokens, dtype=cu_q_lens.dtype),
                           side="right")
    return jnp.minimum(seq, cu_q_lens.shape[0] - 2).astype(jnp.int32)


def ragged_paged_attention_reference(
    q: jax.Array,
    k_pool: jax.Array,
    v_pool: jax.Array,
    layer: jax.Array | int,
    md: AttentionMetadata,
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    chunk_pages: int | None = None,
    max_q_len: int | None = None,
) -> jax.Array:
    """Pure-jnp reference.

    q:       [T, num_heads, head_dim]
    k_pool:  [layers, num_blocks, block_size, kv_heads, head_dim] (v_pool alike), or a tuple
             of such segments numbering their blocks on (``jspec.kernels.segments``)
    layer:   which layer of the stacked pools to read
    max_q_len: the bound on any sequence's new tokens that every attention function takes
             (the tiled path and the kernel plan their tiles with it); this per-token path
             has no tiles, so it does not need it
    returns  [T, num_heads, head_dim] in q's dtype.
    """
    num_tokens, num_heads, head_dim = q.shape
    block_size, kv_heads = seg.segments(k_pool)[0].shape[2:4]
    group = num_heads // kv_heads
    page_table, chunk_pages, chunk = _page_chunks(md.page_table, block_size, chunk_pages)
    token_seq = token_sequence_ids(md.cu_q_lens, num_tokens)
    q_pos = md.positions
    qf = q.reshape(num_tokens, kv_heads, group, head_dim).astype(jnp.float32) * sm_scale
    highest = dot_precision(jnp.float32)  # the oracle: IEEE float32 on a GPU too

    def body(c, carry):
        pages = jax.lax.dynamic_slice_in_dim(page_table, c * chunk_pages, chunk_pages, axis=1)
        tok_pages = pages[token_seq]  # [T, chunk_pages]
        # one gather indexed by (layer, page): slicing the layer out first (k_pool[layer])
        # materialises a copy of that layer's whole pool on XLA:CPU, every layer, every step
        k = seg.read_blocks(k_pool, tok_pages, layer)
        v = seg.read_blocks(v_pool, tok_pages, layer)
        k = k.reshape(num_tokens, chunk, kv_heads, head_dim)
        v = v.reshape(num_tokens, chunk, kv_heads, head_dim)
        mask = _causal_mask(c * chunk + jnp.arange(chunk, dtype=jnp.int32), q_pos,
                            sliding_window)[:, None, None, :]
        s = jnp.einsum("tkgd,tckd->tkgc", qf, k.astype(jnp.float32), precision=highest)
        return _softmax_step(carry, s, mask, lambda p: jnp.einsum(
            "tkgc,tckd->tkgd", p, v.astype(jnp.float32), precision=highest))

    acc = _over_chunks(body, md, page_table, chunk_pages, chunk,
                       (num_tokens, kv_heads, group), head_dim)
    return acc.reshape(num_tokens, num_heads, head_dim).astype(q.dtype)


def _page_chunks(page_table: jax.Array, block_size: int, chunk_pages: int | None,
                 chunk_tokens: int = 256):
    """The page table padded to whole chunks of ``chunk_pages`` pages (default: ``chunk_tokens``
    tokens' worth): (table, chunk_pages, tokens per chunk)."""
    num_pages = page_table.shape[1]
    if chunk_pages is None:
        chunk_pages = max(1, chunk_tokens // block_size)
    chunk_pages = min(chunk_pages, num_pages)
    pad = (-num_pages) % chunk_pages
    if pad:
        page_table = jnp.pad(page_table, ((0, 0), (0, pad)))
    return page_table, chunk_pages, chunk_pages * block_size


def _causal_mask(k_pos: jax.Array, q_pos: jax.Array, sliding_window: int | None) -> jax.Array:
    """[..., C]: key position k_pos visible from query position q_pos (causal by absolute
    position, within the sliding window if any)."""
    mask = k_pos <= q_pos[..., None]
    if sliding_window is not None:
        mask &= k_pos > q_pos[..., None] - sliding_window
    return mask


def _softmax_step(carry, s: jax.Array, mask: jax.Array, pv, invariant: bool = False):
    """One chunk of the online softmax: scores ``s`` [..., C] under ``mask``; ``pv(p)`` is the
    chunk's probabilities times its values. ``invariant``: the probabilities summed in an order
    that does not depend on the number of rows (``batch_invariance.row_sum``)."""
    m, l, acc = carry
    s = jnp.where(mask, s, _MASKED)
    m_new = jnp.maximum(m, s.max(axis=-1))
    p = jnp.where(mask, jnp.exp(jnp.maximum(s - m_new[..., None], _EXP_FLOOR)), 0.0)
    corr = jnp.exp(jnp.maximum(m - m_new, _EXP_FLOOR))
    total = row_sum(p) if invariant else p.sum(axis=-1)
    return m_new, l * corr + total, acc * corr[..., None] + pv(p)


def _over_chunks(body, md: AttentionMetadata, page_table: jax.Array, chunk_pages: int,
                 chunk: int, rows: tuple[int, ...], head_dim: int) -> jax.Array:
    """Run ``body`` over the chunks of pages up to the longest live context (padding rows have
    kv_len 0) and normalise: the attention output [*rows, head_dim] in float32."""
    max_kv = jnp.max(md.kv_lens)
    num_chunks = jnp.minimum((max_kv + chunk - 1) // chunk, page_table.shape[1] // chunk_pages)
    init = (jnp.full(rows, _MASKED, jnp.float32), jnp.zeros(rows, jnp.float32),
            jnp.zeros(rows + (head_dim,), jnp.float32))
    if page_table.shape[1] == chunk_pages:  # one chunk covers every context: no loop to compile
        _, l, acc = body(0, init)
    else:
        _, l, acc = jax.lax.fori_loop(0, num_chunks, body, init)
    return acc / jnp.maximum(l, 1e-30)[..., None]


def reference_q_block(num_tokens: int, num_seqs: int) -> int:
    """Query-tile size of ``ragged_paged_attention_tiled`` for a (tokens, sequences) bucket: the
    mean tokens per sequence rounded down to a power of two (1 when every sequence brings one
    token, i.e. plain decoding, where per-token gathers are already per-sequence)."""
    per_seq = max(1, num_tokens // max(1, num_seqs))
    return 1 << (per_seq.bit_length() - 1)


def ragged_paged_attention_tiled(
    q: jax.Array,
    k_pool: jax.Array,
    v_pool: jax.Array,
    layer: jax.Array | int,
    md: AttentionMetadata,
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    q_block: int | None = None,
    chunk_pages: int | None = None,
    max_q_len: int | None = None,
    batch_invariant: bool = False,
) -> jax.Array:
    """Pure-jnp attention that reads each sequence's pages once per query tile, not per token.

    The per-token reference gathers a sequence's K/V once for every one of its new tokens: a
    γ+1-token verification window reads the context γ+1 times, a P-token prefill chunk P times,
    and on CPU that gather is most of the step. Here the new tokens are cut into the Pallas
    kernel's query tiles (``_tile_plan``: ``q_block`` tokens of one sequence each, at most
    ``ceil(T / q_block) + S`` tiles), each tile gathers its sequence's pages once per chunk of
    ``chunk_pages`` pages and attends for all its tokens, with the same online softmax and the
    same causal-by-absolute-position mask as the reference. This is what the ``reference``
    backend runs (CPU, TPU, GPUs without Pallas); the per-token function stays as the oracle.

    ``q_block`` defaults to ``reference_q_block(T, S)``; with 1 this is the per-token reference.
    ``max_q_len``: a static bound on every sequence's new tokens, which the caller guarantees
    (a decode-only verification: γ + 1). The tile is then that long and there is one tile per
    sequence, where the general bound would gather the context of up to ``T / q_block`` more.
    ``batch_invariant``: every token attends with the same arithmetic whatever its batch
    (``jspec.kernels.batch_invariance``): tiles of at least ``MIN_DOT_ROWS`` rows, and never
    the per-token path, which computes in float32.

    With one kv head (MQA: the built-in draft model and EAGLE head) the products keep the
    pool's layout (``_attend_one_kv_head``); with several, each kv head's K and V are
    gathered apart and V transposed for its product.
    """
    num_tokens, num_heads, head_dim = q.shape
    num_seqs, num_pages = md.page_table.shape
    pool = seg.segments(k_pool)[0]
    block_size, kv_heads = pool.shape[2:4]
    group = num_heads // kv_heads
    if q_block is None:
        q_block = max_q_len or reference_q_block(num_tokens, num_seqs)
    if batch_invariant:
        q_block = max(q_block, min_q_block(group))
    elif q_block <= 1 and (kv_heads > 1 or num_tokens == 1):
        # one token per tile: the per-token path, but for one kv head over a batch of tokens,
        # where the tiles' products (``_attend_one_kv_head``) are faster (a lone token's
        # product is no faster than the per-token path's)
        return ragged_paged_attention_reference(q, k_pool, v_pool, layer, md, sm_scale=sm_scale,
                                                sliding_window=sliding_window,
                                                chunk_pages=chunk_pages)
    # 128-token chunks: a tile's scores then stay small enough for the cache (B = 32, γ = 4
    # verify forward 15% faster on CPU than with 256, prefill chunks 3-9%; 64 was slower)
    page_table, chunk_pages, chunk = _page_chunks(md.page_table, block_size, chunk_pages,
                                                  ATTENTION_CHUNK)
    tile_seq, tile_q_start, _, _, token_tile, token_row = _tile_plan(
        md, num_tokens, q_block, block_size, sliding_window, max_q_len)
    num_tiles = tile_seq.shape[0]
    # tile rows -> flat tokens; rows past their sequence's end are masked out entirely
    q_idx = tile_q_start[:, None] + jnp.arange(q_block, dtype=jnp.int32)[None, :]
    row_live = q_idx < md.cu_q_lens[tile_seq + 1][:, None]
    q_idx = jnp.minimum(q_idx, num_tokens - 1)
    q_pos = jnp.where(row_live, md.positions[q_idx], -1)  # [tiles, qb]; -1 sees no key
    # the dots run in the pool's dtype with float32 accumulation, as the Pallas kernel's do (in
    # bf16 on CPU: 4-8% of a B >= 8 verify forward against widening K/V to float32 first)
    dtype = pool.dtype
    precision = dot_precision(dtype)
    qf = (q.astype(jnp.float32)[q_idx] * sm_scale).astype(dtype)  # [tiles, qb, H, D]
    if kv_heads == 1:
        out = _attend_one_kv_head(qf, q_pos, k_pool, v_pool, layer, md, page_table, tile_seq,
                                  chunk_pages, chunk, sliding_window, batch_invariant)
        out = out[token_tile, token_row]  # back to token order: [T, H, D]
        return out.astype(q.dtype)
    qf = qf.reshape(num_tiles, q_block, kv_heads, group, head_dim)
    tile_pages = page_table[tile_seq]  # [tiles, padded pages]

    def body(c, carry):
        pages = jax.lax.dynamic_slice_in_dim(tile_pages, c * chunk_pages, chunk_pages, axis=1)
        # indexed by (layer, page) at once: no copy of the layer (see the reference)
        k = seg.read_blocks(k_pool, pages, layer).reshape(num_tiles, chunk, kv_heads, head_dim)
        v = seg.read_blocks(v_pool, pages, layer).reshape(num_tiles, chunk, kv_heads, head_dim)
        mask = _causal_mask(c * chunk + jnp.arange(chunk, dtype=jnp.int32), q_pos,
                            sliding_window)[:, :, None, None, :]  # [tiles, qb, 1, 1, chunk]
        s = jnp.einsum("nqkgd,nckd->nqkgc", qf, k, precision=precision,
                       preferred_element_type=jnp.float32)
        return _softmax_step(carry, s, mask, lambda p: jnp.einsum(
            "nqkgc,nckd->nqkgd", p.astype(dtype), v, precision=precision,
            preferred_element_type=jnp.float32), batch_invariant)

    out = _over_chunks(body, md, page_table, chunk_pages, chunk,
                       (num_tiles, q_block, kv_heads, group), head_dim)
    out = out[token_tile, token_row]  # back to token order: [T, kvh, g, D]
    return out.reshape(num_tokens, num_heads, head_dim).astype(q.dtype)


def _attend_one_kv_head(qf: jax.Array, q_pos: jax.Array, k_pool, v_pool, layer,
                        md: AttentionMetadata, page_table: jax.Array, tile_seq: jax.Array,
                        chunk_pages: int, chunk: int, sliding_window: int | None,
                        batch_invariant: bool) -> jax.Array:
    """``ragged_paged_attention_tiled``'s tiles over a pool of one kv head: ``qf`` [tiles, qb, H,
    D] scaled queries, ``q_pos`` [tiles, qb] their positions (-1: no query) -> [tiles, qb, H, D]
    float32.

    A tile's rows are its (token, query head) pairs and a chunk's columns its key tokens, both
    as they lie in memory, so the scores are rows @ K^T and the output p @ V: neither K nor V is
    transposed on the way to a product. The general path's per-kv-head layout makes XLA:CPU
    transpose every chunk of V, which takes longer than the products: the built-in pair's B = 32
    draft loops run 1.24-1.29x faster this way (2-vCPU Intel Xeon). ``batch_invariant``: the
    rows are padded as the mode pads a dot's (``invariant_rows``)."""
    num_tiles, q_block, num_heads, head_dim = qf.shape
    rows = q_block * num_heads
    padded = invariant_rows(rows) if batch_invariant else rows
    dtype = qf.dtype
    precision = dot_precision(dtype)
    qr = _pad_rows(qf.reshape(num_tiles, rows, head_dim), padded)
    row_pos = jnp.repeat(q_pos, num_heads, axis=1)  # [tiles, rows]
    row_pos = _pad_rows(row_pos, padded, -1)
    keys = jnp.arange(chunk, dtype=jnp.int32)
    tile_pages = page_table[tile_seq]  # [tiles, padded pages]

    def body(c, carry):
        pages = jax.lax.dynamic_slice_in_dim(tile_pages, c * chunk_pages, chunk_pages, axis=1)
        k = seg.read_blocks(k_pool, pages, layer).reshape(num_tiles, chunk, head_dim)
        v = seg.read_blocks(v_pool, pages, layer).reshape(num_tiles, chunk, head_dim)
        mask = _causal_mask(c * chunk + keys, row_pos, sliding_window)  # [tiles, rows, chunk]
        s = jnp.einsum("trd,tjd->trj", qr, k, precision=precision,
                       preferred_element_type=jnp.float32)
        return _softmax_step(carry, s, mask, lambda p: jnp.einsum(
            "trj,tjd->trd", p.astype(dtype), v, precision=precision,
            preferred_element_type=jnp.float32), batch_invariant)

    out = _over_chunks(body, md, page_table, chunk_pages, chunk, (num_tiles, padded), head_dim)
    return out[:, :rows].reshape(num_tiles, q_block, num_heads, head_dim)


def _pad_rows(x: jax.Array, size: int, value=0) -> jax.Array:
    """``x`` padded with ``value`` along axis 1 up to ``size``."""
    short = size - x.shape[1]
    if short <= 0:
        return x
    pad = [(0, 0)] * x.ndim
    pad[1] = (0, short)
    return jnp.pad(x, pad, constant_values=value)


# ----------------------------------------------------------------------------- Pallas kernel
# The kernel's shape parameters. PAGES_PER_ITER and PROGRAMS are tuned per GPU model:
# ``gpu_lowering`` passes what `jspec bench kernels --tune` recorded for it, these otherwise.
PAGES_PER_ITER = 8  # pages of K/V one loop iteration reads (JAX's GPU paged attention reads 8)
PROGRAMS = 256  # programs the context split aims at: about two per SM of an H100 (132 SMs)
INVARIANT_SPLITS = 8  # context slots of the batch-invariant mode (fixed per model)
TILE_ROWS = 64  # query rows of a tile when no bound on new tokens is given (and always when
# batch-invariant); a power of two, at least 16 (the smallest dot Triton compiles)
MAX_TILE_ROWS = 128  # the largest tile a bound on new tokens may ask for
MIN_DOT = 16  # Triton's smallest dot dimension
MAX_SPLITS = 64  # the most programs one (tile, kv head) is split over
# The most bytes of K (and of V) one iteration loads: Triton stages each load in shared memory,
# once per pipeline stage, so K + V at 2 stages take 4x this (128 KiB: JAX's own GPU paged
# attention at its defaults, 8 pages of 16 x 128 bf16). f32 or wide heads get fewer pages.
KV_TILE_BYTES = 32 << 10


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def kernel_tile(group: int, max_q_len: int | None = None, q_block: int | None = None,
                tile_rows: int = TILE_ROWS, batch_invariant: bool = False) -> tuple[int, int]:
    """(tokens, rows) of the kernel's query tile for ``group`` query heads per kv head.

    A tile's rows are its tokens times the group, token-major, rounded up to a power of two and
    to at least 16 (the rows past the tile's tokens are computed and never read). With a bound
    ``max_q_len`` on every sequence's new tokens (decode: 1, a γ+1 verification) the tile holds
    that many tokens, so each sequence is one tile and its context is read once (γ+1 = 5 with 7
    heads per kv head: 35 rows, a 64-row tile), up to ``MAX_TILE_ROWS``. Otherwise (prefill
    chunks, mixed batches) the tile holds as many tokens as fit ``tile_rows``.
    ``batch_invariant``: every tile has ``tile_rows`` rows (``max_q_len`` only lowers the tokens
    per tile), so the dots have one shape whatever the batch: a token's arithmetic must not
    depend on whether it is decoded alone or verified in a window.
    ``q_block`` (tokens) overrides the choice of tokens."""
    tile_rows = max(MIN_DOT, _next_pow2(tile_rows))
    if q_block is None:
        fits = max(1, tile_rows // group)
        if batch_invariant:
            q_block = fits if max_q_len is None else min(max_q_len, fits)
        elif max_q_len is not None and max_q_len * group <= MAX_TILE_ROWS:
            q_block = max_q_len
        else:
            q_block = fits
    rows = max(MIN_DOT, _next_pow2(q_block * group))
    if batch_invariant:
        rows = max(rows, tile_rows)
    return q_block, rows


def pages_per_iteration(pages_per_iter: int, num_pages: int, block_size: int, head_dim: int,
                        itemsize: int) -> int:
    """The pages one loop iteration reads: ``pages_per_iter`` rounded up to a power of two, no
    more than ``KV_TILE_BYTES`` of K allow or the page table's width (rounded up) needs, and
    never under 16 keys (Triton's smallest dot)."""
    ppi = min(_next_pow2(pages_per_iter), _next_pow2(num_pages))
    budget = KV_TILE_BYTES // (block_size * head_dim * itemsize)
    if budget >= 1:
        ppi = min(ppi, 1 << (budget.bit_length() - 1))
    return max(ppi, _next_pow2(-(-MIN_DOT // block_size)))


def context_splits(num_tiles: int, kv_heads: int, num_chunks: int, programs: int = PROGRAMS,
                   batch_invariant: bool = False,
                   invariant_splits: int = INVARIANT_SPLITS) -> int:
    """How many programs each (query tile, kv head) splits its context over (flash-decoding).

    Enough that the grid has about ``programs`` programs: a B = 1 decode over 2 kv heads gets
    up to ``programs / 2`` splits, a batch of 32 a few, a batch of 128 tiles none. Never more
    than the chunks of ``pages_per_iter`` pages the page table holds (``num_chunks``): each
    split reads at least one. ``batch_invariant``: ``invariant_splits`` (fixed per model, so a
    token's context is cut at the same places whatever its batch)."""
    cap = max(1, min(MAX_SPLITS, num_chunks))
    if batch_invariant:
        return max(1, min(invariant_splits, cap))
    return max(1, min(cap, -(-programs // max(1, num_tiles * kv_heads))))


def _tile_plan(md: AttentionMetadata, num_tokens: int, q_block: int, block_size: int,
               sliding_window: int | None, max_q_len: int | None = None):
    """Per query tile: (sequence, first token, first page, end page); per token: its tile and row.

    Pure jnp on the metadata (jittable, no host sync). Tiles are numbered sequence by sequence;
    ``num_tiles = ceil(T / q_block) + S`` bounds the real count statically, and so does
    ``S * ceil(max_q_len / q_block)`` when no sequence brings more than ``max_q_len`` tokens.
    """
    num_seqs = md.kv_lens.shape[0]
    # a sequence's last tile may be partial, hence + S; one-token tiles are never partial
    num_tiles = num_tokens if q_block == 1 else -(-num_tokens // q_block) + num_seqs
    if max_q_len is not None:
        num_tiles = min(num_tiles, num_seqs * -(-max_q_len // q_block))
    q_lens = md.cu_q_lens[1:] - md.cu_q_lens[:-1]
    seq_tiles = (q_lens + q_block - 1) // q_block
    cu_tiles = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(seq_tiles).astype(jnp.int32)])
    tile_ids = jnp.arange(num_tiles, dtype=jnp.int32)
    tile_seq = jnp.clip(jnp.searchsorted(cu_tiles[1:], tile_ids, side="right"), 0, num_seqs - 1)
    tile_seq = tile_seq.astype(jnp.int32)
    live = tile_ids < cu_tiles[-1]
    tile_q_start = md.cu_q_lens[tile_seq] + (tile_ids - cu_tiles[tile_seq]) * q_block
    tile_q_start = jnp.where(live, tile_q_start, 0).astype(jnp.int32)

    token_ids = jnp.arange(num_tokens, dtype=jnp.int32)
    token_seq = token_sequence_ids(md.cu_q_lens, num_tokens)
    token_live = token_ids < md.cu_q_lens[-1]
    token_tile = cu_tiles[token_seq] + (token_ids - md.cu_q_lens[token_seq]) // q_block
    token_tile = jnp.where(token_live, token_tile, num_tiles - 1).astype(jnp.int32)
    token_row = jnp.where(token_live, token_ids - tile_q_start[token_tile], 0).astype(jnp.int32)

    big = jnp.iinfo(jnp.int32).max
    pos = md.positions.astype(jnp.int32)
    max_pos = jax.ops.segment_max(jnp.where(token_live, pos, -1), token_tile, num_tiles)
    min_pos = jax.ops.segment_min(jnp.where(token_live, pos, big), token_tile, num_tiles)
    max_pos = jnp.where(live, max_pos, -1)
    end_page = jnp.maximum(max_pos + 1 + block_size - 1, 0) // block_size  # pages [first, end)
    end_page = jnp.minimum(end_page, md.page_table.shape[1])
    if sliding_window is None:
        first_page = jnp.zeros_like(end_page)
    else:
        first_page = jnp.maximum(jnp.where(live, min_pos, 0) - sliding_window + 1, 0) // block_size
    first_page = jnp.minimum(first_page, end_page)
    return (tile_seq, tile_q_start, first_page.astype(jnp.int32), end_page.astype(jnp.int32),
            token_tile, token_row)


def _split_plan(first_page: jax.Array, end_page: jax.Array, pages_per_iter: int,
                num_chunks: int, splits: int, batch_invariant: bool):
    """Per (tile, split): the chunks of ``pages_per_iter`` pages it reads, ``[lo, hi)``.

    Chunks sit at absolute multiples of ``pages_per_iter`` pages, so a page is in the same
    chunk whichever tile reads it. A tile reads the chunks holding its pages ``[first, end)``,
    cut into ``splits`` runs of equal length (the last shorter; a split past the context reads
    nothing). Batch-invariant: the runs are fixed slots of the page table instead
    (``ceil(num_chunks / splits)`` chunks each), so where a token's context is cut does not
    depend on the other tokens of its tile."""
    c0 = first_page // pages_per_iter
    c1 = jnp.where(end_page > first_page, -(-end_page // pages_per_iter), c0)
    s = jnp.arange(splits, dtype=jnp.int32)[None, :]
    if batch_invariant:
        per = -(-num_chunks // splits)
        lo = jnp.maximum(c0[:, None], s * per)
        hi = jnp.minimum(c1[:, None], (s + 1) * per)
    else:
        per = (c1 - c0 + splits - 1) // splits
        lo = c0[:, None] + s * per[:, None]
        hi = jnp.minimum(c1[:, None], lo + per[:, None])
    return lo.astype(jnp.int32), jnp.maximum(hi, lo).astype(jnp.int32)


def _load_pages(refs, layer, blocks, head, live, block_size: int, head_dim: int):
    """One kv head's K (or V) of the pages ``blocks`` ([n] block ids), [n * block_size, D].

    Pages not ``live`` (past the context, before a sliding window) are masked loads: their
    lanes issue no memory access and read as zeros. A two-segment pool
    (``jspec.kernels.segments``) loads every page from both segments under complementary masks
    and selects: each page's bytes are read once, from the segment that holds it, with no
    branch (a branch per page splits the loop body in two, which halves the loads Triton can
    pipeline). Indices are full arrays (Pallas' interpreter takes no mix of vector indices and
    slices); Triton derives the same contiguous rows from them."""
    n = blocks.shape[0]
    shape = (n, block_size, head_dim)
    slot = jax.lax.broadcasted_iota(jnp.int32, shape, 1)
    dim = jax.lax.broadcasted_iota(jnp.int32, shape, 2)
    live = jnp.broadcast_to(live[:, None, None], shape)
    if len(refs) == 1:
        idx = jnp.broadcast_to(blocks[:, None, None], shape)
        out = plgpu.load(refs[0].at[layer, idx, slot, head, dim], mask=live, other=0)
    else:
        base, ext = refs
        n0 = base.shape[1]
        in_base = jnp.broadcast_to((blocks < n0)[:, None, None], shape)
        idx = jnp.broadcast_to(blocks[:, None, None], shape)
        from_base = plgpu.load(base.at[layer, jnp.minimum(idx, n0 - 1), slot, head, dim],
                               mask=live & in_base, other=0)
        from_ext = plgpu.load(ext.at[layer, jnp.clip(idx - n0, 0, ext.shape[1] - 1), slot,
                                     head, dim], mask=live & ~in_base, other=0)
        out = jnp.where(in_base, from_base, from_ext)
    return out.reshape(n * block_size, head_dim)


def _rpa_kernel(tile_seq_ref, tile_q_start_ref, first_page_ref, end_page_ref, chunk_lo_ref,
                chunk_hi_ref, page_table_ref, layer_ref, row_pos_ref, q_ref, *refs, rows: int,
                group: int, pages_per_iter: int, block_size: int,
                sliding_window: int | None, sm_scale: float, num_segments: int, split: bool):
    """One (query tile, kv head, context split): rows are (token, query head of the group),
    token-major. ``refs``: the K segments, the V segments, then the output (the normalised
    tile) or, when the context is split, the split's unnormalised softmax state (acc, max,
    sum) for ``_combine``."""
    k_refs, v_refs = refs[:num_segments], refs[num_segments:2 * num_segments]
    out_refs = refs[2 * num_segments:]
    tile, head, part = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    seq = tile_seq_ref[tile]
    start = tile_q_start_ref[tile] * group
    # dots take the storage dtype and accumulate in f32 (tensor cores on GPU); softmax is f32
    q = (q_ref[head, pl.ds(start, rows), :].astype(jnp.float32) * sm_scale).astype(q_ref.dtype)
    q_pos = row_pos_ref[pl.ds(start, rows)]  # [rows]
    layer = layer_ref[0]
    first, end = first_page_ref[tile], end_page_ref[tile]
    keys = pages_per_iter * block_size
    head_dim = q_ref.shape[-1]
    precision = dot_precision(k_refs[0].dtype)

    def body(chunk, carry):
        m, l, acc = carry
        page0 = chunk * pages_per_iter
        pages = page0 + jax.lax.iota(jnp.int32, pages_per_iter)
        live = (pages >= first) & (pages < end)
        blocks = page_table_ref[seq, pl.ds(page0, pages_per_iter)]
        k = _load_pages(k_refs, layer, blocks, head, live, block_size, head_dim)
        v = _load_pages(v_refs, layer, blocks, head, live, block_size, head_dim)
        s = jax.lax.dot_general(q, k.astype(q.dtype), (((1,), (1,)), ((), ())),
                                precision=precision,
                                preferred_element_type=jnp.float32)  # [rows, keys]
        k_pos = page0 * block_size + jax.lax.broadcasted_iota(jnp.int32, (rows, keys), 1)
        mask = k_pos <= q_pos[:, None]
        if sliding_window is not None:
            mask = mask & (k_pos > q_pos[:, None] - sliding_window)
        s = jnp.where(mask, s, _MASKED)
        m_new = jnp.maximum(m, s.max(axis=1))
        p = jnp.where(mask, jnp.exp(s - m_new[:, None]), 0.0)
        corr = jnp.exp(m - m_new)
        l = l * corr + p.sum(axis=1)
        acc = acc * corr[:, None] + jnp.dot(p.astype(v.dtype), v, precision=precision,
                                             preferred_element_type=jnp.float32)
        return m_new, l, acc

    init = (jnp.full((rows,), _MASKED, jnp.float32), jnp.zeros((rows,), jnp.float32),
            jnp.zeros((rows, head_dim), jnp.float32))
    lo, hi = chunk_lo_ref[tile, part], chunk_hi_ref[tile, part]
    m, l, acc = jax.lax.fori_loop(lo, hi, body, init)
    if not split:
        (o_ref,) = out_refs
        o_ref[...] = (acc / jnp.maximum(l, 1e-30)[:, None]).astype(o_ref.dtype)
        return
    acc_ref, m_ref, l_ref = out_refs

    @pl.when(lo < hi)  # a split past the context writes nothing; _combine skips it
    def _():
        acc_ref[...] = acc
        m_ref[...] = m
        l_ref[...] = l


def _combine(acc: jax.Array, m: jax.Array, l: jax.Array, live: jax.Array) -> jax.Array:
    """Merge the splits' softmax states exactly: acc [..., splits, D], m and l [..., splits],
    ``live`` (broadcastable to m) marks the splits that read something (the others' outputs
    were never written). Each split's share is rescaled to the common max; the sums over the
    splits run in split order, one elementwise step at a time, so a token's result does not
    depend on the shape of the batch around it."""
    m = jnp.where(live, m, _MASKED)
    l = jnp.where(live, l, 0.0)
    acc = jnp.where(live[..., None], acc, 0.0)
    w = jnp.exp(m - m.max(axis=-1, keepdims=True))
    num, den = acc[..., 0, :] * w[..., 0, None], l[..., 0] * w[..., 0]
    for s in range(1, m.shape[-1]):
        num = num + acc[..., s, :] * w[..., s, None]
        den = den + l[..., s] * w[..., s]
    return num / jnp.maximum(den, 1e-30)[..., None]


def ragged_paged_attention(
    q: jax.Array,
    k_pool: jax.Array,
    v_pool: jax.Array,
    layer: jax.Array | int,
    md: AttentionMetadata,
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    q_block: int | None = None,
    max_q_len: int | None = None,
    batch_invariant: bool = False,
    pages_per_iter: int = PAGES_PER_ITER,
    programs: int = PROGRAMS,
    invariant_splits: int = INVARIANT_SPLITS,
    tile_rows: int = TILE_ROWS,
    interpret: bool = False,
    compiler_params=None,
) -> jax.Array:
    """The Pallas kernel; same arguments and result as ``ragged_paged_attention_reference``.

    ``max_q_len``: a static bound on every sequence's new tokens, which the caller guarantees;
    the query tile then holds that many tokens (``kernel_tile``) and the grid has one tile per
    sequence. ``q_block``: tokens per query tile, overriding ``kernel_tile``'s choice.
    ``batch_invariant``: a token's arithmetic does not depend on its batch (one tile shape per
    model, context splits at fixed places: ``kernel_tile``, ``context_splits``,
    ``_split_plan``). ``pages_per_iter``: pages each loop iteration reads (as
    ``pages_per_iteration`` bounds it);
    ``programs``: the grid size the context split aims at; ``invariant_splits``: the split
    count of the batch-invariant mode; ``tile_rows``: query rows per tile when unbounded.
    ``interpret`` runs the kernel through Pallas' interpreter (any backend, CPU included; that
    is how the tests run it); ``compiler_params``: Triton's (``gpu_lowering``).
    """
    num_tokens, num_heads, head_dim = q.shape
    k_segs, v_segs = seg.segments(k_pool), seg.segments(v_pool)
    if len(k_segs) > 2:
        raise ValueError(f"the kernel reads a pool of one or two segments, not {len(k_segs)}")
    block_size, kv_heads = k_segs[0].shape[2:4]
    if num_heads % kv_heads:
        raise ValueError(f"{num_heads} query heads are not a multiple of {kv_heads} kv heads")
    group = num_heads // kv_heads
    q_block, rows = kernel_tile(group, max_q_len, q_block, tile_rows, batch_invariant)
    num_pages = md.page_table.shape[1]
    ppi = pages_per_iteration(pages_per_iter, num_pages, block_size, head_dim,
                              jnp.dtype(k_segs[0].dtype).itemsize)
    (tile_seq, tile_q_start, first_page, end_page, token_tile,
     token_row) = _tile_plan(md, num_tokens, q_block, block_size, sliding_window, max_q_len)
    num_tiles = tile_seq.shape[0]
    num_chunks = -(-num_pages // ppi)
    splits = context_splits(num_tiles, kv_heads, num_chunks, programs, batch_invariant,
                            invariant_splits)
    chunk_lo, chunk_hi = _split_plan(first_page, end_page, ppi, num_chunks, splits,
                                     batch_invariant)
    # whole chunks of the page table are read; the padding pages are masked
    page_table = jnp.pad(md.page_table.astype(jnp.int32),
                         ((0, 0), (0, num_chunks * ppi - num_pages)))

    # q -> [kv_heads, T * group + rows, D], rows token-major within each kv head, so a tile is
    # one contiguous slice; the extra rows keep the last tile's slice in bounds.
    qg = q.reshape(num_tokens, kv_heads, group, head_dim).transpose(1, 0, 2, 3)
    qg = jnp.pad(qg.reshape(kv_heads, num_tokens * group, head_dim), ((0, 0), (0, rows), (0, 0)))
    row_pos = jnp.pad(jnp.repeat(md.positions.astype(jnp.int32), group), (0, rows))
    layer_arr = jnp.asarray(layer, jnp.int32).reshape(1)

    kernel = functools.partial(_rpa_kernel, rows=rows, group=group, pages_per_iter=ppi,
                               block_size=block_size, sliding_window=sliding_window,
                               sm_scale=float(sm_scale), num_segments=len(k_segs),
                               split=splits > 1)
    grid = (num_tiles, kv_heads, splits)
    if splits == 1:
        out_specs = pl.BlockSpec((None, None, None, rows, head_dim),
                                 lambda t, h, s: (t, h, s, 0, 0))
        out_shape = jax.ShapeDtypeStruct((num_tiles, kv_heads, 1, rows, head_dim), q.dtype)
    else:
        state = (num_tiles, kv_heads, splits, rows)
        out_specs = [pl.BlockSpec((None, None, None, rows, head_dim),
                                  lambda t, h, s: (t, h, s, 0, 0)),
                     pl.BlockSpec((None, None, None, rows), lambda t, h, s: (t, h, s, 0)),
                     pl.BlockSpec((None, None, None, rows), lambda t, h, s: (t, h, s, 0))]
        out_shape = [jax.ShapeDtypeStruct(state + (head_dim,), jnp.float32),
                     jax.ShapeDtypeStruct(state, jnp.float32),
                     jax.ShapeDtypeStruct(state, jnp.float32)]
    out = pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=[pl.no_block_spec] * (10 + 2 * len(k_segs)),
        out_specs=out_specs,
        out_shape=out_shape,
        interpret=interpret,
        compiler_params=compiler_params,
        name="ragged_paged_attention",
    )(tile_seq, tile_q_start, first_page, end_page, chunk_lo, chunk_hi, page_table, layer_arr,
      row_pos, qg, *k_segs, *v_segs)
    # tiles -> tokens: token t is rows token_row[t] * group + (0..group-1) of tile token_tile[t]
    sel_tile = token_tile[:, None]
    sel_row = token_row[:, None] * group + jnp.arange(group, dtype=jnp.int32)[None, :]
    if splits == 1:
        res = out[sel_tile, :, 0, sel_row]  # [T, group, kv_heads, D]
    else:
        acc, m, l = (a[sel_tile, :, :, sel_row] for a in out)  # [T, group, kv_heads, splits..]
        live = (chunk_lo < chunk_hi)[token_tile][:, None, None, :]
        res = _combine(acc, m, l, live).astype(q.dtype)
    return res.transpose(0, 2, 1, 3).reshape(num_tokens, num_heads, head_dim)
