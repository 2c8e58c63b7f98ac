"""Drafting with models of the draft pool: one draft model (``DraftModelProposer``), or a chain
in which a middle model verifies the first one's draft before the target does
(``ChainProposer``, SpecRouter §4.2).

A pool model's state is its KV pool (in the runner) and, per sequence, how many of the
sequence's tokens that pool holds (``Sequence.draft_computed[model]``): this module alone moves
the latter forward (catch-up, commit). Elastic memory and preemption reset it to 0 when the
K/V is gone (``Sequence.forget_draft_kv``).
"""

from __future__ import annotations

import jax
import numpy as np

from jspec import input_batch as ib
from jspec.device_steps import DraftInputs, Drafts
from jspec.proposers.base import Proposer


class DraftModelProposer(Proposer):
    """Pool model ``model`` drafts every drafting row in the on-device draft loop
    (``device_steps.draft_loop``), after catching up on the tokens it has not seen."""

    name = "draft_model"

    def __init__(self, runner, model: int = 0):
        self.runner = runner
        self.model = model
        self.models = (model,)

    def catch_up(self, st) -> int:
        return sum(_catch_up(self.runner, st, m) for m in self.models)

    def _first_input(self, st):
        """The draft loop's first forward: (batch, next_positions, gammas)."""
        return ib.draft_first_input(st.rows, st.num_rows, st.table, self.model)

    def propose(self, st) -> None:
        first, next_positions, gammas = self._first_input(st)
        stop_conf = np.zeros(st.num_rows, np.float32)
        stop_ent = np.full(st.num_rows, np.inf, np.float32)
        if st.plan.stop_confidence is not None:
            stop_conf[st.decode_idx] = st.plan.stop_confidence
        if st.plan.stop_entropy is not None:
            stop_ent[st.decode_idx] = st.plan.stop_entropy
        st.draft_inputs = DraftInputs(first, next_positions, st.table, gammas, stop_conf,
                                      stop_ent)
        st.draft = self.runner.run_draft(st.draft_inputs, st.sampling, st.gamma, self.model)
        st.num_drafted = st.draft.num_drafted

    def replay(self, st):
        if st.draft_inputs is None:
            return None
        return lambda: self.runner.run_draft(st.draft_inputs, st.sampling, st.gamma,
                                             self.model).tokens

    def commit_row(self, st, row, seq, old_num_tokens, num_accepted, num_drafted) -> None:
        # the draft fed its first d - 1 tokens; those the target kept stay valid
        seq.draft_computed[self.model] = min(old_num_tokens + max(num_drafted - 1, 0),
                                             old_num_tokens + num_accepted)


class ChainProposer(DraftModelProposer):
    """A two-level chain: ``first`` drafts, ``middle`` verifies that draft on device
    (``device_steps.intermediate_verify``), and what it keeps, with its own distribution as q,
    is the draft the target verifies. Nothing visits the host between the levels."""

    name = "chain"

    def __init__(self, runner, first: int, middle: int):
        super().__init__(runner, first)
        self.middle = middle
        self.models = (first, middle)

    def refine(self, st, clock) -> None:
        batch, slots = ib.intermediate_input(st.rows, st.num_rows, st.gamma, st.table,
                                             self.middle)
        st.first_drafted = st.draft.num_drafted
        drafts = Drafts(st.draft.tokens, slots, st.draft.logits, st.draft.num_drafted)
        st.draft, st.intermediate = self.runner.run_intermediate(
            batch, st.sampling, drafts, st.gamma, self.middle)
        st.num_drafted = st.draft.num_drafted
        clock.lap("intermediate", st.num_drafted)

    def read_back(self, st) -> None:
        # done by now: the step's transfer waited for the device
        st.first_drafted, st.intermediate = jax.device_get((st.first_drafted, st.intermediate))

    def commit_row(self, st, row, seq, old_num_tokens, num_accepted, num_drafted) -> None:
        # the first model fed d1 - 1 of its tokens, the middle one all d1; a token stays valid
        # while it is in the output: among the middle model's accepted a1 and the target's n
        d1 = int(st.first_drafted[row])
        a1 = int(st.intermediate.accepted[row])
        seq.draft_computed[self.model] = old_num_tokens + min(max(d1 - 1, 0), num_accepted, a1)
        seq.draft_computed[self.middle] = old_num_tokens + min(d1, num_accepted, a1)

    def record(self, st, idx: np.ndarray) -> dict:
        """The target verified the middle model's draft; the first model drafted
        ``num_drafted`` tokens, of which the middle one accepted ``intermediate_accepted``."""
        num_drafted = np.asarray(st.first_drafted)[idx].astype(np.int64)
        inter_prob = np.full((len(idx), st.view.max_gamma), np.nan, np.float32)
        if "accept_prob" in self.runner.signals:
            mask = np.arange(st.gamma)[None, :] < num_drafted[:, None]
            inter_prob[:, :st.gamma] = np.where(mask, st.intermediate.accept_prob[idx], np.nan)
        return {"num_drafted": num_drafted,
                "intermediate_accepted": np.minimum(st.intermediate.accepted[idx], num_drafted),
                "intermediate_accept_prob": inter_prob}


def _catch_up(runner, st, model: int) -> int:
    """Feed pool model ``model`` the tokens it missed while it did not draft (or the prompt),
    leaving the newest one for the draft loop: Nightjar's switching cost. Returns the tokens
    fed."""
    return feed_segments(runner, st.table, model, ib.catch_up_segments(st.rows, model))


def feed_segments(runner, table, model: int, segments, make_input=ib.catch_up_input) -> int:
    """Run pool model ``model``'s catch-up over ``segments`` ((seq, row, first, end) of tokens
    to feed) in chunks of the token budget, each batch built by ``make_input(chunk, tokens,
    rows, table)``; the sequences' counts move to ``end``. Returns the tokens fed."""
    if not segments:
        return 0
    rows = runner.catch_up_rows
    fed = 0
    for chunk in ib.pack_catch_up(segments, runner.rc.max_num_batched_tokens, rows):
        n = sum(end - first for _, _, first, end in chunk)
        fed += n
        runner.run_catch_up(make_input(chunk, runner.catch_up_tokens(n), rows, table), model)
    for seq, _, _, end in segments:
        seq.draft_computed[model] = end
    runner.sync_draft(model)
    return fed
