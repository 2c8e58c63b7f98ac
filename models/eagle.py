"""The EAGLE-3 draft head's forward (Li et al., "EAGLE-3: Scaling up Inference Acceleration of
Large Language Models via Training-Time Test", 2025, §3): one decoder layer that drafts from
the target's own hidden states.

A head position p takes two inputs: the embedding of token p + 1 and a hidden state for
position p, and predicts token p + 2. For positions the target has computed, the hidden state is
the target's: its residual stream entering three of its layers (low, middle, high:
``EagleConfig.aux_layers``), concatenated ([3·Ht]) and fused to the head's width by ``fc``. For a
drafted position it is the head's own output at the position before (its pre-norm hidden state,
[H]), which is how the head drafts several tokens. In the layer, the normed embedding and the
normed hidden state are concatenated ([2H]) before the q/k/v projections; the residual stream
starts from the (fused) hidden state. The output projection maps to a reduced draft vocabulary;
``d2t`` places each draft id in the target's vocabulary, and the target tokens outside it get
probability 0, so the draft distribution q is exact and the usual rejection rule stays lossless.

Serving runs the head paged, like every model here (``eagle_forward``): its one layer's K/V live
in a pool over the engine's block ids, and the target's captured hidden states live in a pool of
their own over the same ids (``KVCache.h``, written by the target's forward), read by position
through the page table. ``eagle_dense`` is the plain one-sequence oracle the tests compare with,
written from the formulas alone.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jspec.models.config import ModelConfig
from jspec.models.transformer import AttentionMetadata, KVCache, ModelInput, apply_rope, \
    dense_attention, rms_norm, rope_tables, token_slots
from jspec.kernels import segments
from jspec.kernels.precision import dot_precision


def _dot(x, w):
    return jnp.dot(x, w, precision=dot_precision(x.dtype), preferred_element_type=jnp.float32)


def activation_dtype(params: dict):
    """The dtype the head computes in: its norms' (its dot weights may be ``widened``)."""
    return params["final_norm"].dtype


# the weights the head multiplies by (the embedding is gathered, d2t is an index map)
_DOT_WEIGHTS = ("fc", "wqkv", "wo", "w_gate_up", "w_down", "lm_head")


def widened(params: dict) -> dict:
    """``params`` with the dot weights in float32. XLA:CPU multiplies one row by a bf16 weight
    by widening the weight to float32 first, at every use (``runner.widens_one_row_dots``): a
    one-row draft loop that widens them once per call, before its iterations, computes the
    same one-row products without widening the weights again in every iteration. (The first
    forward's several-token products, which XLA would run on the bf16 weights, then round as
    float32 ones: q is still exactly what the head computed, so verification stays lossless.)"""
    def widen(path, a):
        return a.astype(jnp.float32) if getattr(path[-1], "key", None) in _DOT_WEIGHTS else a

    return jax.tree_util.tree_map_with_path(widen, params)


def fuse_hidden(params: dict, hidden: jax.Array) -> jax.Array:
    """The target's captured hidden states [T, 3·Ht] fused to the head's width [T, H]."""
    dtype = activation_dtype(params)
    return _dot(hidden.astype(dtype), params["fc"]).astype(dtype)


def _attention_inputs(params: dict, emb: jax.Array, hidden: jax.Array, *, cfg: ModelConfig,
                      norm_before_residual: bool) -> tuple[jax.Array, jax.Array]:
    """The head's layer up to its q/k/v projections, over flat tokens: embeddings [T, H] and
    hidden states [T, H] -> (qkv [T, q + 2·kv], the residual stream [T, H])."""
    lp = params["layer"]
    normed = rms_norm(hidden, lp["hidden_norm"], cfg.rms_norm_eps)
    residual = normed if norm_before_residual else hidden
    x = jnp.concatenate([rms_norm(emb, lp["attn_norm"], cfg.rms_norm_eps), normed], axis=-1)
    return _dot(x, lp["wqkv"]).astype(emb.dtype), residual


def _split_heads(qkv: jax.Array, cfg: ModelConfig) -> tuple[jax.Array, jax.Array, jax.Array]:
    num_tokens, q_size, kv_size = qkv.shape[0], cfg.q_size, cfg.kv_size
    q = qkv[:, :q_size].reshape(num_tokens, cfg.num_heads, cfg.head_dim)
    k = qkv[:, q_size:q_size + kv_size].reshape(num_tokens, cfg.num_kv_heads, cfg.head_dim)
    v = qkv[:, q_size + kv_size:].reshape(num_tokens, cfg.num_kv_heads, cfg.head_dim)
    return q, k, v


def _after_attention(params: dict, attn: jax.Array, residual: jax.Array, cfg: ModelConfig
                     ) -> jax.Array:
    """The rest of the layer: attention output [T, heads, head_dim] and residual [T, H] -> the
    pre-norm output [T, H] (the hidden state the next drafted position takes)."""
    lp, dtype = params["layer"], residual.dtype
    attn = attn.reshape(attn.shape[0], cfg.q_size)
    residual = residual + _dot(attn, lp["wo"]).astype(dtype)
    h = rms_norm(residual, lp["mlp_norm"], cfg.rms_norm_eps)
    gate, up = jnp.split(_dot(h, lp["w_gate_up"]), 2, axis=-1)
    down = _dot((jax.nn.silu(gate) * up).astype(dtype), lp["w_down"])
    return residual + down.astype(dtype)


def _layer(params: dict, emb: jax.Array, hidden: jax.Array, cos, sin, attend, *,
           cfg: ModelConfig, norm_before_residual: bool) -> jax.Array:
    """The head's decoder layer over flat tokens: embeddings [T, H] and hidden states [T, H] ->
    the pre-norm output [T, H]; ``attend(q, k, v)`` over the rotated projections."""
    qkv, residual = _attention_inputs(params, emb, hidden, cfg=cfg,
                                      norm_before_residual=norm_before_residual)
    q, k, v = _split_heads(qkv, cfg)
    attn = attend(apply_rope(q, cos, sin), apply_rope(k, cos, sin), v)
    return _after_attention(params, attn, residual, cfg)


def head_logits(params: dict, prenorm: jax.Array, cfg: ModelConfig) -> jax.Array:
    """Final norm and the head's output projection: logits [R, draft vocabulary] (float32).
    Draft id d is target token ``to_target_ids(params, d)``."""
    h = rms_norm(prenorm, params["final_norm"], cfg.rms_norm_eps)
    return _dot(h, params["lm_head"])


def to_target_ids(params: dict, draft_ids: jax.Array) -> jax.Array:
    """Target token ids of draft ids (``d2t``; absent: the same ids)."""
    return draft_ids if "d2t" not in params else params["d2t"][draft_ids]


def to_target_vocab(params: dict, logits: jax.Array, target_vocab: int) -> jax.Array:
    """Logits [..., draft vocabulary] placed in the target's vocabulary [..., target_vocab],
    -inf where the draft vocabulary has no token (q = 0 there)."""
    if "d2t" not in params:  # the full vocabulary, in order
        return logits
    # a gather through the inverse map, not a scatter of the logits: XLA:CPU fused the
    # scatter with a bf16 dot into a kernel it cannot run (DotThunk: BF16 x BF16 = F32)
    d2t = params["d2t"]
    inverse = jnp.full((target_vocab,), -1, jnp.int32).at[d2t].set(
        jnp.arange(d2t.shape[0], dtype=jnp.int32))
    return jnp.where(inverse >= 0, logits[..., jnp.maximum(inverse, 0)], -jnp.inf)


def draft_logits(params: dict, prenorm: jax.Array, cfg: ModelConfig,
                 target_vocab: int) -> jax.Array:
    """Final norm, the draft-vocabulary head and ``d2t``: logits [R, target vocabulary]
    (float32), -inf where the draft vocabulary has no token."""
    return to_target_vocab(params, head_logits(params, prenorm, cfg), target_vocab)


def gather_hidden(h_pool: jax.Array, batch: ModelInput) -> jax.Array:
    """The target's captured hidden state at each token's position (the head's positions are
    the target's), read from ``h_pool`` [blocks, block_size, 3·Ht] through the page table;
    padding tokens read the null block."""
    blocks, offsets = token_slots(batch.attn, batch.input_ids.shape[0], h_pool.shape[1])
    return h_pool[blocks, offsets]


def eagle_forward(params: dict, kv: KVCache, hidden: jax.Array, batch: ModelInput, *,
                  cfg: ModelConfig, attention_fn, norm_before_residual: bool = False,
                  logits: bool = True):
    """The head over a ragged flat batch (``transformer.forward``'s conventions: new K/V
    written through the page table, then attention over the pool; padding tokens write to the
    null block). ``hidden`` [T, H]: each token's hidden state (fused target states, or the
    head's own). Returns (logits [R, draft vocabulary] float32: ``head_logits``, pre-norm hidden
    [R, H] at the logits rows, kv); with ``logits`` False only the K/V are written (a catch-up)
    and the first two are None.

    Logits row i must be the last new token of sequence i (every caller's layout). Only those
    rows go on past the K/V: with one layer, no other token's attention output or MLP is read
    by anything, so a first draft forward that takes a row's accepted tokens again pays for
    their projections alone."""
    md = batch.attn
    num_tokens = batch.input_ids.shape[0]
    emb = params["embed"][batch.input_ids].astype(activation_dtype(params))
    qkv, residual = _attention_inputs(params, emb, hidden.astype(emb.dtype), cfg=cfg,
                                      norm_before_residual=norm_before_residual)
    q, k, v = _split_heads(qkv, cfg)
    cos, sin = rope_tables(md.positions, cfg)
    blocks, offsets = token_slots(md, num_tokens, kv.block_size)
    k_pool = segments.write_slots(kv.k, 0, blocks, offsets, apply_rope(k, cos, sin))
    v_pool = segments.write_slots(kv.v, 0, blocks, offsets, v)
    new_kv = KVCache(k_pool, v_pool, kv.h)
    if not logits:
        return None, None, new_kv
    rows = batch.logits_indices
    num_rows = rows.shape[0]
    # each logits row attends as a one-token query of its sequence
    row_md = AttentionMetadata(md.positions[rows], jnp.arange(num_rows + 1, dtype=jnp.int32),
                               md.kv_lens, md.page_table)
    attn = attention_fn(apply_rope(q[rows], cos[rows], sin[rows]), k_pool, v_pool, 0, row_md,
                        sm_scale=cfg.head_dim ** -0.5, sliding_window=None, max_q_len=1)
    prenorm = _after_attention(params, attn, residual[rows], cfg)
    return head_logits(params, prenorm, cfg), prenorm, new_kv


def eagle_dense(params: dict, tokens: jax.Array, target_hidden: jax.Array, *,
                cfg: ModelConfig, target_vocab: int, num_draft: int = 0,
                norm_before_residual: bool = False):
    """The oracle, one sequence, no cache: ``tokens`` [N] and the target's captured hidden
    states ``target_hidden`` [N - 1, 3·Ht] (position p's, for p < N - 1). Head position p takes
    (token p + 1, target state p). Then ``num_draft`` greedy drafts: each appends the argmax
    token at the next position with the head's own pre-norm state of the position before.
    Returns (logits [N - 1 + num_draft, target vocabulary] of every position, drafted tokens)."""
    tokens = jnp.asarray(tokens)
    hidden = fuse_hidden(params, target_hidden)
    inputs = tokens[1:]
    drafted = []
    for _ in range(num_draft + 1):
        n = inputs.shape[0]
        emb = params["embed"][inputs].astype(activation_dtype(params))
        cos, sin = rope_tables(jnp.arange(n), cfg)
        prenorm = _layer(params, emb, hidden, cos, sin,
                         lambda q, k, v: dense_attention(q, k, v, cfg), cfg=cfg,
                         norm_before_residual=norm_before_residual)
        logits = draft_logits(params, prenorm, cfg, target_vocab)
        if len(drafted) == num_draft:
            return logits, jnp.asarray(drafted, jnp.int32)
        tok = jnp.argmax(logits[-1]).astype(jnp.int32)
        drafted.append(tok)
        inputs = jnp.concatenate([inputs, tok[None]])
        # the drafted position's hidden state is the head's own output before it
        hidden = jnp.concatenate([hidden, prenorm[-1:]], axis=0)
