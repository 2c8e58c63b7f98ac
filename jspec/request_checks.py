"""Checks of what a request is made of, shared by the Python API (``LLM``, ``LLMEngine``) and the
server (``serve/protocol.py``, ``serve/app.py``), so that both accept and refuse the same prompts
and chat messages with the same words. The limits of one engine (context length, max_tokens,
logprobs) are ``EngineLimits``' checks (jspec/engine_info.py); sampling ranges are
``SamplingParams``'.

Every refusal is a ``RequestError``: a ValueError that also carries the field's path (``param``,
e.g. ``messages[2].content``) and an OpenAI error code, which the server puts in its 400 body.
Plain Python, no JAX: the server's request parsing imports it.
"""

from __future__ import annotations

import json
import numbers
from typing import Any

from jspec.sampling_params import SamplingParams


class RequestError(ValueError):
    """Bad input in one field of a request: ``param`` is the field's path, ``code`` the OpenAI
    error code (``invalid_value``, ``invalid_type``, ``missing_required_parameter``)."""

    def __init__(self, param: str | None, message: str, code: str = "invalid_value"):
        super().__init__(message)
        self.param = param
        self.code = code


def type_name(value: Any) -> str:
    """The kind of ``value`` as JSON names it ("a string", "an array", "null", ...): what a
    client sent, whether as JSON or as Python objects."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, numbers.Integral):
        return "an integer"
    if isinstance(value, numbers.Real):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, (list, tuple)):
        return "an array"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__


def type_error(param: str, expected: str, value: Any) -> RequestError:
    """``param must be EXPECTED, got KIND (VALUE)``, the value shortened to 80 characters."""
    try:
        shown = json.dumps(value)
    except (TypeError, ValueError):
        shown = repr(value)
    return RequestError(param, f"{param} must be {expected}, got {type_name(value)} "
                               f"({shown[:80]})", "invalid_type")


def is_token_id(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_prompt(prompt: Any, param: str = "prompt") -> str | list[int]:
    """A prompt as the engine takes it: non-empty text, or a non-empty list of integer token ids
    (ranges against the vocabulary and the context are the engine's checks)."""
    if isinstance(prompt, str):
        if not prompt:
            raise RequestError(param, f"{param} is empty")
        return prompt
    if not isinstance(prompt, (list, tuple)):
        raise type_error(param, "a string or a list of token ids", prompt)
    if not prompt:
        raise RequestError(param, f"{param} is empty")
    for i, t in enumerate(prompt):
        if not is_token_id(t):
            raise type_error(f"{param}[{i}]", "an integer token id", t)
    return [int(t) for t in prompt]


def check_cache_salt(cache_salt: Any, param: str = "cache_salt") -> str | None:
    """A request's prefix-cache salt: None (no salt) or a non-empty string."""
    if cache_salt is None:
        return None
    if not isinstance(cache_salt, str):
        raise type_error(param, "a non-empty string", cache_salt)
    if not cache_salt:
        raise RequestError(param, f"{param} must be a non-empty string, got an empty string")
    return cache_salt


# ----------------------------------------------------------------------------- chat messages
# OpenAI's roles; a chat template may refuse some of them, or their order (render_chat)
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


def check_messages(messages: Any, param: str = "messages") -> list[dict[str, str]]:
    """One conversation checked and normalised to ``[{"role", "content"}]`` with text content:
    a role among ``CHAT_ROLES``, content a string or a list of text parts (joined), or null
    for an assistant turn (an empty string). Other keys of a message are dropped."""
    if not isinstance(messages, (list, tuple)):
        raise type_error(param, "an array of message objects", messages)
    if not messages:
        raise RequestError(param, f"{param} is empty; give at least one message")
    return [_message(f"{param}[{i}]", m) for i, m in enumerate(messages)]


def _message(where: str, message: Any) -> dict[str, str]:
    if not isinstance(message, dict):
        raise type_error(where, "an object with 'role' and 'content'", message)
    role = message.get("role")
    if role is None:
        raise RequestError(f"{where}.role", f"missing required field '{where}.role'",
                           "missing_required_parameter")
    if not isinstance(role, str):
        raise type_error(f"{where}.role", "a string", role)
    if role not in CHAT_ROLES:
        raise RequestError(f"{where}.role", f"{where}.role must be one of "
                                            f"{', '.join(CHAT_ROLES)}; got {role!r}")
    if "content" not in message:
        raise RequestError(f"{where}.content", f"missing required field '{where}.content'",
                           "missing_required_parameter")
    content = message["content"]
    if isinstance(content, list):  # content parts: only text parts exist for a text model
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" \
                    or not isinstance(part.get("text"), str):
                raise RequestError(f"{where}.content[{j}]",
                                   f"{where}.content[{j}] must be a text part "
                                   f"{{\"type\": \"text\", \"text\": ...}}; this model reads "
                                   f"text only", "invalid_type")
            texts.append(part["text"])
        content = "".join(texts)
    elif content is None and role == "assistant":
        content = ""
    elif not isinstance(content, str):
        raise type_error(f"{where}.content", "a string or an array of text parts", content)
    return {"role": role, "content": content}


def render_chat(tokenizer, messages: list[dict[str, str]], param: str = "messages"
                ) -> list[int]:
    """Token ids of checked ``messages`` rendered with the tokenizer's chat template; a
    template that is missing or refuses the conversation is a RequestError naming ``param``."""
    from jspec.models.loader import apply_chat_template

    if tokenizer is None:
        raise RequestError(param, "there is no tokenizer, so no chat template to apply; give "
                                  "the prompt as token ids")
    try:
        return apply_chat_template(tokenizer, messages)
    except ValueError as e:  # no chat template
        raise RequestError(param, str(e)) from None
    except Exception as e:  # noqa: BLE001 - the template itself refused (jinja raise_exception)
        raise RequestError(param, f"the chat template cannot render these messages: "
                                  f"{e}") from None


def check_request(prompt, sampling_params, cache_salt: str | None, *, tokenizer, limits,
                  logprobs_refusal: str | None = None) -> list[int]:
    """A request's prompt as token ids, checked with its sampling parameters and salt against
    an engine's ``limits`` (``EngineLimits``); a ValueError naming the problem otherwise.
    ``logprobs_refusal``: why this engine returns no logprobs at all, when it cannot."""
    if not isinstance(sampling_params, SamplingParams):
        raise ValueError(f"sampling_params must be a SamplingParams, got "
                         f"{type(sampling_params).__name__}")
    check_cache_salt(cache_salt)
    prompt = check_prompt(prompt)
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("a text prompt needs a tokenizer; pass token ids instead")
        token_ids = list(tokenizer.encode(prompt))
        if not token_ids:
            raise ValueError("prompt is empty")
    else:
        token_ids = prompt
    vocab = limits.vocab_size
    bad = [t for t in token_ids if not 0 <= t < vocab]
    if bad:
        raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab})")
    if sampling_params.logprobs is not None:
        if logprobs_refusal is not None:
            raise ValueError(logprobs_refusal)
        limits.check_logprobs(sampling_params.logprobs)
    limits.check_prompt_length(len(token_ids))
    limits.check_max_tokens(len(token_ids), sampling_params.max_tokens)
    return token_ids
