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
batch of T tokens over S sequences has at most ``ceil(T / q_block) + S`` tiles, and the grid is
(that bound, kv_heads). A grid step takes one tile and one kv head; its rows are the tile's tokens
times the query heads of that kv head (GQA: the K/V page is read once for the whole group), and
it loops over the sequence's pages *inside* the kernel (a ``fori_loop`` from the first page a
sliding window can see to the page holding the tile's last position), with an online softmax in
float32. Tiles past the batch's last one find zero pages and write zeros nobody reads. Each grid
step writes its own output tile, so no two steps ever write the same memory; the wrapper gathers
the tiles back into token order. Prefill chunks, 1-token decode and γ+1-token verification are
all just tiles, which is what lets one launch serve the mixed batches speculative decoding makes.
Causality is by absolute position, exactly as in the reference.

Why loop over pages inside the kernel rather than one grid step per page: on a GPU a grid step
per (tile, page) would need a cross-step reduction of the softmax state; and Pallas interpret mode
(the CPU test path) pays per grid step, so a page grid would make the tests slow.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jspec.kernels import segments as seg
from jspec.kernels.batch_invariance import min_q_block
from jspec.kernels.pytree import array_dataclass

_MASKED = -1e30  # finite, so fully masked chunks never produce inf - inf


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
        s = jnp.einsum("tkgd,tckd->tkgc", qf, k.astype(jnp.float32))
        return _softmax_step(carry, s, mask, lambda p: jnp.einsum(
            "tkgc,tckd->tkgd", p, v.astype(jnp.float32)))

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


def _softmax_step(carry, s: jax.Array, mask: jax.Array, pv):
    """One chunk of the online softmax: scores ``s`` [..., C] under ``mask``; ``pv(p)`` is the
    chunk's probabilities times its values."""
    m, l, acc = carry
    s = jnp.where(mask, s, _MASKED)
    m_new = jnp.maximum(m, s.max(axis=-1))
    p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)
    corr = jnp.exp(m - m_new)
    return m_new, l * corr + p.sum(axis=-1), acc * corr[..., None] + pv(p)


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
    elif q_block <= 1:
        return ragged_paged_attention_reference(q, k_pool, v_pool, layer, md, sm_scale=sm_scale,
                                                sliding_window=sliding_window,
                                                chunk_pages=chunk_pages)
    # 128-token chunks: a tile's scores then stay small enough for the cache (B = 32, γ = 4
    # verify forward 15% faster on CPU than with 256, prefill chunks 3-9%; 64 was slower)
    page_table, chunk_pages, chunk = _page_chunks(md.page_table, block_size, chunk_pages, 128)
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
    qf = (q.astype(jnp.float32)[q_idx] * sm_scale).astype(dtype)  # [tiles, qb, H, D]
    qf = qf.reshape(num_tiles, q_block, kv_heads, group, head_dim)
    tile_pages = page_table[tile_seq]  # [tiles, padded pages]

    def body(c, carry):
        pages = jax.lax.dynamic_slice_in_dim(tile_pages, c * chunk_pages, chunk_pages, axis=1)
        # indexed by (layer, page) at once: no copy of the layer (see the reference)
        k = seg.read_blocks(k_pool, pages, layer).reshape(num_tiles, chunk, kv_heads, head_dim)
        v = seg.read_blocks(v_pool, pages, layer).reshape(num_tiles, chunk, kv_heads, head_dim)
        mask = _causal_mask(c * chunk + jnp.arange(chunk, dtype=jnp.int32), q_pos,
                            sliding_window)[:, :, None, None, :]  # [tiles, qb, 1, 1, chunk]
        s = jnp.einsum("nqkgd,nckd->nqkgc", qf, k, preferred_element_type=jnp.float32)
        return _softmax_step(carry, s, mask, lambda p: jnp.einsum(
            "nqkgc,nckd->nqkgd", p.astype(dtype), v, preferred_element_type=jnp.float32))

    out = _over_chunks(body, md, page_table, chunk_pages, chunk,
                       (num_tiles, q_block, kv_heads, group), head_dim)
    out = out[token_tile, token_row]  # back to token order: [T, kvh, g, D]
    return out.reshape(num_tokens, num_heads, head_dim).astype(q.dtype)


# ----------------------------------------------------------------------------- Pallas kernel
def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def default_q_block(group: int, rows: int = 32) -> int:
    """Tokens per query tile: enough that a tile has ``rows`` (query token, head) rows, since GPU
    matrix units want at least 16 rows per dot."""
    return max(1, rows // _next_pow2(group))


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


def _load_page(refs, layer, block, head):
    """One page of one kv head, [block_size, D], from the pool segment that holds ``block``
    (``jspec.kernels.segments``): a branch per page, so an expanded pool reads each page once."""
    if len(refs) == 1:
        return refs[0][layer, block, :, head, :]
    base, ext = refs
    n = base.shape[1]
    return jax.lax.cond(block < n, lambda: base[layer, block, :, head, :],
                        lambda: ext[layer, block - n, :, head, :])


def _rpa_kernel(tile_seq_ref, tile_q_start_ref, first_page_ref, end_page_ref, page_table_ref,
                layer_ref, row_pos_ref, q_ref, *refs, q_block: int, group: int,
                block_size: int, sliding_window: int | None, sm_scale: float,
                num_segments: int):
    """One (query tile, kv head): rows are (token, query head of the group), token-major.
    ``refs`` are the K segments, the V segments and the output."""
    k_refs, v_refs = refs[:num_segments], refs[num_segments:2 * num_segments]
    o_ref = refs[-1]
    tile = pl.program_id(0)
    head = pl.program_id(1)
    rows = q_block * group
    seq = tile_seq_ref[tile]
    start = tile_q_start_ref[tile] * group
    # dots take the storage dtype and accumulate in f32 (tensor cores on GPU); softmax is f32
    q = (q_ref[head, pl.ds(start, rows), :].astype(jnp.float32) * sm_scale).astype(q_ref.dtype)
    q_pos = row_pos_ref[pl.ds(start, rows)]  # [rows]
    layer = layer_ref[0]

    def body(page, carry):
        m, l, acc = carry
        block = page_table_ref[seq, page]
        k = _load_page(k_refs, layer, block, head).astype(q.dtype)  # [block_size, D]
        v = _load_page(v_refs, layer, block, head)
        s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())),
                                preferred_element_type=jnp.float32)  # [rows, block_size]
        k_pos = page * block_size + jax.lax.broadcasted_iota(jnp.int32, (rows, block_size), 1)
        mask = k_pos <= q_pos[:, None]
        if sliding_window is not None:
            mask = mask & (k_pos > q_pos[:, None] - sliding_window)
        s = jnp.where(mask, s, _MASKED)
        m_new = jnp.maximum(m, s.max(axis=1))
        p = jnp.where(mask, jnp.exp(s - m_new[:, None]), 0.0)
        corr = jnp.exp(m - m_new)
        l = l * corr + p.sum(axis=1)
        acc = acc * corr[:, None] + jnp.dot(p.astype(v.dtype), v,
                                             preferred_element_type=jnp.float32)
        return m_new, l, acc

    head_dim = q_ref.shape[-1]
    init = (jnp.full((rows,), _MASKED, jnp.float32), jnp.zeros((rows,), jnp.float32),
            jnp.zeros((rows, head_dim), jnp.float32))
    _, l, acc = jax.lax.fori_loop(first_page_ref[tile], end_page_ref[tile], body, init)
    o_ref[...] = (acc / jnp.maximum(l, 1e-30)[:, None]).astype(o_ref.dtype)


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
    interpret: bool = False,
    compiler_params=None,
) -> jax.Array:
    """The Pallas kernel; same arguments and result as ``ragged_paged_attention_reference``.

    ``q_block``: tokens per query tile (default ``default_q_block``). ``max_q_len``: a static
    bound on every sequence's new tokens, which the caller guarantees; it shrinks the grid to
    ``S * ceil(max_q_len / q_block)`` tiles when that is fewer (``_tile_plan``). ``interpret``
    runs the kernel through Pallas' interpreter (any backend, CPU included; that is how the
    tests run it).
    Query heads per kv head are padded to a power of two (GPU block shapes must be); the padding
    rows compute nothing anyone reads.
    """
    num_tokens, num_heads, head_dim = q.shape
    k_segs, v_segs = seg.segments(k_pool), seg.segments(v_pool)
    if len(k_segs) > 2:
        raise ValueError(f"the kernel reads a pool of one or two segments, not {len(k_segs)}")
    block_size, kv_heads = k_segs[0].shape[2:4]
    if num_heads % kv_heads:
        raise ValueError(f"{num_heads} query heads are not a multiple of {kv_heads} kv heads")
    group = num_heads // kv_heads
    gp = _next_pow2(group)
    q_block = q_block or default_q_block(group)
    rows = q_block * gp
    (tile_seq, tile_q_start, first_page, end_page, token_tile,
     token_row) = _tile_plan(md, num_tokens, q_block, block_size, sliding_window, max_q_len)
    num_tiles = tile_seq.shape[0]

    # q -> [kv_heads, (T + q_block) * gp, D], rows token-major within each kv head, so a tile is
    # one contiguous slice; the extra q_block tokens keep the last tile's slice in bounds.
    qg = q.reshape(num_tokens, kv_heads, group, head_dim)
    qg = jnp.pad(qg, ((0, q_block), (0, 0), (0, gp - group), (0, 0)))
    qg = qg.transpose(1, 0, 2, 3).reshape(kv_heads, (num_tokens + q_block) * gp, head_dim)
    row_pos = jnp.repeat(jnp.pad(md.positions.astype(jnp.int32), (0, q_block)), gp)
    layer_arr = jnp.asarray(layer, jnp.int32).reshape(1)

    kernel = functools.partial(_rpa_kernel, q_block=q_block, group=gp, block_size=block_size,
                               sliding_window=sliding_window, sm_scale=float(sm_scale),
                               num_segments=len(k_segs))
    out = pl.pallas_call(
        kernel,
        grid=(num_tiles, kv_heads),
        in_specs=[pl.no_block_spec] * (8 + 2 * len(k_segs)),
        out_specs=pl.BlockSpec((None, None, rows, head_dim), lambda t, h: (t, h, 0, 0)),
        out_shape=jax.ShapeDtypeStruct((num_tiles, kv_heads, rows, head_dim), q.dtype),
        interpret=interpret,
        compiler_params=compiler_params,
        name="ragged_paged_attention",
    )(tile_seq, tile_q_start, first_page, end_page, md.page_table.astype(jnp.int32), layer_arr,
      row_pos, qg, *k_segs, *v_segs)
    # tiles -> tokens: token t is row token_row[t] of tile token_tile[t]
    out = out.reshape(num_tiles, kv_heads, q_block, gp, head_dim)
    out = out[token_tile, :, token_row, :group, :]  # [T, kv_heads, group, D]
    return out.reshape(num_tokens, num_heads, head_dim)
