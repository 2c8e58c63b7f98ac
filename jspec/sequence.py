"""Per-request state on the host: tokens, how much of them each model's KV pool holds, status."""

from __future__ import annotations

import dataclasses
import enum
from typing import Any


# Where a sequence's newest token goes while the device has sampled it but the host has not read
# it yet (the engine's asynchronous scheduling, LLMEngine.step): it counts in the sequence's
# length, and the device feeds the real token wherever the host would have read this one.
PENDING_TOKEN = -1


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in (SequenceStatus.FINISHED_STOPPED, SequenceStatus.FINISHED_LENGTH,
                        SequenceStatus.FINISHED_ABORTED)


@dataclasses.dataclass(eq=False)
class Sequence:
    """One request's sequence.

    ``num_computed`` counts the tokens whose K/V the target pool holds; ``draft_computed[m]``
    the same for pool model m's KV pool (it lags while the policy chooses γ = 0 or a chain
    without m, and m catches up before it runs again); ``num_draft_computed`` is the first
    model's. In steady decoding ``num_computed == num_tokens - 1``: the newest token is fed in
    the next step.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: Any
    arrival_index: int  # monotonic: FCFS order, and "youngest" for preemption
    arrival_time: float = 0.0
    output_token_ids: list[int] = dataclasses.field(default_factory=list)
    num_computed: int = 0
    draft_computed: list[int] = dataclasses.field(default_factory=lambda: [0])
    status: SequenceStatus = SequenceStatus.WAITING
    seed: int = 0  # per-request PRNG seed (drawn by the engine when the request gave none)
    num_preemptions: int = 0
    # speculation statistics
    num_drafted: int = 0
    num_accepted: int = 0
    num_spec_steps: int = 0
    num_steps: int = 0
    # time of the first output token (for TTFT); set by the engine
    first_token_time: float | None = None
    # prompt tokens whose target K/V came from the prefix cache at first admission (None before
    # it; 0 without caching)
    num_cached_tokens: int | None = None
    # the prefix cache's hash chain of its full blocks (BlockManager.match_prefix): tokens only
    # grow, so each block is hashed once in the sequence's life, preemptions included
    block_hashes: list[bytes] = dataclasses.field(default_factory=list)
    # the request's prefix-cache salt (LLMEngine.add_request): it shares cached blocks only with
    # requests that gave the same one
    cache_salt: str | None = None

    @property
    def num_draft_computed(self) -> int:
        return self.draft_computed[0]

    @num_draft_computed.setter
    def num_draft_computed(self, value: int) -> None:
        self.draft_computed[0] = value

    def forget_draft_kv(self) -> None:
        """Every pool model's K/V of this sequence is gone (preemption, offload)."""
        self.draft_computed = [0] * len(self.draft_computed)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_uncomputed(self) -> int:
        """Tokens the target still has to process (1 in steady decoding)."""
        return self.num_tokens - self.num_computed

    @property
    def is_decoding(self) -> bool:
        return self.num_uncomputed == 1

    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_at(self, index: int) -> int:
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[index] if index < n else self.output_token_ids[index - n]

    def reset_for_recompute(self) -> None:
        """Preemption by recompute: forget all KV; prompt + outputs so far are prefilled again."""
        self.num_computed = 0
        self.forget_draft_kv()
        self.status = SequenceStatus.WAITING
        self.num_preemptions += 1
