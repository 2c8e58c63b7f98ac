"""What a vLLM user types works (or fails with a reason), and the small things that trip up a
newcomer stay fixed."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings

import pytest

from conftest import LLM_KW
from jspec.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


def test_vllm_spelling_gives_the_same_tokens(tiny_pair, tiny_llm):
    from jspec.llm import LLM

    target, draft = tiny_pair
    kw = {k: v for k, v in LLM_KW.items() if k != "num_speculative_tokens"}
    llm = LLM(model=str(target), speculative_config={
        "model": str(draft), "num_speculative_tokens": LLM_KW["num_speculative_tokens"],
        "method": "draft_model"}, **kw)
    assert llm.engine.max_gamma == LLM_KW["num_speculative_tokens"]
    assert llm.engine.draft is not None
    prompts = ["def fibonacci(n):", "Hello, world!"]
    ours = tiny_llm.generate(prompts, GREEDY, use_tqdm=False)
    theirs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in theirs] == [o.token_ids for o in ours]


def test_prompt_dicts_as_vllm_takes_them(tiny_llm):
    ids = tiny_llm.tokenizer.encode("def fibonacci(n):")
    plain = tiny_llm.generate(["def fibonacci(n):", ids], GREEDY, use_tqdm=False)
    dicts = tiny_llm.generate([{"prompt": "def fibonacci(n):"}, {"prompt_token_ids": ids}],
                              GREEDY, use_tqdm=False)
    one = tiny_llm.generate({"prompt_token_ids": ids}, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in dicts] == [o.token_ids for o in plain]
    assert one[0].token_ids == plain[1].token_ids
    with pytest.raises(ValueError, match="exactly one of 'prompt'"):
        tiny_llm.generate([{"prompt": "x", "prompt_token_ids": ids}], GREEDY)


@pytest.mark.parametrize("kw, why", [
    ({"n": 2}, "one sample per request"), ({"best_of": 3}, "one sample per request"),
    ({"presence_penalty": 0.5}, "penalties are not implemented"),
    ({"frequency_penalty": 1.0}, "penalties are not implemented"),
    ({"repetition_penalty": 1.2}, "penalties are not implemented"),
    ({"min_p": 0.1}, "top_k and top_p"), ({"prompt_logprobs": 5}, "prompt tokens are not returned"),
])
def test_unsupported_vllm_sampling_options_say_why(kw, why):
    (name,) = kw
    with pytest.raises(ValueError, match=f"{name}=.* is not supported: .*{why}"):
        SamplingParams(**kw)
    SamplingParams(n=1, best_of=1, presence_penalty=0.0, repetition_penalty=1.0)  # neutral: fine


def test_engine_options_are_checked_by_name():
    from jspec.llm import LLM, _from_vllm_spelling

    with pytest.raises(ValueError, match="unknown option 'max_num_seq'; engine options are"):
        LLM(max_num_seq=4)
    with pytest.raises(ValueError, match="'gpu_memory_utilization' is not supported: .*"
                                         "kv_cache_memory_bytes"):
        LLM(gpu_memory_utilization=0.9)
    with pytest.raises(ValueError, match="method 'eagle' is not supported"):
        _from_vllm_spelling(None, None, "m", {"method": "eagle"}, None)
    with pytest.raises(ValueError, match="give the draft once"):
        _from_vllm_spelling(None, "d", "m", {"model": "d2"}, None)
    with pytest.raises(ValueError, match="disagree"):
        _from_vllm_spelling(None, None, "m", {"num_speculative_tokens": 3}, 5)
    with pytest.raises(ValueError, match="key 'prompt_lookup_max' is not supported"):
        _from_vllm_spelling(None, None, "m", {"prompt_lookup_max": 3}, None)
    assert _from_vllm_spelling(None, None, "m", {"model": "d"}, None) == ("m", "d", 4, {})
    # prompt lookup: vLLM's keys; one bound given sets both, as vLLM does
    assert _from_vllm_spelling(None, None, "m", {"method": "ngram", "num_speculative_tokens": 5,
                                                 "prompt_lookup_max": 3}, None) == (
        "m", None, 5, {"speculative_method": "ngram", "prompt_lookup_min": 3,
                       "prompt_lookup_max": 3})
    with pytest.raises(ValueError, match="'ngram' drafts by lookup .* takes no 'model'"):
        _from_vllm_spelling(None, None, "m", {"method": "ngram", "model": "d"}, None)
    assert _from_vllm_spelling(None, None, "m", {
        "method": "suffix", "suffix_decoding_max_tree_depth": 12}, None) == (
        "m", None, 4, {"speculative_method": "suffix", "suffix_decoding_max_tree_depth": 12})
    with pytest.raises(ValueError, match="'suffix' drafts from suffix trees and takes no"):
        _from_vllm_spelling(None, None, "m", {"method": "suffix", "model": "d"}, None)
    with pytest.raises(ValueError, match="key 'x' is not supported; .*prompt_lookup_max"):
        _from_vllm_spelling(None, None, "m", {"method": "ngram", "x": 1}, None)
    # one config per drafter: one engine that may draft each sequence with any of them
    assert _from_vllm_spelling(None, None, "m", [
        {"method": "draft_model", "model": "d", "num_speculative_tokens": 5},
        {"method": "ngram", "prompt_lookup_max": 3}, {"method": "suffix"}], None) == (
        "m", "d", 5, {"speculative_method": "draft_model+ngram+suffix",
                      "prompt_lookup_min": 3, "prompt_lookup_max": 3})
    with pytest.raises(ValueError, match="give num_speculative_tokens \\[3, 5\\]; one engine"):
        _from_vllm_spelling(None, None, "m", [{"model": "d", "num_speculative_tokens": 5},
                                              {"method": "ngram", "num_speculative_tokens": 3}],
                            None)
    with pytest.raises(ValueError, match="empty list"):
        _from_vllm_spelling(None, None, "m", [], None)


def test_progress_reports_this_call_not_the_engines_lifetime(tiny_llm):
    tiny_llm.generate(["warm the counters up"], GREEDY, use_tqdm=False)
    m = tiny_llm.engine.metrics
    start = (m.step_time, m.spec_decode_num_draft_tokens, m.spec_decode_num_accepted_tokens)
    outs = tiny_llm.generate(["def fibonacci(n):", "Hello"], GREEDY, use_tqdm=False)
    drafted = sum(o.spec.num_drafted for o in outs)
    accepted = sum(o.spec.num_accepted for o in outs)
    tokens = sum(len(o.token_ids) for o in outs)
    shown = tiny_llm._progress(tokens, start)
    assert shown["accept"] == f"{accepted / drafted if drafted else 0.0:.2f}"
    assert float(shown["tok_s"]) == pytest.approx(tokens / (m.step_time - start[0]), rel=0.01)


def test_a_bad_policy_option_names_itself(capsys):
    from jspec.cli import main
    from jspec.policies import make_policy

    with pytest.raises(ValueError, match="static option gamma must be an integer, got 'abc'"):
        make_policy("static", 4, gamma="abc")
    with pytest.raises(ValueError, match=r"dsde option sl_min must be in \[0, 4\], got 9"):
        make_policy("dsde", 4, sl_min=9)
    assert main(["generate", "--policy", "static", "--policy-option", "gamma=abc"]) == 2
    assert "static option gamma must be an integer, got 'abc'" in capsys.readouterr().err


def test_transformers_notices_stay_silent(tiny_pair):
    """Importing the tokenizer side of transformers prints no "PyTorch was not found", and a
    prompt longer than the tokenizer's nominal maximum encodes without transformers' warning
    (the engine checks lengths itself)."""
    target, _ = tiny_pair
    code = ("from jspec.models.loader import load_tokenizer\n"
            f"tok = load_tokenizer({str(target)!r})\n"
            "ids = tok.encode('def f(x): return x ' * 3000)\n"
            "assert len(ids) > 5000\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRANSFORMERS_")}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "PyTorch was not found" not in proc.stderr
    assert "longer than the specified maximum" not in proc.stderr


def test_held_out_prompts_parse_without_warnings(tmp_path):
    from jspec.models.corpus import function_prompts

    class Source:
        def read(self):
            return 'def f(x):\n    """Match \\( in a non-raw string."""\n    return "\\("\n'

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert function_prompts([Source()]) == ['def f(x):\n    """Match \\( in a non-raw '
                                                'string."""\n']
