"""What the rest of jspec reads about a running engine: its fixed limits and a live snapshot.

``LLMEngine.limits`` (an ``EngineLimits``, fixed once the engine is built) and
``LLMEngine.stats()`` (an ``EngineStats``, taken on each call) are the engine's read-only surface
for the server (``serve/``), the CLI and the benchmarks, so none of them reach into the
scheduler, the block manager or the resolved config. ``AsyncLLMEngine`` passes both through.

Plain dataclasses, no JAX: importing this module is cheap.
"""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class EngineLimits:
    """What an engine can hold, fixed for its lifetime."""

    max_model_len: int  # tokens one sequence may hold (prompt + output), from the config
    kv_capacity_tokens: int  # token slots in the whole KV cache (usable blocks × block_size)
    # tokens one sequence may really hold: min(max_model_len, kv_capacity_tokens). A prompt may
    # have at most context_limit - 1 tokens and prompt + max_tokens at most context_limit
    # (check_prompt_length, check_max_tokens)
    context_limit: int
    max_num_seqs: int  # sequences in one step: the most requests that run at once
    max_num_batched_tokens: int  # target tokens one step may process
    block_size: int  # tokens per KV block
    num_kv_blocks: int  # usable KV blocks (the null block excluded)
    vocab_size: int
    has_draft: bool  # False: plain decoding, nothing to speculate with (no draft, no lookup)
    policy: str  # the speculation policy's name
    max_gamma: int  # the most draft tokens a sequence may get in one step
    gamma_buckets: tuple[int, ...]  # the γ values steps are compiled for ((0,) without a draft)
    # the drafters' names, chains index them: the draft models, smallest first, or ("ngram",)
    draft_pool: tuple[str, ...] = ()
    # elastic memory: blocks the pool gains while the draft is offloaded (0 without it); a
    # request must fit in num_kv_blocks, the extension is extra room for the batch
    num_kv_extension_blocks: int = 0
    # the most top log-probabilities a request may ask for (0: none, not even the token's own)
    max_logprobs: int = 0
    kv_dtype: str = ""  # the KV cache's dtype (the models' unless EngineConfig.dtype forces one)
    kernel_backend: str = ""  # each kernel's backend (jspec.kernels.backend)
    weight_layout: str = ""  # the target's projection weights: "in_out" or "out_in"
    layer_buffers: str = ""  # the target's layer weights: "stacked" or "per_layer"

    @classmethod
    def of(cls, engine) -> "EngineLimits":
        """An ``LLMEngine``'s limits, from its config, block manager and runner."""
        bm, config = engine.block_manager, engine.config
        capacity = bm.num_base_usable_blocks * config.block_size
        return cls(
            max_model_len=engine.rc.max_model_len, kv_capacity_tokens=capacity,
            context_limit=min(engine.rc.max_model_len, capacity),
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=engine.rc.max_num_batched_tokens,
            block_size=config.block_size, num_kv_blocks=bm.num_base_usable_blocks,
            num_kv_extension_blocks=bm.num_extension_blocks,
            vocab_size=engine.target.cfg.vocab_size, has_draft=engine.speculates,
            policy=engine.policy.name, max_gamma=engine.max_gamma,
            gamma_buckets=tuple(engine.gamma_buckets),
            draft_pool=engine.pool_names if engine.runner.pool or engine.lookups else (),
            max_logprobs=(engine.runner.logprobs_width
                          if engine.inputs.logprobs_refusal is None else 0),
            kv_dtype=str(engine.runner.kv_dtype), kernel_backend=engine.runner.kernel_backend,
            weight_layout=engine.target.cfg.weight_layout,
            layer_buffers=engine.target.cfg.layer_buffers)

    @property
    def max_prompt_tokens(self) -> int:
        """The longest prompt a request may have (one token must remain for the output)."""
        return self.context_limit - 1

    def _context(self) -> str:
        """What bounds a sequence, in words: max_model_len, or the KV cache when it is smaller."""
        if self.context_limit == self.max_model_len:
            return f"max_model_len is {self.max_model_len}"
        return (f"the KV cache holds {self.kv_capacity_tokens} token slots (max_model_len "
                f"{self.max_model_len})")

    def check_prompt_length(self, num_tokens: int, what: str = "prompt") -> None:
        """A ValueError when a prompt of ``num_tokens`` tokens leaves no room for one output
        token; the engine's and the server's check (``what`` names the prompt)."""
        if num_tokens >= self.context_limit:
            raise ValueError(f"{what} has {num_tokens} tokens, {self._context()} (at least one "
                             f"token must remain for the output)")

    def check_max_tokens(self, prompt_tokens: int, max_tokens: int,
                         param: str = "max_tokens") -> None:
        """A ValueError when ``max_tokens`` (asked for by ``param``) more tokens do not fit after
        a prompt of ``prompt_tokens``; the engine's and the server's check, so the Python API,
        the CLI and a 400 refuse with the same words rather than one of them truncating."""
        if prompt_tokens + max_tokens > self.context_limit:
            raise ValueError(f"{param}={max_tokens} is too large: the prompt has "
                             f"{prompt_tokens} tokens and {self._context()}, so at most "
                             f"{self.context_limit - prompt_tokens} can be generated")

    def check_logprobs(self, k: int, param: str = "logprobs") -> None:
        """A ValueError naming the fix when a request's ``k`` top log-probabilities (asked for
        by ``param``) are more than this engine returns; the engine's and the server's check."""
        if not self.max_logprobs:
            raise ValueError(f"logprobs are off in this engine (max_logprobs=0); build it with "
                             f"max_logprobs={max(k, 1)} (--max-logprobs {max(k, 1)})")
        if k > self.max_logprobs:
            raise ValueError(f"{param}={k} is more than this engine returns (at most "
                             f"{self.max_logprobs}); build it with max_logprobs={k} "
                             f"(--max-logprobs {k})")


@dataclasses.dataclass(frozen=True)
class EngineStats:
    """A snapshot of an engine's load and counters.

    Taken without a lock: called from another thread while the engine steps, each field is read
    whole, but fields may come from consecutive steps (``num_running`` before a step and
    ``num_waiting`` after it, say). The counters (``metrics``) take in a step with its record:
    with asynchronous scheduling once the next step is dispatched, or once the engine idles."""

    num_running: int  # sequences in the running batch
    num_waiting: int  # requests waiting for a slot (the queue depth)
    kv_blocks_total: int  # usable KV blocks now (the elastic extension's too while expanded)
    kv_blocks_used: int  # held by sequences
    kv_blocks_free: int  # blocks an allocation may take (cached blocks no request holds too)
    draft_resident: bool  # the draft model's weights are on the device
    # device bytes by part (target_params, target_kv, draft_params, draft_kv): what elastic
    # memory trades, the draft's two against the target pool's extension
    device_memory_bytes: dict[str, int]
    metrics: dict[str, Any]  # EngineMetrics.as_dict(): counters since the engine was built
    # blocks in the prefix cache's index, held by requests or free for reuse (0 without caching)
    kv_blocks_cached: int = 0

    @classmethod
    def of(cls, engine) -> "EngineStats":
        """A snapshot of an ``LLMEngine``."""
        bm, scheduler = engine.block_manager, engine.scheduler
        total, free = bm.num_usable_blocks, bm.num_free_blocks
        return cls(num_running=scheduler.num_running, num_waiting=scheduler.num_waiting,
                   kv_blocks_total=total, kv_blocks_used=total - free, kv_blocks_free=free,
                   kv_blocks_cached=bm.num_cached_blocks, draft_resident=engine.draft_resident,
                   device_memory_bytes=engine.runner.device_bytes(),
                   metrics=engine.metrics.as_dict())

    @property
    def num_unfinished(self) -> int:
        return self.num_running + self.num_waiting

    @property
    def num_steps(self) -> int:
        return self.metrics["num_steps"]
