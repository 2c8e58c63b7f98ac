"""Continuous batching: FCFS admission, chunked prefill, lookahead KV slots, recompute preemption.

Each engine step starts with :meth:`Scheduler.schedule`, which decides which sequences the target
processes and how many of their tokens, and makes sure the block manager has given every scheduled
sequence the KV slots the step may write.

Token budget and lookahead. A decoding sequence feeds its newest token plus up to γ_i drafted
tokens, and the policy picks γ_i only after scheduling, so the scheduler reserves
``1 + num_lookahead_slots`` tokens of budget and ``num_tokens + num_lookahead_slots`` KV slots for
it. ``num_lookahead_slots`` is ``config.lookahead_slots`` (Γmax) unless the sequence is near
``max_model_len``, the budget is tight, or free KV is short; the engine must keep
γ_i <= ``ScheduledSeq.num_lookahead_slots``.

Lookahead is a reservation for optional work, so when KV runs short it shrinks (down to 0, i.e.
plain decoding for that sequence this step) before anything is preempted: preempting a sequence
costs a full recompute of its prefix, while a smaller γ only costs some speculation. Likewise a
running sequence's prefill chunk shrinks to the KV that is free. Only when a running sequence
cannot get even one token's slot is the youngest running sequence preempted (freed, reset, put at
the front of the waiting queue), repeatedly, possibly the sequence itself.

Budget fairness: running sequences are visited oldest first and each keeps back one budget token
for every running sequence after it (``max_num_batched_tokens >= max_num_seqs``), so no running
sequence, which holds KV, ever stalls for budget; lookahead and prefill chunks shrink instead. The
budget counts target tokens only: the draft's catch-up tokens (``num_draft_computed`` lagging after
γ = 0 steps) are the speculative step's business.

Prefix caching (``BlockManager.enable_caching``): when a waiting sequence comes up for admission
it first takes the cached blocks its tokens start with (``BlockManager.match_prefix``), which
sets ``num_computed`` (and each draft pool model's ``draft_computed``) past them, so its prefill
chunk, its budget and its new blocks cover only the rest. If it is not admitted after all, it
lets them go again and stays waiting with nothing computed. A preempted sequence's blocks stay
cached when it is freed, so its recompute usually starts far along.

Ordering invariant: every running sequence arrived before every waiting one. Admission takes the
waiting queue's head (the oldest), new requests go to its back and a preempted sequence (the
youngest running one) goes to its front, so the invariant holds, and the running dict's insertion
order is arrival order: the youngest running sequence is always the last one.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools

from jspec.block_manager import BlockManager
from jspec.sequence import Sequence, SequenceStatus


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    """Batching limits.

    max_num_seqs:           most sequences running (holding KV) at once.
    max_num_batched_tokens: target tokens per step, counting ``1 + lookahead`` per decode.
    max_model_len:          longest sequence; lookahead slots are never reserved beyond it.
    lookahead_slots:        Γmax, the engine's largest speculative length (0: no speculation).
    enable_chunked_prefill: split long prompts across steps (otherwise a prompt is prefilled in
                            one step and waits until the whole of it fits in the budget).
    """

    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    lookahead_slots: int = 0
    enable_chunked_prefill: bool = True

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.lookahead_slots < 0:
            raise ValueError(f"lookahead_slots must be >= 0, got {self.lookahead_slots}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs "
                f"({self.max_num_seqs}): every running sequence must get at least one token per "
                f"step")
        if self.max_num_batched_tokens < 1 + self.lookahead_slots:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                f"1 + lookahead_slots ({1 + self.lookahead_slots}): one decoding sequence "
                f"reserves its token plus the lookahead")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"without chunked prefill max_num_batched_tokens ({self.max_num_batched_tokens}) "
                f"must be >= max_model_len ({self.max_model_len}), or a long prompt never fits")


@dataclasses.dataclass(slots=True)
class ScheduledSeq:
    """One sequence's share of a step.

    num_new_tokens:      the target processes ``seq.token_ids()[seq.num_computed :
                         seq.num_computed + num_new_tokens]`` (1 for a decode, before drafts).
    is_decode:           steady decoding (``num_uncomputed == 1``): eligible for speculation.
    num_lookahead_slots: KV slots (and budget) reserved beyond the new tokens; the most tokens the
                         engine may draft and verify for this sequence this step. 0 for prefills.
    samples:             the chunk reaches the end of the sequence's tokens, so the step emits at
                         least one token.
    """

    seq: Sequence
    num_new_tokens: int
    is_decode: bool
    num_lookahead_slots: int
    samples: bool


@dataclasses.dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledSeq]
    preempted: list[Sequence]
    num_batched_tokens: int  # budget used, counting 1 + num_lookahead_slots per decode


class Scheduler:
    """FCFS continuous-batching scheduler over one :class:`BlockManager`.

    The engine adds requests, calls :meth:`schedule` once per step, commits the step's tokens to
    the sequences itself (``num_computed`` and ``output_token_ids``, then
    ``block_manager.truncate`` for rollback), and calls :meth:`finish` for finished sequences.
    """

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.block_manager = block_manager
        self._waiting: collections.deque[Sequence] = collections.deque()
        self._running: dict[str, Sequence] = {}  # insertion order == arrival order
        self._requests: dict[str, Sequence] = {}  # every unfinished sequence (waiting or running)

    # ------------------------------------------------------------------ queues

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def running(self) -> tuple[Sequence, ...]:
        """Running sequences in arrival order (a snapshot: safe to finish/abort while iterating)."""
        return tuple(self._running.values())

    @property
    def waiting(self) -> tuple[Sequence, ...]:
        """Waiting sequences in queue order, next to be admitted first (a snapshot)."""
        return tuple(self._waiting)

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    def add(self, seq: Sequence) -> None:
        """Queue a request at the back (FCFS); its ``arrival_index`` must exceed earlier ones."""
        if seq.request_id in self._requests:
            raise ValueError(f"request id {seq.request_id!r} is already scheduled")
        if seq.num_tokens - seq.num_computed < 1:
            raise ValueError(f"request {seq.request_id!r} has no tokens to process")
        seq.status = SequenceStatus.WAITING
        self._waiting.append(seq)
        self._requests[seq.request_id] = seq

    def abort(self, request_id: str) -> Sequence | None:
        """Remove a waiting or running request and free its blocks; None when it is not here."""
        seq = self._requests.pop(request_id, None)
        if seq is None:
            return None
        if self._running.pop(request_id, None) is None:
            self._waiting.remove(seq)
        if self.block_manager.has(request_id):
            self.block_manager.free(request_id)
        seq.status = SequenceStatus.FINISHED_ABORTED
        return seq

    def finish(self, seq: Sequence, status: SequenceStatus) -> None:
        """The engine ends a sequence: drop it from the queues, free its blocks, set its status.

        Finishing a sequence that already ended (e.g. aborted while its step was in flight) is a
        no-op, so the commit path need not know about concurrent aborts.
        """
        if not status.finished:
            raise ValueError(f"finish() needs a finished status, got {status}")
        request_id = seq.request_id
        if self._requests.get(request_id) is not seq:
            if seq.status.finished:
                return
            raise KeyError(f"sequence {request_id!r} is not held by this scheduler")
        del self._requests[request_id]
        if self._running.pop(request_id, None) is None:
            self._waiting.remove(seq)
        if self.block_manager.has(request_id):
            self.block_manager.free(request_id)
        seq.status = status

    # ------------------------------------------------------------------ scheduling

    def schedule(self) -> SchedulerOutput:
        config = self.config
        bm = self.block_manager
        max_model_len = config.max_model_len
        lookahead = config.lookahead_slots
        chunked = config.enable_chunked_prefill
        running = self._running
        budget = config.max_num_batched_tokens
        scheduled: list[ScheduledSeq] = []
        preempted: list[Sequence] = []

        # Running sequences, oldest first. One budget token is kept back for every running
        # sequence not yet visited so that none of them stalls (budget >= max_num_seqs makes
        # `available` >= 1).
        queue = list(running.values())
        end = len(queue)
        i = 0
        while i < end:
            seq = queue[i]
            request_id = seq.request_id
            num_tokens = seq.num_tokens
            num_computed = seq.num_computed
            remaining = num_tokens - num_computed
            available = budget - (end - i - 1)
            if remaining == 1:
                la = min(lookahead, max_model_len - num_tokens, available - 1)
                if la < 0:
                    la = 0
                if not bm.allocate(request_id, num_tokens + la):
                    la = self._fit(request_id, num_tokens, la, 0)
                    if la is None:
                        end = self._preempt_youngest(queue, end, preempted)
                        continue
                budget -= 1 + la
                scheduled.append(ScheduledSeq(seq, 1, True, la, True))
            elif remaining > 1:
                if chunked:
                    num_new = remaining if remaining < available else available
                elif remaining <= available:
                    num_new = remaining
                else:  # cannot happen with whole-prompt prefill; wait rather than split
                    i += 1
                    continue
                if not bm.allocate(request_id, num_computed + num_new):
                    num_new = self._fit(request_id, num_computed, num_new,
                                        1 if chunked else num_new)
                    if num_new is None:
                        end = self._preempt_youngest(queue, end, preempted)
                        continue
                budget -= num_new
                scheduled.append(ScheduledSeq(seq, num_new, False, 0, num_new == remaining))
            else:
                raise RuntimeError(
                    f"running sequence {request_id!r} has no uncomputed token (num_computed="
                    f"{num_computed}, num_tokens={num_tokens}); commit must leave the newest "
                    f"token uncomputed")
            i += 1

        # Admit waiting sequences in strict FCFS order. Not after a preemption: memory just ran
        # out, and admitting now would only preempt again next step.
        if not preempted:
            budget = self._admit(budget, scheduled, prefill_only=False)

        return SchedulerOutput(scheduled, preempted, config.max_num_batched_tokens - budget)

    def prefill_backlog(self, scheduled) -> tuple[int, int]:
        """(prompt tokens, requests) left to prefill after a step that runs ``scheduled`` (items
        with ``seq``, ``num_new_tokens``, ``is_decode``): of the running sequences still in
        prefill, beyond this step's chunks, and of the waiting ones a free slot could take;
        those behind them wait for a slot, not for the token budget
        (policies.base.BatchView.prefill_bound)."""
        chunk = {id(s.seq): s.num_new_tokens for s in scheduled if not s.is_decode}
        tokens = requests = 0
        for seq in self._running.values():
            left = seq.num_tokens - seq.num_computed
            if left <= 1:  # decoding: only its newest token is uncomputed
                continue
            left -= chunk.get(id(seq), 0)
            if left > 0:
                tokens, requests = tokens + left, requests + 1
        free = max(self.config.max_num_seqs - len(self._running), 0)
        for seq in itertools.islice(self._waiting, free):
            tokens, requests = tokens + seq.num_tokens - seq.num_computed, requests + 1
        return tokens, requests

    def _admit(self, budget: int, scheduled: list[ScheduledSeq], prefill_only: bool) -> int:
        """Admit waiting sequences in FCFS order while budget, KV and max_num_seqs allow;
        returns the budget left. ``prefill_only``: stop at a sequence that would decode at once
        (a one-token remainder), which needs a plan the step no longer makes."""
        bm = self.block_manager
        running = self._running
        waiting = self._waiting
        max_num_seqs = self.config.max_num_seqs
        while waiting and budget > 0 and len(running) < max_num_seqs:
            seq = waiting[0]
            # prefix caching: start after the blocks the pool already holds (a waiting sequence
            # holds no blocks, so this is its first look)
            cached = self._match_prefix(seq) if bm.enable_caching else None
            item = self._admission(seq, budget, prefill_only)
            if item is None:
                self._unmatch(seq, cached)
                break
            waiting.popleft()
            if cached is not None:
                bm.count_query(seq.num_tokens, cached)
                if seq.num_cached_tokens is None:
                    seq.num_cached_tokens = cached[0]
            seq.status = SequenceStatus.RUNNING
            running[seq.request_id] = seq
            budget -= item.num_new_tokens + item.num_lookahead_slots
            scheduled.append(item)
        return budget

    def _admission(self, seq: Sequence, budget: int, prefill_only: bool
                   ) -> ScheduledSeq | None:
        """The waiting head's share of the step, its KV slots allocated; None (nothing
        allocated) when it cannot start now."""
        config = self.config
        bm = self.block_manager
        request_id = seq.request_id
        num_tokens = seq.num_tokens
        num_computed = seq.num_computed
        remaining = num_tokens - num_computed
        if remaining == 1:
            if prefill_only:
                return None
            capacity = bm.num_free_blocks * bm.block_size
            if bm.has(request_id):
                capacity += bm.num_slots(request_id)
            la = min(config.lookahead_slots, config.max_model_len - num_tokens, budget - 1,
                     capacity - num_tokens)
            if la < 0:
                la = 0
            if not bm.allocate(request_id, num_tokens + la):
                return None
            return ScheduledSeq(seq, 1, True, la, True)
        if config.enable_chunked_prefill:
            num_new = remaining if remaining < budget else budget
        elif remaining <= budget:
            num_new = remaining
        else:
            return None
        if not bm.allocate(request_id, num_computed + num_new):
            return None
        return ScheduledSeq(seq, num_new, False, 0, num_new == remaining)

    def _match_prefix(self, seq: Sequence) -> list[int]:
        """Give ``seq`` the cached blocks its tokens start with; each model's K/V then covers
        what its pool had cached (the draft's may be shorter than the target's)."""
        cached = self.block_manager.match_prefix(seq.request_id, seq.token_ids(),
                                                 seq.block_hashes, seq.cache_salt)
        seq.num_computed = cached[0]
        seq.draft_computed = cached[1:1 + len(seq.draft_computed)]
        return cached

    def _unmatch(self, seq: Sequence, cached: list[int] | None) -> None:
        """The sequence stays waiting after all: let its cached blocks go again."""
        if cached is not None:
            self.block_manager.free(seq.request_id)
            seq.num_computed = 0
            seq.forget_draft_kv()

    def reclaim(self, sched: SchedulerOutput, lookahead: list[int]) -> bool:
        """Give back lookahead the step will not use and spend it on prefill.

        The policy plans γ after :meth:`schedule` has reserved ``1 + num_lookahead_slots``
        tokens of budget per decoding sequence; when it plans less (γ = 0 under load), the rest
        of the reservation would otherwise be lost to prefill, which then crawls in small
        chunks. ``lookahead[i]`` is what scheduled item i keeps (≤ its reservation; 0 for
        prefill items). The freed budget grows the scheduled prefill chunks, oldest first, then
        admits waiting sequences (prefill only, FCFS, never after a preemption). KV slots
        already reserved stay with their sequences (the next step's allocation covers them).
        Returns whether the step changed."""
        scheduled = sched.scheduled
        freed = 0
        for item, keep in zip(scheduled, lookahead):
            if keep < item.num_lookahead_slots:
                freed += item.num_lookahead_slots - keep
                item.num_lookahead_slots = keep
        if freed == 0:
            return False
        budget = self.config.max_num_batched_tokens - sched.num_batched_tokens + freed
        changed = False
        bm = self.block_manager
        for item in scheduled:
            if budget <= 0:
                break
            # only a chunk that stops short of its prompt's end grows (without chunked prefill
            # every scheduled prompt is whole: ``samples`` is set)
            if item.is_decode or item.samples:
                continue
            seq = item.seq
            remaining = seq.num_tokens - seq.num_computed
            extra = min(remaining - item.num_new_tokens, budget)
            base = seq.num_computed + item.num_new_tokens
            if not bm.allocate(seq.request_id, base + extra):
                extra = self._fit(seq.request_id, base, extra, 1)
                if extra is None:
                    continue
            item.num_new_tokens += extra
            item.samples = item.num_new_tokens == remaining
            budget -= extra
            changed = True
        if not sched.preempted and budget > 0:
            before = len(scheduled)
            budget = self._admit(budget, scheduled, prefill_only=True)
            changed = changed or len(scheduled) > before
        sched.num_batched_tokens = self.config.max_num_batched_tokens - budget
        return changed

    def _fit(self, request_id: str, base: int, want: int, least: int) -> int | None:
        """After ``allocate(request_id, base + want)`` failed: allocate slots for ``base`` plus
        as many of ``want`` tokens as the sequence's blocks and the free blocks hold, and return
        that many; None (nothing allocated) when fewer than ``least`` fit."""
        bm = self.block_manager
        got = min(want, bm.num_slots(request_id) + bm.num_free_blocks * bm.block_size - base)
        if got < least:
            return None
        bm.allocate(request_id, base + got)
        return got

    def _preempt_youngest(self, queue: list[Sequence], end: int,
                          preempted: list[Sequence]) -> int:
        """Preempt ``queue[end - 1]`` (the youngest not-yet-scheduled running sequence)."""
        victim = queue[end - 1]
        request_id = victim.request_id
        del self._running[request_id]
        if self.block_manager.has(request_id):
            self.block_manager.free(request_id)
        victim.reset_for_recompute()
        self._waiting.appendleft(victim)
        preempted.append(victim)
        return end - 1

    # ------------------------------------------------------------------ checking

    def check_invariants(self) -> None:
        """Raise AssertionError on inconsistent queues or blocks (for tests/debugging)."""
        bm = self.block_manager
        bm.check_invariants()
        running = list(self._running.values())
        waiting = list(self._waiting)
        if len(running) > self.config.max_num_seqs:
            raise AssertionError(f"{len(running)} running > max_num_seqs "
                                 f"{self.config.max_num_seqs}")
        ids = [s.request_id for s in running] + [s.request_id for s in waiting]
        if len(set(ids)) != len(ids) or set(ids) != set(self._requests):
            raise AssertionError("running + waiting do not match the unfinished requests")
        for rid, seq in self._running.items():
            if seq.request_id != rid or seq.status is not SequenceStatus.RUNNING:
                raise AssertionError(f"running sequence {rid!r} has status {seq.status}")
            if not bm.has(rid):
                raise AssertionError(f"running sequence {rid!r} has no block table")
            if bm.num_slots(rid) < seq.num_computed:
                raise AssertionError(f"running sequence {rid!r} computed {seq.num_computed} "
                                     f"tokens but holds only {bm.num_slots(rid)} slots")
        for seq in waiting:
            if seq.status is not SequenceStatus.WAITING:
                raise AssertionError(f"waiting sequence {seq.request_id!r} has status "
                                     f"{seq.status}")
            if bm.has(seq.request_id):
                raise AssertionError(f"waiting sequence {seq.request_id!r} holds blocks")
        order = [s.arrival_index for s in running] + [s.arrival_index for s in waiting]
        if any(a >= b for a, b in zip(order, order[1:])):
            raise AssertionError(f"queues are not in arrival order: {order}")
