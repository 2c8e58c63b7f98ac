"""A request as the engine takes it (vLLM's input processor): its prompt tokenized and checked
against the engine's limits, a sampling seed when it gave none, and the ``Sequence`` it becomes.

The checks are the server's too (``jspec.request_checks``, ``EngineLimits``), so the Python API
and the OpenAI server accept and refuse the same requests with the same words.
"""

from __future__ import annotations

import itertools
import time

import numpy as np

from jspec.engine_info import EngineLimits
from jspec.request_checks import check_request
from jspec.sampling_params import SamplingParams
from jspec.sequence import Sequence


class InputProcessor:
    def __init__(self, tokenizer, num_pool_models: int, seed: int):
        self.tokenizer = tokenizer
        self.num_pool_models = num_pool_models
        # why this engine refuses logprobs, when it does (LLMEngine.refuse_logprobs)
        self.logprobs_refusal: str | None = None
        self._arrivals = itertools.count()
        self._seed_rng = np.random.default_rng(seed)

    def validate(self, prompt, sampling_params: SamplingParams, cache_salt: str | None,
                 limits: EngineLimits) -> list[int]:
        """The prompt's token ids; a ValueError naming the problem before anything runs."""
        return check_request(prompt, sampling_params, cache_salt, tokenizer=self.tokenizer,
                             limits=limits, logprobs_refusal=self.logprobs_refusal)

    def sequence(self, request_id: str, token_ids: list[int], sampling_params: SamplingParams,
                 arrival_time: float | None, cache_salt: str | None) -> Sequence:
        """The new request's sequence: its seed (the request's, or one drawn from the engine's
        seeded generator) and its place in arrival order."""
        seed = sampling_params.seed
        if seed is None:
            seed = int(self._seed_rng.integers(0, 2**32))
        now = time.perf_counter() if arrival_time is None else arrival_time
        return Sequence(request_id=request_id, prompt_token_ids=token_ids,
                        sampling_params=sampling_params, arrival_index=next(self._arrivals),
                        arrival_time=now, seed=seed, cache_salt=cache_salt,
                        draft_computed=[0] * max(1, self.num_pool_models))
