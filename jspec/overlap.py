"""Asynchronous scheduling (vLLM's name): a decode-only γ = 0 step runs on the device while the
host commits the one before it.

``SyncSteps`` is the engine's step without overlap: each step is fetched and committed before
the next is scheduled. ``AsyncSteps`` wraps the same dispatch and fetch: a step that drafts
nothing and cannot end a request (``_defers``) is left in flight, and the next call dispatches
its successor before committing it. The host's work for step N (read back the tokens,
detokenize, check stops, build outputs, the record) then overlaps the device's step N + 1,
whose input tokens are step N's, still on device. Meanwhile each sequence holds
``PENDING_TOKEN`` where its step-N token goes (``commit.hold``), so the scheduler and the plan
see the lengths they would after the commit. A sequence that stops at step N wasted its slot of
step N + 1, which is dropped.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jspec import commit
from jspec import input_batch as ib
from jspec.device_steps import Carried
from jspec.sequence import SequenceStatus
from jspec.step_state import StageClock, StepState


class SyncSteps:
    """Every step is committed before the next one is scheduled."""

    def __init__(self, engine):
        self.engine = engine
        self.inflight: StepState | None = None  # dispatched, not yet committed

    def begin(self, outputs: list) -> None:
        """Before the schedule: settle the step in flight, if any."""

    def planned(self, st: StepState, outputs: list, clock: StageClock) -> StepState | None:
        """The plan, once made; None when no row is left to run."""
        return st

    def carry(self, st: StepState):
        """The in-flight step's tokens (on device) that ``st``'s rows feed, or None."""
        return None

    def dispatched(self, st: StepState, outputs: list) -> None:
        """``st``'s verification is running on the device."""

    def finish(self, st: StepState) -> list:
        """Fetch and commit ``st`` (or leave it in flight)."""
        return self.engine.complete(st)

    def drop(self) -> None:
        """Forget the step in flight (the caller failed its requests)."""
        self.inflight = None

    def defers_observation(self) -> bool:
        """Whether a committed step's record may wait for the next step's dispatch."""
        return False


class AsyncSteps(SyncSteps):
    """Decode-only γ = 0 steps overlap the commit of the step before them."""

    def __init__(self, engine):
        super().__init__(engine)
        self.prev: StepState | None = None  # the in-flight step the current one runs after

    def ready(self) -> bool:
        """Whether the engine may leave a step in flight at all: a single process, no elastic
        memory, no synced stage timing, and a policy that learns nothing from the host between
        its draft and the verification (no ``select``, no stage times)."""
        e = self.engine
        return (e.sync is None and e.elastic is None and not e.time_stages
                and not e.policy.timed_stages and not e.policy.wants_select)

    def begin(self, outputs: list) -> None:
        prev, self.inflight = self.inflight, None
        if prev is not None and self._continues(prev):
            commit.hold(prev)
            self.prev = prev
            return
        self.prev = None
        if prev is not None:
            outputs += self.engine.complete(prev)

    def planned(self, st: StepState, outputs: list, clock: StageClock) -> StepState | None:
        prev = self.prev
        if prev is None:
            return st
        if not _runs_on(prev, st):
            raise RuntimeError("asynchronous scheduling: the step after an in-flight step "
                               "changed its sequences")  # _continues rules this out
        if not st.gamma:
            return st
        # the policy drafts: catch-up and the draft read step N's tokens, so commit it first
        outputs += self.engine.complete(prev)
        clock.skip()
        self.prev = None
        return self._replan(st)

    def carry(self, st: StepState):
        prev = self.prev
        if prev is None or st.has_prefill:
            return None
        where = {id(r.seq): i for i, r in enumerate(prev.rows)}
        st.carry_rows = np.full(st.num_rows, -1, np.int32)
        st.carry_rows[:len(st.rows)] = [where[id(r.seq)] for r in st.rows]
        return Carried(prev.result.tokens, st.carry_rows)

    def dispatched(self, st: StepState, outputs: list) -> None:
        prev, self.prev = self.prev, None
        if prev is None:
            return
        # step N + 1 is running: commit step N meanwhile
        e = self.engine
        e.metrics.num_async_steps += 1
        outputs += e.complete(prev)
        st.batch = ib.with_carried_tokens(st.batch, st.carry_rows, prev.tokens[:, 0])
        st.clock.skip()

    def finish(self, st: StepState) -> list:
        if self._defers(st):
            self.inflight = st
            return []
        return self.engine.complete(st)

    def drop(self) -> None:
        self.inflight = self.prev = None

    def defers_observation(self) -> bool:
        """As overlap: a policy that learns with a step's lag anyway (module docstring), and
        no elastic memory, several processes or synced stage timing, which read each step's
        record at once."""
        return self.ready()

    def _replan(self, st: StepState) -> StepState | None:
        """``st`` was planned while the previous step was in flight and drafts after all, so
        that step was committed first: drop the rows whose sequence ended there, and reserve
        again the lookahead slots its commit gave back (truncation), on blocks that may differ,
        hence a new page table. Only frees happened since the schedule, so the reservation
        holds. None when no sequence is left."""
        e = self.engine
        keep = [i for i, r in enumerate(st.rows) if r.seq.status is SequenceStatus.RUNNING]
        for i in keep:
            row = st.rows[i]
            if not e.block_manager.allocate(row.seq.request_id,
                                            row.seq.num_tokens + row.lookahead):
                raise RuntimeError(f"asynchronous scheduling: sequence {row.seq.request_id!r} "
                                   f"lost its lookahead slots")
        if not keep:
            return None
        if len(keep) < len(st.rows):  # all rows decode here: row i is decode row i
            st = self._kept_rows(st, keep)
        e.planner.device_inputs(st)
        return st

    def _kept_rows(self, st: StepState, keep: list[int]) -> StepState:
        planner = self.engine.planner
        rows = [st.rows[i] for i in keep]
        plan = st.plan

        def pick(per_row):
            return None if per_row is None else np.asarray(per_row)[keep]

        decode_idx = np.arange(len(rows))
        kept = StepState(rows=rows, decode_idx=decode_idx,
                         num_rows=planner.row_bucket(rows, decode_idx),
                         num_prefill_tokens=0, chain=st.chain, clock=st.clock)
        kept.view = planner.batch_view(kept)
        kept.plan = dataclasses.replace(plan, gammas=pick(plan.gammas),
                                        stop_confidence=pick(plan.stop_confidence),
                                        stop_entropy=pick(plan.stop_entropy),
                                        drafters=pick(plan.drafters))
        return kept

    def _defers(self, st: StepState) -> bool:
        """Leave ``st`` in flight? Only a decode-only γ = 0 step without logprobs whose every
        sequence is still running and cannot end by length at this step (the last step of a
        request commits at once, so a finished request never waits for the next call)."""
        if (st.gamma or st.has_prefill or st.logprobs is not None or st.result is None
                or not self.ready()):
            return False
        for row in st.rows:
            seq = row.seq
            if (seq.status is not SequenceStatus.RUNNING
                    or seq.num_output_tokens + 1 >= seq.sampling_params.max_tokens):
                return False
        return True

    def _continues(self, prev: StepState) -> bool:
        """Whether the next step can run on ``prev``'s tokens before they are committed: the
        same sequences again (nothing aborted or waiting to be admitted), a KV block free for
        each (so nothing is preempted), and the engine still able to run asynchronously."""
        sched = self.engine.scheduler
        n = len(prev.rows)
        return (self.ready() and not sched.num_waiting and sched.num_running == n
                and self.engine.block_manager.num_free_blocks >= n
                and all(r.seq.status is SequenceStatus.RUNNING for r in prev.rows))


def _runs_on(prev: StepState, st: StepState) -> bool:
    """The step ``st`` decodes exactly ``prev``'s sequences, one token each."""
    rows = st.rows
    return (len(rows) == len(prev.rows) and not st.has_prefill
            and {id(r.seq) for r in rows} == {id(r.seq) for r in prev.rows})
