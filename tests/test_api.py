"""The offline API: ``from jspec import LLM, SamplingParams``; generate / chat over a checkpoint
pair (the tiny pair, with the shared LLM_KW engine shapes)."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from conftest import LLM_KW
from jspec.sampling_params import SamplingParams

PROMPTS = ["def fibonacci(n):", "Hello, world! How are you", "The engine serves many requests",
           "x"]
GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
LLM_GAMMA = LLM_KW["num_speculative_tokens"]


def test_import_is_light_and_exports_the_public_names():
    code = (
        "import sys, jspec\n"
        "assert 'jax' not in sys.modules, 'import jspec imported jax'\n"
        "from jspec import LLM, SamplingParams, RequestOutput, EngineConfig\n"
        "assert 'jax' not in sys.modules, 'the light names imported jax'\n"
        "from jspec import LLMEngine, AsyncLLMEngine\n"
        "import jspec.engine, jspec.async_engine, jspec.llm\n"
        "assert LLMEngine is jspec.engine.LLMEngine and LLM is jspec.llm.LLM\n"
        "assert AsyncLLMEngine is jspec.async_engine.AsyncLLMEngine\n"
        "assert set(jspec.__all__) >= {'LLM', 'SamplingParams', 'RequestOutput', 'EngineConfig',"
        " 'LLMEngine', 'AsyncLLMEngine'}\n"
        "try:\n"
        "    jspec.NoSuchThing\n"
        "except AttributeError:\n"
        "    pass\n"
        "else:\n"
        "    raise AssertionError('unknown attribute did not raise')\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_outputs_in_prompt_order(tiny_llm):
    """Requests finish in a different order than they were given; outputs come back in order."""
    max_tokens = [20, 3, 11, 1]
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in max_tokens]
    outs = tiny_llm.generate(PROMPTS, params, use_tqdm=False)
    assert [o.prompt for o in outs] == PROMPTS
    for out, n in zip(outs, max_tokens):
        assert out.finished and out.finish_reason == "length"
        assert len(out.token_ids) == n
    # the batch does not change greedy results (lossless, and batch-invariant in fp32)
    alone = tiny_llm.generate(PROMPTS[0], params[0], use_tqdm=False)
    assert len(alone) == 1 and alone[0].token_ids == outs[0].token_ids


def test_max_tokens_length_and_spec_stats(tiny_llm):
    outs = tiny_llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    for out in outs:
        assert out.finish_reason == "length" and len(out.token_ids) == GREEDY.max_tokens
        spec = out.spec
        assert spec.num_steps >= 1 and spec.num_spec_steps >= 1
        assert spec.num_drafted >= spec.num_accepted >= 0 and spec.num_drafted > 0
        assert 0.0 <= spec.acceptance_rate <= 1.0
        assert 1.0 <= spec.mean_accepted_length <= 1 + LLM_GAMMA
        # every step emits at least one token; a speculative one at most 1 + accepted
        assert spec.num_steps <= len(out.token_ids)
        assert len(out.token_ids) <= spec.num_steps + spec.num_accepted
    m = tiny_llm.metrics
    assert m["spec_decode_num_draft_tokens"] > 0 and "acceptance_rate" in m



def test_text_is_the_decoded_tokens(tiny_llm):
    tok = tiny_llm.tokenizer
    outs = tiny_llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    for out in outs:
        assert out.prompt_token_ids == tok.encode(out.prompt)
        decoded = tok.decode(out.token_ids, skip_special_tokens=True)
        # a random model may end on an incomplete UTF-8 sequence, which the streaming
        # detokenizer holds back
        assert decoded.rstrip("\ufffd") == out.text.rstrip("\ufffd")


def test_token_id_prompt_equals_text_prompt(tiny_llm):
    ids = tiny_llm.tokenizer.encode(PROMPTS[1])
    by_ids, by_text = tiny_llm.generate([ids, PROMPTS[1]], GREEDY, use_tqdm=False)
    assert by_ids.prompt is None and by_ids.prompt_token_ids == ids
    assert by_ids.token_ids == by_text.token_ids and by_ids.text == by_text.text
    # a single token-id list is one prompt, not a batch of one-token prompts
    (single,) = tiny_llm.generate(ids, GREEDY, use_tqdm=False)
    assert single.token_ids == by_ids.token_ids


def test_stop_string_cuts_the_text(tiny_llm):
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    (full,) = tiny_llm.generate(PROMPTS[0], params, use_tqdm=False)
    text = full.text.rstrip("\ufffd")
    assert len(text) >= 12, "the tiny model's text is too short for this test"
    # a stop string from the middle of the text, clear of undecodable bytes
    stop = next(text[k:k + 3] for k in range(len(text) // 2, len(text) - 3)
                if "\ufffd" not in text[k:k + 3] and text[k:k + 3].strip())
    expected = text[:text.index(stop)]
    stopped_params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, stop=[stop])
    (out,) = tiny_llm.generate(PROMPTS[0], stopped_params, use_tqdm=False)
    assert out.finish_reason == "stop"
    assert out.text == expected and stop not in out.text
    assert len(out.token_ids) < len(full.token_ids)
    assert out.token_ids == full.token_ids[:len(out.token_ids)]


def test_stop_token_ids_end_generation_and_are_returned(tiny_llm):
    (full,) = tiny_llm.generate(PROMPTS[2], GREEDY, use_tqdm=False)
    stop_token = full.token_ids[5]
    cut = full.token_ids.index(stop_token) + 1
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True,
                            stop_token_ids=[stop_token])
    (out,) = tiny_llm.generate(PROMPTS[2], params, use_tqdm=False)
    assert out.finish_reason == "stop"
    assert out.token_ids == full.token_ids[:cut]


def test_eos_stops_unless_ignore_eos(tiny_llm):
    """A random model rarely emits its EOS, so this makes a token it does emit the EOS."""
    (full,) = tiny_llm.generate(PROMPTS[3], GREEDY, use_tqdm=False)
    eos = full.token_ids[3]
    cut = full.token_ids.index(eos) + 1
    engine = tiny_llm.engine
    saved = engine.outputs.eos_token_ids
    engine.outputs.eos_token_ids = {eos}
    try:
        (stopped,) = tiny_llm.generate(PROMPTS[3], SamplingParams(max_tokens=24, temperature=0),
                                       use_tqdm=False)
        (ignored,) = tiny_llm.generate(PROMPTS[3], GREEDY, use_tqdm=False)
    finally:
        engine.outputs.eos_token_ids = saved
    assert stopped.finish_reason == "stop" and stopped.token_ids == full.token_ids[:cut]
    assert ignored.finish_reason == "length" and ignored.token_ids == full.token_ids


def test_seeded_sampling_is_reproducible(tiny_llm):
    params = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=1234,
                            ignore_eos=True)
    first = tiny_llm.generate(PROMPTS, params, use_tqdm=False)
    again = tiny_llm.generate(PROMPTS[::-1], params, use_tqdm=False)[::-1]
    assert [o.token_ids for o in first] == [o.token_ids for o in again]


def test_progress_bar_can_be_disabled(tiny_llm, capsys):
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    tiny_llm.generate(PROMPTS[:2], params, use_tqdm=False)
    assert capsys.readouterr().err == ""
    tiny_llm.generate(PROMPTS[:2], params, use_tqdm=True)
    assert "generate" in capsys.readouterr().err


def test_no_prompt_count_compiles_after_the_warmup(tiny_llm):
    """The shapes come from the engine's options, not from the prompts: after the warm-up,
    batches of 1, 2, 3, 5 and 8 prompts (text and token ids, short and chunked, greedy and
    sampled) compile nothing."""
    from jspec.runner import compile_events

    before = compile_events()
    for n in (1, 2, 3, 5, 8):
        prompts = [PROMPTS[i % len(PROMPTS)] if i % 2 else [3 + i] * (7 + 29 * i % 90)
                   for i in range(n)]
        params = [SamplingParams(max_tokens=2 + i, temperature=0.8 * (i % 2), seed=i,
                                 ignore_eos=True) for i in range(n)]
        outs = tiny_llm.generate(prompts, params, use_tqdm=False)
        assert [len(o.token_ids) for o in outs] == [p.max_tokens for p in params]
    assert compile_events() == before, "a new prompt count compiled after the warm-up"


def test_the_warmup_freezes_the_heap(tiny_pair):
    """After the warm-up the engine and what it built (models, executables, tokenizer) are out
    of the garbage collector's walks, so a full collection while serving does not walk them;
    what is allocated afterwards is still collected."""
    import gc

    from jspec.llm import LLM

    llm = LLM(*tiny_pair, use_tqdm=False, **LLM_KW)
    tracked = {id(o) for o in gc.get_objects()}
    assert gc.get_freeze_count() > 0
    assert id(llm.engine) not in tracked and id(llm.engine.runner) not in tracked
    later = [llm.engine]  # a container made after the warm-up
    assert any(o is later for o in gc.get_objects())


def test_warmup_progress_can_be_disabled(tiny_pair, tiny_llm, capsys):
    """LLM's warm-up shows its shape buckets on stderr unless use_tqdm=False (these shapes are
    the session's, compiled already by ``tiny_llm``)."""
    from jspec.llm import LLM

    capsys.readouterr()
    LLM(*tiny_pair, use_tqdm=False, **LLM_KW)
    assert capsys.readouterr().err == ""
    llm = LLM(*tiny_pair, **LLM_KW)
    n = len(llm.engine.runner.bucket_plan())
    err = capsys.readouterr().err
    assert "compile" in err  # the bar
    line = re.search(r"(\d+) shape buckets ready in [\d.]+ s: (\d+) compiled, (\d+) loaded from "
                     r"the compilation cache(?:, (\d+) compiled before in this process)?\n", err)
    assert line, err
    counts = [int(g or 0) for g in line.groups()]
    assert counts[0] == n == sum(counts[1:])


def test_a_warmup_bounded_by_rows_compiles_the_narrow_decode_steps_and_every_other_shape(
        tiny_llm):
    """``warmup(max_rows=n)`` (the GPU serving sweep's, per concurrency level; `jspec generate`'s
    with n prompts) keeps every shape a step of at most n sequences can take: the decode-only
    steps of the row buckets up to n's, and every prefill, sampling and catch-up shape (those run
    at the widest row bucket), less, with one sequence, the steps that carry prefill beside a
    draft."""
    runner = tiny_llm.engine.runner
    rc = runner.rc
    full = runner.bucket_plan()
    decode = {"verify_accept", "draft", "intermediate", "signals", "logprobs"}
    for rows in (1, 2):
        narrow = runner.bucket_plan(max_rows=rows)
        assert len(rc.seq_buckets) > 1 and set(narrow) < set(full)
        assert {item[1] for item in narrow if item[0] in decode} == \
            {b for b in rc.seq_buckets if b <= rc.seq_bucket(rows)}
        others = {item for item in full if item[0] not in decode}
        # ("verify", tokens, rows, γ) and ("accept", rows, γ): γ > 0 only beside a draft
        beside_a_draft = {item for item in others if item[0] in ("verify", "accept")
                          and item[3 if item[0] == "verify" else 2] > 0}
        assert beside_a_draft
        assert others - beside_a_draft <= set(narrow)
        assert bool(beside_a_draft & set(narrow)) == (rows > 1)
    assert runner.bucket_plan(max_rows=2) == [item for item in full if item[0] not in decode
                                              or item[1] <= rc.seq_bucket(2)]
    assert runner.bucket_plan(max_rows=rc.engine.max_num_seqs) == full
    # more prompts than the engine runs at once (`jspec generate` with many): every shape
    assert runner.bucket_plan(max_rows=rc.engine.max_num_seqs + 5) == full


@pytest.mark.parametrize("policy,method", [("static", "draft_model"), ("auto", "draft_model"),
                                           ("auto", "draft_model+ngram+suffix")])
def test_one_sequence_runs_only_the_shapes_a_warmup_for_one_row_compiled(tiny_pair, policy,
                                                                        method):
    """`jspec generate` with one prompt warms up with ``max_rows=1``: one sequence at a time
    (chunked prompt, greedy and sampled rows, every γ the policy plays) reaches no shape that
    warm-up left out (none is added to the runner's executables)."""
    from jspec.llm import LLM

    llm = LLM(*tiny_pair, speculative_method=method, use_tqdm=False, warmup=False,
              **dict(LLM_KW, policy=policy))
    runner = llm.engine.runner
    llm.engine.warmup(max_rows=1)
    shapes = set(runner._local)
    long_prompt = [5 + i % 50 for i in range(LLM_KW["max_num_batched_tokens"] + 27)]  # 2 chunks
    for prompt, temperature in ((PROMPTS[0], 0.0), (long_prompt, 0.0), (PROMPTS[1], 0.9)):
        (out,) = llm.generate([prompt], SamplingParams(max_tokens=24, temperature=temperature,
                                                       seed=1, ignore_eos=True),
                              use_tqdm=False)
        assert len(out.token_ids) == 24
    assert llm.engine.metrics.spec_decode_num_draft_tokens > 0
    assert set(runner._local) == shapes, sorted(set(runner._local) - shapes, key=str)


def test_chat_applies_the_template(tiny_llm):
    from jspec.models.loader import apply_chat_template

    conversation = [{"role": "system", "content": "You are terse."},
                    {"role": "user", "content": "Hello, world!"}]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    (out,) = tiny_llm.chat(conversation, params, use_tqdm=False)
    tok = tiny_llm.tokenizer
    assert out.prompt_token_ids == apply_chat_template(tok, conversation)
    rendered = tok.decode(out.prompt_token_ids)
    assert rendered == ("<|im_start|>system\nYou are terse.<|im_end|>\n"
                        "<|im_start|>user\nHello, world!<|im_end|>\n<|im_start|>assistant\n")
    assert len(out.token_ids) == 8
    # a list of conversations gives one output each, in order
    other = [{"role": "user", "content": "What is the weather like?"}]
    outs = tiny_llm.chat([conversation, other], params, use_tqdm=False)
    assert outs[0].token_ids == out.token_ids
    assert outs[1].prompt_token_ids == apply_chat_template(tok, other)


def test_cache_salt_in_vllm_prompt_dicts(tiny_llm):
    """``{"prompt": ..., "cache_salt": ...}``: a prompt reuses cached blocks only from requests
    with the same salt; a bad salt is refused before anything runs."""
    text = "Salted: " + " ".join(PROMPTS[:3])  # longer than a KV block, sent only here
    ids = tiny_llm.tokenizer.encode(text)
    full = (len(ids) - 1) // LLM_KW["block_size"] * LLM_KW["block_size"]
    assert full > 0
    sp = SamplingParams(max_tokens=2, temperature=0)
    asks = [{"prompt": text, "cache_salt": "tenant-a"}, {"prompt": text, "cache_salt": "tenant-b"},
            {"prompt_token_ids": ids, "cache_salt": "tenant-a"}, {"prompt": text}, text]
    outs = [tiny_llm.generate(ask, sp, use_tqdm=False)[0] for ask in asks]
    assert [o.num_cached_tokens for o in outs] == [0, 0, full, 0, full]
    assert len({tuple(o.token_ids) for o in outs}) == 1
    for bad, says in ((5, "got an integer"), ("", "got an empty string")):
        with pytest.raises(ValueError, match=f"cache_salt must be a non-empty string, {says}"):
            tiny_llm.generate([text, {"prompt": text, "cache_salt": bad}], sp, use_tqdm=False)
    with pytest.raises(ValueError, match="optionally 'cache_salt'; got keys"):
        tiny_llm.generate({"prompt": text, "salt": "x"}, sp, use_tqdm=False)
    assert not tiny_llm.engine.has_unfinished_requests()


def test_default_sampling_params_and_mismatched_lists(tiny_llm):
    with pytest.raises(ValueError, match="2 sampling params for 3 prompts"):
        tiny_llm.generate(PROMPTS[:3], [GREEDY, GREEDY], use_tqdm=False)
    (out,) = tiny_llm.generate(PROMPTS[0], use_tqdm=False)  # SamplingParams() defaults
    assert 1 <= len(out.token_ids) <= SamplingParams().max_tokens


def test_engine_limits_and_stats(tiny_llm):
    """LLMEngine.limits says what validate_request enforces; stats() follows the requests."""
    engine = tiny_llm.engine
    limits = engine.limits
    assert engine.limits is limits  # fixed for the engine's lifetime
    assert limits.max_model_len == LLM_KW["max_model_len"]
    assert limits.max_num_seqs == LLM_KW["max_num_seqs"]
    assert limits.block_size == LLM_KW["block_size"]
    assert limits.kv_capacity_tokens == limits.num_kv_blocks * limits.block_size
    assert limits.context_limit == min(limits.max_model_len, limits.kv_capacity_tokens)
    assert limits.context_limit == limits.max_model_len  # these shapes' KV pool holds more
    assert limits.has_draft and limits.max_gamma == LLM_GAMMA and 0 in limits.gamma_buckets
    assert limits.vocab_size == 512 and limits.policy == engine.policy.name
    sp = SamplingParams(max_tokens=1)
    longest = [1] * limits.max_prompt_tokens
    assert engine.validate_request(longest, sp) == longest
    with pytest.raises(ValueError, match="max_model_len is 128"):
        engine.validate_request(longest + [1], sp)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.validate_request([limits.vocab_size], sp)

    idle = engine.stats()
    assert (idle.num_running, idle.num_waiting, idle.num_unfinished) == (0, 0, 0)
    assert idle.kv_blocks_used == 0 and idle.kv_blocks_free == idle.kv_blocks_total
    assert idle.kv_blocks_total == limits.num_kv_blocks and idle.draft_resident
    assert idle.num_steps == engine.metrics.num_steps
    engine.add_request("stats-0", [5, 6, 7], GREEDY)
    try:
        queued = engine.stats()
        assert (queued.num_running, queued.num_waiting, queued.num_unfinished) == (0, 1, 1)
        assert queued.kv_blocks_used == 0
        engine.step()  # prefills it
        running = engine.stats()
        assert (running.num_running, running.num_waiting) == (1, 0)
        assert running.kv_blocks_used > 0
        assert running.kv_blocks_used + running.kv_blocks_free == running.kv_blocks_total
    finally:
        engine.abort_request("stats-0")
        engine.step()  # hands out the aborted request's output
    done = engine.stats()
    assert (done.num_running, done.num_waiting, done.kv_blocks_used) == (0, 0, 0)
    # a step's record (the counters) is in place once the next step runs or the engine idles
    assert done.num_steps == idle.num_steps + 1 == engine.metrics.num_steps
    assert done.metrics["num_prefill_tokens"] == idle.metrics["num_prefill_tokens"] + 3
    assert done.metrics["num_requests_aborted"] == idle.metrics["num_requests_aborted"] + 1
