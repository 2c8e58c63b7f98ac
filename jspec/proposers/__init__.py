"""Drafters behind one interface (``Proposer``): a draft model, a chain of draft models
(SpecRouter), and prompt lookup (n-gram). ``make_proposers`` builds one per chain the policy
may play."""

from __future__ import annotations

from jspec.proposers.base import Proposer
from jspec.proposers.draft_model import ChainProposer, DraftModelProposer
from jspec.proposers.ngram import NgramProposer, ngram_lookup


def make_proposers(runner, chains, config) -> dict[tuple[int, ...], Proposer]:
    """The proposer for each chain of drafters (``DraftPlan.chain``): with
    ``config.speculative_method`` "ngram" the one drafter is the lookup; otherwise the chain
    indexes the draft pool: one model drafts alone, two form a chain whose middle model
    verifies the first's draft."""
    out: dict[tuple[int, ...], Proposer] = {}
    if config.speculative_method == "ngram":
        lookup = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max,
                               config.max_num_seqs)
        return {chain: lookup for chain in chains if chain}
    for chain in chains:
        if not chain:  # the policy may plan to draft with none
            continue
        if len(chain) == 1:
            out[chain] = DraftModelProposer(runner, chain[0])
        else:
            out[chain] = ChainProposer(runner, *chain)
    return out


__all__ = ["ChainProposer", "DraftModelProposer", "NgramProposer", "Proposer", "make_proposers",
           "ngram_lookup"]
