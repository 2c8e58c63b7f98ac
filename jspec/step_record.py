"""The record of one step (``StepOutcome``), built once from the step's state and its fetched
results; the metrics, the policy and every step listener read this same record."""

from __future__ import annotations

import numpy as np

from jspec.policies import StepOutcome
from jspec.step_state import Fetched, StageClock, StepState


def _signal_reader(st: StepState, fetched: Fetched, verified: np.ndarray, max_gamma: int):
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


def build_outcome(st: StepState, fetched: Fetched, clock: StageClock, scheduler) -> StepOutcome:
    idx = st.decode_idx
    decode_rows = st.decode_rows
    n = len(decode_rows)
    gamma = st.gamma
    max_gamma = st.view.max_gamma
    planned = np.array([r.gamma_planned for r in decode_rows], np.int64)
    verify = np.array([r.gamma_verify for r in decode_rows], np.int64)
    num_drafted = np.asarray(fetched.drafted)[idx] if gamma else np.zeros(n, np.int64)
    verified = np.minimum(num_drafted, verify)
    accepted = np.minimum(fetched.result.num_accepted[idx], verified)
    extra = st.proposer.record(st, idx) if gamma and st.proposer is not None else {}
    emitted = np.array([r.num_emitted for r in decode_rows], np.int64)
    signal = _signal_reader(st, fetched, verified, max_gamma)
    t = clock.times
    return StepOutcome(
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
        num_running=scheduler.num_running, num_waiting=scheduler.num_waiting,
        chain=st.chain if gamma else (), intermediate_time=t["intermediate"], **extra)
