"""The OpenAI-compatible server (serve/) on 127.0.0.1: the official `openai` client for
completions, chat and streaming (greedy answers equal offline ``LLM.generate``), raw HTTP for
every error case, the API key, /v1/models, /health, /metrics, and `jspec serve` argument errors.

One server per module, over the tiny pair with the shared LLM_KW engine shapes (fp32)."""

from __future__ import annotations

import json
import socket
import sys

import pytest

from conftest import LLM_KW, llm_cli_args
from jspec.sampling_params import SamplingParams
from jspec.serve.metrics import VLLM_METRICS
from serve_helpers import MODEL, TIMEOUT, http, start_server, wait_idle

API_KEY = "test-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
PROMPTS = ["def fibonacci(n):", "Hello, world! How are you", "The engine serves"]
CONVERSATION = [{"role": "system", "content": "You write code."},
                {"role": "user", "content": "Write a haiku about caches."}]


@pytest.fixture(scope="module")
def server(tiny_pair):
    server = start_server(tiny_pair, api_key=API_KEY)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(server):
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0,
                         timeout=TIMEOUT)


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, **kw)


# ----------------------------------------------------------------------------- happy paths
def test_models_and_health(server, client):
    (model,) = client.models.list().data
    assert model.id == MODEL and model.owned_by == "jspec"
    assert model.model_extra["max_model_len"] == LLM_KW["max_model_len"]
    assert client.models.retrieve(MODEL).id == MODEL
    status, _, body = http("GET", server.url + "/health")  # no key needed
    health = json.loads(body)
    assert status == 200 and health["status"] == "ready" and health["model"] == MODEL
    assert health["in_flight"] == 0


def test_completions_equal_offline_generate(client, tiny_llm):
    expected = tiny_llm.generate(PROMPTS, greedy(12), use_tqdm=False)
    for prompt, want in zip(PROMPTS, expected):
        resp = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12,
                                         temperature=0)
        (choice,) = resp.choices
        assert choice.text == want.text and choice.finish_reason == want.finish_reason
        assert resp.usage.prompt_tokens == len(want.prompt_token_ids)
        assert resp.usage.completion_tokens == len(want.token_ids)
        assert resp.usage.total_tokens == resp.usage.prompt_tokens + len(want.token_ids)
        assert resp.object == "text_completion" and resp.model == MODEL
        assert resp.id.startswith("cmpl-")


def test_batch_and_token_id_prompts(client, tiny_llm):
    params = greedy(8, ignore_eos=True)
    expected = tiny_llm.generate(PROMPTS, params, use_tqdm=False)
    resp = client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=8, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert [c.index for c in resp.choices] == [0, 1, 2]
    assert [c.text for c in resp.choices] == [e.text for e in expected]
    assert resp.usage.completion_tokens == 3 * 8
    ids = expected[0].prompt_token_ids
    resp = client.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert resp.choices[0].text == expected[0].text


def test_stop_strings_and_default_max_tokens(client, tiny_llm):
    (full,) = tiny_llm.generate(PROMPTS[0], greedy(16, ignore_eos=True), use_tqdm=False)
    text = full.text.rstrip("\ufffd")
    stop = next(text[k:k + 3] for k in range(len(text) // 2, len(text) - 3)
                if "\ufffd" not in text[k:k + 3] and text[k:k + 3].strip())
    (want,) = tiny_llm.generate(PROMPTS[0], greedy(16, ignore_eos=True, stop=[stop]),
                                use_tqdm=False)
    resp = client.completions.create(model=MODEL, prompt=PROMPTS[0], temperature=0,
                                     stop=stop, extra_body={"ignore_eos": True})
    # no max_tokens: OpenAI's default of 16 for completions
    assert resp.choices[0].text == want.text and resp.choices[0].finish_reason == "stop"


def test_chat_equals_offline_chat(client, tiny_llm):
    (want,) = tiny_llm.chat(CONVERSATION, greedy(10), use_tqdm=False)
    resp = client.chat.completions.create(model=MODEL, messages=CONVERSATION, max_tokens=10,
                                          temperature=0)
    (choice,) = resp.choices
    assert choice.message.role == "assistant" and choice.message.content == want.text
    assert choice.finish_reason == want.finish_reason
    assert resp.usage.prompt_tokens == len(want.prompt_token_ids)
    assert resp.usage.completion_tokens == len(want.token_ids)
    assert resp.object == "chat.completion" and resp.id.startswith("chatcmpl-")
    # content parts and max_completion_tokens, as newer clients send them
    parts = [{"role": m["role"], "content": [{"type": "text", "text": m["content"]}]}
             for m in CONVERSATION]
    resp = client.chat.completions.create(model=MODEL, messages=parts,
                                          max_completion_tokens=10, temperature=0)
    assert resp.choices[0].message.content == want.text


def test_streaming_completion(client, tiny_llm):
    (want,) = tiny_llm.generate(PROMPTS[0], greedy(24, ignore_eos=True), use_tqdm=False)
    chunks = list(client.completions.create(
        model=MODEL, prompt=PROMPTS[0], max_tokens=24, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    *content, last = chunks
    assert len(content) > 1, "expected several streamed chunks"
    assert "".join(c.choices[0].text for c in content) == want.text
    assert [c.choices[0].finish_reason for c in content] == [None] * (len(content) - 1) + [
        "length"]
    assert all(c.usage is None for c in content)
    # the extra last chunk: usage and no choices
    assert last.choices == [] and last.usage.completion_tokens == 24
    assert last.usage.prompt_tokens == len(want.prompt_token_ids)
    assert len({c.id for c in chunks}) == 1


def test_streaming_chat(client, tiny_llm):
    (want,) = tiny_llm.chat(CONVERSATION, greedy(16), use_tqdm=False)
    chunks = list(client.chat.completions.create(model=MODEL, messages=CONVERSATION,
                                                 max_tokens=16, temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want.text
    assert chunks[-1].choices[0].finish_reason == want.finish_reason
    assert all(c.usage is None for c in chunks)  # no include_usage: no usage chunk


def test_logprobs_completion_stream_and_chat(client, tiny_llm):
    """OpenAI's logprobs objects carry the engine's per-token log-probabilities, streamed or
    not; a request that does not ask gets null."""
    (want,) = tiny_llm.generate(PROMPTS[0], greedy(8, ignore_eos=True, logprobs=2),
                                use_tqdm=False)
    expected = [e[t].logprob for t, e in zip(want.token_ids, want.logprobs)]
    kw = dict(model=MODEL, prompt=PROMPTS[0], max_tokens=8, temperature=0, logprobs=2,
              extra_body={"ignore_eos": True})
    lp = client.completions.create(**kw).choices[0].logprobs
    assert lp.token_logprobs == pytest.approx(expected, abs=1e-5)
    assert len(lp.tokens) == len(lp.top_logprobs) == len(lp.text_offset) == 8
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    for top, chosen in zip(lp.top_logprobs, lp.token_logprobs):
        assert 1 <= len(top) <= 2 and max(top.values()) == pytest.approx(chosen)  # greedy
    streamed = [x for c in client.completions.create(stream=True, **kw) if c.choices
                for x in (c.choices[0].logprobs.token_logprobs if c.choices[0].logprobs
                          else [])]
    assert streamed == pytest.approx(expected, abs=1e-5)
    resp = client.chat.completions.create(model=MODEL, messages=CONVERSATION, max_tokens=6,
                                          temperature=0, logprobs=True, top_logprobs=3)
    content = resp.choices[0].logprobs.content
    assert len(content) == resp.usage.completion_tokens
    for item in content:
        assert len(item.top_logprobs) == 3 and item.bytes == list(item.token.encode())
        ranked = [t.logprob for t in item.top_logprobs]
        assert ranked == sorted(ranked, reverse=True) and item.logprob == ranked[0]
    plain = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=2)
    assert plain.choices[0].logprobs is None


def test_stream_is_server_sent_events_ending_in_done(server):
    status, headers, raw = http("POST", server.url + "/v1/completions", {
        "model": MODEL, "prompt": PROMPTS[1], "max_tokens": 4, "stream": True,
        "stream_options": {"include_usage": True}}, headers=AUTH)
    assert status == 200 and headers["Content-Type"].startswith("text/event-stream")
    events = raw.decode().split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    assert all(e.startswith("data: ") for e in events[:-1])
    usage = json.loads(events[-3][len("data: "):])["usage"]
    assert usage["completion_tokens"] <= 4


# ----------------------------------------------------------------------------- errors
def _with(body, overrides):
    """``body`` with ``overrides`` applied; a value of _DROP removes the field."""
    for key, value in overrides.items():
        if value is _DROP:
            body.pop(key)
        else:
            body[key] = value
    return body


def _body(**overrides):
    return _with({"model": MODEL, "prompt": "Hello", "max_tokens": 4}, overrides)


def _chat(**overrides):
    return _with({"model": MODEL, "messages": [{"role": "user", "content": "Hi"}],
                  "max_tokens": 4}, overrides)


_DROP = object()
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"

ERROR_CASES = [
    # (id, path, body, status, param, code, message fragment)
    ("malformed-json", COMPLETIONS, b'{"model": "tiny-pair", "prompt": "x",', 400, None,
     "invalid_json", "not valid JSON"),
    ("empty-body", COMPLETIONS, b"", 400, None, "invalid_json", "body is empty"),
    ("not-an-object", COMPLETIONS, b"[1, 2]", 400, None, "invalid_json",
     "must be a JSON object, got an array"),
    ("nan", COMPLETIONS, b'{"model": "tiny-pair", "prompt": "x", "temperature": NaN}', 400,
     "temperature", "invalid_value", "temperature must be a finite number"),
    ("missing-model", COMPLETIONS, _body(model=_DROP), 400, "model",
     "missing_required_parameter", "missing required field 'model'"),
    ("missing-prompt", COMPLETIONS, _body(prompt=_DROP), 400, "prompt",
     "missing_required_parameter", "missing required field 'prompt'"),
    ("max-tokens-type", COMPLETIONS, _body(max_tokens="10"), 400, "max_tokens", "invalid_type",
     "max_tokens must be an integer, got a string"),
    ("max-tokens-float", COMPLETIONS, _body(max_tokens=2.5), 400, "max_tokens", "invalid_type",
     "max_tokens must be an integer, got a number"),
    ("temperature-type", COMPLETIONS, _body(temperature="hot"), 400, "temperature",
     "invalid_type", "temperature must be a number"),
    ("stream-type", COMPLETIONS, _body(stream="yes"), 400, "stream", "invalid_type",
     "stream must be a boolean"),
    ("prompt-type", COMPLETIONS, _body(prompt=5), 400, "prompt", "invalid_type",
     "prompt must be a string, an array of token ids"),
    ("empty-prompt", COMPLETIONS, _body(prompt=""), 400, "prompt", "invalid_value",
     "prompt is empty"),
    ("unknown-model", COMPLETIONS, _body(model="gpt-4"), 400, "model", "model_not_found",
     "model 'gpt-4' does not exist; this server serves 'tiny-pair'"),
    ("prompt-too-long", COMPLETIONS, _body(prompt="word " * 300), 400, "prompt",
     "context_length_exceeded", "max_model_len is 128"),
    ("max-tokens-zero", COMPLETIONS, _body(max_tokens=0), 400, "max_tokens", "invalid_value",
     "max_tokens must be >= 1, got 0"),
    ("max-tokens-too-large", COMPLETIONS, _body(max_tokens=1000), 400, "max_tokens",
     "context_length_exceeded", "max_tokens=1000 is too large"),
    ("temperature-negative", COMPLETIONS, _body(temperature=-1), 400, "temperature",
     "invalid_value", "temperature must be a finite number >= 0, got -1.0"),
    ("top-p", COMPLETIONS, _body(top_p=1.5), 400, "top_p", "invalid_value",
     "top_p must be in (0, 1], got 1.5"),
    ("top-k", COMPLETIONS, _body(top_k=-5), 400, "top_k", "invalid_value",
     "top_k must be an integer >= 0"),
    ("seed", COMPLETIONS, _body(seed=-1), 400, "seed", "invalid_value",
     "seed must be an integer in [0, 2**32)"),
    ("empty-stop", COMPLETIONS, _body(stop=[""]), 400, "stop", "invalid_value",
     "stop strings must be non-empty"),
    ("stop-type", COMPLETIONS, _body(stop=[1]), 400, "stop", "invalid_type",
     "stop must be a string or an array of strings"),
    ("token-outside-vocab", COMPLETIONS, _body(prompt=[1, 99999]), 400, "prompt",
     "invalid_value", "prompt token id 99999 is outside the vocabulary [0, 512)"),
    ("n", COMPLETIONS, _body(n=2), 400, "n", "unsupported_parameter", "n must be 1"),
    ("penalty", COMPLETIONS, _body(presence_penalty=0.5), 400, "presence_penalty",
     "unsupported_parameter", "presence_penalty is not supported"),
    ("unknown-field", COMPLETIONS, _body(max_token=5), 400, "max_token", "unknown_parameter",
     "unrecognized request argument supplied: max_token"),
    ("stream-options-without-stream", COMPLETIONS,
     _body(stream_options={"include_usage": True}), 400, "stream_options", "invalid_value",
     "only allowed with stream: true"),
    ("chat-missing-messages", CHAT, _chat(messages=_DROP), 400, "messages",
     "missing_required_parameter", "missing required field 'messages'"),
    ("chat-messages-type", CHAT, _chat(messages="Hi"), 400, "messages", "invalid_type",
     "messages must be an array of message objects"),
    ("chat-no-messages", CHAT, _chat(messages=[]), 400, "messages", "invalid_value",
     "messages is empty"),
    ("chat-missing-content", CHAT, _chat(messages=[{"role": "user"}]), 400,
     "messages[0].content", "missing_required_parameter",
     "missing required field 'messages[0].content'"),
    ("chat-bad-role", CHAT, _chat(messages=[{"role": "wizard", "content": "x"}]), 400,
     "messages[0].role", "invalid_value", "messages[0].role must be one of"),
    ("chat-content-type", CHAT, _chat(messages=[{"role": "user", "content": 5}]), 400,
     "messages[0].content", "invalid_type", "messages[0].content must be a string"),
    ("chat-too-long", CHAT, _chat(messages=[{"role": "user", "content": "word " * 300}]), 400,
     "messages", "context_length_exceeded", "rendered with the chat template has"),
    ("chat-max-tokens-disagree", CHAT, _chat(max_completion_tokens=5), 400,
     "max_completion_tokens", "invalid_value", "max_tokens (4) and max_completion_tokens (5)"),
    ("chat-max-tokens-too-large", CHAT, _chat(max_tokens=500), 400, "max_tokens",
     "context_length_exceeded", "so at most"),
    ("logprobs-too-many", COMPLETIONS, _body(logprobs=50), 400, "logprobs", "invalid_value",
     "logprobs=50 is more than this engine returns (at most 20)"),
    ("logprobs-negative", COMPLETIONS, _body(logprobs=-1), 400, "logprobs", "invalid_value",
     "logprobs must be None or an integer >= 0"),
    ("chat-top-logprobs-alone", CHAT, _chat(top_logprobs=2), 400, "top_logprobs",
     "invalid_value", "top_logprobs needs logprobs: true"),
    ("cache-salt-empty", COMPLETIONS, _body(cache_salt=""), 400, "cache_salt", "invalid_value",
     "cache_salt must be a non-empty string, got an empty string"),
    ("cache-salt-type", COMPLETIONS, _body(cache_salt=5), 400, "cache_salt", "invalid_type",
     "cache_salt must be a non-empty string, got an integer"),
    ("chat-cache-salt-type", CHAT, _chat(cache_salt=["a"]), 400, "cache_salt", "invalid_type",
     "cache_salt must be a non-empty string, got an array"),
]


@pytest.mark.parametrize("path, body, status, param, code, fragment",
                         [case[1:] for case in ERROR_CASES], ids=[c[0] for c in ERROR_CASES])
def test_error_cases(server, path, body, status, param, code, fragment):
    got, headers, raw = http("POST", server.url + path, body, headers={
        **AUTH, "Content-Type": "application/json"})
    assert got == status, raw
    assert headers["Content-Type"].startswith("application/json")
    error = json.loads(raw)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param and error["code"] == code
    assert fragment in error["message"], error["message"]


# (endpoint, body fields, what the same request is through the Python API)
AGREEMENT_CASES = [
    ("missing-content", CHAT, {"messages": [{"role": "user"}]}),
    ("wizard-role", CHAT, {"messages": [{"role": "wizard", "content": "x"}]}),
    ("role-type", CHAT, {"messages": [{"role": 3, "content": "x"}]}),
    ("content-type", CHAT, {"messages": [{"role": "user", "content": 5}]}),
    ("image-part", CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}),
    ("no-messages", CHAT, {"messages": []}),
    ("message-type", CHAT, {"messages": ["Hi"]}),
    ("chat-too-long", CHAT, {"messages": [{"role": "user", "content": "word " * 300}]}),
    ("prompt-too-long", COMPLETIONS, {"prompt": list(range(3, 3 + 128))}),
    ("max-tokens-too-large", COMPLETIONS, {"prompt": list(range(3, 103)), "max_tokens": 50}),
    ("empty-prompt", COMPLETIONS, {"prompt": ""}),
    ("token-outside-vocab", COMPLETIONS, {"prompt": [1, 99999]}),
]


@pytest.mark.parametrize("path, fields", [c[1:] for c in AGREEMENT_CASES],
                         ids=[c[0] for c in AGREEMENT_CASES])
def test_api_and_server_refuse_alike(server, tiny_llm, path, fields):
    """What the server refuses with a 400, LLM.generate / LLM.chat refuse with a ValueError
    in the same words (one check, jspec.request_checks and EngineLimits, behind both)."""
    body = {"model": MODEL, "max_tokens": 4, **fields}
    status, _, raw = http("POST", server.url + path, body, headers={
        **AUTH, "Content-Type": "application/json"})
    assert status == 400, raw
    message = json.loads(raw)["error"]["message"]
    params = SamplingParams(max_tokens=body["max_tokens"])
    with pytest.raises(ValueError) as refused:
        if path == CHAT:
            tiny_llm.chat(body["messages"], params, use_tqdm=False)
        else:
            tiny_llm.generate(body["prompt"], params, use_tqdm=False)
    # the API prefixes a conversation's own errors with "messages: "; the server's param says it
    assert str(refused.value).removeprefix("messages: ") == message


def test_routing_errors_are_json(server):
    status, _, raw = http("GET", server.url + COMPLETIONS, headers=AUTH)
    assert status == 405 and json.loads(raw)["error"]["code"] == "method_not_allowed"
    status, _, raw = http("GET", server.url + "/v1/nothing", headers=AUTH)
    assert status == 404 and json.loads(raw)["error"]["code"] == "not_found"
    status, _, raw = http("GET", server.url + "/v1/models/gpt-4", headers=AUTH)
    assert status == 404 and json.loads(raw)["error"]["code"] == "model_not_found"


def test_api_key(server):
    import openai

    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        status, got, raw = http("POST", server.url + COMPLETIONS, _body(), headers=headers)
        assert status == 401 and got["WWW-Authenticate"] == "Bearer"
        error = json.loads(raw)["error"]
        assert error["type"] == "authentication_error" and error["code"] == "invalid_api_key"
        assert "--api-key" in error["message"]
    status, _, _ = http("GET", server.url + "/v1/models")
    assert status == 401
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model=MODEL, prompt="Hi", max_tokens=2)
    # monitoring endpoints stay open
    assert http("GET", server.url + "/health")[0] == 200
    assert http("GET", server.url + "/metrics")[0] == 200


def test_metrics_exposition(server, client):
    client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=8, temperature=0,
                              extra_body={"ignore_eos": True})
    m = wait_idle(server.url)
    assert m["jspec_server_ready"] == 1 and m["jspec_draft_resident"] == 1
    assert m["jspec_kv_blocks_used"] == 0 and m["jspec_kv_blocks_free"] > 0
    for name in ("jspec_time_to_first_token_seconds_count",
                 "jspec_time_per_output_token_seconds_count",
                 "jspec_e2e_request_latency_seconds_count", "jspec_generation_tokens_total",
                 "jspec_prompt_tokens_total", "jspec_engine_steps_total",
                 "jspec_spec_decode_num_drafts_total", "jspec_spec_decode_num_draft_tokens_total",
                 "jspec_spec_decode_num_emitted_tokens_total"):
        assert m[name] > 0, name
    assert "jspec_spec_decode_num_accepted_tokens_total" in m
    gamma_max = LLM_KW["num_speculative_tokens"]
    positions = [k for k in m if k.startswith("jspec_spec_decode_num_accepted_tokens_per_pos")]
    assert len(positions) == gamma_max
    gammas = {k: v for k, v in m.items() if k.startswith("jspec_spec_decode_gamma_total")}
    assert len(gammas) == gamma_max + 1 and sum(gammas.values()) > 0
    assert any(k.startswith("jspec_spec_decode_gamma_by_batch_total{batch_bucket=") for k in m)
    chains = {k: v for k, v in m.items() if k.startswith("jspec_spec_decode_chain_steps_total")}
    assert any('chain="draft>target"' in k for k in chains) and sum(chains.values()) > 0
    drafted = [k for k in m if k.startswith("jspec_spec_decode_drafter_draft_tokens_total")]
    assert drafted == ['jspec_spec_decode_drafter_draft_tokens_total{drafter="draft"}']
    assert m[drafted[0]] == m["jspec_spec_decode_num_draft_tokens_total"]
    assert m['jspec_http_requests_total{code="200",endpoint="/v1/completions"}'] >= 1
    assert m['jspec_request_finished_total{reason="length"}'] >= 1
    assert m["jspec_num_requests_waiting"] == 0 and m["jspec_num_requests_running"] == 0


def test_vllm_metric_names(server, client):
    """The series vLLM's dashboards read, under vLLM's names and labels, agree with jspec's."""
    client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=6, temperature=0,
                              extra_body={"ignore_eos": True})
    m = wait_idle(server.url)
    engine = f'engine="0",model_name="{MODEL}"'
    names = {k.split("{")[0] for k in m if k.startswith("vllm:")}
    for family in VLLM_METRICS:
        assert any(n == family or n.startswith(family + "_") for n in names), family
    assert m[f"vllm:num_requests_running{{{engine}}}"] == 0
    assert m[f"vllm:num_requests_waiting{{{engine}}}"] == 0
    assert m[f"vllm:kv_cache_usage_perc{{{engine}}}"] == 0.0
    for vllm, jspec in (("spec_decode_num_drafts_total", "spec_decode_num_drafts_total"),
                        ("spec_decode_num_draft_tokens_total",
                         "spec_decode_num_draft_tokens_total"),
                        ("spec_decode_num_accepted_tokens_total",
                         "spec_decode_num_accepted_tokens_total"),
                        ("generation_tokens_total", "generation_tokens_total"),
                        ("prompt_tokens_total", "prompt_tokens_total"),
                        ("time_to_first_token_seconds_count", "time_to_first_token_seconds_count"),
                        ("e2e_request_latency_seconds_count", "e2e_request_latency_seconds_count"),
                        ("iteration_tokens_total_count", "engine_step_tokens_count")):
        assert m[f"vllm:{vllm}{{{engine}}}"] == m[f"jspec_{jspec}"], vllm
    assert m[f"vllm:spec_decode_num_draft_tokens_total{{{engine}}}"] > 0
    for p in range(LLM_KW["num_speculative_tokens"]):
        name = "spec_decode_num_accepted_tokens_per_pos_total"
        assert (m[f'vllm:{name}{{{engine},position="{p}"}}']
                == m[f'jspec_{name}{{position="{p}"}}'])
    assert m[f'vllm:request_success_total{{engine="0",finished_reason="length",'
             f'model_name="{MODEL}"}}'] >= 1
    assert m[f"vllm:request_generation_tokens_sum{{{engine}}}"] >= 6


def test_prefix_cache_metrics_and_usage(server, client):
    """A prompt sent twice: the second answer's usage names the cached prompt tokens, and
    vLLM's prefix-cache counters on /metrics agree with jspec's and with the engine's."""
    prompt = " ".join(PROMPTS * 2)  # longer than a KV block
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    second = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    block = server.app.engine.limits.block_size
    n = first.usage.prompt_tokens
    assert n > block
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens == (n - 1) // block * block
    m = wait_idle(server.url)
    stats = server.app.engine.stats()
    engine = f'engine="0",model_name="{MODEL}"'
    for name in ("queries", "hits"):
        assert (m[f"vllm:prefix_cache_{name}_total{{{engine}}}"]
                == m[f"jspec_prefix_cache_{name}_total"]
                == stats.metrics[f"prefix_cache_{name}"])
    assert m[f"vllm:prefix_cache_hits_total{{{engine}}}"] >= (n - 1) // block * block
    assert m["jspec_kv_blocks_cached"] == stats.kv_blocks_cached >= (n - 1) // block
    assert 0 < m["jspec_prefix_cache_hit_rate"] < 1


def test_cache_salt_separates_tenants(server, client):
    """``cache_salt`` in completion and chat bodies: a prompt hits the prefix cache only with
    the salt it was cached under (no salt: only without one)."""
    prompt = " ".join(reversed(PROMPTS * 2))  # longer than a KV block, sent by no other test
    block = server.app.engine.limits.block_size

    def cached(salt: str | None) -> int:
        extra = {} if salt is None else {"cache_salt": salt}
        out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2,
                                        temperature=0, extra_body=extra)
        return out.usage.prompt_tokens_details.cached_tokens

    n = len(server.app.engine.tokenizer.encode(prompt))
    full = (n - 1) // block * block
    assert full > 0
    assert [cached(s) for s in (None, "tenant-a", "tenant-a", "tenant-b", None)] == \
        [0, 0, full, 0, full]
    chat = [{"role": "user", "content": prompt}]
    hits = [client.chat.completions.create(
        model=MODEL, messages=chat, max_tokens=2, temperature=0,
        extra_body={"cache_salt": salt}).usage.prompt_tokens_details.cached_tokens
        for salt in ("tenant-c", "tenant-c")]
    assert hits[0] == 0 and hits[1] > 0


def test_step_metrics_come_from_every_step(server, client):
    """The step listener's series count the steps the engine ran and agree with its own
    counters; the gauges come from stats()."""
    client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=10, temperature=0,
                              extra_body={"ignore_eos": True})
    m = wait_idle(server.url)
    engine = server.app.engine
    stats = engine.stats()
    em = stats.metrics
    steps = stats.num_steps
    assert steps > 0 and m["jspec_engine_steps_total"] == steps
    assert m["jspec_engine_step_time_seconds_count"] == steps
    assert m["jspec_engine_step_batch_size_count"] == steps
    assert m["jspec_engine_step_tokens_count"] == steps
    by_bucket = {k: v for k, v in m.items()
                 if k.startswith("jspec_engine_steps_by_gamma_bucket_total")}
    assert len(by_bucket) == len(engine.limits.gamma_buckets)
    assert sum(by_bucket.values()) == steps
    assert m["jspec_engine_prefill_tokens_total"] == em["num_prefill_tokens"]
    assert m["jspec_engine_step_time_seconds_sum"] == pytest.approx(em["step_time"])
    for stage, seconds in em["stage_time"].items():
        assert m[f'jspec_engine_stage_time_seconds_total{{stage="{stage}"}}'] == pytest.approx(
            seconds)
    for name in ("spec_decode_num_drafts", "spec_decode_num_draft_tokens",
                 "spec_decode_num_accepted_tokens", "spec_decode_num_emitted_tokens"):
        assert m[f"jspec_{name}_total"] == em[name], name
    gamma_max = engine.limits.max_gamma
    assert [m[f'jspec_spec_decode_num_accepted_tokens_per_pos_total{{position="{p}"}}']
            for p in range(gamma_max)] == em["accepted_per_position"]
    assert [m[f'jspec_spec_decode_gamma_total{{gamma="{g}"}}']
            for g in range(gamma_max + 1)] == em["gamma_histogram"]
    for bucket, hist in em["gamma_histogram_by_batch"].items():
        key = 'jspec_spec_decode_gamma_by_batch_total{{batch_bucket="{}",gamma="{}"}}'
        assert [m[key.format(bucket, g)] for g in range(gamma_max + 1)] == hist
    assert m["jspec_kv_blocks_free"] == stats.kv_blocks_free == engine.limits.num_kv_blocks
    assert m["jspec_engine_requests_aborted_total"] == em["num_requests_aborted"]
    assert m["jspec_engine_preemptions_total"] == em["num_preemptions"]


def test_bad_requests_leave_the_server_serving(server, client, tiny_llm):
    wait_idle(server.url)  # every refused request above left nothing behind
    (want,) = tiny_llm.generate(PROMPTS[2], greedy(6), use_tqdm=False)
    resp = client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=6,
                                     temperature=0)
    assert resp.choices[0].text == want.text


# ----------------------------------------------------------------------------- `jspec serve` CLI
def _serve_cli(capsys, *argv):
    from jspec.cli import main

    code = main(["serve", *argv])
    return code, capsys.readouterr().err


@pytest.mark.parametrize("extra, message", [
    (["--max-queue", "-1"], "--max-queue must be an integer >= 0, got -1"),
    (["--grace-period", "-2"], "--grace-period must be >= 0 seconds, got -2.0"),
    (["--port", "70000"], "--port must be in [0, 65535], got 70000"),
    (["--policy", "nope"], "unknown policy 'nope'"),
    (["--api-key", ""], "--api-key must not be empty"),
])
def test_serve_bad_arguments_exit_2_before_loading(capsys, tiny_pair, extra, message):
    target, draft = tiny_pair
    code, err = _serve_cli(capsys, "--target", target, "--draft", draft, *llm_cli_args(),
                           *extra)
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 2 and len(errors) == 1 and message in errors[0], err


def test_serve_port_in_use(capsys, tiny_pair):
    target, draft = tiny_pair
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code, err = _serve_cli(capsys, "--target", target, "--draft", draft, *llm_cli_args(),
                               "--port", str(port), "--no-progress")
    assert code == 2 and f"error: cannot listen on 127.0.0.1:{port}" in err, err


def test_serve_without_aiohttp_says_what_to_install(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "aiohttp", None)  # makes `import aiohttp` fail
    code, err = _serve_cli(capsys)
    assert code == 2
    assert ("error: jspec serve needs aiohttp, which is not installed: "
            "pip install 'jspec[serve]'") in err
