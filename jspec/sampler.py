"""On-device sampling: logit processing, draft sampling, lossless rejection sampling, signals.

Everything here is jittable and batched over sequence rows. Each row carries its own sampling
parameters (temperature 0 = greedy) and its own random stream, derived from the request's seed and
the sequence length at the step (``row_uniforms``), so a seeded request samples the same tokens
whatever else shares its batch.

Lossless rule (speculative sampling: Leviathan et al., "Fast Inference from Transformers via
Speculative Decoding", and Chen et al., "Accelerating Large Language Model Decoding with
Speculative Sampling"): a drafted token x_j is accepted with
probability min(1, p_j(x_j) / q_j(x_j)); at the first rejection the emitted token is sampled from
norm(max(0, p_j - q_j)); if every drafted token is accepted the bonus token is sampled from
p_{γ+1}. p and q are the *processed* distributions (temperature, top-k, top-p applied to both).
Greedy rows use one-hot distributions: accept iff x_j == argmax p_j, emit argmax p at the first
mismatch (or as the bonus). A draft with no distribution (a lookup) has a one-hot q on its token.
"""

from __future__ import annotations


import jax
import jax.numpy as jnp

from jspec.kernels.pytree import array_dataclass

_NEG = -1e30
_PROB_FLOOR = 1e-8  # clamp before logs for KL / entropy signals


@array_dataclass
class SamplingTensors:
    """Per-row sampling state, [S] each. counters make each step's key distinct."""

    temperature: jax.Array  # float32, 0 = greedy
    top_k: jax.Array  # int32, 0 = off
    top_p: jax.Array  # float32, 1 = off
    seeds: jax.Array  # uint32
    counters: jax.Array  # int32 (the sequence length when the step starts)


def _mix32(x: jax.Array) -> jax.Array:
    """A bijective avalanche mix of uint32 words ("lowbias32": xorshift-multiply rounds)."""
    x = x ^ (x >> 16)
    x = x * jnp.uint32(0x7FEB352D)
    x = x ^ (x >> 15)
    x = x * jnp.uint32(0x846CA68B)
    return x ^ (x >> 16)


def row_uniforms(st: SamplingTensors, stream: int, count: int) -> jax.Array:
    """``count`` uniforms in (0, 1] per row for a named random stream of this step: [S, count].

    Number j depends only on (seed, step counter, stream, j), never on ``count``: the γ bucket a
    step was compiled for must not change what a seeded request samples.

    The generator is counter-based: a chain of integer mixes over (seed, counter, stream, j),
    24 bits per uniform. ``jax.random``'s threefry gives the same reproducibility, but its graph
    cost ~0.9 s of XLA:CPU compile time per call site, and every sampling executable has one to
    three (docs/benchmarks.md, "Start-up"); these mixes compile in milliseconds.
    """
    seeds = st.seeds.astype(jnp.uint32)[:, None]
    step = (st.counters.astype(jnp.uint32) * jnp.uint32(8) + jnp.uint32(stream))[:, None]
    j = jnp.arange(count, dtype=jnp.uint32)[None, :]
    h = _mix32(seeds ^ jnp.uint32(0x9E3779B9))
    h = _mix32(h ^ step)
    h = _mix32(h + j * jnp.uint32(0x632BE5AB))
    h = _mix32(h ^ jnp.uint32(0x85EBCA6B))
    return ((h >> 8).astype(jnp.float32) + 1.0) * jnp.float32(2.0 ** -24)


def sample_from_probs(probs: jax.Array, u: jax.Array) -> jax.Array:
    """Inverse-CDF sampling, one uniform per draw: probs [S, V] (unnormalized is fine), u [S] in
    (0, 1]. The chosen token is the first whose cumulative mass reaches u * total, so a token of
    zero probability is never chosen."""
    cdf = jnp.cumsum(probs, axis=-1)
    threshold = u[:, None] * cdf[:, -1:]
    return jnp.minimum(jnp.sum(cdf < threshold, axis=-1), probs.shape[-1] - 1).astype(jnp.int32)


def processed_logprobs(logits: jax.Array, st: SamplingTensors) -> jax.Array:
    """Log-probabilities after temperature, top-k and top-p, for random rows.

    logits: [S, ..., V] float32. Rows are filtered by their own parameters. Greedy rows get
    temperature 1 here; callers use argmax for them.
    """
    extra = logits.ndim - 2
    expand = (slice(None),) + (None,) * (extra + 1)
    temp = jnp.where(st.temperature > 0, st.temperature, 1.0)[expand]
    x = logits / temp
    vocab = x.shape[-1]

    def filtered(x):
        sorted_desc = -jnp.sort(-x, axis=-1)
        # top-k: keep logits >= the k-th largest (ties kept, as the reference implementations do)
        k = jnp.where(st.top_k > 0, jnp.minimum(st.top_k, vocab), vocab)[expand]
        kth = jnp.take_along_axis(sorted_desc, k.astype(jnp.int32) - 1, axis=-1)
        x = jnp.where(x >= kth, x, _NEG)
        # top-p over the top-k-filtered distribution: keep the smallest prefix of sorted tokens
        # whose mass reaches top_p (the token that crosses the threshold is kept)
        sorted_desc = jnp.where(jnp.arange(vocab) < k, sorted_desc, _NEG)
        sorted_probs = jax.nn.softmax(sorted_desc, axis=-1)
        mass_before = jnp.cumsum(sorted_probs, axis=-1) - sorted_probs
        # top_p = 1 keeps everything, also the tail that float rounding would push past 1.0
        keep_sorted = (mass_before < st.top_p[expand]) | (st.top_p[expand] >= 1.0)
        num_keep = jnp.maximum(keep_sorted.sum(axis=-1, keepdims=True), 1)
        threshold = jnp.take_along_axis(sorted_desc, num_keep - 1, axis=-1)
        return jnp.where(x >= threshold, x, _NEG)

    # The sort over the vocabulary runs only when some row filters: a row with neither top-k
    # nor top-p keeps every logit either way (its k-th largest and its threshold are the
    # minimum), and on a CPU the sort of a step's rows x (1 + γ) x vocabulary cost as much as
    # the forward (B = 32, temperature 1.0: a plain step 38.8 ms with it, 18.4 ms without;
    # docs/benchmarks.md, "Sampling without top-k or top-p does not sort the vocabulary").
    filters = jnp.any(st.top_k > 0) | jnp.any(st.top_p < 1.0)
    x = jax.lax.cond(filters, filtered, lambda x: x, x)
    return jax.nn.log_softmax(x, axis=-1)


def greedy_tokens(logits: jax.Array) -> jax.Array:
    """``argmax`` over the last axis as int32, the first index among ties (as ``jnp.argmax``).

    Two plain reductions (the maximum, then the least index holding it) instead of the one
    (value, index) reduction ``jnp.argmax`` lowers to: XLA:CPU runs that paired reduction at
    about half the speed (on a Zen 3 EPYC, [32, 4096] float32: 0.21 against 0.38 ms at p10).
    A row without a maximum (NaN) gets the last id, never an id out of range."""
    top = jnp.max(logits, axis=-1, keepdims=True)
    ids = jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)
    vocab = logits.shape[-1]
    return jnp.minimum(jnp.min(jnp.where(logits == top, ids, vocab), axis=-1), vocab - 1)


def sample_draft_tokens(logits: jax.Array, st: SamplingTensors, u: jax.Array) -> jax.Array:
    """Draft token per row: argmax for greedy rows, a sample from the processed q otherwise.

    logits [S, V]; u [S] uniforms. The random branch (a sort over the vocabulary for top-k/top-p)
    only runs when some row samples.
    """
    greedy = greedy_tokens(logits)

    def sampled(_):
        drawn = sample_from_probs(jnp.exp(processed_logprobs(logits, st)), u)
        return jnp.where(st.temperature > 0, drawn, greedy)

    return jax.lax.cond(jnp.any(st.temperature > 0), sampled, lambda _: greedy, None)


@array_dataclass
class VerifyResult:
    """tokens [S, G+1]: accepted drafts then the emitted token (row i emits num_accepted[i] + 1
    tokens)."""

    tokens: jax.Array
    num_accepted: jax.Array


# The per-position signals a policy may read (jspec.policies.base.Policy.signals). Each is a full-
# vocabulary reduction per drafted position, so the engine computes only those its policy reads.
SIGNALS = ("accept_prob", "kl", "draft_entropy", "confidence")


def verify_signals(target_logits: jax.Array, draft_logits: jax.Array, draft_tokens: jax.Array,
                   which: tuple[str, ...]) -> dict[str, jax.Array]:
    """Signals [S, G] per drafted position from the raw (temperature 1) distributions:
    accept_prob = 1 - TV(p, q) = sum min(p, q); kl = KL(p || q); draft_entropy = H(q);
    confidence = q(x_j). Only the names in ``which`` are computed (a static choice)."""
    unknown = set(which) - set(SIGNALS)
    if unknown:
        raise ValueError(f"unknown signals {sorted(unknown)}; choose from {SIGNALS}")
    num_rows, gamma = draft_tokens.shape
    if target_logits.ndim == 2:
        target_logits = target_logits.reshape(num_rows, gamma + 1, target_logits.shape[-1])
    logq = jax.nn.log_softmax(draft_logits, axis=-1)
    q = jnp.exp(logq)
    out = {}
    if "accept_prob" in which or "kl" in which:
        logp = jax.nn.log_softmax(target_logits[:, :gamma], axis=-1)
        p = jnp.exp(logp)
        if "accept_prob" in which:
            out["accept_prob"] = jnp.minimum(p, q).sum(-1)
        if "kl" in which:
            out["kl"] = (p * (jnp.log(jnp.maximum(p, _PROB_FLOOR))
                              - jnp.log(jnp.maximum(q, _PROB_FLOOR)))).sum(-1)
    if "draft_entropy" in which:
        out["draft_entropy"] = -(q * jnp.log(jnp.maximum(q, _PROB_FLOOR))).sum(-1)
    if "confidence" in which:
        out["confidence"] = jnp.take_along_axis(q, draft_tokens[..., None], axis=-1)[..., 0]
    return out


@array_dataclass
class TokenLogprobs:
    """Log-probabilities of a step's emitted tokens under the target's raw distribution (the
    model's softmax at temperature 1, before top-k/top-p: what vLLM returns by default), laid out
    like ``VerifyResult.tokens`` [S, G+1]: ``logprob`` and ``rank`` (1 = the most likely token)
    of the token at each place, and the ``top_ids`` / ``top_logprobs`` [S, G+1, K] of the K most
    likely tokens there."""

    logprob: jax.Array
    rank: jax.Array
    top_ids: jax.Array
    top_logprobs: jax.Array


def token_logprobs(logits: jax.Array, tokens: jax.Array, k: int) -> TokenLogprobs:
    """``logits`` [S*(G+1), V] as the verify laid them out (row i's G+1 positions together),
    ``tokens`` [S, G+1] the step's VerifyResult.tokens; K = ``k`` >= 1 (a static width: callers
    slice each request's own count on the host)."""
    num_seqs, width = tokens.shape
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    logp = logp.reshape(num_seqs, width, -1)
    chosen = jnp.take_along_axis(logp, tokens[..., None], axis=-1)
    rank = 1 + jnp.sum(logp > chosen, axis=-1, dtype=jnp.int32)
    top_logprobs, top_ids = jax.lax.top_k(logp, k)
    return TokenLogprobs(chosen[..., 0], rank, top_ids.astype(jnp.int32), top_logprobs)


def sample_tokens(logits: jax.Array, st: SamplingTensors) -> VerifyResult:
    """Plain decoding (γ = 0 for every row): one token per row from logits [S, V]. Draws what
    ``rejection_sample`` would with no drafts (the bonus token, from the same random stream),
    without its draft-side graph."""
    greedy = greedy_tokens(logits)

    def random_rows(_):
        u = row_uniforms(st, stream=2, count=1)[:, 0]
        drawn = sample_from_probs(jnp.exp(processed_logprobs(logits, st)), u)
        return jnp.where(st.temperature > 0, drawn, greedy)

    tokens = jax.lax.cond(jnp.any(st.temperature > 0), random_rows, lambda _: greedy, None)
    return VerifyResult(tokens[:, None], jnp.zeros((logits.shape[0],), jnp.int32))


def rejection_sample(
    target_logits: jax.Array,
    draft_logits: jax.Array,
    draft_tokens: jax.Array,
    num_drafted: jax.Array,
    st: SamplingTensors,
    streams: tuple[int, int] = (1, 2),
    onehot_rows: jax.Array | None = None,
) -> VerifyResult:
    """target_logits [S, G+1, V] (or the verify forward's flat [S*(G+1), V]); draft_logits
    [S, G, V], or None for drafts that come without a distribution (a lookup: n-gram, suffix),
    whose q is one-hot on the drafted token: x_j is accepted with probability p_j(x_j), and at
    the first rejection the token is drawn from p_j with x_j removed and renormalised (the
    general rule with q = δ_x); draft_tokens [S, G]; num_drafted [S].

    ``streams``: the random streams (``row_uniforms``) of the acceptance tests and of the final
    draw. An intermediate level of a chain verifies with streams of its own, so its decisions
    are independent of the target's (shared uniforms would correlate the two levels' accepts
    and bias the output).

    ``onehot_rows`` [S] bool: in a step that mixes drafts with a distribution and without, the
    rows drafted without one: their q is one-hot (their ``draft_logits`` rows are ignored).

    The runner compiles this apart from the target forward, per (sequences, γ) bucket only:
    sampling costs far more to compile than the forward, which also varies with the token bucket.
    Signals for the policies are ``verify_signals``, compiled only for policies that read them.
    """
    num_rows, gamma = draft_tokens.shape
    if target_logits.ndim == 2:
        target_logits = target_logits.reshape(num_rows, gamma + 1, target_logits.shape[-1])
    vocab = target_logits.shape[-1]
    positions = jnp.arange(gamma)
    drafted = positions[None, :] < num_drafted[:, None]  # [S, G]
    target_argmax = greedy_tokens(target_logits)  # [S, G+1]

    def first_false(ok):  # number of leading True per row
        return jnp.argmin(jnp.concatenate([ok, jnp.zeros((num_rows, 1), bool)], axis=1), axis=1)

    # ---- greedy rows
    greedy_ok = (draft_tokens == target_argmax[:, :gamma]) & drafted
    greedy_n = first_false(greedy_ok)
    greedy_last = jnp.take_along_axis(target_argmax, greedy_n[:, None], axis=1)[:, 0]

    # ---- random rows (only computed when some row samples)
    def random_rows(_):
        logp = processed_logprobs(target_logits, st)  # [S, G+1, V]
        p_tok = jnp.take_along_axis(logp[:, :gamma], draft_tokens[..., None], axis=-1)[..., 0]
        if draft_logits is None:  # a draft without a distribution: q is one-hot on x_j
            q_tok = jnp.zeros_like(p_tok)
        else:
            logq = processed_logprobs(draft_logits, st)  # [S, G, V]
            q_tok = jnp.take_along_axis(logq, draft_tokens[..., None], axis=-1)[..., 0]
            if onehot_rows is not None:
                q_tok = jnp.where(onehot_rows[:, None], 0.0, q_tok)
        uniforms = row_uniforms(st, stream=streams[0], count=gamma)
        final_u = row_uniforms(st, stream=streams[1], count=1)[:, 0]
        # accept iff u * q <= p  (i.e. u <= p/q), computed in log space
        ok = (jnp.log(uniforms) + q_tok <= p_tok) & drafted
        n = first_false(ok)
        p_n = jnp.exp(jnp.take_along_axis(logp, n[:, None, None], axis=1)[:, 0])  # [S, V]

        def onehot_q():
            # max(0, p − δ_x) is p with the rejected token x removed (p(x) ≤ 1)
            pad = jnp.concatenate([draft_tokens, jnp.full((num_rows, 1), -1, jnp.int32)], axis=1)
            x_n = jnp.take_along_axis(pad, n[:, None], axis=1)
            return (jnp.arange(vocab)[None, :] == x_n).astype(p_n.dtype)

        if draft_logits is None:
            q_n = onehot_q()
        else:
            q_pad = jnp.concatenate([jnp.exp(logq), jnp.zeros((num_rows, 1, vocab))], axis=1)
            q_n = jnp.take_along_axis(q_pad, n[:, None, None], axis=1)[:, 0]
            if onehot_rows is not None:
                q_n = jnp.where(onehot_rows[:, None], onehot_q(), q_n)
        rejected = (n < num_drafted)[:, None]
        residual = jnp.where(rejected, jnp.maximum(p_n - q_n, 0.0), p_n)
        # p == q exactly leaves no residual mass; then sampling from p is the right limit
        residual = jnp.where(residual.sum(-1, keepdims=True) > 0, residual, p_n)
        return n, sample_from_probs(residual, final_u)

    def no_random(_):
        return greedy_n, greedy_last

    rand_n, rand_last = jax.lax.cond(jnp.any(st.temperature > 0), random_rows, no_random, None)
    is_greedy = st.temperature <= 0
    num_accepted = jnp.where(is_greedy, greedy_n, rand_n).astype(jnp.int32)
    last = jnp.where(is_greedy, greedy_last, rand_last)
    tokens = jnp.concatenate([draft_tokens, jnp.zeros((num_rows, 1), jnp.int32)], axis=1)
    tokens = _place_last(tokens, num_accepted, last)

    return VerifyResult(tokens, num_accepted)


def _place_last(tokens: jax.Array, num_accepted: jax.Array, last: jax.Array) -> jax.Array:
    col = jnp.arange(tokens.shape[1])[None, :]
    return jnp.where(col == num_accepted[:, None], last[:, None], tokens)
