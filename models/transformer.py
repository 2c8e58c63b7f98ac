"""The decoder forward pass over a ragged flat token batch and a paged KV pool.

One pure function serves prefill chunks, single-token decode and multi-token verification: the
batch says how many new tokens each sequence brings (``cu_q_lens``), their positions, and which
rows to return logits for (``logits_indices``). New K/V are written into the pool at the slots
their positions map to through the page table, then attention reads everything from the pool.
Padding tokens (past ``cu_q_lens[-1]``) write into the reserved null block 0, which no sequence
ever owns.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jspec.models import sharding
from jspec.models.config import ModelConfig
from jspec.kernels import segments
from jspec.kernels.batch_invariance import pad_rows, row_sum
from jspec.kernels.precision import dot_precision
from jspec.kernels.pytree import array_dataclass
from jspec.kernels.ragged_paged_attention import (
    AttentionMetadata,
    ragged_paged_attention_tiled,
    token_sequence_ids,
)

AttentionFn = Callable[..., jax.Array]


@array_dataclass
class KVCache:
    """A model's paged KV pool: k and v are [layers, num_blocks, block_size, kv_heads, head_dim],
    or tuples of such segments whose blocks number on (``jspec.kernels.segments``: the target's
    pool while elastic memory has it expanded). ``h`` [num_blocks, block_size, width]: where an
    EAGLE head drafts, the target's hidden states that the head reads (``forward``'s
    ``aux_layers``) over the same block ids; None otherwise."""

    k: segments.Pool
    v: segments.Pool
    h: jax.Array | None = None

    @property
    def num_blocks(self) -> int:
        return segments.num_blocks(self.k)

    @property
    def block_size(self) -> int:
        return segments.segments(self.k)[0].shape[2]

    @property
    def num_segments(self) -> int:
        return len(segments.segments(self.k))

    @classmethod
    def create(cls, cfg: ModelConfig, num_blocks: int, block_size: int, dtype,
               device=None, hidden_width: int = 0) -> "KVCache":
        """An empty pool; ``device``: where it lives (a ``NamedSharding`` on a tensor-parallel
        mesh creates each device's share in place, nothing passes through one device);
        ``hidden_width``: the width of ``h`` (0: none)."""
        shape = (cfg.num_layers, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        h = (jnp.zeros((num_blocks, block_size, hidden_width), dtype, device=device)
             if hidden_width else None)
        return cls(jnp.zeros(shape, dtype, device=device), jnp.zeros(shape, dtype, device=device),
                   h)

    @staticmethod
    def bytes_per_block(cfg: ModelConfig, block_size: int, dtype, hidden_width: int = 0) -> int:
        return ((2 * cfg.num_layers * cfg.kv_size + hidden_width) * block_size
                * jnp.dtype(dtype).itemsize)


@array_dataclass
class ModelInput:
    """input_ids [T]; attention metadata; logits_indices [R] (flat token rows to score)."""

    input_ids: jax.Array
    attn: AttentionMetadata
    logits_indices: jax.Array


# ----------------------------------------------------------------------------- building blocks
def rms_norm(x: jax.Array, weight: jax.Array, eps: float, invariant: bool = False) -> jax.Array:
    """RMSNorm in float32. ``invariant``: the mean of squares summed in an order that does not
    depend on the number of rows (``jspec.kernels.batch_invariance.row_sum``)."""
    xf = x.astype(jnp.float32)
    if invariant:
        mean_sq = (row_sum(xf * xf) / xf.shape[-1])[..., None]
    else:
        mean_sq = jnp.mean(xf * xf, axis=-1, keepdims=True)
    xf = xf * jax.lax.rsqrt(mean_sq + eps)
    return (xf * weight.astype(jnp.float32)).astype(x.dtype)


def rope_inv_freq(cfg: ModelConfig) -> np.ndarray:
    """Inverse frequencies in float32, computed the way the reference implementation does."""
    dim = cfg.head_dim
    exponent = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)
    inv_freq = (np.float32(1.0) / (np.float32(cfg.rope_theta) ** exponent)).astype(np.float32)
    scaling = cfg.rope_scaling_dict
    rope_type = scaling.get("rope_type", "default")
    if rope_type == "linear":
        inv_freq = inv_freq / np.float32(scaling["factor"])
    elif rope_type == "llama3":
        factor = float(scaling["factor"])
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        old_len = float(scaling["original_max_position_embeddings"])
        low_wavelen = old_len / low
        high_wavelen = old_len / high
        wavelen = 2 * np.pi / inv_freq
        scaled = np.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv_freq = np.where(medium, smoothed, scaled).astype(np.float32)
    return inv_freq


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate-half RoPE. x [T, heads, D]; cos/sin [T, D/2] float32."""
    half = x.shape[-1] // 2
    xf = x.astype(jnp.float32)
    x1, x2 = xf[..., :half], xf[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).astype(x.dtype)


def rope_tables(positions: jax.Array, cfg: ModelConfig) -> tuple[jax.Array, jax.Array]:
    angles = positions.astype(jnp.float32)[:, None] * jnp.asarray(rope_inv_freq(cfg))[None, :]
    return jnp.cos(angles), jnp.sin(angles)


def project(x: jax.Array, w: jax.Array, layout: str, min_rows: int = 1) -> jax.Array:
    """``x @ W`` in float32 for a weight laid out as ``layout`` says (``ModelConfig.weight_layout``,
    models/params.py): ``[in, out]``, or ``[out, in]`` contracted on its last axis. ``x``'s rows
    (its leading axis) are zero-padded to ``min_rows`` for the product (``ModelConfig.
    min_dot_rows``) and the padding's rows dropped from the result."""
    contract = 0 if layout == "in_out" else 1
    rows = x.shape[0]
    padded = jnp.pad(x, [(0, min_rows - rows)] + [(0, 0)] * (x.ndim - 1)) if rows < min_rows \
        else x
    y = jax.lax.dot_general(padded, w, (((x.ndim - 1,), (contract,)), ((), ())),
                            precision=dot_precision(x.dtype),
                            preferred_element_type=jnp.float32)
    return y[:rows] if rows < min_rows else y


def decoder_layer(lp: dict, x: jax.Array, cos: jax.Array, sin: jax.Array, attend, *,
                  cfg: ModelConfig, reduce=None, invariant: bool = False) -> jax.Array:
    """One pre-norm decoder layer over flat tokens x [T, hidden].

    ``attend(q, k, v) -> [T, heads, head_dim]`` receives the rotated projections and decides
    where keys come from: the paged pool (serving) or the tokens themselves (dense, training).
    ``reduce`` sums the row-parallel projections' partial products across a tensor-parallel
    mesh (float32, before the bias); None on one device. ``invariant``: batch-invariant norms
    (``rms_norm``).
    """
    num_tokens = x.shape[0]
    dtype = x.dtype
    q_size, kv_size = cfg.q_size, cfg.kv_size
    h = rms_norm(x, lp["attn_norm"], cfg.rms_norm_eps, invariant)
    qkv = project(h, lp["wqkv"], cfg.weight_layout, cfg.min_dot_rows)
    if cfg.qkv_bias:
        qkv = qkv + lp["bqkv"].astype(jnp.float32)
    qkv = qkv.astype(dtype)
    q = qkv[:, :q_size].reshape(num_tokens, cfg.num_heads, cfg.head_dim)
    k = qkv[:, q_size:q_size + kv_size].reshape(num_tokens, cfg.num_kv_heads, cfg.head_dim)
    v = qkv[:, q_size + kv_size:].reshape(num_tokens, cfg.num_kv_heads, cfg.head_dim)
    attn = attend(apply_rope(q, cos, sin), apply_rope(k, cos, sin), v)
    o = project(attn.reshape(num_tokens, q_size), lp["wo"], cfg.weight_layout,
                cfg.min_dot_rows)
    if reduce is not None:
        o = reduce(o)
    if cfg.o_bias:
        o = o + lp["bo"].astype(jnp.float32)
    x = x + o.astype(dtype)
    h = rms_norm(x, lp["mlp_norm"], cfg.rms_norm_eps, invariant)
    gate_up = project(h, lp["w_gate_up"], cfg.weight_layout, cfg.min_dot_rows)
    gate, up = jnp.split(gate_up, 2, axis=-1)
    down = project((jax.nn.silu(gate) * up).astype(dtype), lp["w_down"], cfg.weight_layout,
                   cfg.min_dot_rows)
    if reduce is not None:
        down = reduce(down)
    return x + down.astype(dtype)


def lm_head(params: dict, hidden: jax.Array, cfg: ModelConfig, invariant: bool = False
            ) -> tuple[jax.Array, jax.Array]:
    """Final norm and output projection: (logits float32, normed hidden)."""
    hidden = rms_norm(hidden, params["final_norm"], cfg.rms_norm_eps, invariant)
    logits = project(hidden, params["lm_head"], cfg.weight_layout, cfg.min_dot_rows)
    return logits, hidden


# ----------------------------------------------------------------------------- forward
def forward(
    params: dict,
    kv: KVCache,
    batch: ModelInput,
    *,
    cfg: ModelConfig,
    attention_fn: AttentionFn = ragged_paged_attention_tiled,
    return_hidden: bool = False,
    mesh: Mesh | None = None,
    batch_invariant: bool = False,
    aux_layers: tuple[int, ...] = (),
):
    """Returns (logits [R, vocab] float32, updated kv). Pure; jit with ``kv`` donated.

    ``aux_layers``: write the residual stream entering these layers, concatenated, into the
    pool's ``h`` at every token's slot (what an EAGLE-3 head drafts from; ``models/eagle.py``).

    ``batch_invariant``: a token's logits do not depend on the rest of the batch (every dot
    runs over at least ``MIN_DOT_ROWS`` rows: ``jspec.kernels.batch_invariance``); pass an
    attention function made batch-invariant too.

    With ``return_hidden`` the final-norm hidden states at the logits rows are returned too
    (training and distillation use them). With a ``mesh`` the params and the pool are sharded
    by jspec.models.sharding's rules and every device runs this same forward on its own heads
    (``shard_map``): attention without communication, two all-reduces per layer, the logits
    gathered over the vocabulary; everything returned but the pool is replicated.
    """
    if (kv.h is None) != (not aux_layers):
        raise ValueError("a pool with hidden states needs the layers to capture, and only it")
    if mesh is None:
        return _forward(params, kv, batch, cfg=cfg, attention_fn=attention_fn,
                        return_hidden=return_hidden, batch_invariant=batch_invariant,
                        aux_layers=aux_layers)
    if aux_layers:
        raise ValueError("capturing hidden states for an EAGLE head is not built for a "
                         "tensor-parallel target")
    tp = mesh.size
    body = functools.partial(_forward, cfg=sharding.local_config(cfg, tp),
                             attention_fn=attention_fn, return_hidden=return_hidden,
                             axis=sharding.AXIS, batch_invariant=batch_invariant)
    kv_specs = KVCache(sharding.KV_SPEC, sharding.KV_SPEC)
    rep = sharding.REPLICATED
    out_specs = (rep, kv_specs, rep) if return_hidden else (rep, kv_specs)
    # check_vma off: JAX cannot infer that all-gathered logits are the same on every device
    # (jax 0.10 has no invariant all-gather); every output here is replicated by construction
    # (all-reduced or gathered) or sharded as declared
    return jax.shard_map(body, mesh=mesh,
                         in_specs=(sharding.param_specs(cfg, tp), kv_specs, rep),
                         out_specs=out_specs, check_vma=False)(params, kv, batch)


def over_layers(layer, carry, layers, cfg: ModelConfig):
    """``layer(carry, (layer_params, index)) -> (carry, y)`` over the model's layers, as
    ``jax.lax.scan`` returns it (the ys stacked, or None). Stacked weights run as a scan (one
    compiled layer body); per-layer buffers (``cfg.layer_buffers``, models/params.py) run
    unrolled with a static index, each layer reading its own weights where they lie, where the
    scan copies each layer's slice out of the stacked arrays first."""
    if cfg.layer_buffers == "stacked":
        return jax.lax.scan(layer, carry, (layers, jnp.arange(cfg.num_layers, dtype=jnp.int32)))
    ys = []
    for i, lp in enumerate(layers):
        carry, y = layer(carry, (lp, i))
        ys.append(y)
    return carry, None if ys[0] is None else jnp.stack(ys)


def token_slots(md: AttentionMetadata, num_tokens: int, block_size: int
                ) -> tuple[jax.Array, jax.Array]:
    """(block, offset) [T] of every flat token's position in a paged pool, through the page
    table; padding tokens (past ``cu_q_lens[-1]``) go to the null block."""
    token_idx = jnp.arange(num_tokens, dtype=jnp.int32)
    valid = token_idx < md.cu_q_lens[-1]
    token_seq = token_sequence_ids(md.cu_q_lens, num_tokens)
    page = jnp.clip(md.positions // block_size, 0, md.page_table.shape[1] - 1)
    blocks = jnp.where(valid, md.page_table[token_seq, page], 0)
    offsets = jnp.where(valid, md.positions % block_size, token_idx % block_size)
    return blocks, offsets


def _embed(params: dict, ids: jax.Array, axis: str | None) -> jax.Array:
    table = params["embed"]
    if axis is None:
        return table[ids].astype(table.dtype)
    # this device's rows of the vocabulary-sharded table; the others add zeros
    rows = table.shape[0]
    local = ids - jax.lax.axis_index(axis) * rows
    mine = (local >= 0) & (local < rows)
    x = jnp.where(mine[:, None], table[jnp.clip(local, 0, rows - 1)], 0).astype(table.dtype)
    return jax.lax.psum(x, axis)


def _forward(params: dict, kv: KVCache, batch: ModelInput, *, cfg: ModelConfig,
             attention_fn: AttentionFn, return_hidden: bool, axis: str | None = None,
             batch_invariant: bool = False, aux_layers: tuple[int, ...] = ()):
    """``forward`` on one device; under ``shard_map`` (``axis`` named) on this device's share:
    ``cfg`` is then jspec.models.sharding.local_config's, the params and pool are local slices."""
    num_rows = batch.logits_indices.shape[0]
    md = batch.attn
    if batch_invariant:  # padding tokens sit past cu_q_lens[-1]: they write to the null block
        md = AttentionMetadata(pad_rows(md.positions), md.cu_q_lens, md.kv_lens, md.page_table)
        batch = ModelInput(pad_rows(batch.input_ids), md, pad_rows(batch.logits_indices))
    num_tokens = batch.input_ids.shape[0]
    block_size = kv.block_size
    vocab_split = axis is not None and params["lm_head"].shape[1] < cfg.vocab_size
    x = _embed(params, batch.input_ids, axis if vocab_split else None)
    cos, sin = rope_tables(md.positions, cfg)

    blocks, offsets = token_slots(md, num_tokens, block_size)
    sm_scale = cfg.head_dim ** -0.5
    reduce = None if axis is None else functools.partial(jax.lax.psum, axis_name=axis)

    aux_ids = jnp.asarray(aux_layers, jnp.int32)

    def layer(carry, xs):
        x, k_pool, v_pool, aux = carry
        lp, i = xs
        if aux_layers:  # keep the residual stream entering each captured layer
            aux = jnp.where((aux_ids == i)[:, None, None], x[None], aux)

        def attend(q, k, v):
            # write this layer's new K/V first, then attend over everything in the pool
            nonlocal k_pool, v_pool
            k_pool = segments.write_slots(k_pool, i, blocks, offsets, k)
            v_pool = segments.write_slots(v_pool, i, blocks, offsets, v)
            return attention_fn(q, k_pool, v_pool, i, md, sm_scale=sm_scale,
                                sliding_window=cfg.sliding_window)

        x = decoder_layer(lp, x, cos, sin, attend, cfg=cfg, reduce=reduce,
                          invariant=batch_invariant)
        return (x, k_pool, v_pool, aux), None

    aux = jnp.zeros((len(aux_layers), num_tokens, x.shape[-1]), x.dtype)
    (x, k_pool, v_pool, aux), _ = over_layers(layer, (x, kv.k, kv.v, aux), params["layers"], cfg)
    h_pool = kv.h
    if aux_layers:
        captured = jnp.transpose(aux, (1, 0, 2)).reshape(num_tokens, -1)
        h_pool = h_pool.at[blocks, offsets].set(captured.astype(h_pool.dtype))
    logits, hidden = lm_head(params, x[batch.logits_indices], cfg, batch_invariant)
    logits, hidden = logits[:num_rows], hidden[:num_rows]
    if vocab_split:
        logits = jax.lax.all_gather(logits, axis, axis=1, tiled=True)
    new_kv = KVCache(k_pool, v_pool, h_pool)
    if return_hidden:
        return logits, new_kv, hidden
    return logits, new_kv


def dense_attention(q: jax.Array, k: jax.Array, v: jax.Array, cfg: ModelConfig) -> jax.Array:
    """Causal attention of one sequence over itself (positions 0..T-1), float32 softmax."""
    num_tokens = q.shape[0]
    group = cfg.num_heads // cfg.num_kv_heads
    pos = jnp.arange(num_tokens)
    mask = pos[None, :] <= pos[:, None]
    if cfg.sliding_window is not None:
        mask &= pos[None, :] > pos[:, None] - cfg.sliding_window
    k = jnp.repeat(k.astype(jnp.float32), group, axis=1)
    v = jnp.repeat(v.astype(jnp.float32), group, axis=1)
    highest = dot_precision(jnp.float32)  # float32 operands: IEEE on a GPU too
    s = jnp.einsum("qhd,khd->hqk", q.astype(jnp.float32), k,
                   precision=highest) * cfg.head_dim ** -0.5
    p = jax.nn.softmax(jnp.where(mask[None], s, -jnp.inf), axis=-1)
    return jnp.einsum("hqk,khd->qhd", p, v, precision=highest).astype(q.dtype)


def dense_forward(params: dict, tokens: jax.Array, *, cfg: ModelConfig,
                  return_hidden: bool = False, aux_layers: tuple[int, ...] = ()):
    """Plain causal forward of one sequence [T] -> logits [T, vocab]; the test oracle and the
    training forward. No KV cache, no paging; the same layer code as the paged forward.

    ``aux_layers``: also return the residual stream entering these layers, concatenated
    [T, len * hidden] (an EAGLE-3 head's input), after the logits (and hidden)."""
    x = params["embed"][tokens].astype(params["embed"].dtype)
    cos, sin = rope_tables(jnp.arange(tokens.shape[-1]), cfg)
    attend = lambda q, k, v: dense_attention(q, k, v, cfg)
    # each layer's input stacked [L, T, hidden] only when a head needs some of them
    x, inputs = over_layers(
        lambda x, xs: (decoder_layer(xs[0], x, cos, sin, attend, cfg=cfg),
                       x if aux_layers else None),
        x, params["layers"], cfg)
    logits, hidden = lm_head(params, x, cfg)
    out = (logits, hidden) if return_hidden else (logits,)
    if aux_layers:
        aux = jnp.concatenate([inputs[i] for i in aux_layers], axis=-1)
        out += (aux,)
    return out if len(out) > 1 else logits
