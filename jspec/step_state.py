"""One engine step's state (``StepState``) and its stage clock (``StageClock``).

``LLMEngine.step`` fills a StepState stage by stage (plan, catch-up, draft, select, verify,
accept, commit) instead of threading a dozen arguments through helpers; the device arrays it
holds stay on device until the step's one transfer.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any

import jax
import numpy as np

from jspec.input_batch import RowWork
from jspec.policies.base import BatchView, DraftPlan

# The stages of a step, in order, as StageClock times them
# ("deferred": drafters' host work that no draft waits for, done while the device verifies)
STAGES = ("schedule", "plan", "catch_up", "draft", "intermediate", "verify", "accept", "signals",
          "deferred", "commit")


@dataclasses.dataclass(eq=False)
class StepState:
    rows: list[RowWork]  # scheduled sequences in schedule order (the row order of every call)
    decode_idx: np.ndarray  # rows that decode (may speculate), in the view's order
    num_rows: int  # the sequence bucket the rows are padded to
    num_prefill_tokens: int
    view: BatchView | None = None
    plan: DraftPlan | None = None
    gamma: int = 0  # the γ bucket: 0 means no draft work and no draft tensors at all
    chain: tuple[int, ...] = ()  # the pool models drafting this step (DraftPlan.chain)
    # the step's jspec.proposers.Proposer (None when nothing drafts): the chain's, or one that
    # runs each row's drafter (DraftPlan.drafters)
    proposer: Any = None
    table: np.ndarray | None = None  # page table [num_rows, max_pages]
    sampling: Any = None  # SamplingTensors [num_rows]
    draft: Any = None  # DraftResult (device), when the step drafted
    num_drafted: Any = None  # [num_rows] drafted tokens to verify (device, or host after select)
    # a two-level chain: what the first model drafted [num_rows] and the middle model's
    # verdict (device_steps.IntermediateResult); ``draft`` then holds the middle model's draft
    first_drafted: Any = None
    intermediate: Any = None
    # a step whose rows draft with different drafters: the rows a lookup drafted [num_rows]
    # (one-hot q; None when every row's drafts have a distribution, or none has)
    onehot_rows: np.ndarray | None = None
    draft_inputs: Any = None  # the draft loop's DraftInputs (benchmarks replay them)
    batch: Any = None  # the verify batch (ModelInput, drafts as placeholders)
    draft_slots: np.ndarray | None = None  # [num_rows, γ] where each draft goes in ``batch``
    catch_up_tokens: int = 0
    fetch_time: float = 0.0  # the result transfer (inside the commit stage)
    num_tokens: int = 0  # target tokens in the verify batch
    num_padded_tokens: int = 0  # the verify batch's width (its compiled bucket)
    # a decode-only step verified as a step with prefill is, at a token bucket
    # (``Executor.verify``): its rows padded to the widest bucket
    ragged: bool = False
    # dispatched, not yet read back (device): the verify's logits and VerifyResult, the
    # requested logprobs and the policy's signals; dropped once committed
    logits: Any = None
    result: Any = None
    logprobs: Any = None
    signals: Any = None
    clock: "StageClock | None" = None
    # asynchronous scheduling (LLMEngine.step): the previous step's row whose device token each
    # row fed (-1: the host's), and whether this step's sequences hold PENDING_TOKEN now
    carry_rows: np.ndarray | None = None
    held: bool = False
    tokens: np.ndarray | None = None  # the sampled tokens [S, G + 1], once fetched

    @property
    def wants_logprobs(self) -> bool:
        """Whether a row that samples this step belongs to a request that asked for logprobs."""
        return any(r.samples and r.seq.sampling_params.logprobs is not None for r in self.rows)

    @property
    def has_prefill(self) -> bool:
        return len(self.decode_idx) < len(self.rows)

    @property
    def verified_ragged(self) -> bool:
        """Verified at a token bucket, sampled apart (``Executor.accept``): a step with prefill,
        or a decode-only one whose drafts are short enough (``ragged``)."""
        return self.ragged or self.has_prefill

    @functools.cached_property
    def decode_rows(self) -> list[RowWork]:
        # fixed once planned: the reclaim step only appends prefill rows
        return [self.rows[i] for i in self.decode_idx.tolist()]

    @property
    def draft_tokens(self):
        return None if self.draft is None else self.draft.tokens

    @property
    def draft_logits(self):
        return None if self.draft is None else self.draft.logits

    def drop_device_buffers(self) -> None:
        """Let go of the step's device outputs once they are committed."""
        self.result = self.logits = self.signals = self.logprobs = None

    def row_gammas(self) -> np.ndarray:
        """Verified draft slots per padded row (0 for prefill and padding rows)."""
        out = np.zeros(self.num_rows, np.int64)
        for i in self.decode_idx.tolist():
            out[i] = self.rows[i].gamma_verify
        return out


@dataclasses.dataclass
class Fetched:
    """A step's results on the host (the step's one host<-device transfer): the VerifyResult,
    the policy's signals, drafted tokens per row and the requested logprobs."""

    result: Any
    signals: Any
    drafted: Any
    logprobs: Any


class StageClock:
    """Wall time per stage of a step (``STAGES``). With ``sync`` each device
    stage waits for its outputs before the lap closes, so the split between device stages is
    exact (benchmarks); without it a lap closes at dispatch and device time lands in whichever
    later stage first waits for it (the step's total is right either way)."""

    def __init__(self, sync: bool = False):
        self.sync = sync
        self.start = self.last = time.perf_counter()
        self.skipped = 0.0
        self.times = dict.fromkeys(STAGES, 0.0)
        self.period: float | None = None  # results to results (``total``)

    def lap(self, stage: str, *outputs) -> None:
        if self.sync and outputs:
            jax.block_until_ready(outputs)
        now = time.perf_counter()
        self.times[stage] += now - self.last
        self.last = now

    def skip(self) -> None:
        """Leave the time since the last lap out of the step: the host spent it on another
        step (asynchronous scheduling commits one step while the next one runs)."""
        now = time.perf_counter()
        self.skipped += now - self.last
        self.last = now

    @property
    def total(self) -> float:
        """The step's time: its ``period`` while the engine is busy (``LLMEngine.complete``),
        else its stages' laps."""
        if self.period is not None:
            return self.period
        return self.last - self.start - self.skipped
