"""The jitted device work of one speculative step: a draft model's catch-up, the draft loop, a
chain's middle-level verification, the target's verification with its sampling.

Each is a pure function of (params, KV pool, pytree inputs) with what it is compiled for bound
as one static ``StepOptions``; the runner compiles each once per shape bucket with the KV pool
donated. The draft loop runs up to G draft forwards in one ``lax.while_loop`` with per-sequence
active masks, so drafting is one dispatch however long the draft is, with no host round trip
per drafted token.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import jax.scipy.special  # noqa: F401 - entr

from jspec.sampler import (SamplingTensors, rejection_sample, row_uniforms, sample_draft_tokens,
                           sample_tokens)
from jspec.models import eagle
from jspec.models.config import ModelConfig
from jspec.models.transformer import KVCache, ModelInput, forward
from jspec.kernels.pytree import array_dataclass
from jspec.kernels.ragged_paged_attention import AttentionMetadata

# Most tokens a pool model has not yet seen when it drafts or verifies (the newest token, and the
# bonus token before it): longer lags are caught up first (input_batch.catch_up_segments). The
# batch widths below and the attention's tile bound rely on it.
MAX_PENDING = 2

_DRAFT_STREAM = 3


@dataclasses.dataclass(frozen=True)
class StepOptions:
    """What a device step is compiled for (static: bound with ``functools.partial`` before
    ``jit``). ``mesh`` and ``batch_invariant``: the tensor-parallel mesh and the target's
    batch-invariant numerics (``forward``'s); ``num_steps``: the draft loop's most tokens;
    ``with_stats``: the draft loop computes confidence and entropy and applies the stop rule,
    a chain's middle level computes its acceptance-probability signal."""

    cfg: ModelConfig
    attention_fn: Callable
    mesh: Any = None
    batch_invariant: bool = False
    num_steps: int = 0
    with_stats: bool = False
    aux_layers: tuple[int, ...] = ()
    eagle: Any = None  # the EagleConfig of a head that drafts (models/eagle_checkpoint.py)

    def forward(self, params: dict, kv: KVCache, batch: ModelInput, attention_fn=None):
        return forward(params, kv, batch, cfg=self.cfg,
                       attention_fn=attention_fn or self.attention_fn, mesh=self.mesh,
                       batch_invariant=self.batch_invariant, aux_layers=self.aux_layers)

    def eagle_forward(self, params: dict, kv: KVCache, hidden: jax.Array, batch: ModelInput,
                      logits: bool = True):
        """The EAGLE head (``models/eagle.py``) over ``batch`` with hidden states ``hidden``
        [T, H]: (logits over the draft vocabulary, pre-norm hidden at the logits rows, kv);
        ``logits`` False: the K/V alone, (None, None, kv)."""
        return eagle.eagle_forward(params, kv, hidden, batch, cfg=self.cfg,
                                   attention_fn=self.attention_fn,
                                   norm_before_residual=self.eagle.norm_before_residual,
                                   logits=logits)


@array_dataclass
class DraftInputs:
    """The draft loop's host-built inputs: ``first`` feeds each drafting row's pending tokens
    (1-2) and asks for logits at the last; ``next_positions`` [S] where drafted token 1 goes;
    ``page_table`` [S, P]; ``gammas`` [S] tokens to draft; ``stop_confidence`` and
    ``stop_entropy`` [S], the policy's stop rule."""

    first: ModelInput
    next_positions: jax.Array
    page_table: jax.Array
    gammas: jax.Array
    stop_confidence: jax.Array
    stop_entropy: jax.Array


@array_dataclass
class Drafts:
    """A step's drafts as a verifier takes them (vLLM's ``SpecDecodeMetadata``): ``tokens``
    [S, G]; ``slots`` [S, G], where each goes in the verify batch (out of range: not verified);
    ``logits`` [S, G, V], the draft distribution q (None: a lookup's drafts, one-hot q);
    ``num_drafted`` [S]; ``onehot`` [S] bool, in a step that mixes a pool model's drafts with
    a lookup's: the rows whose q is one-hot (their ``logits`` rows are ignored)."""

    tokens: jax.Array
    slots: jax.Array
    logits: jax.Array
    num_drafted: jax.Array
    onehot: jax.Array | None = None


@array_dataclass
class Carried:
    """A γ = 0 step's input tokens from the step before it, still on device (asynchronous
    scheduling): row i's token is ``tokens[rows[i], 0]`` where ``rows[i] >= 0``, else the
    host's."""

    tokens: jax.Array
    rows: jax.Array


@array_dataclass
class DraftResult:
    """tokens [S, G]; raw draft logits [S, G, V] (float32, needed by the rejection sampler and the
    signals; None for a lookup's drafts); num_drafted [S]; confidence q(x_j) and entropy of q_j
    [S, G] (raw distributions)."""

    tokens: jax.Array
    logits: jax.Array
    num_drafted: jax.Array
    confidence: jax.Array
    entropy: jax.Array


def draft_loop(params: dict, kv: KVCache, inputs: DraftInputs, st: SamplingTensors, *,
               opts: StepOptions):
    """Draft up to ``opts.num_steps`` tokens per sequence with a draft model.

    ``inputs.first`` feeds each drafting sequence's pending tokens (the 1-2 tokens the draft has not
    seen; longer lags were caught up before) and asks for logits at its last one: that is the
    distribution of x_1. Iterations k = 1.. feed x_k at position next_positions + k - 1, one token
    per sequence row (``_draft_tokens`` says which are drafted).
    """
    cfg, attention_fn = opts.cfg, opts.attention_fn
    # ``first`` brings at most MAX_PENDING tokens per row (input_batch asserts it): one tile each
    logits0, kv = forward(params, kv, inputs.first, cfg=cfg,
                          attention_fn=functools.partial(attention_fn, max_q_len=MAX_PENDING))

    def feed(md, tok, rows, carry, kv):
        logits, kv = forward(params, kv, ModelInput(tok, md, rows), cfg=cfg,
                             attention_fn=attention_fn)
        return logits, carry, kv

    no_carry = jnp.zeros((inputs.gammas.shape[0], 0), jnp.float32)
    result, _, kv = _draft_tokens(feed, logits0, no_carry, kv, inputs, st, opts)
    return result, kv


def eagle_draft_loop(params: dict, kv: KVCache, target_h: jax.Array, inputs: DraftInputs,
                     st: SamplingTensors, *, opts: StepOptions):
    """Draft with an EAGLE-3 head (``models/eagle.py``). ``inputs.first`` feeds each drafting
    row's tokens the head has not taken yet, token t at position t - 1 beside the target's
    hidden state there (read from ``target_h``, fused by ``fc``): the last one's logits give
    x_1. Iteration k feeds x_k at ``next_positions + k - 1`` beside the head's own pre-norm
    hidden state of the position before.

    The loop samples over the draft vocabulary: the same distribution as over the target's
    with q = 0 outside it, at the draft vocabulary's cost (the built-in head's is half the
    target's). The drafted ids and the returned q are in the target's vocabulary."""
    hidden = eagle.fuse_hidden(params, eagle.gather_hidden(target_h, inputs.first))
    logits0, carry, kv = opts.eagle_forward(params, kv, hidden, inputs.first)

    def feed(md, tok, rows, carry, kv):
        return opts.eagle_forward(params, kv, carry, ModelInput(tok, md, rows))

    result, carry, kv = _draft_tokens(feed, logits0, carry, kv, inputs, st, opts,
                                      token_ids=functools.partial(eagle.to_target_ids, params))
    logits = eagle.to_target_vocab(params, result.logits, opts.cfg.vocab_size)
    return dataclasses.replace(result, logits=logits), carry, kv


def eagle_catch_up(params: dict, kv: KVCache, target_h: jax.Array, batch: ModelInput, *,
                   opts: StepOptions) -> KVCache:
    """Feed an EAGLE head tokens it missed (token t at position t - 1, with the target's hidden
    state there) without drafting."""
    hidden = eagle.fuse_hidden(params, eagle.gather_hidden(target_h, batch))
    return opts.eagle_forward(params, kv, hidden, batch, logits=False)[2]


def _draft_tokens(feed, logits0, carry0, kv, inputs: DraftInputs, st: SamplingTensors,
                  opts: StepOptions, token_ids=None):
    """The draft loop shared by every model drafter: from ``logits0`` (x_1's distribution) and
    a per-row ``carry0`` (what the model carries from one drafted position to the next: an EAGLE
    head's hidden state; nothing for a draft model), sample x_k and, while some row drafts on,
    ``feed(md, tokens, rows, carry, kv) -> (logits, carry, kv)`` it at position
    ``next_positions + k - 1``. Rows that are not drafting (γ_i = 0, stopped, prefill, padding)
    see an all-null page table, so whatever they compute lands in the null block.

    A token j is drafted iff j < γ_i, the product of the confidences of the tokens before it is
    ≥ stop_confidence_i, and the entropy of its distribution is ≤ stop_entropy_i.

    ``opts.with_stats``: compute confidence and entropy (two full-vocabulary reductions per
    drafted token) and apply the stop rules. Only policies that stop drafts early or ``select``
    read them; for the others the loop drafts exactly γ_i tokens and returns zeros there.

    ``token_ids``: the model's logits cover a vocabulary of its own, and ``token_ids(ids)``
    gives the target ids of its ids (an EAGLE head's ``d2t``); the result's tokens are target
    ids, its logits stay in the model's vocabulary. Returns (DraftResult, the last carry,
    kv)."""
    num_steps, with_stats = opts.num_steps, opts.with_stats
    next_positions, page_table, gammas = inputs.next_positions, inputs.page_table, inputs.gammas
    stop_confidence, stop_entropy = inputs.stop_confidence, inputs.stop_entropy
    num_rows = gammas.shape[0]
    vocab = logits0.shape[-1]
    uniforms = row_uniforms(st, _DRAFT_STREAM, num_steps)

    to_target = token_ids or (lambda ids: ids)

    def draft_one(logits, k, active, cum_conf):
        tokens = sample_draft_tokens(logits, st, jax.lax.dynamic_index_in_dim(uniforms, k, 1,
                                                                               keepdims=False))
        if not with_stats:
            zero = jnp.zeros((num_rows,), jnp.float32)
            return to_target(tokens), zero, zero, active & (k < gammas)
        logq = jax.nn.log_softmax(logits, axis=-1)
        entropy = jax.scipy.special.entr(jnp.exp(logq)).sum(-1)
        conf = jnp.exp(jnp.take_along_axis(logq, tokens[:, None], axis=-1)[:, 0])
        active = active & (k < gammas) & (cum_conf >= stop_confidence) & (entropy <= stop_entropy)
        return to_target(tokens), conf, entropy, active

    # One sampling site: each iteration samples token k from the logits it carries, then (only
    # while some row may draft token k + 1) feeds token k to the draft for the next logits. The
    # sampling graph costs more compile time than the draft's forward, so it is built once.
    rows = jnp.arange(num_rows, dtype=jnp.int32)

    def feed_k(k, tok, more, carry, kv):
        md = AttentionMetadata(
            positions=jnp.where(more, next_positions + k, 0),
            cu_q_lens=jnp.arange(num_rows + 1, dtype=jnp.int32),
            kv_lens=jnp.where(more, next_positions + k + 1, 0),
            page_table=jnp.where(more[:, None], page_table, 0),
        )
        return feed(md, tok, rows, carry, kv)

    def cond(state):
        k, active = state[0], state[1]
        return (k < num_steps) & jnp.any(active)

    def body(state):
        (k, active, kv, logits, carry, tokens, logits_buf, conf_buf, ent_buf, num_drafted,
         cum_conf) = state
        tok, conf, ent, drafted = draft_one(logits, k, active, cum_conf)
        tokens = tokens.at[:, k].set(tok)
        logits_buf = logits_buf.at[:, k].set(logits)
        conf_buf = conf_buf.at[:, k].set(conf)
        ent_buf = ent_buf.at[:, k].set(ent)
        num_drafted = num_drafted + drafted.astype(jnp.int32)
        cum_conf = jnp.where(drafted, cum_conf * conf, cum_conf)
        more = drafted & (k + 1 < gammas)
        logits, carry, kv = jax.lax.cond(
            jnp.any(more), lambda c, kv: feed_k(k, tok, more, c, kv),
            lambda c, kv: (logits, c, kv), carry, kv)
        return (k + 1, more, kv, logits, carry, tokens, logits_buf, conf_buf, ent_buf,
                num_drafted, cum_conf)

    zeros = jnp.zeros((num_rows, num_steps), jnp.float32)
    state = (jnp.int32(0), gammas > 0, kv, logits0, carry0,
             jnp.zeros((num_rows, num_steps), jnp.int32),
             jnp.zeros((num_rows, num_steps, vocab), jnp.float32), zeros, zeros,
             jnp.zeros((num_rows,), jnp.int32), jnp.ones((num_rows,), jnp.float32))
    _, _, kv, _, carry, tokens, logits_buf, conf_buf, ent_buf, num_drafted, _ = \
        jax.lax.while_loop(cond, body, state)
    return DraftResult(tokens, logits_buf, num_drafted, conf_buf, ent_buf), carry, kv


def verify_forward(params: dict, kv: KVCache, batch: ModelInput, draft_tokens: jax.Array,
                   draft_slots: jax.Array, *, opts: StepOptions) -> tuple[jax.Array, KVCache]:
    """One target pass over the ragged batch; returns logits [S*(G+1), V].

    The host built ``batch`` before the draft ran, with placeholders where drafted tokens go;
    ``draft_slots [S, G]`` says which flat token each drafted token fills (out-of-range = not
    verified), so the draft output never visits the host. ``batch.logits_indices`` is laid out
    densely as [S, G+1]: row i, column j is the position whose logits judge draft token j+1 (and
    column γ_i gives the bonus); prefill rows use column 0.
    """
    input_ids = batch.input_ids.at[draft_slots.reshape(-1)].set(
        draft_tokens.reshape(-1), mode="drop")
    return opts.forward(params, kv, ModelInput(input_ids, batch.attn, batch.logits_indices))


def verify_and_accept(params: dict, kv: KVCache, batch: ModelInput, st: SamplingTensors,
                      feed: "Drafts | Carried", *, opts: StepOptions):
    """A decode-only step's verification in one call: the target forward, then rejection
    sampling of the drafts (``feed``: Drafts) or, without drafts (γ = 0; ``feed``: Carried),
    plain sampling. Returns (VerifyResult, logits, kv); the logits stay on device for the
    policy's signals. Steps that carry prefill run the forward and the sampling as two
    executables instead (compiled per token bucket, the sampling graph would multiply the
    compile time).

    At γ = 0 each row's input token may come from the previous step's sampled tokens, still on
    device (``Carried``): asynchronous scheduling dispatches a step before the host has seen
    the tokens it feeds (jspec/overlap.py)."""
    if isinstance(feed, Carried):
        row_ids = jnp.where(feed.rows >= 0, feed.tokens[jnp.maximum(feed.rows, 0), 0],
                            batch.input_ids)
        logits, kv = opts.forward(params, kv, ModelInput(row_ids, batch.attn,
                                                         batch.logits_indices))
        return sample_tokens(logits, st), logits, kv
    logits, kv = verify_forward(params, kv, batch, feed.tokens, feed.slots, opts=opts)
    return (rejection_sample(logits, feed.logits, feed.tokens, feed.num_drafted, st,
                             onehot_rows=feed.onehot), logits, kv)


def accept_mixed(logits: jax.Array, draft_logits: jax.Array, draft_tokens: jax.Array,
                 num_drafted: jax.Array, st: SamplingTensors, onehot: jax.Array):
    """The acceptance of a step that carried prefill, its drafts mixing a pool model's rows
    with a lookup's (``onehot`` [S]: the rows whose q is one-hot)."""
    return rejection_sample(logits, draft_logits, draft_tokens, num_drafted, st,
                            onehot_rows=onehot)


# The random streams of an intermediate level's acceptance tests and correction draw (the
# target uses 1 and 2, the draft loop 3): every level decides with uniforms of its own.
_INTERMEDIATE_STREAMS = (4, 5)


@array_dataclass
class IntermediateResult:
    """An intermediate level's verdict: ``accepted`` [S] (tokens it accepted of the first
    model's draft) and ``accept_prob`` [S, G] (1 - TV between its distribution and the first
    model's per drafted position; zeros unless the policy reads it)."""

    accepted: jax.Array
    accept_prob: jax.Array


def intermediate_verify(params: dict, kv: KVCache, batch: ModelInput, st: SamplingTensors,
                        drafts: Drafts, *, opts: StepOptions):
    """A middle model of a chain verifies the first model's draft (SpecRouter §4.2, multi-level
    verification): one forward over each row's pending tokens and the drafted tokens
    (``input_batch.intermediate_input``; ``drafts.slots`` place them), then
    ``intermediate_accept`` (its signal with ``opts.with_stats``). Returns (DraftResult for the
    target, IntermediateResult, kv)."""
    logits, kv = verify_forward(params, kv, batch, drafts.tokens, drafts.slots, opts=opts)
    out, verdict = intermediate_accept(logits, drafts, st, with_signal=opts.with_stats)
    return out, verdict, kv


def intermediate_accept(logits: jax.Array, draft: "DraftResult | Drafts",
                        st: SamplingTensors, *, with_signal: bool = False):
    """The middle level's lossless rule: accept draft token x_j with probability
    min(1, p_mid(x_j) / q(x_j)), q the drafter's processed distribution, on random streams of
    its own; at the first rejection its correction comes from norm(max(0, p_mid - q)). What
    survives (the accepted prefix, then the correction; when everything was accepted nothing
    more: the draft is cut at the window, so the target's γ bucket is the drafter's) is an
    exact sample of the middle model's processed distribution, token by token, so the target
    verifies it with q = p_mid: the returned DraftResult carries the middle model's logits.

    logits: [S*(G+1), V] or [S, G+1, V] (column j judges draft token j+1). Returns (DraftResult
    whose num_drafted = min(accepted + 1, drafted), IntermediateResult)."""
    num_rows, gamma = draft.tokens.shape
    verdict = rejection_sample(logits, draft.logits, draft.tokens, draft.num_drafted, st,
                               streams=_INTERMEDIATE_STREAMS)
    logits = logits.reshape(num_rows, gamma + 1, logits.shape[-1])[:, :gamma]
    num_drafted = jnp.minimum(verdict.num_accepted + 1, draft.num_drafted).astype(jnp.int32)
    if with_signal:
        p = jax.nn.softmax(logits, axis=-1)
        q = jax.nn.softmax(draft.logits, axis=-1)
        accept_prob = jnp.minimum(p, q).sum(-1)
    else:
        accept_prob = jnp.zeros((num_rows, gamma), jnp.float32)
    zeros = jnp.zeros((num_rows, gamma), jnp.float32)
    out = DraftResult(verdict.tokens[:, :gamma], logits, num_drafted, zeros, zeros)
    return out, IntermediateResult(verdict.num_accepted, accept_prob)


def catch_up(params: dict, kv: KVCache, batch: ModelInput, *, opts: StepOptions) -> KVCache:
    """Feed tokens into a model's KV pool without sampling (the draft catching up)."""
    _, kv = opts.forward(params, kv, batch)
    return kv
