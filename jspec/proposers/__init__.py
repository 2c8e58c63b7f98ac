"""Drafters behind one interface (``Proposer``): a draft model, a chain of draft models
(SpecRouter), prompt lookup (n-gram) and suffix decoding. ``make_proposers`` builds one per
chain the policy may play."""

from __future__ import annotations

from jspec.proposers.base import Proposer
from jspec.proposers.draft_model import ChainProposer, DraftModelProposer
from jspec.proposers.ngram import NgramProposer, ngram_lookup
from jspec.proposers.suffix import SuffixProposer, SuffixTree


def make_lookup(config) -> Proposer:
    """The drafter without a model that ``config.speculative_method`` names."""
    if config.speculative_method == "ngram":
        return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max,
                             config.max_num_seqs)
    return SuffixProposer(config.suffix_decoding_max_tree_depth,
                          config.suffix_decoding_max_spec_factor,
                          config.suffix_decoding_min_token_prob,
                          config.suffix_decoding_max_cached_requests, config.max_num_seqs)


def make_proposers(runner, chains, config) -> dict[tuple[int, ...], Proposer]:
    """The proposer for each chain of drafters (``DraftPlan.chain``): with
    ``config.speculative_method`` "ngram" or "suffix" the one drafter is that lookup; otherwise
    the chain indexes the draft pool: one model drafts alone, two form a chain whose middle
    model verifies the first's draft."""
    out: dict[tuple[int, ...], Proposer] = {}
    if config.speculative_method != "draft_model":
        lookup = make_lookup(config)
        return {chain: lookup for chain in chains if chain}
    for chain in chains:
        if not chain:  # the policy may plan to draft with none
            continue
        if len(chain) == 1:
            out[chain] = DraftModelProposer(runner, chain[0])
        else:
            out[chain] = ChainProposer(runner, *chain)
    return out


__all__ = ["ChainProposer", "DraftModelProposer", "NgramProposer", "Proposer", "SuffixProposer",
           "SuffixTree", "make_proposers", "ngram_lookup"]
