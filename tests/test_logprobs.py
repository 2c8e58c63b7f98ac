"""Log-probabilities of generated tokens: the target's raw distribution at the place each token
was emitted, whatever speculation did there; computed only on steps that ask."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import make_engine, run_to_completion
from jspec.config import EngineConfig
from jspec.sampling_params import SamplingParams
from jspec.models.transformer import dense_forward
from jspec.policies.static import StaticPolicy

K = 3


@functools.cache
def _dense_fn(cfg):
    return jax.jit(lambda p, t: jax.nn.log_softmax(dense_forward(p, t, cfg=cfg), axis=-1))


def _dense_logprobs(target, tokens: list[int]) -> np.ndarray:
    padded = np.zeros(128, np.int32)  # causal: right padding never changes earlier positions
    padded[:len(tokens)] = tokens
    return np.asarray(_dense_fn(target.cfg)(target.params, jnp.asarray(padded)))


@pytest.mark.parametrize("gamma", [0, 3])
def test_logprobs_are_the_targets_at_every_emitted_token(engine_models, mixed_prompts, gamma):
    """Greedy and sampled requests with drafts accepted and rejected, prefill's first token, a
    request without logprobs in the same batch: each token's entry equals a dense forward's
    log-softmax at its position (logprob, rank, the top K)."""
    target, draft, _ = engine_models
    # compiled as the steps need them (the warm-up's logprobs buckets: test_engine_workloads)
    engine = make_engine(target, draft, policy=StaticPolicy(7, gamma=gamma), warmup=False)
    prompts = mixed_prompts[:4]
    params = [SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=K),
              SamplingParams(max_tokens=12, temperature=0.9, seed=7, ignore_eos=True,
                             logprobs=K),
              SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=12, temperature=0.7, seed=1, ignore_eos=True,
                             logprobs=0)]
    outs = run_to_completion(engine, prompts, params)
    if gamma:
        assert engine.metrics.spec_decode_num_accepted_tokens > 0
        assert engine.metrics.spec_decode_num_accepted_tokens < \
            engine.metrics.spec_decode_num_draft_tokens  # some drafts rejected
    assert outs["2"].logprobs is None and outs["2"].cumulative_logprob is None
    for i in (0, 1, 3):
        out, k = outs[str(i)], params[i].logprobs
        assert len(out.logprobs) == len(out.token_ids) == 12
        dense = _dense_logprobs(target, list(prompts[i]) + out.token_ids)
        for j, (token, entry) in enumerate(zip(out.token_ids, out.logprobs)):
            ref = dense[len(prompts[i]) + j - 1]
            order = np.argsort(-ref, kind="stable")
            assert entry[token].logprob == pytest.approx(ref[token], abs=1e-4)
            assert entry[token].rank == 1 + int((ref > ref[token]).sum())
            top = sorted((lp.rank, t) for t, lp in entry.items() if lp.rank <= k)
            assert [t for _, t in top] == order[:k].tolist()
            assert set(entry) == set(order[:k].tolist()) | {token}
        assert out.cumulative_logprob == pytest.approx(
            sum(e[t].logprob for t, e in zip(out.token_ids, out.logprobs)))
    assert outs["0"].logprobs[0][outs["0"].token_ids[0]].rank == 1  # greedy: the argmax


def test_logprobs_limit_and_off(engine_models):
    target, draft, _ = engine_models
    engine = make_engine(target, draft, max_logprobs=4, warmup=False)
    assert engine.limits.max_logprobs == 4
    with pytest.raises(ValueError, match=r"logprobs=5 is more than this engine returns \(at "
                                         r"most 4\); build it with max_logprobs=5"):
        engine.add_request("a", [5, 6, 7], SamplingParams(logprobs=5))
    off = make_engine(target, draft, max_logprobs=0, warmup=False)
    assert not any(item[0] == "logprobs" for item in off.runner.bucket_plan())
    assert any(item[0] == "logprobs" for item in engine.runner.bucket_plan())
    with pytest.raises(ValueError, match=r"logprobs are off in this engine \(max_logprobs=0\)"):
        off.add_request("a", [5, 6, 7], SamplingParams(logprobs=0))
    with pytest.raises(ValueError, match="logprobs must be None or an integer >= 0"):
        SamplingParams(logprobs=-1)
    with pytest.raises(ValueError, match="max_logprobs must be an integer >= 0"):
        EngineConfig(max_logprobs=-2)
