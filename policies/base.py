"""The policy protocol and the types it shares with the engine.

A policy is pure host-side Python/numpy: the engine shows it a ``BatchView`` of the sequences
that may speculate this step, the policy answers with a ``DraftPlan`` (a draft length γ_i per
sequence, 0 allowed, the chain of models, an optional on-device stop rule), may trim the verify
lengths after seeing the draft (``select``), and learns from the ``StepOutcome``. Nothing here
imports the engine; the engine imports these types.
"""

from __future__ import annotations

import abc
import dataclasses
import functools
import math
from typing import Any, Callable

import numpy as np


def batch_bucket(batch_size: int) -> int:
    """The batch-size context shared by the policies and the metrics: the smallest power of two
    >= batch_size (1, 2, 4, 8, ...). Step cost changes smoothly with B, so neighbouring sizes
    share what they learn, and a bucket set this coarse fills up quickly (Nightjar keeps one
    bandit per bucket)."""
    return 1 << max(0, int(batch_size) - 1).bit_length()


def drafting_buckets(max_gamma: int) -> tuple[int, ...]:
    """The draft lengths > 0 the engine compiles a step for at most (config.gamma_buckets keeps
    those some possible γ rounds up to): powers of two below Γmax, and Γmax."""
    return tuple(sorted({max_gamma} | {1 << i for i in range(max_gamma.bit_length())
                                        if (1 << i) < max_gamma})) if max_gamma > 0 else ()


def chain_label(pool_names, chain) -> str:
    """A chain of pool models as the metrics name it: "draft>mid>target"; "target" for the
    target alone (a step that drafted nothing)."""
    return ">".join([pool_names[m] for m in chain] + ["target"])


@dataclasses.dataclass
class BatchView:
    """What a policy sees before a step. Arrays are per speculating-eligible sequence, in the
    order the plan must answer in (decoding sequences only; prefill chunks never draft)."""

    request_ids: list[str]
    context_lens: np.ndarray  # [n] int: tokens in each sequence
    pending_draft_tokens: np.ndarray  # [n] int: tokens the draft must catch up on before drafting
    batch_size: int  # all sequences in the step (decode + prefill): the load
    num_prefill_tokens: int  # prefill tokens sharing this step
    num_waiting: int  # queue depth
    num_free_blocks: int
    num_total_blocks: int
    draft_resident: bool  # False: the draft is offloaded and γ is forced to 0
    max_gamma: int
    # [n] int: output tokens each sequence may still emit (its max_tokens less what it has;
    # a stop string or EOS may end it sooner)
    remaining_tokens: np.ndarray
    # prompt tokens still to prefill after this step, of the requests that hold a slot or have a
    # free one waiting for them (not those queued for a slot), and how many such requests
    prefill_backlog_tokens: int = 0
    prefill_backlog_requests: int = 0
    # token budget the schedule reserved for the decoding rows' drafts (Σ lookahead slots);
    # what a plan leaves unused goes to prompts (``displaced_prompt_tokens``)
    lookahead_tokens: int = 0
    # per lookup drafter (pool index): how many tokens it would draft now for each sequence,
    # at most Γmax; given to a policy that reads them (``Policy.reads_lookups``), once it asks
    # (``surveyed``)
    lookup_lengths: dict[int, np.ndarray] = dataclasses.field(default_factory=dict)
    # per lookup drafter: [n, Γmax] its own estimate that the first j + 1 tokens of its draft
    # are all accepted (suffix decoding's chained frequencies, SuffixDecoding §3.3), NaN past
    # the draft or where the lookup has none (prompt lookup)
    lookup_probs: dict[int, np.ndarray] = dataclasses.field(default_factory=dict)
    # the engine's verify width: ``verify_width(drafted, g, model_drafts)`` is the padded
    # tokens of the target's pass if the decoding rows verify ``drafted`` = Σ γ_i drafts in
    # all at γ bucket g, the draft model drafting some of them (``model_drafts``) or only
    # lookups (the step's n + drafted tokens); None: n x (1 + g)
    verify_width: Any = None
    # () -> (lookup_lengths, lookup_probs): the lookups' survey, which ``surveyed`` runs when a
    # policy reads them (a policy that decodes plainly without planning skips its cost)
    survey: Callable | None = None

    def surveyed(self) -> "BatchView":
        """This view with ``lookup_lengths`` and ``lookup_probs`` filled in."""
        if self.survey is not None:
            self.lookup_lengths, self.lookup_probs = self.survey()
            self.survey = None
        return self

    @property
    def num_decode(self) -> int:
        return len(self.request_ids)

    def displaced_prompt_tokens(self, drafted):
        """Prompt tokens a plan that drafts ``drafted`` tokens in all (Σ γ_i; a number or an
        array of candidates) keeps out of this step. The engine gives the lookahead budget a
        plan leaves unused to the prompts that wait for it (``Scheduler.reclaim``), so while
        prompt tokens wait each drafted token takes one's place, which a later step must run:
        a plan should pay for it at the target's marginal cost per token."""
        free, waiting = self.lookahead_tokens, self.prefill_backlog_tokens
        if free <= 0 or waiting <= 0:  # no prompt waits (most steps): nothing to displace
            return 0
        return min(free, waiting) - np.minimum(np.maximum(free - np.asarray(drafted), 0),
                                               waiting)

    @property
    def prefill_bound(self) -> bool:
        """Whether prompts, not decoding, hold the batch back: after this step at least as many
        requests (and at least two) still wait for their prompt's prefill, holding slots or
        with slots free for them, as there are decoding sequences, and more of their prompt
        tokens than this step's chunk. Then the engine's throughput is the pace of its steps
        (each prefills one budget's worth): a decoding row's extra tokens free a slot only for
        a request that joins the prefill queue, while speculation lengthens the step and takes
        token budget from the prefill. A transient queue (a few requests that finished in the
        same step, replaced by new prompts) is not that, nor is one long prompt at low load,
        where its decoding neighbours' latency is what counts."""
        waiting = self.prefill_backlog_requests
        return (waiting >= max(2, self.num_decode)
                and self.prefill_backlog_tokens > max(self.num_prefill_tokens, 0))


@dataclasses.dataclass
class DraftPlan:
    """γ_i per sequence of the view, and the chain of pool models that produce the draft.

    ``chain`` holds indices into the engine's draft pool (``Policy.pool``, smallest model
    first): ``(i,)`` lets model i draft for the target, ``(i, j)`` (i < j) lets i draft and j
    verify i's draft before the target does (SpecRouter's multi-level chain), ``()`` runs the
    target alone (the gammas are then ignored: nothing drafts). One chain serves the whole step,
    unless ``drafters`` names a drafter per sequence.

    ``stop_confidence[i]``: stop drafting sequence i once the product of its draft confidences
    q(x_1)..q(x_j) falls below this (0 never stops). ``stop_entropy[i]``: stop once a draft
    distribution's entropy exceeds this (inf never stops). Both are evaluated on device inside
    the draft loop, with no host round trip per token.
    """

    gammas: np.ndarray
    chain: tuple[int, ...] = (0,)
    stop_confidence: np.ndarray | None = None
    stop_entropy: np.ndarray | None = None
    # [n] int: the pool index that drafts each sequence (one drafter alone, no chain), for a
    # policy that picks the drafter per sequence (``Policy.possible_drafters``); ``chain`` is
    # then ignored. At most one draft model per step; any number of lookups beside it.
    drafters: np.ndarray | None = None
    # the policy's own note on its decision, handed back with this step's outcome
    # (``StepOutcome.plan_note``): with asynchronous scheduling the next step is planned before
    # this one is observed, so a decision kept on the policy would meet the wrong outcome
    note: Any = None


@dataclasses.dataclass
class DraftStats:
    """What the draft produced, shown to ``select`` (costs one host sync, so only for policies
    that override select)."""

    num_drafted: np.ndarray  # [n]
    confidence: np.ndarray  # [n, G] q(x_j) of each drafted token
    draft_entropy: np.ndarray  # [n, G]


@dataclasses.dataclass
class StepOutcome:
    """What happened in a step, per decoding sequence of the view, plus timings in seconds.

    What a policy learns from. The engine's record of a step (``jspec.step_record.StepRecord``)
    extends it with the engine's own telemetry (time per stage, the γ bucket, the queue); the
    policy is handed that record (steps with decoding sequences) and reads this part of it.
    """

    request_ids: list[str]
    gammas: np.ndarray  # [n] planned
    num_drafted: np.ndarray  # [n] actually drafted (a stop rule may end early)
    num_verified: np.ndarray  # [n] drafted tokens sent to verification (after select)
    num_accepted: np.ndarray  # [n]
    num_emitted: np.ndarray  # [n] tokens appended (accepted + bonus/correction, after stops)
    batch_size: int
    step_time: float  # whole step, wall clock, including draft catch-up
    draft_time: float  # the draft loop (synced)
    verify_time: float  # target forward, sampling, signals and the result transfer
    catch_up_time: float  # draft catching up on lagging KV (Nightjar's switching cost)
    catch_up_tokens: int
    num_prefill_tokens: int
    # per drafted position [n, G]; NaN where nothing was drafted or the policy does not read it
    accept_prob: np.ndarray
    kl: np.ndarray
    draft_entropy: np.ndarray
    confidence: np.ndarray
    num_tokens: int = 0  # target tokens in the step's batch (decode + drafts + prefill)
    num_padded_tokens: int = 0  # the verify forward's width, padding included (0: not given)
    # Multi-level chains (SpecRouter): the pool models that drafted this step (DraftPlan.chain;
    # () when nothing drafted). With an intermediate level (a chain (i, j)), ``num_drafted`` is
    # what model i drafted, ``intermediate_accepted`` [n] how many of those j accepted,
    # ``num_verified`` the length of j's draft (accepted + its correction, at most the window)
    # that the target verified, ``accept_prob`` is 1 - TV(target, j) and
    # ``intermediate_accept_prob`` [n, G] 1 - TV(j, i) per drafted position (NaN where none or
    # unread); ``intermediate_time`` is j's verification pass (seconds).
    chain: tuple[int, ...] = ()
    intermediate_time: float = 0.0
    intermediate_accepted: np.ndarray | None = None
    intermediate_accept_prob: np.ndarray | None = None
    # [n] the pool index that drafted each sequence (-1: it did not draft; a chain's rows name
    # its first model); None where not recorded (then ``chain`` says it for every row)
    drafters: np.ndarray | None = None
    # draft forwards a draft model ran (its longest draft); None: not recorded, the step's
    # longest draft stands in (every drafting row used the draft model)
    model_forwards: int | None = None
    # the ``DraftPlan.note`` of the plan this step ran (None: no plan, or the policy kept none)
    plan_note: Any = None

    @property
    def draft_forwards(self) -> int:
        """The draft model's forwards this step (its draft loop's iterations)."""
        if self.model_forwards is not None:
            return int(self.model_forwards)
        return int(np.max(self.num_drafted, initial=0))

    @property
    def num_decode(self) -> int:
        return len(self.request_ids)

    def emitted_per_second(self, seconds: float) -> float:
        """Tokens produced by decoding sequences per ``seconds`` (a reward over a chosen time)."""
        return float(self.num_emitted.sum()) / seconds if seconds > 0 else 0.0

    @property
    def goodput(self) -> float:
        """Tokens produced by decoding sequences per second of step time."""
        return self.emitted_per_second(self.step_time)

    @property
    def target_time(self) -> float:
        """The step's time less the draft loop and its catch-up: the target's forward with
        everything around it (sampling, signals, the commit, the host's work)."""
        return max(self.step_time - self.draft_time - self.catch_up_time, 0.0)

    @property
    def decode_time(self) -> float:
        """The step time less the share of it that the step's prefill chunks took: the target's
        part of the step (all but the draft loop and its catch-up, which serve decoding alone) is
        split between decode and prefill in proportion to their target tokens (``num_tokens``,
        drafts included). A first-order model: at load the forward's cost grows with its tokens,
        and a prompt's tokens must be computed whatever γ the decoding rows play."""
        if self.num_prefill_tokens <= 0 or self.num_tokens <= self.num_prefill_tokens:
            return self.step_time
        return self.step_time - self.target_time * self.num_prefill_tokens / self.num_tokens


def option_bool(policy: str, key: str, value: Any) -> bool:
    """A true/false policy option, or a clear error naming it."""
    if not isinstance(value, bool):
        raise ValueError(f"{policy} option {key} must be true or false, got {value!r}")
    return value


def option_int(policy: str, key: str, value: Any, low: int, high: int | None = None) -> int:
    """An integer option in [low, high] (no upper bound for None), or a clear error naming it
    (not ``invalid literal for int()`` from deep inside the policy)."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{policy} option {key} must be an integer, got {value!r}")
    if value < low or (high is not None and value > high):
        bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise ValueError(f"{policy} option {key} must be {bound}, got {value}")
    return int(value)


def option_number(policy: str, key: str, value: Any, low: float = 0.0, high: float = math.inf,
                  low_open: bool = False) -> float:
    """A finite number option in [low, high] ((low, high] with ``low_open``), or a clear error."""
    ok = (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
          and (value > low if low_open else value >= low) and value <= high)
    if not ok:
        if math.isinf(high):
            want = f"> {low:g}" if low_open else f">= {low:g}"
        else:
            want = f"in {'(' if low_open else '['}{low:g}, {high:g}]"
        raise ValueError(f"{policy} option {key} must be a number {want}, got {value!r}")
    return float(value)


def expected_tokens(alpha: float, gammas) -> np.ndarray:
    """E(γ) = Σ_{j=0..γ} α^j for each γ: tokens one sequence emits drafting γ when every draft
    token is accepted independently with probability α (the geometric acceptance model; γ = 0 is
    plain decoding, 1 token). The sum form needs no special case at α = 1."""
    gammas = np.asarray(gammas, np.int64)
    powers = np.cumsum(float(alpha) ** gamma_range(int(gammas.max(initial=0)) + 1))
    return powers[gammas]


@functools.lru_cache(maxsize=64)
def gamma_range(n: int) -> np.ndarray:
    """γ = 0..n-1, read-only: the candidates a plan weighs every step, made once per n."""
    out = np.arange(n, dtype=np.int64)
    out.flags.writeable = False
    return out


@functools.lru_cache(maxsize=64)
def _bucket_of(buckets: tuple[int, ...], top: int) -> np.ndarray:
    """For γ = 0..top, the compiled bucket γ runs in (itself past the largest), read-only."""
    g = gamma_range(top + 1)
    b = np.asarray(buckets, np.int64)
    out = np.maximum(b[np.minimum(np.searchsorted(b, g), len(b) - 1)], g)
    out.flags.writeable = False
    return out


def upper_bound(alpha: float, judged_tokens: float, z: float) -> float:
    """An acceptance rate ``alpha`` plus ``z`` standard errors over ``judged_tokens`` judged
    tokens (at least one), at most 1: a rate with thin evidence plans high, so its drafter is
    tried and learns."""
    a = alpha + z * math.sqrt(max(alpha * (1.0 - alpha), 0.0) / max(judged_tokens, 1.0))
    return min(a, 1.0)


def judged_rows(outcome: "StepOutcome") -> tuple[np.ndarray, np.ndarray]:
    """Per sequence of a step, (accepted, judged) draft tokens: judged = the accepted prefix plus
    the first rejection, if the sequence had one (accepted < verified). The tokens behind a
    rejection are discarded unjudged and say nothing about the acceptance rate."""
    verified = np.asarray(outcome.num_verified, np.int64)
    accepted = np.minimum(np.asarray(outcome.num_accepted, np.int64), verified)
    return accepted, np.minimum(accepted + 1, verified)


def judged_acceptance(outcome: "StepOutcome") -> tuple[int, int]:
    """(accepted, judged) draft tokens of a step (``judged_rows`` summed), the sufficient
    statistics of the per-token acceptance rate α under the geometric model: accepted / judged
    has expectation exactly α (counting the unjudged tail, as accepted / verified does, reads
    α = 0.8 at γ = 4 as 0.59)."""
    accepted, judged = judged_rows(outcome)
    return int(accepted.sum()), int(judged.sum())


class Policy(abc.ABC):
    """Chooses how much to speculate. Subclasses set ``name`` and implement ``plan``."""

    name: str = ""
    # What the policy reads, declared so the engine computes nothing else (compile-time choices,
    # not runtime branches): ``signals`` are the per-position StepOutcome signals it reads
    # (accept_prob, kl, draft_entropy, confidence; the others arrive as NaN), ``draft_stops``
    # says its plans set stop_confidence / stop_entropy (the draft loop then computes draft
    # confidence and entropy on device; a policy overriding ``select`` gets them too).
    signals: frozenset[str] = frozenset()
    draft_stops: bool = False
    # ``needs_profile``: the policy reasons from a step-time profile (policies/profile.py) held
    # in ``profile``. Given none, an engine measures one at start-up (jspec/autoprofile.py) and
    # hands it over with ``set_profile`` before the first plan.
    needs_profile: bool = False
    profile: Any = None
    # ``timed_stages``: the policy learns from the draft / intermediate / verify times of each
    # step, so the engine waits for each device stage before timing the next (otherwise device
    # time lands in whichever later stage first waits for it).
    timed_stages: bool = False
    # The engine's draft pool, smallest model first (``set_pool``): the names DraftPlan.chain
    # indexes. One draft unless the engine was given several.
    pool: tuple[str, ...] = ("draft",)
    # ``wants_pool``: the policy runs chains over several drafts; with no models given the
    # engine loads the built-in pool's middle model too (jspec.llm.build_engine).
    wants_pool: bool = False
    # The pool indices that are drafters without a model (``set_lookups``: after the draft
    # models in the pool), and whether the policy reads what each would draft before the step
    # (``BatchView.lookup_lengths``: the lookups run at plan time, their drafts kept for the step)
    lookups: tuple[int, ...] = ()
    reads_lookups: bool = False
    # The γ values the engine compiled its steps for (``set_gamma_buckets``): a step runs at
    # the smallest bucket ≥ its largest γ, and its target forward is as wide as that bucket for
    # every decoding row (γ = 3 in a bucket of 4 pays for 4). None: every γ its own shape.
    gamma_buckets: tuple[int, ...] | None = None

    def __init__(self, max_gamma: int):
        if not isinstance(max_gamma, int) or max_gamma < 0:
            raise ValueError(f"max_gamma must be an integer >= 0, got {max_gamma!r}")
        self.max_gamma = max_gamma

    def possible_gammas(self) -> set[int]:
        """Every γ this policy may ever plan; the engine compiles only for these."""
        return set(range(self.max_gamma + 1))

    @abc.abstractmethod
    def plan(self, view: BatchView) -> DraftPlan:
        ...

    def select(self, view: BatchView, stats: DraftStats) -> np.ndarray | None:
        """Optionally trim verify lengths (≤ num_drafted). None verifies everything drafted."""
        return None

    @property
    def wants_select(self) -> bool:
        return type(self).select is not Policy.select

    @property
    def wants_draft_stats(self) -> bool:
        """Whether the draft loop must compute confidence / entropy (stop rules, select)."""
        return self.draft_stops or self.wants_select

    def observe(self, outcome: StepOutcome) -> None:
        """Learn from a finished step."""

    def set_profile(self, profile: Any) -> None:
        self.profile = profile

    def set_gamma_buckets(self, buckets) -> None:
        """The engine's compiled γ buckets (config.gamma_buckets), set before the first plan."""
        self.gamma_buckets = tuple(sorted(int(b) for b in buckets))

    def padded_gamma(self, gammas) -> np.ndarray:
        """The γ each of ``gammas`` runs at: its bucket (``gamma_buckets``), itself when the
        buckets are unknown or it exceeds them."""
        g = np.asarray(gammas, np.int64)
        if not self.gamma_buckets:
            return g
        return _bucket_of(self.gamma_buckets, int(g.max(initial=0)))[g]

    def set_pool(self, names: tuple[str, ...]) -> None:
        """The engine's draft pool (model names, smallest first), set before the first plan."""
        self.pool = tuple(names)

    def set_lookups(self, indices) -> None:
        """The pool indices of the drafters without a model, set after ``set_pool``."""
        self.lookups = tuple(int(i) for i in indices)

    def possible_chains(self) -> set[tuple[int, ...]]:
        """Every chain this policy may plan (the engine compiles the intermediate levels only
        for these). Single-draft policies draft with the pool's first model."""
        return {(0,)}

    def possible_drafters(self) -> set[int]:
        """The pool indices this policy may name per row (``DraftPlan.drafters``); none for a
        policy that drafts a whole step with one chain."""
        return set()

    @property
    def step_profile(self) -> Any:
        """``profile``, or a clear error when a policy that needs one plans without it."""
        if self.profile is None:
            raise ValueError(f"policy {self.name!r} has no step-time profile: pass "
                             f"profile=PROFILE.json (from `jspec profile`), or run it inside an "
                             f"engine, which measures one at start-up")
        return self.profile

    def state_dict(self) -> dict[str, Any]:
        return {}

    def check_state(self, state: Any) -> None:
        """The checks every ``load_state_dict`` starts with: a dict, saved by this policy (when
        it says), learned with the same Γmax (the arms must match)."""
        if not isinstance(state, dict):
            raise ValueError(f"{self.name} state must be a dict, got {type(state).__name__}")
        if state.get("policy", self.name) != self.name:
            raise ValueError(f"state belongs to policy {state.get('policy')!r}, not {self.name!r}")
        if state.get("max_gamma") != self.max_gamma:
            raise ValueError(f"{self.name} state was learned with max_gamma="
                             f"{state.get('max_gamma')!r}, this policy has max_gamma="
                             f"{self.max_gamma}; its arms do not match")

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state:
            raise ValueError(f"policy {self.name!r} has no learned state, got keys {sorted(state)}")
