"""The proposer interface: what every drafter does in a step, whatever it drafts with.

A step's plan gives each decoding row a draft length γ_i (0: the row does not draft). The
proposer that the plan names fills in ``StepState.draft`` (``device_steps.DraftResult``: tokens
[S, G], draft logits [S, G, V], num_drafted [S]); the target then verifies every row's draft in
one ragged pass and the rejection sampler accepts. What a drafter keeps between steps is its
own business: a draft model keeps a KV pool and how far each sequence's tokens are in it
(``Sequence.draft_computed``), and catches up on the tokens it missed; a lookup drafter keeps
nothing on device.

The engine calls, in order, once per step that drafts: ``catch_up`` (stage "catch_up"),
``propose`` (stage "draft"), ``refine`` (a chain's middle model: stage "intermediate"), and
after the step's one host<-device transfer ``read_back``, then ``commit_row`` for every
drafting row, and ``record`` for the step's telemetry.
"""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # the step's state and clock sit above the proposers
    from jspec.sequence import Sequence
    from jspec.step_state import StageClock, StepState


class Proposer(abc.ABC):
    """One way of drafting. ``models``: the draft pool's models it runs (their KV pools are the
    state it keeps in step with the sequences); empty for a drafter without a model."""

    name: str = "proposer"
    models: tuple[int, ...] = ()

    def catch_up(self, st: "StepState") -> int:
        """Bring the drafter's own state up to the drafting rows' tokens before it drafts;
        returns the tokens fed (Nightjar's switching cost). Nothing to do by default."""
        return 0

    @abc.abstractmethod
    def propose(self, st: "StepState") -> None:
        """Draft up to ``row.gamma_planned`` tokens for each decoding row of ``st``: set
        ``st.draft`` (a DraftResult, on device) and ``st.num_drafted``."""

    def refine(self, st: "StepState", clock: "StageClock") -> None:
        """Work on the draft after the policy has seen it (``Policy.select``), before the
        target verifies: a chain's middle model verifying the first one's draft. Nothing by
        default."""

    def read_back(self, st: "StepState") -> None:
        """After the step's transfer: bring the proposer's own device outputs to the host."""

    def after_dispatch(self, st: "StepState") -> None:
        """Host work that no draft waits for, run once each step's verification is on the
        device (``st``, whichever drafters it uses): there it overlaps the device's pass
        instead of delaying the next draft. Nothing by default."""

    @abc.abstractmethod
    def commit_row(self, st: "StepState", row: int, seq: "Sequence", old_num_tokens: int,
                   num_accepted: int, num_drafted: int) -> None:
        """Row ``row`` (``seq``, ``old_num_tokens`` long before the step) had ``num_drafted``
        draft tokens verified and the target kept ``num_accepted``: keep the drafter's state in
        step (what its KV pool still holds validly)."""

    def reset_cache(self) -> int:
        """Forget what the drafter keeps from finished requests (suffix decoding's tree of their
        outputs); returns how many requests' outputs it forgot. Nothing by default."""
        return 0

    def replay(self, st: "StepState"):
        """A call that drafts again on ``st``'s inputs (benchmarks time it beside the step), or
        None where that cannot be repeated alone."""
        return None

    def record(self, st: "StepState", idx: np.ndarray) -> dict:
        """Fields of the step's record (``StepRecord``) only this proposer knows, for the decoding rows
        ``idx``; none by default."""
        return {}
