"""The OpenAI wire format: request bodies checked field by field into typed requests, and the
response / stream-chunk / error bodies.

Every rejection is an ``APIError`` that becomes an OpenAI-style body
``{"error": {"message", "type", "param", "code"}}``; the message names the offending field and
``param`` holds its name, so a client can point at the field without parsing prose. Range rules
for sampling parameters live in one place, ``jspec.SamplingParams``, and the checks of chat
messages and prompts in another, ``jspec.request_checks``, both shared with the Python API; this
module checks JSON types and which fields exist, then maps their ValueErrors back to the field.

Unknown fields are refused (as OpenAI does): a misspelt ``max_token`` silently running with the
default would be worse than a 400. Known OpenAI fields that the engine cannot honour are accepted
only at their neutral value (``n=1``, ``presence_penalty=0``, ``echo=false`` ...).

Log-probabilities: ``logprobs: k`` on completions and ``logprobs: true`` + ``top_logprobs: k`` on
chat completions ask for the target's log-probability of every generated token and its top k
alternatives (``completion_logprobs`` / ``chat_logprobs`` shape them as OpenAI does).
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from typing import Any

from jspec.request_checks import (RequestError, check_cache_salt, check_messages, type_error,
                                  type_name)
from jspec.sampling_params import SamplingParams


class APIError(Exception):
    """An HTTP error with an OpenAI-style JSON body."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str, param: str | None = None, code: str | None = None
               ) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def invalid(param: str | None, message: str, code: str = "invalid_value") -> APIError:
    return APIError(400, message, param=param, code=code)


def from_request_error(e: RequestError) -> APIError:
    """The 400 for a check shared with the Python API (``jspec.request_checks``)."""
    return invalid(e.param, str(e), e.code)


# ----------------------------------------------------------------------------- body parsing
def parse_json_body(raw: bytes) -> dict:
    if not raw.strip():
        raise invalid(None, "the request body is empty; expected a JSON object", "invalid_json")
    try:
        body = json.loads(raw)
    except UnicodeDecodeError:
        raise invalid(None, "the request body is not UTF-8 text", "invalid_json") from None
    except json.JSONDecodeError as e:
        raise invalid(None, f"the request body is not valid JSON: {e.msg} at line {e.lineno} "
                            f"column {e.colno}", "invalid_json") from None
    if not isinstance(body, dict):
        raise invalid(None, f"the request body must be a JSON object, got "
                            f"{type_name(body)}", "invalid_json")
    return body


def _type_error(name: str, expected: str, value: Any) -> APIError:
    return from_request_error(type_error(name, expected, value))


def _int(name: str, value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise _type_error(name, "an integer", value)
    return value


def _number(name: str, value: Any) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise _type_error(name, "a number", value)
    if not math.isfinite(value):  # json.loads accepts NaN and Infinity
        raise invalid(name, f"{name} must be a finite number, got {value}")
    return float(value)


def _bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise _type_error(name, "a boolean", value)
    return value


def _str(name: str, value: Any) -> str:
    if not isinstance(value, str):
        raise _type_error(name, "a string", value)
    return value


def _neutral(name: str, value: Any, allowed: tuple, what: str) -> None:
    """Accept a known OpenAI field only at a value that changes nothing here (its JSON type is
    checked before, so ``value in allowed`` cannot confuse a boolean with a number)."""
    if value is None or value in allowed:
        return
    raise invalid(name, f"{name} is not supported by this server ({what}); got "
                        f"{json.dumps(value)[:80]}", "unsupported_parameter")


# Fields shared by /v1/completions and /v1/chat/completions, and how each is read.
# Extensions beyond OpenAI's schema, as in vLLM: top_k, stop_token_ids, ignore_eos, cache_salt.
_SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids",
                    "ignore_eos", "logprobs")
_COMMON_FIELDS = {"model", "max_tokens", "stream", "stream_options", "n", "user", "cache_salt",
                  "presence_penalty", "frequency_penalty", "logit_bias", *_SAMPLING_FIELDS}
_COMPLETION_FIELDS = _COMMON_FIELDS | {"prompt", "echo", "logprobs", "best_of", "suffix"}
_CHAT_FIELDS = _COMMON_FIELDS | {"messages", "max_completion_tokens", "logprobs",
                                 "top_logprobs", "response_format", "tools", "tool_choice",
                                 "parallel_tool_calls"}


@dataclasses.dataclass
class GenerationRequest:
    """A checked request: what to generate for, and how."""

    kind: str  # "completion" | "chat"
    model: str
    prompts: list  # completion: str or token-id lists; chat: one list of messages
    max_tokens: int | None  # None: the endpoint's default (see app)
    max_tokens_param: str  # the field max_tokens came from (chat also takes max_completion_tokens)
    sampling: dict[str, Any]  # SamplingParams fields other than max_tokens
    stream: bool
    include_usage: bool
    # the prefix-cache salt (vLLM's cache_salt): prefixes are shared only among its requests
    cache_salt: str | None = None


def _check_fields(body: dict, known: set[str]) -> None:
    unknown = sorted(set(body) - known)
    if unknown:
        raise invalid(unknown[0], f"unrecognized request argument supplied: {unknown[0]}",
                      "unknown_parameter")


def _required(body: dict, name: str) -> Any:
    if name not in body or body[name] is None:
        raise invalid(name, f"missing required field '{name}'", "missing_required_parameter")
    return body[name]


def _common(body: dict) -> tuple[str, dict, bool, bool]:
    model = _str("model", _required(body, "model"))
    sampling: dict[str, Any] = {}
    if body.get("temperature") is not None:
        sampling["temperature"] = _number("temperature", body["temperature"])
    if body.get("top_p") is not None:
        sampling["top_p"] = _number("top_p", body["top_p"])
    if body.get("top_k") is not None:
        sampling["top_k"] = _int("top_k", body["top_k"])
    if body.get("seed") is not None:
        sampling["seed"] = _int("seed", body["seed"])
    stop = body.get("stop")
    if stop is not None:
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise _type_error("stop", "a string or an array of strings", body["stop"])
        sampling["stop"] = tuple(stop)
    ids = body.get("stop_token_ids")
    if ids is not None:
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool)
                                                for t in ids):
            raise _type_error("stop_token_ids", "an array of integers", ids)
        sampling["stop_token_ids"] = tuple(ids)
    if body.get("ignore_eos") is not None:
        sampling["ignore_eos"] = _bool("ignore_eos", body["ignore_eos"])
    stream = _bool("stream", body["stream"]) if body.get("stream") is not None else False
    include_usage = False
    options = body.get("stream_options")
    if options is not None:
        if not isinstance(options, dict):
            raise _type_error("stream_options", "an object", options)
        if not stream:
            raise invalid("stream_options", "stream_options is only allowed with stream: true")
        extra = sorted(set(options) - {"include_usage"})
        if extra:
            raise invalid("stream_options", f"unrecognized stream_options field: {extra[0]}",
                          "unknown_parameter")
        if options.get("include_usage") is not None:
            include_usage = _bool("stream_options.include_usage", options["include_usage"])
    if body.get("n") is not None and _int("n", body["n"]) != 1:
        raise invalid("n", f"n must be 1 (one choice per prompt), got {body['n']}",
                      "unsupported_parameter")
    if body.get("user") is not None:
        _str("user", body["user"])
    for name in ("presence_penalty", "frequency_penalty"):
        if body.get(name) is not None:
            _number(name, body[name])
            _neutral(name, body[name], (0,), "penalties would change the target distribution")
    if body.get("logit_bias") is not None:
        if not isinstance(body["logit_bias"], dict):
            raise _type_error("logit_bias", "an object", body["logit_bias"])
        _neutral("logit_bias", body["logit_bias"] or None, (), "no logit biasing")
    return model, sampling, stream, include_usage


def _cache_salt(body: dict) -> str | None:
    try:  # the same check as the Python API's
        return check_cache_salt(body.get("cache_salt"))
    except RequestError as e:
        raise from_request_error(e) from None


def _max_tokens(name: str, value: Any) -> int | None:
    if value is None:
        return None
    value = _int(name, value)
    if value < 1:
        raise invalid(name, f"{name} must be >= 1, got {value}")
    return value


def parse_completion_request(body: dict) -> GenerationRequest:
    _check_fields(body, _COMPLETION_FIELDS)
    model, sampling, stream, include_usage = _common(body)
    prompt = _required(body, "prompt")
    prompts = _prompts(prompt)
    if body.get("echo") is not None:
        _neutral("echo", _bool("echo", body["echo"]), (False,), "the prompt is not echoed")
    if body.get("logprobs") is not None:
        sampling["logprobs"] = _int("logprobs", body["logprobs"])
    if body.get("best_of") is not None:
        _neutral("best_of", _int("best_of", body["best_of"]), (1,), "one sample per prompt")
    if body.get("suffix") is not None:
        _neutral("suffix", _str("suffix", body["suffix"]) or None, (), "no insertion")
    return GenerationRequest("completion", model, prompts,
                             _max_tokens("max_tokens", body.get("max_tokens")), "max_tokens",
                             sampling, stream, include_usage, _cache_salt(body))


def _is_token_ids(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in value)


def _prompts(prompt: Any) -> list:
    """OpenAI's prompt forms: a string, an array of token ids, or an array of either (a batch:
    one choice per prompt, ``index`` = position in the array)."""
    expected = "a string, an array of token ids, or an array of strings / token-id arrays"
    if isinstance(prompt, str):
        prompts = [prompt]
    elif _is_token_ids(prompt):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(
            isinstance(p, str) or _is_token_ids(p) for p in prompt):
        prompts = list(prompt)
    elif isinstance(prompt, list) and not prompt:
        raise invalid("prompt", "prompt is empty")
    else:
        raise _type_error("prompt", expected, prompt)
    for p in prompts:
        if isinstance(p, str) and not p:
            raise invalid("prompt", "prompt is empty")
    return prompts


def parse_chat_request(body: dict) -> GenerationRequest:
    _check_fields(body, _CHAT_FIELDS)
    model, sampling, stream, include_usage = _common(body)
    try:  # the same check as LLM.chat's
        checked = check_messages(_required(body, "messages"))
    except RequestError as e:
        raise from_request_error(e) from None
    max_tokens = _max_tokens("max_tokens", body.get("max_tokens"))
    max_completion = _max_tokens("max_completion_tokens", body.get("max_completion_tokens"))
    if max_tokens is not None and max_completion is not None and max_tokens != max_completion:
        raise invalid("max_completion_tokens", f"max_tokens ({max_tokens}) and "
                                               f"max_completion_tokens ({max_completion}) "
                                               f"disagree; give one of them")
    wants = body.get("logprobs") is not None and _bool("logprobs", body["logprobs"])
    top = body.get("top_logprobs")
    if top is not None:
        top = _int("top_logprobs", top)
        if not wants:
            raise invalid("top_logprobs", "top_logprobs needs logprobs: true")
        if top < 0:
            raise invalid("top_logprobs", f"top_logprobs must be >= 0, got {top}")
    if wants:
        sampling["logprobs"] = top or 0
    fmt = body.get("response_format")
    if fmt is not None:
        if not isinstance(fmt, dict):
            raise _type_error("response_format", "an object", fmt)
        _neutral("response_format", fmt.get("type"), ("text",), "plain text only")
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise _type_error("tools", "an array", tools)
        _neutral("tools", tools or None, (), "no tool calling")
    if body.get("tool_choice") is not None:
        _neutral("tool_choice", body["tool_choice"], ("none", "auto"), "no tool calling")
    if body.get("parallel_tool_calls") is not None:
        _bool("parallel_tool_calls", body["parallel_tool_calls"])
    salt = _cache_salt(body)
    if max_tokens is None and max_completion is not None:
        return GenerationRequest("chat", model, [checked], max_completion,
                                 "max_completion_tokens", sampling, stream, include_usage, salt)
    return GenerationRequest("chat", model, [checked], max_tokens, "max_tokens", sampling,
                             stream, include_usage, salt)


def sampling_params(request: GenerationRequest, max_tokens: int) -> SamplingParams:
    """SamplingParams from a checked request, with its ValueError mapped to the field: its
    messages start with the field's name ("top_p must be in (0, 1], got 1.5")."""
    try:
        return SamplingParams(max_tokens=max_tokens, **request.sampling)
    except ValueError as e:
        message = str(e)
        first = message.split(" ", 1)[0]
        param = first if first in ("max_tokens", *_SAMPLING_FIELDS) else None
        raise invalid(param, message) from None


# ----------------------------------------------------------------------------- responses
def usage_body(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """OpenAI's usage object; ``prompt_tokens_details.cached_tokens`` are the prompt tokens
    served from the prefix cache."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def response_body(kind: str, request_id: str, created: int, model: str, choices: list[dict],
                  usage: dict | None = None, chunk: bool = False) -> dict:
    """A whole response (``chunk=False``) or one stream chunk of a completion or chat request.
    Stream chunks carry ``usage`` only in the extra last chunk asked for with
    ``stream_options.include_usage`` (with empty ``choices``), as OpenAI sends it."""
    if kind == "completion":
        obj = "text_completion"  # OpenAI names completion chunks the same as the whole
    else:
        obj = "chat.completion.chunk" if chunk else "chat.completion"
    body = {"id": request_id, "object": obj, "created": created, "model": model,
            "choices": choices}
    if usage is not None:
        body["usage"] = usage
    return body


def choice_body(kind: str, index: int, text: str, reason: str | None,
                logprobs: dict | None = None) -> dict:
    """One choice of a whole response (``logprobs``: ``completion_logprobs`` or
    ``chat_logprobs``, when the request asked)."""
    if kind == "completion":
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason}
    return {"index": index, "message": {"role": "assistant", "content": text},
            "logprobs": logprobs, "finish_reason": reason}


def chunk_choice(kind: str, index: int, text: str | None, reason: str | None,
                 first: bool = False, logprobs: dict | None = None) -> dict:
    """One choice of a stream chunk: completion chunks carry text, chat chunks a delta (the
    first one with the assistant role, the last one empty with the finish reason)."""
    if kind == "completion":
        return {"index": index, "text": text or "", "logprobs": logprobs,
                "finish_reason": reason}
    delta: dict[str, str] = {}
    if first:
        delta["role"] = "assistant"
    if text is not None:
        delta["content"] = text
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}


def _top(entry: dict, k: int) -> list:
    """The k most likely of one token's Logprob entries, most likely first."""
    return sorted((lp for lp in entry.values() if lp.rank <= k), key=lambda lp: lp.rank)


def completion_logprobs(token_ids: list[int], entries: list[dict], k: int,
                        offset: int = 0) -> dict:
    """The legacy completions ``logprobs`` object for these tokens (``entries``: the engine's
    ``{token id: Logprob}`` per token); ``offset``: the text length before the first one."""
    tokens, offsets = [], []
    for t, entry in zip(token_ids, entries):
        offsets.append(offset)
        text = entry[t].decoded_token or ""
        tokens.append(text)
        offset += len(text)
    return {"tokens": tokens,
            "token_logprobs": [entry[t].logprob for t, entry in zip(token_ids, entries)],
            "top_logprobs": [{lp.decoded_token: lp.logprob for lp in _top(entry, k)}
                             for entry in entries],
            "text_offset": offsets}


def chat_logprobs(token_ids: list[int], entries: list[dict], k: int) -> dict:
    """The chat completions ``logprobs`` object (``{"content": [...]}``) for these tokens."""
    def item(lp) -> dict:
        text = lp.decoded_token or ""
        return {"token": text, "logprob": lp.logprob, "bytes": list(text.encode())}

    return {"content": [dict(item(entry[t]), top_logprobs=[item(lp) for lp in _top(entry, k)])
                        for t, entry in zip(token_ids, entries)]}


def created_now() -> int:
    return int(time.time())
