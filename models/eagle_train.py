"""Training an EAGLE-3 head for a target (``jspec train-eagle``): the target frozen, the head
taught the target's next-token distribution from the target's own hidden states, with EAGLE-3's
training-time test (Li et al., 2025, §3.2).

Training-time test: at serving time the head's first draft reads the target's hidden state,
but every later one reads the head's own output at the position before. A head trained only on
the first would meet inputs at depth 2, 3, ... it never saw. So each training step unrolls
``depth`` passes over the window: pass 1 takes the target's states; pass j takes, at position p,
the token p + 1 and pass j - 1's pre-norm output at p - 1, and attends as the served head would
there: to pass 1's keys up to position p - j + 1 (what the target had computed) and to the keys
passes 2..j wrote along its own chain (one per pass, at p - j + 2 .. p). Every pass is scored
against the target's distribution of the token it drafts, restricted to the draft vocabulary
(soft cross entropy: the head learns the target's probabilities, which is what acceptance
depends on, not only its argmax).

The draft vocabulary is the ``draft_vocab_size`` most frequent tokens of the training windows
(EAGLE-3's reduction: the head's output layer is the largest part of it, and rare tokens are
rarely accepted anyway); ``d2t`` places them in the target's vocabulary.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jspec.models.config import ModelConfig
from jspec.models.corpus import get_batch
from jspec.models.eagle import _layer, fuse_hidden
from jspec.models.eagle_checkpoint import (EagleConfig, _positive_int, default_aux_layers,
                                          layer_config_for)
from jspec.models.transformer import dense_forward, rms_norm, rope_tables


def head_config(target: ModelConfig, draft_vocab_size: int,
                aux_layers: tuple[int, ...] | None = None, *, hidden_size: int | None = None,
                num_heads: int | None = None, num_kv_heads: int | None = None,
                intermediate_size: int | None = None) -> EagleConfig:
    """A head shaped like one of ``target``'s layers (EAGLE-3's choice: the head is a target
    layer with a wider input), or narrower: ``hidden_size`` (with ``num_heads`` and
    ``num_kv_heads`` of the target's head size) and ``intermediate_size``. A head narrower than
    the target cannot share its embedding and has its own (``own_embed``): in a shallow target
    one target-wide layer costs as much as a whole small draft model (docs/benchmarks.md,
    "EAGLE-3 head against the other drafters")."""
    aux = tuple(aux_layers) if aux_layers is not None else default_aux_layers(target.num_layers)
    layer = layer_config_for(target)
    h = layer.hidden_size if hidden_size is None else hidden_size
    heads = num_heads if num_heads is not None else (
        layer.num_heads if hidden_size is None else max(h // layer.head_dim, 1))
    kv_heads = num_kv_heads if num_kv_heads is not None else (
        layer.num_kv_heads if heads == layer.num_heads else 1)
    inter = layer.intermediate_size if intermediate_size is None else intermediate_size
    for name, value in (("hidden_size", h), ("num_heads", heads), ("num_kv_heads", kv_heads),
                        ("intermediate_size", inter)):
        _positive_int(value, f"the head's {name}")
    if heads % kv_heads:
        raise ValueError(f"the head's num_heads {heads} must be a multiple of its num_kv_heads "
                         f"{kv_heads}")
    layer = dataclasses.replace(layer, hidden_size=h, num_heads=heads, num_kv_heads=kv_heads,
                                intermediate_size=inter)
    return EagleConfig(layer=layer, draft_vocab_size=draft_vocab_size,
                       target_hidden_size=target.hidden_size, aux_layers=aux,
                       own_embed=h != target.hidden_size, norm_before_residual=False,
                       layout="eagle3")


def draft_vocabulary(windows: np.ndarray, size: int, vocab_size: int,
                     always: tuple[int, ...] = ()) -> np.ndarray:
    """The ``size`` most frequent tokens of ``windows`` (with ``always``, e.g. EOS), sorted:
    the head's draft vocabulary as target ids."""
    if not 0 < size <= vocab_size:
        raise ValueError(f"draft vocabulary size {size} must be in 1..{vocab_size}")
    counts = np.bincount(windows.reshape(-1), minlength=vocab_size).astype(np.float64)
    counts[list(always)] = np.inf
    # ties broken by id so the choice is reproducible
    order = np.lexsort((np.arange(vocab_size), -counts))
    return np.sort(order[:size]).astype(np.int32)


def init_head(ecfg: EagleConfig, d2t: np.ndarray, seed: int = 0, std: float = 0.02,
              init_from: dict | None = None) -> dict:
    """Random head params (float32): normal(0, std) weights, norms at 1. ``init_from``: the
    params of a model of the head's width over the target's vocabulary (the draft model), whose
    token embedding, final norm and output layer (at the draft vocabulary's tokens) the head
    starts from instead; only for a head with its own embedding."""
    cfg = ecfg.layer
    h, i = cfg.hidden_size, cfg.intermediate_size
    rng = np.random.default_rng(seed)

    def w(*shape):
        return jnp.asarray(std * rng.standard_normal(shape), jnp.float32)

    params = {
        "fc": w(len(ecfg.aux_layers) * ecfg.target_hidden_size, h),
        "layer": {"hidden_norm": jnp.ones(h), "attn_norm": jnp.ones(h),
                  "wqkv": w(2 * h, cfg.q_size + 2 * cfg.kv_size), "wo": w(cfg.q_size, h),
                  "mlp_norm": jnp.ones(h), "w_gate_up": w(h, 2 * i), "w_down": w(i, h)},
        "final_norm": jnp.ones(h),
        "lm_head": w(h, ecfg.draft_vocab_size),
        "d2t": jnp.asarray(d2t, jnp.int32),
    }
    if init_from is not None:
        if not ecfg.own_embed:
            raise ValueError("a head of the target's width shares the target's embedding; "
                             "there is nothing to initialise from another model")
        shape = tuple(init_from["embed"].shape)
        if shape != (cfg.vocab_size, h):
            raise ValueError(f"the model to initialise from has an embedding of shape {shape}; "
                             f"the head needs ({cfg.vocab_size}, {h}) (the target's vocabulary "
                             f"at the head's width)")
        params["embed"] = jnp.asarray(init_from["embed"], jnp.float32)
        params["final_norm"] = jnp.asarray(init_from["final_norm"], jnp.float32)
        params["lm_head"] = jnp.asarray(np.asarray(init_from["lm_head"])[:, np.asarray(d2t)],
                                        jnp.float32)
    elif ecfg.own_embed:
        params["embed"] = w(cfg.vocab_size, h)
    return params


def _ttt_attention(q, keys, values, depth: int, cfg: ModelConfig):
    """Pass ``depth``'s attention (module docstring): position p attends to pass 1's keys at
    positions <= p - depth + 1 and to pass i's key at p - (depth - i) for i = 2..depth."""
    n = q.shape[0]
    group = cfg.num_heads // cfg.num_kv_heads
    scale = cfg.head_dim ** -0.5
    qf = q.astype(jnp.float32)

    def heads(x):
        return jnp.repeat(x.astype(jnp.float32), group, axis=1)

    def shifted(x, s):  # row p holds x[p - s] (zeros before the start)
        return jnp.concatenate([jnp.zeros((s,) + x.shape[1:], x.dtype), x[:n - s]], 0) if s \
            else x

    pos = jnp.arange(n)
    k1, v1 = heads(keys[0]), heads(values[0])
    s1 = jnp.einsum("qhd,khd->hqk", qf, k1) * scale
    s1 = jnp.where((pos[None, :] <= pos[:, None] - (depth - 1))[None], s1, -jnp.inf)
    diag_s, diag_v = [], []
    for i in range(2, depth + 1):
        shift = depth - i
        ki, vi = shifted(heads(keys[i - 1]), shift), shifted(heads(values[i - 1]), shift)
        s = (qf * ki).sum(-1).T * scale  # [h, n]
        diag_s.append(jnp.where((pos >= shift)[None], s, -jnp.inf))
        diag_v.append(vi)
    scores = jnp.concatenate([s1] + [s[:, :, None] for s in diag_s], axis=-1)
    weights = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("hqk,khd->qhd", weights[:, :, :n], v1)
    for j, vi in enumerate(diag_v):
        out = out + weights[:, :, n + j].T[:, :, None] * vi
    return out.astype(q.dtype)


def ttt_logits(params: dict, embed: jax.Array, aux: jax.Array, inputs: jax.Array, *,
               ecfg: EagleConfig, depth: int) -> list[jax.Array]:
    """One sequence: the head's draft-vocabulary logits [n, Vd] of passes 1..depth, position p
    taking token ``inputs[p]`` (the token after p) and the target's captured state ``aux[p]``
    in pass 1."""
    cfg = ecfg.layer
    n = inputs.shape[0]
    cos, sin = rope_tables(jnp.arange(n), cfg)
    emb = embed[inputs].astype(params["fc"].dtype)
    hidden = fuse_hidden(params, aux)
    keys, values, out = [], [], []
    for j in range(1, depth + 1):
        def attend(q, k, v, j=j):
            keys.append(k)
            values.append(v)
            return _ttt_attention(q, keys, values, j, cfg)

        prenorm = _layer(params, emb, hidden, cos, sin, attend, cfg=cfg,
                         norm_before_residual=ecfg.norm_before_residual)
        normed = rms_norm(prenorm, params["final_norm"], cfg.rms_norm_eps)
        out.append(jnp.dot(normed, params["lm_head"], preferred_element_type=jnp.float32))
        # the next pass's position p reads this pass's output at p - 1
        hidden = jnp.concatenate([jnp.zeros_like(prenorm[:1]), prenorm[:-1]], axis=0)
    return out


def ttt_loss(params: dict, target_params: dict, windows: jax.Array, *, target_cfg: ModelConfig,
             ecfg: EagleConfig, depth: int):
    """Mean soft cross entropy over passes and positions, and each pass's top-1 agreement with
    the target (argmax over the draft vocabulary), for windows [B, T] of target tokens."""
    d2t = params["d2t"]

    def one(tokens):
        t_logits, aux = dense_forward(target_params, tokens, cfg=target_cfg,
                                      aux_layers=ecfg.aux_layers)
        t_logits, aux = jax.lax.stop_gradient((t_logits, aux))
        # position p (token p + 1 in, target state p) drafts token p + 2: the target's row p + 1
        t_logp = jax.nn.log_softmax(t_logits[1:, d2t], axis=-1)
        embed = params["embed"] if ecfg.own_embed else target_params["embed"]
        passes = ttt_logits(params, embed, aux[:-1], tokens[1:], ecfg=ecfg, depth=depth)
        n = tokens.shape[0] - 1
        losses, agree = [], []
        for j, logits in enumerate(passes):
            mask = (jnp.arange(n) >= j).astype(jnp.float32)  # pass j + 1 needs j positions
            ce = -(jnp.exp(t_logp) * jax.nn.log_softmax(logits, axis=-1)).sum(-1)
            hit = (jnp.argmax(logits, -1) == jnp.argmax(t_logp, -1)).astype(jnp.float32)
            losses.append((ce * mask).sum() / mask.sum())
            agree.append((hit * mask).sum() / mask.sum())
        return jnp.stack(losses), jnp.stack(agree)

    losses, agree = jax.vmap(one)(windows)
    return losses.mean(), agree.mean(0)


def train_head(target_cfg: ModelConfig, target_params: dict, ecfg: EagleConfig, params: dict,
               windows: np.ndarray, *, steps: int, batch_size: int, lr: float = 1e-3,
               warmup: int = 50, depth: int = 3, seed: int = 0, progress: bool = True):
    """AdamW (warm-up, cosine decay, clipping) over ``windows`` [N, T]; returns the trained
    params (float32) and the last logged per-pass agreement."""
    from tqdm import tqdm

    if int(windows.max(initial=0)) >= target_cfg.vocab_size:
        raise ValueError(f"token id {int(windows.max())} >= vocab_size {target_cfg.vocab_size}")
    schedule = optax.warmup_cosine_decay_schedule(0.0, lr, min(warmup, steps - 1),
                                                  max(steps, warmup + 1), lr * 0.1)
    trainable = {k: v for k, v in params.items() if k != "d2t"}
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=0.0))
    opt_state = opt.init(trainable)
    target_params = jax.tree_util.tree_map(lambda a: jnp.asarray(a, jnp.float32), target_params)
    d2t = params["d2t"]

    @jax.jit
    def step(trainable, opt_state, batch):
        def loss_fn(p):
            return ttt_loss(dict(p, d2t=d2t), target_params, batch, target_cfg=target_cfg,
                            ecfg=ecfg, depth=depth)

        (loss, agree), grads = jax.value_and_grad(loss_fn, has_aux=True)(trainable)
        updates, opt_state = opt.update(grads, opt_state, trainable)
        return optax.apply_updates(trainable, updates), opt_state, loss, agree

    bar = tqdm(total=steps, desc="train-eagle", disable=not progress, dynamic_ncols=True)
    agree = None
    t_last = time.perf_counter()
    try:
        for s in range(steps):
            batch = jnp.asarray(get_batch(windows, s, batch_size, seed))
            trainable, opt_state, loss, agree = step(trainable, opt_state, batch)
            if progress and (time.perf_counter() - t_last > 2.0 or s + 1 == steps):
                bar.set_postfix(loss=f"{float(loss):.3f}",
                                top1=" ".join(f"{a:.2f}" for a in np.asarray(agree)))
                t_last = time.perf_counter()
            bar.update(1)
    finally:
        bar.close()
    return dict(trainable, d2t=d2t), (None if agree is None else np.asarray(agree))


def held_out_agreement(target_cfg: ModelConfig, target_params: dict, ecfg: EagleConfig,
                       params: dict, windows: np.ndarray, *, depth: int,
                       batch_size: int = 8) -> np.ndarray:
    """Top-1 agreement with the target per pass (depth) over ``windows`` [N, T]."""
    target_params = jax.tree_util.tree_map(lambda a: jnp.asarray(a, jnp.float32), target_params)
    params = jax.tree_util.tree_map(lambda a: jnp.asarray(a) if a.dtype == jnp.int32
                                    else jnp.asarray(a, jnp.float32), params)
    fn = jax.jit(lambda b: ttt_loss(params, target_params, b, target_cfg=target_cfg,
                                    ecfg=ecfg, depth=depth)[1])
    total, count = np.zeros(depth), 0
    for start in range(0, len(windows) - batch_size + 1, batch_size):
        total += np.asarray(fn(jnp.asarray(windows[start:start + batch_size])))
        count += 1
    return total / max(count, 1)
