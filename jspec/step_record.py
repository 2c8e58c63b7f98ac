"""The record of one step (``StepRecord``), built once from the step's state and its fetched
results; the metrics, elastic memory, the policy and every step listener read this same record.
The policy reads its ``StepOutcome`` part."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import numpy as np

from jspec.metrics import DrafterCounts, SpecCounts
from jspec.policies import StepOutcome

if TYPE_CHECKING:  # the step's state imports JAX; the record (read by the simulator) does not
    from jspec.step_state import Fetched, StageClock, StepState


@dataclasses.dataclass
class StepRecord(StepOutcome):
    """What happened in a step: what a policy learns from (``StepOutcome``) and the engine's own
    telemetry, for the metrics, the Prometheus exporter and the benchmarks. The engine makes
    one for every step that ran (prefill-only steps too: their per-sequence arrays are empty).

    ``stage_times``: seconds per stage of the step (``step_state.STAGES``). Device stages are
    timed at dispatch unless the engine syncs between them (``LLMEngine.time_stages``): then
    verify/accept/signals split the device time exactly; otherwise device time lands in the
    stage that first waits for it (the commit, which starts with the step's one result
    transfer). A decode-only step samples inside its verify executable, so its "accept" is
    empty."""

    stage_times: dict[str, float] = dataclasses.field(default_factory=dict)
    gamma_bucket: int = 0  # the compiled γ bucket the step ran in (0: no draft work)
    num_running: int = 0  # sequences running after the step
    num_waiting: int = 0  # queue depth after the step
    # the step's speculation counts, overall and per drafter, computed once for every reader
    # (None without decoding rows)
    spec_counts: SpecCounts | None = None
    drafter_counts: DrafterCounts | None = None

    @property
    def stage_total(self) -> float:
        """The seconds of the step's own stages; ``step_time``, while the engine is busy, also
        holds the work between steps and device time the host did not wait for."""
        return sum(self.stage_times.values())


def _signal_reader(st: "StepState", fetched: "Fetched", verified: np.ndarray, max_gamma: int):
    """Per-position signal ``name`` for the decoding rows, NaN past what was verified (one
    shared read-only all-NaN array for every signal not computed)."""
    idx, gamma = st.decode_idx, st.gamma
    n = len(idx)
    computed = fetched.signals if gamma and fetched.signals is not None else {}
    unread = np.full((n, max_gamma), np.nan, np.float32)
    unread.flags.writeable = False

    def signal(name):
        if name not in computed:
            return unread
        out = np.full((n, max_gamma), np.nan, np.float32)
        vals = np.asarray(computed[name])[idx]
        mask = np.arange(gamma)[None, :] < verified[:, None]
        out[:, :gamma] = np.where(mask, vals, np.nan)
        return out

    return signal


def build_record(st: "StepState", fetched: "Fetched", clock: "StageClock",
                 queue: tuple[int, int], num_models: int = 1) -> StepRecord:
    """The step's record; ``queue``: the scheduler's running and waiting requests after the
    step's commit; ``num_models``: the pool indices below it are draft models (the rest
    lookups, which run no draft forward)."""
    idx = st.decode_idx
    decode_rows = st.decode_rows
    n = len(decode_rows)
    gamma = st.gamma
    max_gamma = st.view.max_gamma
    emitted = np.array([r.num_emitted for r in decode_rows], np.int64)
    if gamma:
        planned = np.array([r.gamma_planned for r in decode_rows], np.int64)
        verify = np.array([r.gamma_verify for r in decode_rows], np.int64)
        num_drafted = np.asarray(fetched.drafted)[idx]
        verified = np.minimum(num_drafted, verify)
        accepted = np.minimum(fetched.result.num_accepted[idx], verified)
        extra = st.proposer.record(st, idx) if st.proposer is not None else {}
        drafters = np.array([r.drafter for r in decode_rows], np.int64)
        by_model = (drafters >= 0) & (drafters < num_models)
        model_forwards = int(np.max(np.asarray(extra.get("num_drafted", num_drafted))[by_model],
                                    initial=0))
        counts = SpecCounts.count(planned, verified, accepted, emitted, max_gamma) if n else None
        by_drafter = DrafterCounts.count(drafters, verified, accepted, st.chain) if n else None
    else:  # every row decoded plainly: the same record in a few operations (it runs every step)
        planned, num_drafted, verified, accepted = (np.zeros(n, np.int64) for _ in range(4))
        extra, drafters, model_forwards = {}, np.full(n, -1, np.int64), 0
        counts = SpecCounts.plain(n, max_gamma) if n else None
        by_drafter = DrafterCounts.plain(n) if n else None
    chain = st.chain if gamma else ()
    signal = _signal_reader(st, fetched, verified, max_gamma)
    t = clock.times
    return StepRecord(
        request_ids=st.view.request_ids, gammas=planned,
        num_drafted=extra.pop("num_drafted", num_drafted),
        num_verified=verified, num_accepted=accepted, num_emitted=emitted,
        batch_size=len(st.rows), step_time=clock.total,
        draft_time=t["draft"],
        verify_time=t["verify"] + t["accept"] + t["signals"] + st.fetch_time,
        catch_up_time=t["catch_up"], catch_up_tokens=st.catch_up_tokens,
        num_prefill_tokens=st.num_prefill_tokens,
        accept_prob=signal("accept_prob"), kl=signal("kl"),
        draft_entropy=signal("draft_entropy"), confidence=signal("confidence"),
        stage_times=dict(t), gamma_bucket=gamma, num_tokens=st.num_tokens,
        num_padded_tokens=st.num_padded_tokens,
        num_running=queue[0], num_waiting=queue[1],
        chain=chain, intermediate_time=t["intermediate"], spec_counts=counts,
        drafter_counts=by_drafter, drafters=drafters, model_forwards=model_forwards,
        plan_note=None if st.plan is None else st.plan.note, **extra)
