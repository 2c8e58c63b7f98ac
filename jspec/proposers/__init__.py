"""Drafters behind one interface (``Proposer``): a draft model, and a chain of draft models
(SpecRouter). ``make_proposers`` builds one per chain the policy may play."""

from __future__ import annotations

from jspec.proposers.base import Proposer
from jspec.proposers.draft_model import ChainProposer, DraftModelProposer


def make_proposers(runner, chains) -> dict[tuple[int, ...], Proposer]:
    """The proposer for each chain of the draft pool (``DraftPlan.chain``): one model drafts
    alone, two form a chain whose middle model verifies the first's draft."""
    out: dict[tuple[int, ...], Proposer] = {}
    for chain in chains:
        if not chain:  # the policy may plan to draft with none
            continue
        if len(chain) == 1:
            out[chain] = DraftModelProposer(runner, chain[0])
        else:
            out[chain] = ChainProposer(runner, *chain)
    return out


__all__ = ["ChainProposer", "DraftModelProposer", "Proposer", "make_proposers"]
