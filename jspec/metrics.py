"""Engine counters, read as a dict (the server exports them to Prometheus under the same names)."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import numpy as np

from jspec.block_manager import PrefixCacheStats
from jspec.policies.base import batch_bucket, chain_label

if TYPE_CHECKING:  # the record's module imports JAX; this one need not
    from jspec.step_record import StepRecord


@dataclasses.dataclass(frozen=True)
class SpecCounts:
    """One decoding step's speculation counts, the definitions of vLLM's ``spec_decode_*``
    metrics: what ``EngineMetrics`` and the server's Prometheus exporter (serve/metrics.py) both
    add up. A sequence-step drafted when it sent draft tokens to verification."""

    gamma_counts: np.ndarray  # [max_gamma + 1] sequence-steps per γ planned (beyond Γmax clipped)
    num_drafts: int  # sequence-steps that drafted
    num_draft_tokens: int  # drafted tokens sent to verification
    num_accepted_tokens: int  # by the drafting sequence-steps
    num_emitted_tokens: int  # by the drafting sequence-steps
    accepted_per_position: np.ndarray  # [max_gamma] position k: drafts that accepted > k tokens

    @classmethod
    def plain(cls, n: int, max_gamma: int) -> SpecCounts:
        """``count`` of a step whose ``n`` sequences all decoded plainly (γ = 0)."""
        gamma_counts = np.zeros(max_gamma + 1, np.int64)
        gamma_counts[0] = n
        return cls(gamma_counts, 0, 0, 0, 0, np.zeros(max_gamma, np.int64))

    @classmethod
    def count(cls, gammas: np.ndarray, num_verified: np.ndarray, num_accepted: np.ndarray,
              num_emitted: np.ndarray, max_gamma: int) -> SpecCounts:
        """The counts of the per-sequence arrays of one step (``StepOutcome``'s)."""
        # bincounts, not np.add.at or a loop per sequence: this runs on every decoding step
        size = max_gamma + 1
        gamma_counts = np.bincount(np.minimum(gammas, max_gamma), minlength=size)
        drafting = num_verified > 0
        if not drafting.any():
            return cls(gamma_counts, 0, 0, 0, 0, np.zeros(max_gamma, np.int64))
        accepted = num_accepted[drafting]
        # position k counts the drafts that accepted more than k tokens
        at_least = np.cumsum(np.bincount(np.minimum(accepted, max_gamma),
                                         minlength=size)[::-1])[::-1]
        return cls(gamma_counts=gamma_counts, num_drafts=int(drafting.sum()),
                   num_draft_tokens=int(num_verified.sum()),
                   num_accepted_tokens=int(accepted.sum()),
                   num_emitted_tokens=int(num_emitted[drafting].sum()),
                   accepted_per_position=at_least[1:])


@dataclasses.dataclass(frozen=True)
class DrafterCounts:
    """One decoding step's speculation split by drafter (pool index; -1: decoded plainly):
    sequence-steps, draft tokens verified and accepted, what ``EngineMetrics`` and the server's
    exporter both add up; and the step's chain label ("mixed" when its sequences drafted with
    different drafters, so no one chain names it)."""

    by_drafter: dict[int, tuple[int, int, int]]
    mixed: bool

    @classmethod
    def plain(cls, n: int) -> DrafterCounts:
        """``count`` of a step whose ``n`` sequences all decoded plainly."""
        return cls({-1: (n, 0, 0)}, mixed=False)

    @classmethod
    def count(cls, drafters: np.ndarray, num_verified: np.ndarray, num_accepted: np.ndarray,
              chain: tuple[int, ...]) -> DrafterCounts:
        accepted = np.minimum(num_accepted, num_verified)
        by_drafter = {}
        for d in np.unique(drafters).tolist():
            rows = drafters == d
            by_drafter[d] = (int(rows.sum()), int(num_verified[rows].sum()),
                             int(accepted[rows].sum()))
        return cls(by_drafter, mixed=not chain and bool((drafters >= 0).any()))

    def chain_label(self, pool_names, chain) -> str:
        return "mixed" if self.mixed else chain_label(pool_names, chain)

    @staticmethod
    def drafter_name(pool_names, d: int) -> str:
        return pool_names[d] if 0 <= d < len(pool_names) else "target"


@dataclasses.dataclass
class EngineMetrics:
    max_gamma: int
    # the draft pool's model names (smallest first): chain labels, e.g. "draft>mid>target"
    pool_names: tuple[str, ...] = ("draft",)
    num_steps: int = 0
    num_prefill_tokens: int = 0
    num_generated_tokens: int = 0
    num_preemptions: int = 0
    num_requests_finished: int = 0
    num_requests_aborted: int = 0
    # steps dispatched before the previous step was committed (asynchronous scheduling)
    num_async_steps: int = 0
    # speculation (names follow vLLM's spec_decode_* metrics)
    spec_decode_num_drafts: int = 0  # sequence-steps that drafted
    spec_decode_num_draft_tokens: int = 0  # drafted tokens sent to verification
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_emitted_tokens: int = 0  # tokens emitted by drafting sequence-steps
    # time (seconds, summed over steps)
    step_time: float = 0.0
    draft_time: float = 0.0
    intermediate_time: float = 0.0  # middle models of chains verifying drafts (SpecRouter)
    verify_time: float = 0.0
    catch_up_time: float = 0.0
    catch_up_tokens: int = 0
    host_time: float = 0.0  # the steps' own stages other than draft / verify / catch-up
    policy_time: float = 0.0  # inside the policy's plan / select / observe (part of host_time)
    policy_calls: int = 0  # steps in which the policy was consulted
    # elastic memory (Nightjar §5; jspec/elastic.py)
    num_pool_expansions: int = 0
    num_pool_contractions: int = 0
    num_migrated_blocks: int = 0  # live blocks moved out of the extension by contractions
    pool_expansion_time: float = 0.0  # offloading the draft and growing the pool
    pool_contraction_time: float = 0.0  # planning and running the block migration
    draft_reload_dispatch_time: float = 0.0  # starting the asynchronous reload (host time)
    draft_reload_time: float = 0.0  # from that start until the engine saw the draft back
    # prefix caching: the block manager's counters (tokens looked up and found, per pool)
    prefix_cache: PrefixCacheStats = dataclasses.field(default_factory=PrefixCacheStats)

    def __post_init__(self):
        self.accepted_per_position = np.zeros(self.max_gamma, np.int64)
        self.gamma_histogram = np.zeros(self.max_gamma + 1, np.int64)
        # batch-size bucket (jspec.policies.base.batch_bucket) -> γ histogram of the steps at that load
        self.gamma_histogram_by_batch: dict[int, np.ndarray] = {}
        self.stage_time: dict[str, float] = {}  # seconds per step stage (jspec.policies.base.STAGES)
        # decoding steps per chain of models (SpecRouter), overall and per batch-size bucket;
        # labels name the pool's models, e.g. "draft>mid>target", "target"
        self.pool_names = tuple(self.pool_names)
        self.chain_histogram: dict[str, int] = {}
        self.chain_histogram_by_batch: dict[int, dict[str, int]] = {}
        # per drafter (its pool name): sequence-steps it drafted, draft tokens verified and
        # accepted (vLLM's spec_decode_* counts, split by drafter); and per batch-size bucket
        # how many sequence-steps each drafted ("target": decoded plainly)
        self.drafter_stats: dict[str, dict[str, int]] = {}
        self.drafter_histogram_by_batch: dict[int, dict[str, int]] = {}

    def chain_label(self, chain) -> str:
        return chain_label(self.pool_names, chain)

    def observe(self, outcome: "StepRecord") -> None:
        """Fold in one step's record (every step that ran, prefill-only steps included)."""
        self.num_steps += 1
        self.num_prefill_tokens += outcome.num_prefill_tokens
        self.step_time += outcome.step_time
        self.draft_time += outcome.draft_time
        self.intermediate_time += outcome.intermediate_time
        self.verify_time += outcome.verify_time
        self.catch_up_time += outcome.catch_up_time
        self.catch_up_tokens += outcome.catch_up_tokens
        self.host_time += (outcome.stage_total - outcome.draft_time - outcome.verify_time
                           - outcome.catch_up_time - outcome.intermediate_time)
        for stage, seconds in outcome.stage_times.items():
            self.stage_time[stage] = self.stage_time.get(stage, 0.0) + seconds
        if outcome.num_decode:
            self.record_spec(outcome.spec_counts, outcome.batch_size)
            drafter_counts = outcome.drafter_counts
            label = (drafter_counts.chain_label(self.pool_names, outcome.chain)
                     if drafter_counts is not None else self.chain_label(outcome.chain))
            self.chain_histogram[label] = self.chain_histogram.get(label, 0) + 1
            hist = self.chain_histogram_by_batch.setdefault(batch_bucket(outcome.batch_size), {})
            hist[label] = hist.get(label, 0) + 1
            if drafter_counts is not None:
                self.record_drafters(drafter_counts, outcome.batch_size)

    def record_drafters(self, counts: DrafterCounts, batch_size: int) -> None:
        """Fold in which drafter drafted each decoding sequence, and what it got accepted."""
        hist = self.drafter_histogram_by_batch.setdefault(batch_bucket(batch_size), {})
        for d, (rows, drafted, accepted) in counts.by_drafter.items():
            name = counts.drafter_name(self.pool_names, d)
            hist[name] = hist.get(name, 0) + rows
            if d < 0:
                continue
            entry = self.drafter_stats.setdefault(
                name, {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0})
            entry["num_drafts"] += rows
            entry["num_draft_tokens"] += drafted
            entry["num_accepted_tokens"] += accepted

    def record_spec(self, counts: SpecCounts, batch_size: int = 0) -> None:
        """Fold in one decoding step's speculation counts (``StepRecord.spec_counts``)."""
        self.gamma_histogram += counts.gamma_counts
        bucket = batch_bucket(batch_size)
        hist = self.gamma_histogram_by_batch.get(bucket)
        if hist is None:
            hist = self.gamma_histogram_by_batch[bucket] = np.zeros(self.max_gamma + 1, np.int64)
        hist += counts.gamma_counts
        if not counts.num_drafts:
            return
        self.spec_decode_num_drafts += counts.num_drafts
        self.spec_decode_num_draft_tokens += counts.num_draft_tokens
        self.spec_decode_num_accepted_tokens += counts.num_accepted_tokens
        self.spec_decode_num_emitted_tokens += counts.num_emitted_tokens
        self.accepted_per_position += counts.accepted_per_position

    @property
    def acceptance_rate(self) -> float:
        d = self.spec_decode_num_draft_tokens
        return self.spec_decode_num_accepted_tokens / d if d else 0.0

    @property
    def mean_accepted_length(self) -> float:
        d = self.spec_decode_num_drafts
        return (self.spec_decode_num_accepted_tokens + d) / d if d else 0.0

    def as_dict(self) -> dict:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
               if f.name != "prefix_cache"}
        pc = self.prefix_cache
        out["prefix_cache_queries"] = pc.queries
        out["prefix_cache_hits"] = pc.hits
        out["prefix_cache_hit_rate"] = pc.hit_rate
        out["prefix_cache_draft_hits"] = list(pc.draft_hits)
        out["pool_names"] = list(self.pool_names)
        out["accepted_per_position"] = self.accepted_per_position.tolist()
        out["gamma_histogram"] = self.gamma_histogram.tolist()
        out["gamma_histogram_by_batch"] = {str(b): h.tolist() for b, h in
                                           sorted(self.gamma_histogram_by_batch.items())}
        out["stage_time"] = dict(self.stage_time)
        out["chain_histogram"] = dict(self.chain_histogram)
        out["chain_histogram_by_batch"] = {str(b): dict(h) for b, h in
                                           sorted(self.chain_histogram_by_batch.items())}
        out["drafter_stats"] = {name: dict(v) for name, v in self.drafter_stats.items()}
        out["drafter_histogram_by_batch"] = {str(b): dict(h) for b, h in
                                             sorted(self.drafter_histogram_by_batch.items())}
        out["policy_time_per_step"] = self.policy_time / self.policy_calls if self.policy_calls \
            else 0.0
        out["acceptance_rate"] = self.acceptance_rate
        out["mean_accepted_length"] = self.mean_accepted_length
        return out
