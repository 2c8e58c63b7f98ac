"""Cost-realistic synthetic mode: the shapes of a real pair, random weights, synthetic acceptance.

Why: the built-in pair is tiny, so on it a forward step is dominated by per-layer overhead and
the question "when does speculation stop paying?" gets the answer of a 10M-parameter model.
Real deployments run targets of 0.5B parameters and up, whose steps are memory-bound at small
batches (verifying 8 tokens costs about what 2 do) and compute-bound at large ones (cost nearly
linear in batch x tokens). Random weights give those costs exactly, but a random draft agrees
with a random target only by chance; so in this mode the *number of accepted drafts* is drawn,
per sequence and step, from a configured acceptance model, while every FLOP and byte of the
draft loop and the verification pass is real. vLLM offers the same for benchmarking. Outputs
are meaningless text and every report says SYNTHETIC.

Acceptance model (``SyntheticAcceptance``): per draft position i a conditional acceptance rate
p_i = P(draft i accepted | drafts 1..i-1 accepted); a step that drafted d tokens accepts the
first n, n = the number of leading successes of independent Bernoulli(p_1..p_d) draws (seeded).
Specs (``parse_acceptance``): one rate ``"0.8"`` (every position), a list ``"0.9,0.8,0.7"``
(the last repeats), a JSON file written by ``jspec bench pair --json`` (its unconditional
acceptance by position u_i become p_i = u_i / u_{i-1}: the accepted-length distribution that
pair showed at that γ is replayed), or ``default-pair`` for the shipped pair's recorded file
``models/default_pair/acceptance.json``. Positions are independent across steps: the bursts of
easy and hard text a real pair shows are not reproduced.

What stays real: the draft's and target's signals that some policies read (DSDE's KL, AdaSpec's
draft confidence and on-device stop) come from the random models, so those policies' decisions
in this mode say nothing about real text; Nightjar, DSD and static/off depend only on measured
time and (synthetic) acceptance counts.

Mechanics: the engine's runner is wrapped (``synthetic_runner``): when it fetches a step's
verification results it replaces each decoding row's accepted count
by the synthetic draw n and its emitted tokens by the row's first n drafted tokens followed by
the target's own emitted token. The target's KV already holds exactly those n drafted tokens
(it verified them as inputs), so the cache stays consistent, as after a real rejection at n.
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np

from jspec.default_models import SHIPPED_DIR
from jspec.jsonfile import read_json
from jspec.models.config import ModelConfig

SHIPPED_ACCEPTANCE = str(SHIPPED_DIR / "acceptance.json")


@dataclasses.dataclass
class SyntheticAcceptance:
    rates: tuple[float, ...]  # conditional acceptance per draft position (the last repeats)
    seed: int = 0
    source: str = ""

    def __post_init__(self):
        if not self.rates:
            raise ValueError("synthetic acceptance needs at least one rate")
        for r in self.rates:
            if not 0.0 <= r <= 1.0:
                raise ValueError(f"synthetic acceptance rates must be in [0, 1], got {r}")
        self.rates = tuple(float(r) for r in self.rates)
        self._rng = np.random.default_rng([self.seed, 1234])

    def conditional(self, num_positions: int) -> np.ndarray:
        r = np.asarray(self.rates, np.float64)
        if num_positions <= len(r):
            return r[:num_positions]
        return np.concatenate([r, np.full(num_positions - len(r), r[-1])])

    def expected_accepted(self, gamma: int) -> float:
        """E[accepted] for a step drafting ``gamma`` tokens."""
        return float(np.cumprod(self.conditional(gamma)).sum()) if gamma > 0 else 0.0

    def draw(self, drafted: np.ndarray) -> np.ndarray:
        """Accepted count per row for rows that drafted ``drafted`` tokens."""
        drafted = np.asarray(drafted, np.int64)
        width = int(drafted.max(initial=0))
        if width == 0:
            return np.zeros_like(drafted)
        ok = self._rng.random((len(drafted), width)) < self.conditional(width)[None, :]
        lead = np.cumprod(ok, axis=1).sum(axis=1)
        return np.minimum(lead, drafted)

    def apply(self, result, draft_tokens: np.ndarray, drafted: np.ndarray,
              gammas: np.ndarray):
        """The step's host-side VerifyResult with synthetic acceptance for rows with
        ``gammas`` > 0 (prefill rows and γ = 0 rows pass through unchanged)."""
        tokens = np.array(result.tokens, copy=True)
        num_accepted = np.array(result.num_accepted, copy=True)
        d = np.minimum(np.asarray(drafted, np.int64), np.asarray(gammas, np.int64))
        rows = np.nonzero(d > 0)[0]
        if len(rows) == 0:
            return result
        n = self.draw(d[rows])
        real_n = np.minimum(num_accepted[rows], d[rows])
        emitted = tokens[rows, real_n]  # the target's own token at its real rejection point
        src = np.asarray(draft_tokens)[rows]  # [rows, G]; tokens are [rows, G + 1]
        gamma = src.shape[1]
        new = tokens[rows].copy()
        new[:, :gamma] = np.where(np.arange(gamma)[None, :] < n[:, None], src, new[:, :gamma])
        new[np.arange(len(rows)), n] = emitted
        tokens[rows] = new
        num_accepted[rows] = n
        return dataclasses.replace(result, tokens=tokens, num_accepted=num_accepted)

    def describe(self) -> dict:
        return {"conditional_acceptance": list(self.rates), "source": self.source,
                "seed": self.seed,
                "expected_accepted_at_gamma": {g: round(self.expected_accepted(g), 4)
                                               for g in range(1, 9)}}


def parse_acceptance(spec: str, seed: int = 0) -> SyntheticAcceptance:
    """``"0.8"``, ``"0.9,0.8,0.7"``, a ``jspec bench pair --json`` file or ``default-pair``."""
    spec = str(spec).strip()
    if spec == "default-pair":
        if not os.path.exists(SHIPPED_ACCEPTANCE):
            raise ValueError(f"the shipped pair's recorded acceptance {SHIPPED_ACCEPTANCE!r} is "
                             "missing; record one with `jspec bench pair --json FILE`")
        return _from_file(SHIPPED_ACCEPTANCE, seed, "default-pair")
    if os.path.exists(spec) or spec.endswith(".json"):
        return _from_file(spec, seed, spec)
    try:
        rates = tuple(float(x) for x in spec.split(","))
    except ValueError:
        raise ValueError(f"synthetic acceptance {spec!r} is neither rates (0.8 or 0.9,0.8,...), "
                         "a JSON file from `jspec bench pair --json`, nor 'default-pair'") from None
    return SyntheticAcceptance(rates, seed=seed, source=f"rates {spec}")


def _from_file(path: str, seed: int, label: str) -> SyntheticAcceptance:
    data = read_json(path, "synthetic acceptance")
    if not isinstance(data, dict):
        raise ValueError(f"synthetic acceptance {path!r} must hold a JSON object")
    if "conditional_acceptance" in data:
        rates = tuple(data["conditional_acceptance"])
    elif "acceptance_by_position" in data:
        rates = conditional_from_unconditional(data["acceptance_by_position"])
    else:
        raise ValueError(f"{path!r} has neither 'acceptance_by_position' (jspec bench pair "
                         "--json) nor 'conditional_acceptance'")
    return SyntheticAcceptance(rates, seed=seed, source=f"recorded: {label}")


def conditional_from_unconditional(per_position) -> tuple[float, ...]:
    """P(position i accepted) for i = 1..γ (as ``jspec bench pair`` reports them) ->
    P(position i accepted | 1..i-1 accepted)."""
    u = [float(x) for x in per_position]
    if not u:
        raise ValueError("empty acceptance-by-position list")
    out, prev = [], 1.0
    for x in u:
        if not 0.0 <= x <= prev + 1e-9:
            raise ValueError(f"acceptance by position must be non-increasing in [0, 1], got {u}")
        out.append(x / prev if prev > 0 else 0.0)
        prev = x
    return tuple(min(1.0, v) for v in out)


# ----------------------------------------------------------------------------- model shapes
# Qwen2.5-0.5B and a draft about ten times cheaper. The draft keeps the vocabulary (a real pair
# shares its tokenizer), so its output head over 152k tokens is most of its cost, as it is for
# real small drafts. `jspec bench model-step` times the same two shapes.
QWEN25_05B = dict(model_type="qwen2", vocab_size=151936, hidden_size=896, num_layers=24,
                  num_heads=14, num_kv_heads=2, head_dim=64, intermediate_size=4864,
                  tie_word_embeddings=True, qkv_bias=True, rope_theta=1000000.0,
                  max_position_embeddings=32768, rms_norm_eps=1e-6)
QWEN25_05B_DRAFT = dict(QWEN25_05B, hidden_size=320, num_layers=6, num_heads=5, num_kv_heads=1,
                        intermediate_size=1024)

# Qwen2.5-7B drafted by Qwen2.5-0.5B, the pair a GPU serves (`jspec validate-gpu`). The draft's
# embedding takes the 7B's 152064 rows (the real 0.5B pads its vocabulary to 151936): the engine
# wants one vocabulary size, and 128 more rows of the output head change nothing measurable.
QWEN25_7B = dict(QWEN25_05B, vocab_size=152064, hidden_size=3584, num_layers=28, num_heads=28,
                 num_kv_heads=4, head_dim=128, intermediate_size=18944, tie_word_embeddings=False)
QWEN25_7B_DRAFT = dict(QWEN25_05B, vocab_size=152064)
# a stand-in that runs anywhere in seconds (the built-in tokenizer's 4096 tokens): for smoke runs
# of the harnesses on a CPU, not for numbers
TINY = dict(model_type="llama", vocab_size=4096, hidden_size=64, num_layers=2, num_heads=4,
            num_kv_heads=2, head_dim=16, intermediate_size=128, max_position_embeddings=1024)
TINY_DRAFT = dict(TINY, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                  intermediate_size=64)
QWEN_EOS = (151643, 151645)

# name -> (target config, draft config); the engine caps max_model_len at 4096 by default
SHAPES: dict[str, tuple[ModelConfig, ModelConfig]] = {
    "qwen2.5-0.5b": (ModelConfig(**QWEN25_05B, eos_token_ids=QWEN_EOS),
                     ModelConfig(**QWEN25_05B_DRAFT, eos_token_ids=QWEN_EOS)),
    "qwen2.5-7b": (ModelConfig(**QWEN25_7B, eos_token_ids=QWEN_EOS),
                   ModelConfig(**QWEN25_7B_DRAFT, eos_token_ids=QWEN_EOS)),
    "tiny": (ModelConfig(**TINY, eos_token_ids=(2, 4)),
             ModelConfig(**TINY_DRAFT, eos_token_ids=(2, 4))),
}

_PARAMS: dict[tuple[str, str, str], dict] = {}


def check_shape(shape: str, target: str | None = None) -> None:
    """The checks of a command's ``--synthetic SHAPE`` (with its ``--target``), made before
    anything loads."""
    if target is not None:
        raise ValueError("--synthetic builds its own random-weight models; drop --target and "
                         "--draft")
    if shape not in SHAPES:
        raise ValueError(f"unknown --synthetic shape {shape!r}; choose from {', '.join(SHAPES)}")


def random_params(cfg: ModelConfig, dtype, seed: int = 0) -> dict:
    """Random weights in the runtime layout, generated on device (numpy would take most of a
    minute for the 0.5B shapes). Values only need to be finite and non-degenerate: normal(0,
    0.02) matrices, unit norms, the tied head the transposed embedding."""
    import jax
    import jax.numpy as jnp

    from jspec.models.params import param_shapes

    shapes = param_shapes(cfg)
    leaves, treedef = jax.tree_util.tree_flatten(shapes, is_leaf=lambda s: isinstance(s, tuple))
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    out = []
    for key, shape in zip(keys, leaves):
        make = jax.jit(lambda k, shape=shape: (0.02 * jax.random.normal(k, shape, jnp.float32))
                       .astype(dtype))
        out.append(make(key))
    params = jax.tree_util.tree_unflatten(treedef, out)
    params["final_norm"] = jnp.ones_like(params["final_norm"])
    params["layers"]["attn_norm"] = jnp.ones_like(params["layers"]["attn_norm"])
    params["layers"]["mlp_norm"] = jnp.ones_like(params["layers"]["mlp_norm"])
    if cfg.tie_word_embeddings:
        params["lm_head"] = jnp.transpose(params["embed"])
    return jax.block_until_ready(params)


def synthetic_models(shape: str, dtype: str = "bfloat16"):
    """(target, draft) LoadedModels with random weights of ``shape`` (cached per process, so
    every policy of a benchmark shares one copy)."""
    import jax.numpy as jnp

    from jspec.runner import LoadedModel

    if shape not in SHAPES:
        raise ValueError(f"unknown synthetic shape {shape!r}; choose from {', '.join(SHAPES)}")
    models = []
    for role, cfg, seed in (("target", SHAPES[shape][0], 0), ("draft", SHAPES[shape][1], 1)):
        key = (shape, role, dtype)
        if key not in _PARAMS:
            _PARAMS[key] = random_params(cfg, jnp.dtype(dtype), seed=seed)
        models.append(LoadedModel(cfg=cfg, params=_PARAMS[key], name=f"synthetic-{role}"))
    return models[0], models[1]


def install(engine, spec: str, seed: int = 0) -> SyntheticAcceptance:
    """Benchmarking only: from now on, each drafting row's accepted count in ``engine`` is a
    draw from the acceptance model ``spec`` (``parse_acceptance``) instead of the
    verification's, rewritten in the step's results as they reach the host (the runner's
    ``fetch``), so the engine's step is untouched. The engine then refuses logprobs: the tokens
    rewritten here are not the ones the log-probabilities were computed for. Install before the
    engine's first step (its step-time profile is cached per acceptance model)."""
    import jax

    acceptance = parse_acceptance(spec, seed=seed)
    runner = engine.runner
    if len(runner.pool) > 1:
        raise ValueError("synthetic acceptance models one draft's acceptance; it does not "
                         f"support a pool of {len(runner.pool)} drafts")
    fetch = runner.fetch

    def synthetic_fetch(result, signals, num_drafted, draft_tokens, gammas, logprobs=None):
        result, signals, drafted, logprobs = fetch(result, signals, num_drafted, draft_tokens,
                                                   gammas, logprobs)
        if draft_tokens is not None:
            result = acceptance.apply(result, jax.device_get(draft_tokens), drafted, gammas)
        return result, signals, drafted, logprobs

    if runner.pool:
        runner.fetch = synthetic_fetch
        runner.synthetic_acceptance = spec
    engine.refuse_logprobs("logprobs are not available with synthetic acceptance: the emitted "
                           "tokens are drawn from an acceptance model, not sampled")
    return acceptance
