"""Bad input is a ValueError naming the problem and the limit, raised before anything runs; the
engine keeps serving everyone else."""

from __future__ import annotations

import re

import pytest

from conftest import LLM_KW
from jspec.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
MAX_MODEL_LEN = LLM_KW["max_model_len"]


@pytest.mark.parametrize("kwargs, message", [
    (dict(max_tokens=0), "max_tokens must be an integer >= 1, got 0"),
    (dict(max_tokens=-3), "max_tokens must be an integer >= 1, got -3"),
    (dict(max_tokens=2.5), "max_tokens must be an integer >= 1, got 2.5"),
    (dict(temperature=-0.5), "temperature must be a finite number >= 0, got -0.5"),
    (dict(temperature=float("nan")), "temperature must be a finite number >= 0"),
    (dict(top_p=0.0), "top_p must be in (0, 1], got 0.0"),
    (dict(top_p=1.5), "top_p must be in (0, 1], got 1.5"),
    (dict(top_p=-0.1), "top_p must be in (0, 1], got -0.1"),
    (dict(top_k=-2), "top_k must be an integer >= 0"),
    (dict(seed=-1), "seed must be an integer in [0, 2**32)"),
    (dict(stop=[""]), "stop strings must be non-empty strings"),
    (dict(stop_token_ids=[-1]), "stop_token_ids must be non-negative integers"),
])
def test_sampling_params_name_the_field_and_limit(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("prompt, message", [
    ("", "prompt is empty"),
    ([], "prompt is empty"),
    (list(range(3, 3 + MAX_MODEL_LEN + 50)), f"prompt has {MAX_MODEL_LEN + 50} tokens, "
                                             f"max_model_len is {MAX_MODEL_LEN}"),
    # one token must remain for the output
    (list(range(3, 3 + MAX_MODEL_LEN)), f"max_model_len is {MAX_MODEL_LEN}"),
    ([5, 600], "prompt token id 600 is outside the vocabulary [0, 512)"),
])
def test_bad_prompt_raises_before_anything_runs(tiny_llm, prompt, message):
    engine = tiny_llm.engine
    steps = engine.metrics.num_steps
    # the good prompt beside it must not run either: everything is validated first
    with pytest.raises(ValueError, match=re.escape(message)):
        tiny_llm.generate(["def fibonacci(n):", prompt], GREEDY, use_tqdm=False)
    assert engine.metrics.num_steps == steps
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.num_used_blocks == 0


def test_longest_allowed_prompt_runs(tiny_llm):
    prompt = list(range(3, 3 + MAX_MODEL_LEN - 1))
    (out,) = tiny_llm.generate(prompt, GREEDY, use_tqdm=False)
    # clipped to what the context leaves
    assert out.finish_reason == "length" and len(out.token_ids) == 1


def test_sampling_params_must_be_sampling_params(tiny_llm):
    with pytest.raises(ValueError, match="sampling_params must be a SamplingParams, got dict"):
        tiny_llm.generate(["hello"], [{"max_tokens": 3}], use_tqdm=False)
    with pytest.raises(ValueError, match="sampling_params must be a SamplingParams, got dict"):
        tiny_llm.engine.add_request("dict-params", "hello", {"max_tokens": 3})
    assert not tiny_llm.engine.has_unfinished_requests()


def test_engine_keeps_serving_after_bad_requests(tiny_llm):
    engine = tiny_llm.engine
    (expected,) = tiny_llm.generate("Hello, world!", GREEDY, use_tqdm=False)
    engine.add_request("good-1", "Hello, world!", GREEDY)
    engine.step()  # good-1 is running when the bad ones arrive
    with pytest.raises(ValueError, match="prompt is empty"):
        engine.add_request("bad-1", "", GREEDY)
    with pytest.raises(ValueError, match=re.escape(f"max_model_len is {MAX_MODEL_LEN}")):
        engine.add_request("bad-2", [7] * (MAX_MODEL_LEN + 1), GREEDY)
    with pytest.raises(ValueError, match="request id 'good-1' is already in use"):
        engine.add_request("good-1", "again", GREEDY)
    engine.add_request("good-2", "Hello, world!", GREEDY)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert set(done) == {"good-1", "good-2"}
    for out in done.values():
        assert out.token_ids == expected.token_ids and out.finish_reason == "length"
    assert engine.block_manager.num_used_blocks == 0
    engine.block_manager.check_invariants()


def test_unknown_policy(tiny_pair):
    from jspec.llm import LLM

    target, draft = tiny_pair
    with pytest.raises(ValueError, match=re.escape(
            "unknown policy 'nope'; known policies: adaedl, adaspec, auto, dsd, dsde, "
            "heuristic, nightjar, off, specrouter, static, ucb")):
        LLM(target=target, draft=draft, policy="nope", **LLM_KW)


@pytest.mark.parametrize("options, message", [
    ({"gamma": 9}, "gamma must be in [0, max_gamma=7], got 9"),
    ({"bogus": 1}, "bad options for policy 'static'"),
])
def test_bad_policy_options(tiny_pair, options, message):
    from jspec.llm import LLM

    target, draft = tiny_pair
    with pytest.raises(ValueError, match=re.escape(message)):
        LLM(target=target, draft=draft, policy_options=options, **LLM_KW)


@pytest.mark.parametrize("overrides, message", [
    (dict(max_model_len=1024), "max_model_len=1024 exceeds the target model's "
                               "max_position_embeddings=512"),
    (dict(max_num_seqs=0), "max_num_seqs must be a positive integer, got 0"),
    (dict(dtype="float16"), "dtype must be 'auto', 'bfloat16' or 'float32', got 'float16'"),
    (dict(num_kv_blocks=1), "num_kv_blocks must be >= 2"),
])
def test_bad_engine_config(tiny_pair, overrides, message):
    from jspec.llm import LLM

    target, draft = tiny_pair
    with pytest.raises(ValueError, match=re.escape(message)):
        LLM(target=target, draft=draft, **dict(LLM_KW, **overrides))


def test_draft_with_another_vocabulary(tiny_pair, tmp_path):
    from jspec.llm import LLM
    from jspec.models.tiny import DRAFT_OVERRIDES, write_tiny_checkpoint

    target, _ = tiny_pair
    draft = write_tiny_checkpoint(tmp_path / "draft-520", "llama", seed=3, vocab_size=520,
                                  **DRAFT_OVERRIDES)
    with pytest.raises(ValueError, match=re.escape(
            "draft vocabulary (520 tokens) differs from the target's (512)")):
        LLM(target=target, draft=draft, **LLM_KW)


def test_draft_without_target(tiny_pair):
    from jspec.llm import LLM

    with pytest.raises(ValueError, match="a draft was given without a target"):
        LLM(draft=tiny_pair[1], **LLM_KW)


def test_missing_checkpoint(tmp_path):
    from jspec.llm import LLM

    with pytest.raises(ValueError, match="checkpoint directory .*nowhere.* does not exist"):
        LLM(target=tmp_path / "nowhere", draft=None, **LLM_KW)
