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
    (dict(stop_token_ids=[True]), "stop_token_ids must be non-negative integers, got True"),
    (dict(ignore_eos="yes"), "ignore_eos must be True or False, got 'yes'"),
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
    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    (out,) = tiny_llm.generate(prompt, one, use_tqdm=False)
    assert out.finish_reason == "length" and len(out.token_ids) == 1


def test_max_tokens_beyond_the_context_is_refused(tiny_llm):
    """Not truncated: the same refusal, in the same words, as the server's 400 and the CLI's."""
    prompt = list(range(3, 103))
    steps = tiny_llm.engine.metrics.num_steps
    with pytest.raises(ValueError, match=re.escape(
            f"max_tokens=50 is too large: the prompt has 100 tokens and max_model_len is "
            f"{MAX_MODEL_LEN}, so at most {MAX_MODEL_LEN - 100} can be generated")):
        tiny_llm.generate(prompt, SamplingParams(max_tokens=50), use_tqdm=False)
    with pytest.raises(ValueError, match=re.escape("prompts[1]: max_tokens=50 is too large")):
        tiny_llm.generate(["Hello", prompt], SamplingParams(max_tokens=50), use_tqdm=False)
    with pytest.raises(ValueError, match="max_tokens=50 is too large"):
        tiny_llm.engine.add_request("too-long", prompt, SamplingParams(max_tokens=50))
    assert tiny_llm.engine.metrics.num_steps == steps
    assert not tiny_llm.engine.has_unfinished_requests()
    (out,) = tiny_llm.generate(prompt, SamplingParams(max_tokens=MAX_MODEL_LEN - 100,
                                                      ignore_eos=True), use_tqdm=False)
    assert len(out.token_ids) == MAX_MODEL_LEN - 100


@pytest.mark.parametrize("prompts, message", [
    (None, "prompts must be a string, a list of token ids, a {'prompt': text} or "
           "{'prompt_token_ids': ids} dict, or a list of those, got null"),
    (5, "prompts must be a string, a list of token ids"),
    (["Hello", None], "prompts[1]: prompt must be a string or a list of token ids, got null"),
    (["Hello", 5], "prompts[1]: prompt must be a string or a list of token ids, got an integer"),
    ([[5, 6], [5, 2.5]], "prompts[1]: prompt[1] must be an integer token id, got a number (2.5)"),
    ([5, True], "prompt[1] must be an integer token id, got a boolean (true)"),
    (["Hello", ""], "prompts[1]: prompt is empty"),
    ({"text": "Hello"}, "a prompt dict takes exactly one of 'prompt' (text) or "
                        "'prompt_token_ids' (token ids), and optionally 'cache_salt'; got "
                        "keys ['text']"),
])
def test_prompts_of_the_wrong_kind_name_the_argument(tiny_llm, prompts, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        tiny_llm.generate(prompts, GREEDY, use_tqdm=False)
    assert not tiny_llm.engine.has_unfinished_requests()


@pytest.mark.parametrize("messages, message", [
    ([{"role": "user"}], "missing required field 'messages[0].content'"),
    ([{"content": "Hi"}], "missing required field 'messages[0].role'"),
    ([{"role": "user", "content": "Hi"}, {"role": "wizard", "content": "x"}],
     "messages[1].role must be one of system, developer, user, assistant, tool; got 'wizard'"),
    ([{"role": "user", "content": 5}],
     "messages[0].content must be a string or an array of text parts, got an integer (5)"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}],
     "messages[0].content[0] must be a text part"),
    ([], "messages is empty; give at least one message"),
    (None, "messages must be an array of message objects, got null"),
    ([[{"role": "user", "content": "Hi"}], [{"role": "user"}]],
     "missing required field 'messages[1][0].content'"),
    ([{"role": "user", "content": "word " * 300}],
     "messages: the conversation rendered with the chat template has"),
])
def test_bad_chat_messages_name_the_message_and_field(tiny_llm, messages, message):
    """The server's checks (tests/test_serve.py: the same words in its 400s)."""
    with pytest.raises(ValueError, match=re.escape(message)):
        tiny_llm.chat(messages, GREEDY, use_tqdm=False)
    assert not tiny_llm.engine.has_unfinished_requests()


def test_chat_takes_what_the_server_takes(tiny_llm):
    """Text parts are joined, an assistant turn may have null content, extra keys are dropped:
    as /v1/chat/completions reads them."""
    plain = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"},
             {"role": "assistant", "content": ""}, {"role": "user", "content": "Again"}]
    varied = [{"role": "system", "content": [{"type": "text", "text": "Be "},
                                             {"type": "text", "text": "brief."}]},
              {"role": "user", "content": "Hello", "name": "ann"},
              {"role": "assistant", "content": None}, {"role": "user", "content": "Again"}]
    (a,), (b,) = (tiny_llm.chat(m, GREEDY, use_tqdm=False) for m in (plain, varied))
    assert a.prompt_token_ids == b.prompt_token_ids and a.token_ids == b.token_ids


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
        LLM(target=target, draft=draft, **dict(LLM_KW, policy="nope"))


@pytest.mark.parametrize("policy, options, message", [
    ("static", {"gamma": 9}, "gamma must be in [0, max_gamma=7], got 9"),
    ("static", {"gama": 2}, "unknown option 'gama' for policy 'static'; did you mean 'gamma'? "
                            "(its options are gamma, chain)"),
    ("static", {"bogus": 1}, "unknown option 'bogus' for policy 'static' (its options are "
                             "gamma, chain)"),
    ("off", {"gamma": 1}, "unknown option 'gamma' for policy 'off'; 'gamma' is an option of "
                          "policy 'static' (it takes no options)"),
    # the default policy chooses γ itself; a fixed γ is static's
    ("auto", {"gamma": 3}, "unknown option 'gamma' for policy 'auto'; 'gamma' is an option of "
                           "policy 'static' (its options are "),
    ("ucb", {"max_gamma": 3}, "max_gamma is not an option of policy 'ucb': the engine's "
                              "num_speculative_tokens"),
    ("nightjar", {"sed": 1}, "unknown option 'sed' for policy 'nightjar'; did you mean 'seed'? "
                             "(its options are profile, seed, "),
])
def test_bad_policy_options(tiny_pair, policy, options, message):
    from jspec.llm import LLM

    target, draft = tiny_pair
    with pytest.raises(ValueError, match=re.escape(message)):
        LLM(target=target, draft=draft, policy_options=options, **dict(LLM_KW, policy=policy))


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


def test_draft_tokenizer_with_two_entries_swapped(tiny_pair, tmp_path):
    """Same size, other token -> id mapping: refused, naming the first token that differs."""
    import json
    import shutil

    from jspec.llm import LLM
    from jspec.models.loader import load_tokenizer

    target, draft = tiny_pair
    swapped = shutil.copytree(draft, tmp_path / "draft-swapped")
    spec = json.loads((swapped / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    by_id = {i: t for t, i in vocab.items()}
    a, b = by_id[300], by_id[301]
    vocab[a], vocab[b] = 301, 300
    (swapped / "tokenizer.json").write_text(json.dumps(spec))
    assert len(load_tokenizer(swapped).get_vocab()) == len(load_tokenizer(target).get_vocab())
    first = min(a, b)  # both differ from id 300 on; the message names them in string order
    ours, theirs = (300, 301) if first == a else (301, 300)
    with pytest.raises(ValueError, match=re.escape(
            f"draft vocabulary differs from the target's: token {first!r} is id {ours} in the "
            f"target's tokenizer and id {theirs} in the tokenizer of draft ({str(swapped)!r}); "
            f"speculative decoding needs the same tokenizer")):
        LLM(target=target, draft=swapped, **LLM_KW)
    with pytest.raises(ValueError, match=re.escape("draft 'draft-swapped' vocabulary differs")):
        LLM(target=target, draft=[draft, swapped], **dict(LLM_KW, policy="specrouter"))


def test_draft_without_target(tiny_pair):
    from jspec.llm import LLM

    with pytest.raises(ValueError, match="a draft was given without a target"):
        LLM(draft=tiny_pair[1], **LLM_KW)


def test_missing_checkpoint(tmp_path):
    from jspec.llm import LLM

    with pytest.raises(ValueError, match="checkpoint directory .*nowhere.* does not exist"):
        LLM(target=tmp_path / "nowhere", draft=None, **LLM_KW)


def test_checkpoint_file_instead_of_its_directory(tiny_pair):
    from jspec.llm import LLM

    import os

    target, draft = tiny_pair
    config = os.path.join(target, "config.json")
    with pytest.raises(ValueError, match=re.escape(
            f"expected a checkpoint directory, but {config!r} is a file; pass its directory "
            f"{str(target)!r}")):
        LLM(target=config, draft=draft, **LLM_KW)
    with pytest.raises(ValueError, match=re.escape(
            f"expected a tokenizer directory, but {config!r} is a file")):
        LLM(target=target, draft=draft, tokenizer=config, **LLM_KW)
