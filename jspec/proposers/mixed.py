"""A step in which sequences draft with different drafters (``DraftPlan.drafters``): each
drafter runs on its own rows only, and their drafts become the one ``DraftResult`` the target
verifies in its single ragged pass.

Each drafter sees the step through a view whose other rows do not draft, so a draft model runs
its catch-up and its draft loop for its rows alone (and not at all in a step where no row uses
it), and a lookup looks up only its rows. At most one draft model drafts in a step: its logits
are the step's q, and the rows a lookup drafted are verified with a one-hot q instead
(``StepState.onehot_rows``, ``sampler.rejection_sample``). Merging a model's drafts with a
lookup's needs the model's tokens on the host: one device->host copy of [S, G] tokens after the
draft loop, which the target's pass would have waited for anyway.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from jspec.device_steps import DraftResult
from jspec.proposers.base import Proposer


class MixedProposer(Proposer):
    """The drafters of one step, keyed by pool index (built by the planner per step)."""

    name = "mixed"

    def __init__(self, parts: dict[int, Proposer]):
        self.parts = parts
        self.models = tuple(m for p in parts.values() for m in p.models)
        if sum(bool(p.models) for p in parts.values()) > 1:
            raise RuntimeError("a step may draft with one draft model at most beside lookups; "
                               f"got {sorted(parts)}")
        self._views: dict[int, object] = {}
        self._owner: dict[int, Proposer] = {}  # row -> the drafter that drafted it

    def _view(self, st, index: int):
        """``st`` as drafter ``index`` sees it: rows of other drafters draft nothing."""
        view = self._views.get(index)
        if view is None:
            rows = [r if not r.is_decode or r.drafter == index
                    else dataclasses.replace(r, gamma_planned=0, gamma_verify=0)
                    for r in st.rows]
            view = self._views[index] = dataclasses.replace(st, rows=rows)
            for i in st.decode_idx.tolist():
                if st.rows[i].drafter == index:
                    self._owner[i] = self.parts[index]
        return view

    def catch_up(self, st) -> int:
        return sum(p.catch_up(self._view(st, i)) for i, p in self.parts.items())

    def propose(self, st) -> None:
        tokens = np.zeros((st.num_rows, st.gamma), np.int32)
        drafted = np.zeros(st.num_rows, np.int32)
        onehot = np.zeros(st.num_rows, np.bool_)
        model_draft = None
        for index, part in self.parts.items():
            view = self._view(st, index)
            part.propose(view)
            mine = np.array([r.is_decode and r.drafter == index for r in st.rows]
                            + [False] * (st.num_rows - len(st.rows)))
            draft = view.draft
            if draft.logits is not None:  # the draft model's: its tokens come to the host
                model_draft = draft
                draft_tokens, draft_drafted = jax.device_get((draft.tokens, draft.num_drafted))
                st.draft_inputs = view.draft_inputs
            else:
                draft_tokens, draft_drafted = draft.tokens, draft.num_drafted
                onehot |= mine
            tokens[mine] = np.asarray(draft_tokens)[mine]
            drafted[mine] = np.asarray(draft_drafted)[mine]
        if model_draft is None:  # lookups only: every row's q is one-hot
            zeros = np.zeros((st.num_rows, st.gamma), np.float32)
            st.draft = DraftResult(tokens, None, drafted, zeros, zeros)
        else:
            st.draft = DraftResult(tokens, model_draft.logits, drafted, model_draft.confidence,
                                   model_draft.entropy)
            st.onehot_rows = onehot
        st.num_drafted = drafted

    def read_back(self, st) -> None:
        for index, part in self.parts.items():
            part.read_back(self._view(st, index))

    def commit_row(self, st, row, seq, old_num_tokens, num_accepted, num_drafted) -> None:
        part = self._owner.get(row)
        if part is not None:
            part.commit_row(st, row, seq, old_num_tokens, num_accepted, num_drafted)

    def replay(self, st):
        calls = [p.replay(self._view(st, i)) for i, p in self.parts.items()]
        if any(c is None for c in calls):
            return None
        return lambda: [c() for c in calls]
