"""Drafters behind one interface (``Proposer``): a draft model, an EAGLE-3 head, a chain of draft
models (SpecRouter), prompt lookup (n-gram) and suffix decoding, and a step that mixes them row by
row (``MixedProposer``). ``make_proposers`` builds one per chain the policy may play."""

from __future__ import annotations

from jspec.proposers.base import Proposer
from jspec.proposers.draft_model import ChainProposer, DraftModelProposer
from jspec.proposers.eagle import EagleProposer
from jspec.proposers.mixed import MixedProposer
from jspec.proposers.ngram import NgramProposer, TokenBuffers, ngram_lookup
from jspec.proposers.suffix import SuffixProposer, SuffixTree


def make_lookup(config, method: str, tokens: TokenBuffers | None = None) -> Proposer:
    """The drafter without a model that ``method`` ("ngram" or "suffix") names, with the
    config's options; ``tokens``: the request token buffers it shares with the engine's other
    lookups."""
    if method == "ngram":
        return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max,
                             config.max_num_seqs, tokens)
    return SuffixProposer(config.suffix_decoding_max_tree_depth,
                          config.suffix_decoding_max_spec_factor,
                          config.suffix_decoding_min_token_prob,
                          config.suffix_decoding_max_cached_requests, config.max_num_seqs,
                          tokens)


def make_proposers(runner, chains, config, num_models: int) -> dict[tuple[int, ...], Proposer]:
    """The proposer for each chain (``DraftPlan.chain``) over the pool: its first
    ``num_models`` indices are draft models (one drafts alone; two form a chain whose middle
    model verifies the first's draft), the rest the lookups ``config.speculative_method``
    names, in order, sharing one set of token buffers."""
    out: dict[tuple[int, ...], Proposer] = {}
    lookups = config.lookups
    tokens = TokenBuffers(config.max_num_seqs)
    for chain in chains:
        if not chain:  # the policy may plan to draft with none
            continue
        if chain[0] >= num_models:
            out[chain] = make_lookup(config, lookups[chain[0] - num_models], tokens)
        elif len(chain) == 1:
            out[chain] = (EagleProposer(runner, chain[0]) if runner.pool[chain[0]].eagle
                          else DraftModelProposer(runner, chain[0]))
        else:
            out[chain] = ChainProposer(runner, *chain)
    return out


__all__ = ["ChainProposer", "DraftModelProposer", "EagleProposer", "MixedProposer", "NgramProposer", "Proposer",
           "SuffixProposer", "SuffixTree", "TokenBuffers", "make_proposers", "ngram_lookup"]
