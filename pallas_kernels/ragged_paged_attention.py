"""Ragged paged attention: the one attention signature every model layer calls.

A step's tokens are a flat ragged batch: sequence ``s`` owns tokens ``cu_q_lens[s]:cu_q_lens[s+1]``
(a prefill chunk, one decode token or a γ+1-token verification window, all alike). Their K/V have
already been written into the paged pool, so every query attends to keys read from the pool
through its sequence's page table, causally by absolute position: key position ``kp`` is
visible to a query at position ``qp`` iff ``kp <= qp`` (and ``kp > qp - window`` with a sliding
window). Stale K/V left behind a rolled-back sequence sits at positions above every live query and
is masked by the same rule, which is why rollback needs no data movement.

This module holds the metadata pytree and the pure-jnp reference. The reference walks the keys in
chunks of pages with an online softmax (flash-attention style), so memory stays bounded by
``tokens x chunk`` however long the contexts are, and the loop stops at the longest live context
rather than at the page-table width.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.pytree import array_dataclass

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
) -> jax.Array:
    """Pure-jnp reference.

    q:       [T, num_heads, head_dim]
    k_pool:  [layers, num_blocks, block_size, kv_heads, head_dim] (v_pool alike)
    layer:   which layer of the stacked pools to read
    returns  [T, num_heads, head_dim] in q's dtype.
    """
    num_tokens, num_heads, head_dim = q.shape
    block_size, kv_heads = k_pool.shape[2], k_pool.shape[3]
    group = num_heads // kv_heads
    num_seqs, num_pages = md.page_table.shape
    if chunk_pages is None:
        chunk_pages = max(1, 256 // block_size)
    chunk_pages = min(chunk_pages, num_pages)
    page_table = md.page_table
    pad = (-num_pages) % chunk_pages
    if pad:
        page_table = jnp.pad(page_table, ((0, 0), (0, pad)))
    chunk = chunk_pages * block_size

    token_seq = token_sequence_ids(md.cu_q_lens, num_tokens)
    q_pos = md.positions
    qf = q.reshape(num_tokens, kv_heads, group, head_dim).astype(jnp.float32) * sm_scale
    k_layer = k_pool[layer]
    v_layer = v_pool[layer]

    def body(c, carry):
        m, l, acc = carry
        pages = jax.lax.dynamic_slice_in_dim(page_table, c * chunk_pages, chunk_pages, axis=1)
        tok_pages = pages[token_seq]  # [T, chunk_pages]
        k = k_layer[tok_pages].reshape(num_tokens, chunk, kv_heads, head_dim)
        v = v_layer[tok_pages].reshape(num_tokens, chunk, kv_heads, head_dim)
        k_pos = c * chunk + jnp.arange(chunk, dtype=q_pos.dtype)
        mask = k_pos[None, :] <= q_pos[:, None]
        if sliding_window is not None:
            mask &= k_pos[None, :] > q_pos[:, None] - sliding_window
        s = jnp.einsum("tkgd,tckd->tkgc", qf, k.astype(jnp.float32))
        s = jnp.where(mask[:, None, None, :], s, _MASKED)
        m_new = jnp.maximum(m, s.max(axis=-1))
        p = jnp.where(mask[:, None, None, :], jnp.exp(s - m_new[..., None]), 0.0)
        corr = jnp.exp(m - m_new)
        l = l * corr + p.sum(axis=-1)
        acc = acc * corr[..., None] + jnp.einsum("tkgc,tckd->tkgd", p, v.astype(jnp.float32))
        return m_new, l, acc

    # Padding sequences have kv_len 0, so the loop ends at the longest live context.
    max_kv = jnp.max(md.kv_lens)
    num_chunks = jnp.minimum((max_kv + chunk - 1) // chunk, page_table.shape[1] // chunk_pages)
    init = (
        jnp.full((num_tokens, kv_heads, group), _MASKED, jnp.float32),
        jnp.zeros((num_tokens, kv_heads, group), jnp.float32),
        jnp.zeros((num_tokens, kv_heads, group, head_dim), jnp.float32),
    )
    if page_table.shape[1] == chunk_pages:  # one chunk covers every context: no loop to compile
        _, l, acc = body(0, init)
    else:
        _, l, acc = jax.lax.fori_loop(0, num_chunks, body, init)
    out = acc / jnp.maximum(l, 1e-30)[..., None]
    return out.reshape(num_tokens, num_heads, head_dim).astype(q.dtype)
