"""Sampling parameters of one request (vLLM-compatible names), validated at the boundary."""

from __future__ import annotations

import dataclasses
import math


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to sample one request.

    temperature 0 means greedy. top_k 0 (or -1) and top_p 1 disable those filters. ``seed`` makes a
    request's sampling reproducible whatever else is in the batch; without one the engine draws a
    seed. ``stop`` strings end generation when they appear in the text (the stop string itself is
    not returned); ``stop_token_ids`` end it on those tokens (returned), as does the model's EOS
    unless ``ignore_eos``.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # top log-probabilities per output token (0: the token's own)
    # vLLM's options that jspec does not implement: accepted only at the value that changes
    # nothing, so vLLM code runs unchanged until it asks for one (_UNSUPPORTED says why)
    n: int = 1
    best_of: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    prompt_logprobs: int | None = None

    def __post_init__(self):
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop or ()))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        self._validate()

    def _validate(self) -> None:
        for name, (neutral, why) in _UNSUPPORTED.items():
            value = getattr(self, name)
            if value not in neutral or isinstance(value, bool):
                raise ValueError(f"{name}={value!r} is not supported: {why}")
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) \
                or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not _is_number(self.temperature) or self.temperature < 0 \
                or not math.isfinite(self.temperature):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 or -1 disables), got {self.top_k!r}")
        if self.logprobs is not None and (not isinstance(self.logprobs, int)
                                          or isinstance(self.logprobs, bool) or self.logprobs < 0):
            raise ValueError(f"logprobs must be None or an integer >= 0, got {self.logprobs!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)
                                      or not 0 <= self.seed < 2**32):
            raise ValueError(f"seed must be an integer in [0, 2**32), got {self.seed!r}")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop strings must be non-empty strings, got {s!r}")
        for t in self.stop_token_ids:
            if not isinstance(t, int) or isinstance(t, bool) or t < 0:
                raise ValueError(f"stop_token_ids must be non-negative integers, got {t!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be True or False, got {self.ignore_eos!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


_ONE_SAMPLE = ("jspec returns one sample per request; for several, submit the prompt several "
               "times with different seeds")
_EXACT = ("jspec samples the target's distribution exactly (speculation is verified against "
          "it), and logit penalties are not implemented")
_UNSUPPORTED = {
    "n": ((1,), _ONE_SAMPLE),
    "best_of": ((None, 1), _ONE_SAMPLE),
    "presence_penalty": ((0,), _EXACT),
    "frequency_penalty": ((0,), _EXACT),
    "repetition_penalty": ((1,), _EXACT),
    "min_p": ((0,), "the filters implemented are top_k and top_p"),
    "prompt_logprobs": ((None,), "log-probabilities of prompt tokens are not returned (those "
                        "of generated tokens are: logprobs)"),
}


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)
