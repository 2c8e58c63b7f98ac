"""What the engine returns: vLLM-shaped request outputs plus speculation statistics."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class SpecStats:
    """Speculation statistics of one request so far."""

    num_drafted: int = 0  # draft tokens sent to verification
    num_accepted: int = 0
    num_spec_steps: int = 0  # decode steps that drafted (γ > 0)
    num_steps: int = 0  # steps that emitted tokens for this request

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted / self.num_drafted if self.num_drafted else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per speculative step (accepted drafts + the bonus/correction token)."""
        if not self.num_spec_steps:
            return 0.0
        return (self.num_accepted + self.num_spec_steps) / self.num_spec_steps


@dataclasses.dataclass
class Logprob:
    """One token's log-probability under the target's raw distribution (vLLM's fields): its
    ``rank`` in that distribution (1 = most likely) and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclasses.dataclass
class RequestOutput:
    """One request's state after a step. ``text``/``token_ids`` are cumulative; ``delta_text`` /
    ``delta_token_ids`` are what this step added (for streaming)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    # The request's output-token list (shared, append-only) and how much of it this output
    # covers: ``token_ids`` is sliced on access, so streaming a long request costs O(1) per step
    # instead of copying every token every step.
    token_source: list[int] = dataclasses.field(repr=False)
    num_tokens: int
    delta_text: str
    delta_token_ids: list[int]
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | None while running
    spec: SpecStats
    metrics: dict = dataclasses.field(default_factory=dict)  # arrival, first token, finish times
    # per output token {token id: Logprob} (the request's top ``logprobs`` and the emitted
    # token), shared and sliced like ``token_source``; None unless the request asked
    logprob_source: list | None = dataclasses.field(default=None, repr=False)
    # prompt tokens served from the prefix cache at admission (vLLM's name; 0 without caching)
    num_cached_tokens: int = 0

    @property
    def token_ids(self) -> list[int]:
        return self.token_source[:self.num_tokens]

    @property
    def logprobs(self) -> list[dict[int, Logprob]] | None:
        """vLLM's ``CompletionOutput.logprobs``: one dict per output token."""
        return None if self.logprob_source is None else self.logprob_source[:self.num_tokens]

    @property
    def cumulative_logprob(self) -> float | None:
        """The summed log-probability of the output tokens (None without logprobs)."""
        if self.logprob_source is None:
            return None
        return sum(entry[t].logprob for entry, t in zip(self.logprobs, self.token_ids))

    # vLLM-style accessors so code written for vLLM reads naturally
    @property
    def outputs(self) -> list["RequestOutput"]:
        return [self]
