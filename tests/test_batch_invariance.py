"""Batch-invariant numerics (EngineConfig.deterministic, pallas_kernels/batch_invariance.py).

In bfloat16 a token's logits must not depend on the batch it runs in, so greedy speculative
output equals plain greedy output token for token with every policy, decoded alone or batched,
with the prompt prefilled in chunks or whole. (The fp32 lossless tests are in
test_engine_lossless.py; bf16 is the serving dtype on CPU and the one whose rounding amplifies
every difference in summation order.)
"""

from __future__ import annotations

import jax
import jax.extend.core as jax_core
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import ENGINE_KW, make_engine, run_to_completion
from jspec.runner import LoadedModel
from jspec.sampling_params import SamplingParams
from jspec.kernels.batch_invariance import (MIN_DOT_ROWS, invariant_rows, min_q_block,
                                            pad_rows, row_sum)
from jspec.policies import POLICIES, make_policy, policy_options
from policy_helpers import free_draft_profile

MAX_TOKENS = 24
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
BF16 = dict(dtype="bfloat16")


def test_pad_rows_and_min_q_block():
    x = jnp.arange(6.0).reshape(2, 3)
    padded = pad_rows(x)
    assert padded.shape == (MIN_DOT_ROWS, 3)
    np.testing.assert_array_equal(padded[:2], x)
    assert not np.asarray(padded[2:]).any()
    # past one panel to a multiple of it: no dot has a last panel of one to three rows
    assert [pad_rows(jnp.zeros((n, 3))).shape[0] for n in (5, 9, 16, 17, 18, 20, 33)] == \
        [5, 9, 16, 20, 20, 20, 36]
    # tiles reach MIN_DOT_ROWS (token, head) rows, in powers of two
    assert [min_q_block(g) for g in (1, 2, 3, 4, 7, 8)] == [4, 2, 2, 1, 1, 1]


@pytest.mark.parametrize("layout", ["in_out", "out_in"])
@pytest.mark.parametrize("shape", [(64, 192), (192, 64), (384, 384), (896, 4864), (4864, 896)])
def test_xla_dot_rows_do_not_depend_on_the_row_count(shape, layout):
    """What the mode rests on: on this backend every row of a bf16 dot (float32 accumulation)
    comes out bit-identical for every row count the mode runs (``invariant_rows``), in any
    position, with the weight stored either way (models/params.py). 20 and 36 rows leave a last
    panel of four rows past 16 and 32; a [rows, 384] @ [384, 384] product's last panel of one or
    two rows (18, 34) takes another order on the Intel Xeon with AMX, which is why the mode never
    runs one. If a machine breaks this, the deterministic mode's guarantee does not hold there."""
    rng = np.random.default_rng(0)
    k, n = shape
    w = rng.standard_normal((k, n)) * 0.05
    contract = 0
    if layout == "out_in":
        w, contract = np.ascontiguousarray(w.T), 1
    w = jnp.asarray(w, jnp.bfloat16)
    x = jnp.asarray(rng.standard_normal((260, k)), jnp.bfloat16)
    dot = jax.jit(lambda x, w: jax.lax.dot_general(x, w, (((1,), (contract,)), ((), ())),
                                                   preferred_element_type=jnp.float32))
    widest = np.asarray(dot(x, w))
    for rows in (MIN_DOT_ROWS, 5, 9, 10, 16, 20, 36, 68):
        assert invariant_rows(rows) == rows
        np.testing.assert_array_equal(np.asarray(dot(x[:rows], w)), widest[:rows],
                                      err_msg=f"{rows}")
    moved = x[:16].at[11].set(x[0])  # the same row in another position of the batch
    np.testing.assert_array_equal(np.asarray(dot(moved, w))[11], widest[0])


def _dot_rows(jaxpr) -> list[int]:
    """The row counts of every two-dimensional product in ``jaxpr`` and the jaxprs it calls."""
    rows = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general" and eqn.invars[0].aval.ndim == 2:
            rows.append(eqn.invars[0].aval.shape[0])
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                if isinstance(sub, jax_core.ClosedJaxpr):
                    sub = sub.jaxpr
                if isinstance(sub, jax_core.Jaxpr):
                    rows += _dot_rows(sub)
    return rows


def test_a_batch_invariant_forward_multiplies_whole_multiples_of_the_floor():
    """18 tokens over six sequences (a 6-row γ = 2 verification) and their logits: every
    product of the forward, projections, output head and row sums, runs over rows the mode
    allows, the 18 tokens' over 20."""
    import functools

    from jspec.kernels.ragged_paged_attention import (
        AttentionMetadata, ragged_paged_attention_tiled)
    from jspec.models.params import init_params
    from jspec.models.tiny import tiny_config
    from jspec.models.transformer import KVCache, ModelInput, forward

    cfg = tiny_config("llama")
    params = init_params(cfg, 0, jnp.bfloat16)
    kv = KVCache.create(cfg, 16, 4, jnp.bfloat16)
    i32 = jnp.int32
    batch = ModelInput(jnp.zeros(18, i32), AttentionMetadata(
        jnp.arange(18, dtype=i32), jnp.arange(0, 19, 3, dtype=i32), jnp.full(6, 3, i32),
        jnp.zeros((6, 2), i32)), jnp.arange(18, dtype=i32))
    attend = functools.partial(ragged_paged_attention_tiled, batch_invariant=True)
    run = functools.partial(forward, cfg=cfg, attention_fn=attend, batch_invariant=True)
    rows = _dot_rows(jax.make_jaxpr(run)(params, kv, batch).jaxpr)
    assert rows and all(invariant_rows(r) == r for r in rows), rows
    assert 20 in rows and 18 not in rows
    logits, _ = run(params, kv, batch)
    assert logits.shape == (18, cfg.vocab_size)


@pytest.mark.parametrize("width", [128, 384, 960])
def test_row_sums_keep_one_order_for_every_row_count(width):
    """RMSNorm's mean of squares and attention's softmax denominator sum a row's values; the
    mode sums them as a product (``row_sum``), whose order does not depend on the number of rows
    (XLA:CPU's own reduction changes it: at 960 columns from 5 rows on the Intel Xeon)."""
    x = jnp.asarray(np.random.default_rng(0).standard_normal((300, width)), jnp.float32)
    rows = row_sum(x[:MIN_DOT_ROWS])
    for n in (1, 2, MIN_DOT_ROWS + 1, 8, 16, 17, 64, 300):
        np.testing.assert_array_equal(np.asarray(row_sum(x[:n]))[:min(n, MIN_DOT_ROWS)],
                                      np.asarray(rows)[:min(n, MIN_DOT_ROWS)], err_msg=f"{n}")
    np.testing.assert_allclose(np.asarray(row_sum(x)), np.asarray(x).sum(-1), rtol=1e-5,
                               atol=1e-4)
    assert row_sum(x.reshape(3, 100, width)).shape == (3, 100)


CODE_PROMPTS = [
    "def fibonacci(n):",
    "import numpy as np\n\n\ndef moving_average(values, window):\n    \"\"\"Average of each "
    "window of values.\"\"\"\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):",
    "def parse_args(argv):\n    parser = argparse.ArgumentParser(description=\"Copy files.\")\n"
    "    parser.add_argument(\"--src\", required=True)\n    parser.add_argument(\"--dst\", "
    "required=True)\n    parser.add_argument(\"--verbose\", action=\"store_true\")\n",
]


def test_the_built_in_targets_logprobs_do_not_depend_on_the_batch():
    """The built-in target (hidden 384): four prompts decoded alone and side by side keep every
    logprob's bits. Its rows are wide enough that XLA:CPU's own row sums (RMSNorm over 384
    values, attention's softmax over 128-token chunks) change their order with the batch, which
    the tiny models' 64-wide rows never reach; the mode's row sums must not."""
    from jspec import LLM

    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=0)
    llm = LLM(dtype="bfloat16", policy="off", max_num_seqs=4, use_tqdm=False)

    def decoded(outputs):
        return [(list(o.outputs[0].token_ids),
                 [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)])
                for o in outputs]

    alone = [decoded(llm.generate([p], params, use_tqdm=False))[0] for p in CODE_PROMPTS]
    assert decoded(llm.generate(CODE_PROMPTS, params, use_tqdm=False)) == alone


# ----------------------------------------------------------------------------- engine level
@pytest.fixture(scope="module")
def bf16_models(engine_models):
    """The fp32 engine models cast to bfloat16 (the pools follow the params' dtype)."""
    def cast(m):
        params = jax.tree_util.tree_map(lambda a: jnp.asarray(a, jnp.bfloat16), m.params)
        return LoadedModel(m.cfg, params, m.name)

    return tuple(cast(m) for m in engine_models)


@pytest.fixture(scope="module")
def prompts(mixed_prompts):
    """Eight prompts of 1-100 tokens: the long ones are prefilled in chunks."""
    return mixed_prompts[:8]


@pytest.fixture(scope="module")
def plain_alone(bf16_models, prompts):
    """Target-only greedy decoding of each prompt on its own (B = 1): the reference."""
    target = bf16_models[0]
    engine = make_engine(target, None, **BF16)
    return [run_to_completion(engine, [p], GREEDY)["0"].token_ids for p in prompts]


def _batched(engine, prompts):
    outs = run_to_completion(engine, prompts, GREEDY)
    return [outs[str(i)].token_ids for i in range(len(prompts))]


def _assert_same(outputs, reference, what):
    for i, (out, ref) in enumerate(zip(outputs, reference)):
        assert out == ref, f"{what}: prompt {i} diverged at token " \
            f"{next(j for j, (a, b) in enumerate(zip(out, ref)) if a != b)}"


def test_plain_batched_equals_plain_alone(bf16_models, prompts, plain_alone):
    _assert_same(_batched(make_engine(bf16_models[0], None, **BF16), prompts), plain_alone,
                 "plain decoding in a batch of 8")


def test_unchunked_prefill_equals_chunked(bf16_models, prompts, plain_alone):
    """Whole prompts (no chunked prefill, a 128-token budget) against the 64-token chunks of the
    reference's engine."""
    engine = make_engine(bf16_models[0], None, enable_chunked_prefill=False,
                         max_num_batched_tokens=128, **BF16)
    _assert_same(_batched(engine, prompts), plain_alone, "unchunked prefill")


# every speculative policy (off is the reference), fixed γ at several lengths
SPECULATIVE = [
    ("static", (("gamma", 1),)),
    ("static", (("gamma", 3),)),
    ("static", (("gamma", 7),)),
    ("nightjar", ()),
    ("dsde", ()),
    ("adaspec", ()),
    ("dsd", ()),
    ("ucb", ()),
    ("adaedl", (("lam", 0.1),)),  # at the default λ it drafts nothing here
    ("heuristic", ()),
    ("specrouter", ()),
    ("auto", ()),
]


def test_every_policy_is_checked():
    assert {name for name, _ in SPECULATIVE} | {"off"} == set(POLICIES)


@pytest.mark.parametrize("policy, options", SPECULATIVE)
def test_speculative_equals_plain_in_bf16(bf16_models, prompts, plain_alone, policy, options):
    """Every draft length, fixed or chosen per step / per sequence, verified with its drafted
    tokens beside other sequences' prefill chunks and decode rows: the plain tokens."""
    target, draft, _ = bf16_models
    label = f"{policy} {dict(options)} batched"
    options = dict(options)
    # the cost-aware policies speculate only where their step times say it pays: with these tiny
    # models the draft costs about what the target does, so a measured profile (or the run's
    # measured times) can make γ = 0 right on a busy machine. A profile where drafting is nearly
    # free keeps this test about losslessness.
    if "profile" in policy_options(policy):
        options["profile"] = free_draft_profile(target.cfg, draft.cfg)
    if "measured" in policy_options(policy):
        options["measured"] = False
    engine = make_engine(target, draft, make_policy(policy, ENGINE_KW["num_speculative_tokens"],
                                                    **options), **BF16)
    _assert_same(_batched(engine, prompts), plain_alone, label)
    assert engine.metrics.spec_decode_num_accepted_tokens > 0  # it really speculated


def test_speculative_alone_equals_plain_alone(bf16_models, prompts, plain_alone):
    target, draft, _ = bf16_models
    engine = make_engine(target, draft, policy_options=(("gamma", 4),), **BF16)
    outs = [run_to_completion(engine, [p], GREEDY)["0"].token_ids for p in prompts]
    _assert_same(outs, plain_alone, "static γ=4 alone")


def test_the_backend_probe_passes_here_and_names_what_differs(monkeypatch):
    from jspec.kernels import batch_invariance

    assert batch_invariance.probe_dots("bfloat16", 64, 192) is None
    assert batch_invariance.probe_dots("bfloat16", 64, 192, "out_in") is None
    # a backend whose dots changed order past 4 rows would be named, with the shapes
    monkeypatch.setattr(batch_invariance, "MIN_DOT_ROWS", 1)
    batch_invariance.probe_dots.cache_clear()
    try:
        reason = batch_invariance.probe_dots("bfloat16", 64, 192)
    finally:
        batch_invariance.probe_dots.cache_clear()
    assert reason is not None and "differs between 1 and" in reason and "[rows, 64]" in reason
    with pytest.warns(batch_invariance.BatchInvarianceWarning, match="cannot make logits"):
        batch_invariance.warn_if_unsupported("bfloat16", [(64, 200)])
    batch_invariance.probe_dots.cache_clear()
