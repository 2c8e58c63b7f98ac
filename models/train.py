"""Training and distillation of the built-in model pair on the stdlib corpus (``jspec.models.corpus``).

Recipe
    * Loss: next-token cross entropy over packed windows (``jspec.models.corpus.pack``), the Flax
      ``Decoder`` vmapped over the batch. Master weights and optimizer state are float32; the loss
      casts the params to the compute dtype (bf16 by default) inside the differentiated function,
      so the forward/backward matmuls run in bf16 (accumulating in f32 via
      ``preferred_element_type``) and gradients arrive in f32 on the master copy.
    * Optimizer: AdamW (b1 0.9, b2 0.95, weight decay 0.1 on matrices only: not on norms, biases)
      after global-norm clipping (1.0); learning rate: linear warm-up then cosine decay to 10% of
      the peak (``optax.warmup_cosine_decay_schedule``).
    * Distillation (``teacher=...``): the draft minimises KL(target || draft) of the next-token
      distributions, the target's logits computed on the fly in the same step under
      ``stop_gradient``. ``distill_mode="ce"`` trains the draft independently (plain cross
      entropy on the data, the teacher unused). The windows can be the target's own completions
      mixed with corpus windows (``jspec distill --self-generated``, ``jspec/self_distill.py``).
    * State: ``{"params", "opt_state", "step", "rng"}`` (a plain pytree), checkpointed with
      orbax-checkpoint's ``CheckpointManager`` every ``checkpoint_every`` steps and at the end.
      A run resumes from the latest checkpoint in its directory; the batch of step ``s`` is a pure
      function of (s, seed) (``jspec.models.corpus.batch_indices``), so resuming gives the same state
      as never stopping.
    * Export: ``export_hf`` writes an HF checkpoint through ``jspec.models.loader.save_checkpoint``.

Default pair (``config_for("default", ...)``; llama architecture, tied input/output embeddings,
vocabulary 4096, RoPE theta 10000, max positions 1024)
    target: 6 layers, hidden 384, 6 heads x 64 (2 kv heads), ffn 960 -> 10.57M parameters
            (9.0M in the layers, 1.6M embedding shared with the head).
    draft:  2 layers, hidden 192, 3 heads x 64 (1 kv head), ffn 512 -> 1.57M parameters.
    Both tied so the shipped pair fits 25 MB in bf16 (12.1M parameters = 24.3 MB).
    Forward FLOPs per token (matmuls incl. the output head, plus attention at context 256, the
    mean context of a 512-token window; ``forward_flops_per_token``): target 23.5 MFLOP, draft
    3.5 MFLOP, ratio 0.151 (<= 1/6); 0.149 without attention. ``python -m jspec.models.train`` prints
    these numbers.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jspec.models.config import ModelConfig
from jspec.models.corpus import get_batch
from jspec.models.modeling import Decoder, params_for_module, params_for_serving
from jspec.models.tiny import BOS_ID, DRAFT_OVERRIDES, EOS_ID, IM_END_ID, tiny_config

# ----------------------------------------------------------------------------- model configs
DEFAULT_TARGET = dict(num_layers=6, hidden_size=384, num_heads=6, num_kv_heads=2, head_dim=64,
                      intermediate_size=960)
DEFAULT_DRAFT = dict(num_layers=2, hidden_size=192, num_heads=3, num_kv_heads=1, head_dim=64,
                     intermediate_size=512)
# The pool's middle model (SpecRouter chains small -> mid -> target): between the two in depth
# and width, so it agrees with the target better than the draft does at a fraction of its cost.
DEFAULT_INTERMEDIATE = dict(num_layers=4, hidden_size=256, num_heads=4, num_kv_heads=1,
                            head_dim=64, intermediate_size=640)
TINY_INTERMEDIATE = dict(num_layers=1, hidden_size=48, num_heads=2, num_kv_heads=1, head_dim=24,
                         intermediate_size=96)
ROLES = ("target", "intermediate", "draft")
CONFIG_NAMES = ("tiny", "default")


def config_for(name: str, role: str = "target", vocab_size: int = 4096) -> ModelConfig:
    """The ``tiny`` (tests) or ``default`` (the shipped pool) config for ``role`` target /
    intermediate / draft."""
    if role not in ROLES:
        raise ValueError(f"role must be one of {', '.join(ROLES)}, got {role!r}")
    if name == "tiny":
        over = {"target": {}, "intermediate": TINY_INTERMEDIATE, "draft": DRAFT_OVERRIDES}[role]
        return tiny_config("llama", vocab_size=vocab_size, **over)
    if name == "default":
        shape = {"target": DEFAULT_TARGET, "intermediate": DEFAULT_INTERMEDIATE,
                 "draft": DEFAULT_DRAFT}[role]
        return ModelConfig(model_type="llama", vocab_size=vocab_size, rms_norm_eps=1e-6,
                           rope_theta=10000.0, max_position_embeddings=1024,
                           tie_word_embeddings=True, bos_token_id=BOS_ID,
                           eos_token_ids=(EOS_ID, IM_END_ID), **shape)
    raise ValueError(f"unknown config {name!r}; choose from {', '.join(CONFIG_NAMES)}")


def forward_flops_per_token(cfg: ModelConfig, context: int = 256) -> int:
    """Forward FLOPs of one token: 2 x (every matmul weight, incl. the output head) plus the
    attention scores and weighted sum over ``context`` keys."""
    h, i = cfg.hidden_size, cfg.intermediate_size
    layer = h * (cfg.q_size + 2 * cfg.kv_size) + cfg.q_size * h + 3 * h * i
    attn = 2 * cfg.q_size * context  # q.k and p.v, per layer
    return 2 * (cfg.num_layers * (layer + attn) + h * cfg.vocab_size)


# ----------------------------------------------------------------------------- training config
@dataclasses.dataclass(frozen=True)
class TrainConfig:
    steps: int = 1000
    batch_size: int = 8
    seq_len: int = 512
    lr: float = 1e-3
    warmup_steps: int = 100
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    clip_norm: float = 1.0
    seed: int = 0
    compute_dtype: str = "bfloat16"
    distill_mode: str = "kl"  # with a teacher: "kl" (distillation) or "ce" (independent)


def make_schedule(tc: TrainConfig):
    warmup = min(tc.warmup_steps, max(tc.steps - 1, 0))
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=tc.lr, warmup_steps=warmup,
        decay_steps=max(tc.steps, warmup + 1), end_value=tc.lr * tc.min_lr_ratio)


def _decay_mask(params):
    def leaf_mask(path, _):
        name = str(getattr(path[-1], "key", path[-1]))
        return not (name.endswith("norm") or name.startswith("b"))
    return jax.tree_util.tree_map_with_path(leaf_mask, params)


def make_optimizer(tc: TrainConfig) -> optax.GradientTransformation:
    return optax.chain(
        optax.clip_by_global_norm(tc.clip_norm),
        optax.adamw(make_schedule(tc), b1=tc.b1, b2=tc.b2, weight_decay=tc.weight_decay,
                    mask=_decay_mask),
    )


def init_params(cfg: ModelConfig, seed: int = 0) -> dict:
    """Module params (f32) from the Flax ``Decoder`` initializer."""
    key = jax.random.PRNGKey(seed)
    return Decoder(cfg).init(key, jnp.zeros((2,), jnp.int32))["params"]


def init_state(cfg: ModelConfig, tc: TrainConfig, params: dict | None = None) -> dict:
    params = init_params(cfg, tc.seed) if params is None else params
    params = jax.tree_util.tree_map(lambda a: jnp.asarray(a, jnp.float32), params)
    return {"params": params, "opt_state": make_optimizer(tc).init(params),
            "step": jnp.asarray(0, jnp.int32), "rng": jax.random.PRNGKey(tc.seed + 1)}


# ----------------------------------------------------------------------------- losses
def batch_logits(cfg: ModelConfig, params: dict, tokens: jax.Array, dtype=jnp.bfloat16):
    """tokens [B, T] -> float32 logits [B, T, vocab], params cast to ``dtype`` for compute."""
    p = jax.tree_util.tree_map(lambda a: a.astype(dtype), params)
    module = Decoder(cfg)
    return jax.vmap(lambda t: module.apply({"params": p}, t))(tokens)


def lm_loss(params, cfg: ModelConfig, windows: jax.Array, dtype=jnp.bfloat16):
    """Mean next-token cross entropy; windows [B, T+1]."""
    logits = batch_logits(cfg, params, windows[:, :-1], dtype)
    return optax.softmax_cross_entropy_with_integer_labels(logits, windows[:, 1:]).mean()


def kl_loss(params, cfg: ModelConfig, teacher_params, teacher_cfg: ModelConfig,
            windows: jax.Array, dtype=jnp.bfloat16):
    """Mean KL(teacher || student) of the next-token distributions; windows [B, T+1]."""
    inputs = windows[:, :-1]
    t_logits = jax.lax.stop_gradient(batch_logits(teacher_cfg, teacher_params, inputs, dtype))
    s_logits = batch_logits(cfg, params, inputs, dtype)
    t_logp = jax.nn.log_softmax(t_logits, axis=-1)
    s_logp = jax.nn.log_softmax(s_logits, axis=-1)
    return (jnp.exp(t_logp) * (t_logp - s_logp)).sum(-1).mean()


def make_train_step(cfg: ModelConfig, tc: TrainConfig, teacher_cfg: ModelConfig | None = None
                    ) -> Callable:
    """jitted ``step(state, windows, teacher_params) -> (state, loss)`` (teacher_params None
    unless distilling with mode "kl")."""
    optimizer = make_optimizer(tc)
    dtype = jnp.dtype(tc.compute_dtype)
    distill = teacher_cfg is not None and tc.distill_mode == "kl"
    if tc.distill_mode not in ("kl", "ce"):
        raise ValueError(f"distill_mode must be 'kl' or 'ce', got {tc.distill_mode!r}")

    def loss_fn(params, windows, teacher_params):
        if distill:
            return kl_loss(params, cfg, teacher_params, teacher_cfg, windows, dtype)
        return lm_loss(params, cfg, windows, dtype)

    @jax.jit
    def step(state, windows, teacher_params):
        loss, grads = jax.value_and_grad(loss_fn)(state["params"], windows, teacher_params)
        updates, opt_state = optimizer.update(grads, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        rng, _ = jax.random.split(state["rng"])
        return {"params": params, "opt_state": opt_state, "step": state["step"] + 1,
                "rng": rng}, loss

    return step


# ----------------------------------------------------------------------------- checkpoints
def _manager(directory: str, max_to_keep: int = 2):
    import orbax.checkpoint as ocp

    return ocp.CheckpointManager(os.path.abspath(directory),
                                 options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep))


def save_state(manager, state: dict) -> None:
    import orbax.checkpoint as ocp

    manager.save(int(state["step"]), args=ocp.args.StandardSave(state), force=True)


def restore_state(manager, like: dict, step: int | None = None) -> dict:
    """Restore the checkpoint at ``step`` (latest if None) into the structure of ``like``."""
    import orbax.checkpoint as ocp

    step = manager.latest_step() if step is None else step
    abstract = jax.tree_util.tree_map(ocp.utils.to_shape_dtype_struct, like)
    return manager.restore(step, args=ocp.args.StandardRestore(abstract))


# ----------------------------------------------------------------------------- the loop
def train(
    cfg: ModelConfig,
    windows: np.ndarray,
    tc: TrainConfig,
    *,
    checkpoint_dir: str | None = None,
    checkpoint_every: int = 0,
    resume: bool = True,
    teacher: tuple[ModelConfig, dict] | None = None,
    init: dict | None = None,
    stop_after: int | None = None,
    progress: bool = True,
    desc: str = "train",
) -> dict:
    """Train ``cfg`` on ``windows`` [N, seq_len+1] for ``tc.steps`` steps; returns the state.

    ``teacher`` = (config, module params) distils (``tc.distill_mode``). With ``checkpoint_dir``
    the state is saved every ``checkpoint_every`` steps (0: only at the end) and at the end, and
    with ``resume`` the run continues from the latest checkpoint there. ``stop_after`` ends the
    run early at that step (as an interruption would), without the final save."""
    from tqdm import tqdm

    if windows.ndim != 2 or windows.shape[1] < 2:
        raise ValueError(f"windows must be [N, seq_len+1], got shape {windows.shape}")
    if int(windows.max(initial=0)) >= cfg.vocab_size:
        raise ValueError(f"token id {int(windows.max())} >= vocab_size {cfg.vocab_size}")
    teacher_cfg, teacher_params = teacher if teacher is not None else (None, None)
    if teacher_cfg is not None:
        if teacher_cfg.vocab_size != cfg.vocab_size:
            raise ValueError(f"teacher vocab {teacher_cfg.vocab_size} != draft vocab "
                             f"{cfg.vocab_size}")
        teacher_params = jax.tree_util.tree_map(
            lambda a: jnp.asarray(a, jnp.dtype(tc.compute_dtype)),
            params_for_module(teacher_cfg, teacher_params))
    if tc.distill_mode == "ce":
        teacher_cfg = None
        teacher_params = None

    state = init_state(cfg, tc, init)
    manager = _manager(checkpoint_dir) if checkpoint_dir else None
    if manager is not None and resume and manager.latest_step() is not None:
        state = restore_state(manager, state)
    step_fn = make_train_step(cfg, tc, teacher_cfg)
    start = int(state["step"])
    end = tc.steps if stop_after is None else min(tc.steps, stop_after)
    tokens_per_step = tc.batch_size * (windows.shape[1] - 1)
    bar = tqdm(total=tc.steps, initial=start, desc=desc, disable=not progress, dynamic_ncols=True)
    t_last, steps_since, rate = time.perf_counter(), 0, 0.0
    loss = None
    try:
        for s in range(start, end):
            batch = jnp.asarray(get_batch(windows, s, tc.batch_size, tc.seed))
            state, loss = step_fn(state, batch, teacher_params)
            steps_since += 1
            if manager is not None and checkpoint_every and (s + 1) % checkpoint_every == 0:
                save_state(manager, state)
            now = time.perf_counter()
            if progress and (now - t_last > 1.0 or s + 1 == end):
                loss_value = float(loss)  # syncs
                now = time.perf_counter()
                rate = steps_since * tokens_per_step / (now - t_last)
                bar.set_postfix(loss=f"{loss_value:.3f}", tok_s=f"{rate:,.0f}")
                t_last, steps_since = now, 0
            bar.update(1)
        if manager is not None and stop_after is None and (
                manager.latest_step() != int(state["step"])):
            save_state(manager, state)
    finally:
        bar.close()
        if manager is not None:
            manager.wait_until_finished()
            manager.close()
    return state


# ----------------------------------------------------------------------------- eval / export
def eval_loss(cfg: ModelConfig, params: dict, windows: np.ndarray, batch_size: int = 8,
              dtype=jnp.bfloat16) -> float:
    f = jax.jit(lambda p, w: lm_loss(p, cfg, w, dtype))
    losses = [float(f(params, jnp.asarray(windows[i:i + batch_size])))
              for i in range(0, len(windows) - batch_size + 1, batch_size)]
    return float(np.mean(losses))


def greedy_agreement(cfg_a: ModelConfig, params_a: dict, cfg_b: ModelConfig, params_b: dict,
                     windows: np.ndarray, batch_size: int = 8, dtype=jnp.bfloat16) -> float:
    """Fraction of positions where both models' argmax next tokens agree (greedy acceptance
    rate of a one-token draft)."""
    f = jax.jit(lambda pa, pb, t: (batch_logits(cfg_a, pa, t, dtype).argmax(-1)
                                   == batch_logits(cfg_b, pb, t, dtype).argmax(-1)).mean())
    vals = [float(f(params_a, params_b, jnp.asarray(windows[i:i + batch_size, :-1])))
            for i in range(0, len(windows) - batch_size + 1, batch_size)]
    return float(np.mean(vals))


def export_hf(path: str, cfg: ModelConfig, params: dict, tokenizer=None,
              dtype=jnp.bfloat16) -> str:
    """Module params -> HF checkpoint directory (runtime layout via ``params_for_serving``)."""
    from jspec.models.loader import save_checkpoint

    runtime = params_for_serving(cfg, params)
    runtime = jax.tree_util.tree_map(lambda a: np.asarray(jnp.asarray(a, dtype)), runtime)
    return save_checkpoint(path, cfg, runtime, tokenizer=tokenizer)


def describe_default_pair(vocab_size: int = 4096, context: int = 256) -> str:
    t, d = config_for("default", "target", vocab_size), config_for("default", "draft", vocab_size)
    ft, fd = forward_flops_per_token(t, context), forward_flops_per_token(d, context)
    f0t, f0d = forward_flops_per_token(t, 0), forward_flops_per_token(d, 0)
    return (f"target: {t.num_params() / 1e6:.2f}M params, {ft / 1e6:.1f} MFLOP/token\n"
            f"draft:  {d.num_params() / 1e6:.2f}M params, {fd / 1e6:.1f} MFLOP/token\n"
            f"draft/target forward FLOPs: {fd / ft:.3f} at context {context}, "
            f"{f0d / f0t:.3f} without attention")


if __name__ == "__main__":
    print(describe_default_pair())
