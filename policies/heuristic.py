"""HF transformers' assisted-generation heuristic, per sequence (transformers'
``AssistedCandidateGenerator.update_candidate_strategy`` with
``num_assistant_tokens_schedule="heuristic"``).

Each request keeps its own draft length. It starts at ``min(initial, max_gamma)``, where
``initial`` defaults to 20, the default of transformers' ``GenerationConfig.num_assistant_tokens``
in current releases (older ones used 5), so by default a request starts at Γmax. After a step in which every drafted token that was
verified got accepted, it grows by 2; after any rejection it shrinks by 1. HF bounds it below by
1 only; here it also stays ≤ Γmax, the most the engine can draft.

Choices:

- "All accepted" compares against the tokens actually verified (``num_verified``), like newer
  transformers compare against the candidates actually produced: a draft cut short by the engine
  (a request near its token limit) that was fully accepted still counts as a success. A step in
  which a sequence verified nothing (γ forced to 0) leaves its length unchanged.
- State is keyed by request id and bounded by the batch: ids not in the current view are dropped
  at every plan, so a request that leaves the view (finished, preempted) and comes back starts
  again at the initial length.
- With the draft offloaded every sequence gets γ = 0 (and keeps its length).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from jspec.policies.base import BatchView, DraftPlan, Policy, StepOutcome

HF_NUM_ASSISTANT_TOKENS = 20  # transformers' GenerationConfig.num_assistant_tokens default


class HeuristicPolicy(Policy):
    name = "heuristic"

    def __init__(self, max_gamma: int = 4, initial: int = HF_NUM_ASSISTANT_TOKENS):
        super().__init__(max_gamma)
        if isinstance(initial, bool) or not isinstance(initial, int) or initial < 1:
            raise ValueError(f"heuristic option initial must be an integer >= 1, got {initial!r}")
        self.initial = initial
        self._start = min(initial, max_gamma)
        self._lowest = min(1, max_gamma)  # HF's floor of 1, unless the engine cannot draft
        self._lengths: dict[str, int] = {}  # request id -> its next draft length

    def plan(self, view: BatchView) -> DraftPlan:
        # forget requests that left the batch: memory stays O(batch size)
        self._lengths = {rid: self._lengths.get(rid, self._start) for rid in view.request_ids}
        if not view.draft_resident:
            return DraftPlan(gammas=np.zeros(view.num_decode, np.int32))
        return DraftPlan(gammas=np.array([self._lengths[r] for r in view.request_ids], np.int32))

    def observe(self, outcome: StepOutcome) -> None:
        for rid, verified, accepted in zip(outcome.request_ids, outcome.num_verified,
                                           outcome.num_accepted):
            if rid not in self._lengths or verified <= 0:
                continue
            length = self._lengths[rid]
            length = length + 2 if accepted >= verified else length - 1
            self._lengths[rid] = int(min(max(length, self._lowest), self.max_gamma))

    def lengths(self) -> dict[str, int]:
        """The next draft length of every request the policy currently tracks."""
        return dict(self._lengths)

    def state_dict(self) -> dict[str, Any]:
        return {"policy": self.name, "max_gamma": self.max_gamma, "lengths": dict(self._lengths)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.check_state(state)
        try:
            lengths = {str(rid): int(n) for rid, n in state["lengths"].items()}
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ValueError(f"malformed heuristic state: {e}") from None
        bad = {rid: n for rid, n in lengths.items() if not self._lowest <= n <= self.max_gamma}
        if bad:
            raise ValueError(f"heuristic state has draft lengths outside "
                             f"[{self._lowest}, {self.max_gamma}]: {bad}")
        self._lengths = lengths
