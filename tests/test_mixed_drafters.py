"""Several drafters in one engine (``speculative_method="draft_model+ngram+suffix"``): each
step each sequence may draft with a different one (``DraftPlan.drafters``), all verified in the
one target pass, the draft model running only for its rows; and ``auto`` choosing drafter and
length per sequence."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import make_engine, run_to_completion
# the repeating target and its reference outputs are fixtures, used by name
from test_ngram import (GREEDY, _prompts, assert_first_two_tokens_follow_the_target,  # noqa: F401
                        repeating_reference, repeating_target)
from jspec.policies import make_policy
from jspec.policies.base import DraftPlan, Policy
from jspec.runner import LoadedModel

ALL = "draft_model+ngram+suffix"


class RowDrafters(Policy):
    """Row i of a step drafts with ``cycle[i % len(cycle)]`` (-1: plain decoding), every
    drafting row Γmax tokens: every step mixes the drafters."""

    name = "row-drafters"

    def __init__(self, max_gamma: int, cycle=(0, 1, 2, -1)):
        super().__init__(max_gamma)
        self.cycle = tuple(cycle)

    def possible_drafters(self) -> set[int]:
        return {d for d in self.cycle if d >= 0}

    def possible_gammas(self) -> set[int]:
        return {0, self.max_gamma}  # one drafting bucket: less to compile

    def plan(self, view):
        n = view.num_decode
        drafters = np.array([self.cycle[i % len(self.cycle)] for i in range(n)], np.int64)
        return DraftPlan(gammas=np.where(drafters >= 0, self.max_gamma, 0).astype(np.int32),
                         drafters=drafters)


@pytest.fixture(scope="module")
def repeating_draft(repeating_target):
    """A draft model that mostly agrees with the repeating target."""
    rng = np.random.default_rng(4)
    params = jax.tree_util.tree_map(
        lambda a: a + 0.003 * rng.standard_normal(a.shape).astype(np.float32),
        jax.tree_util.tree_map(np.asarray, repeating_target.params))
    return LoadedModel(repeating_target.cfg, jax.tree_util.tree_map(jnp.asarray, params),
                       "draft")


@pytest.mark.parametrize("policy,overrides", [
    ("rows", {}),  # asynchronous scheduling and prefix caching on (the defaults)
    ("rows", {"async_scheduling": False, "enable_prefix_caching": False}),
    ("rows", {"num_kv_blocks": 14}),  # preemption and recompute
    ("auto", {}),
    ("auto", {"async_scheduling": False, "enable_prefix_caching": False}),
], ids=["rows-defaults", "rows-sync-no-cache", "rows-preemption", "auto-defaults",
        "auto-sync-no-cache"])
def test_greedy_mixed_drafters_equal_target_only(repeating_target, repeating_draft,
                                                 repeating_reference, overrides, policy):
    pol = RowDrafters(4) if policy == "rows" else make_policy("auto", 4)
    engine = make_engine(repeating_target, repeating_draft, pol, speculative_method=ALL,
                         **overrides)
    compiled = engine.runner.num_compiled  # after the warm-up
    outs = run_to_completion(engine, _prompts(), GREEDY)
    for i, ref in enumerate(repeating_reference):
        assert outs[str(i)].token_ids == ref, f"prompt {i}"
    assert engine.block_manager.num_used_blocks == 0
    assert engine.runner.num_compiled == compiled  # the warm-up compiled every shape it ran
    if "num_kv_blocks" in overrides:
        assert engine.metrics.num_preemptions > 0
    stats = engine.metrics.drafter_stats
    if policy == "rows":
        for name in ("draft", "ngram", "suffix"):
            assert stats[name]["num_draft_tokens"] > 0, name
    assert sum(s["num_accepted_tokens"] for s in stats.values()) > 0


@pytest.mark.parametrize("drafter", [0, 2], ids=["draft-model", "suffix"])
def test_a_step_one_drafter_drafts_is_that_drafters_own(repeating_target, repeating_draft,
                                                        repeating_reference, drafter):
    """A plan that names one drafter for every drafting row runs that drafter's own step (its
    chain), not a mix of one: the draft model's tokens stay on device between its loop and
    the target's pass instead of coming to the host to be merged."""
    engine = make_engine(repeating_target, repeating_draft, RowDrafters(4, (drafter, -1)),
                         speculative_method=ALL)
    records = []
    engine.add_step_listener(records.append)
    outs = run_to_completion(engine, _prompts(), GREEDY)
    for i, ref in enumerate(repeating_reference):
        assert outs[str(i)].token_ids == ref, f"prompt {i}"
    drafting = [r for r in records if r.gamma_bucket]
    assert drafting and all(r.chain == (drafter,) for r in drafting)


def test_lookups_mix_without_a_draft_model(repeating_target, repeating_reference):
    engine = make_engine(repeating_target, None, RowDrafters(4, (0, 1, -1)),
                         speculative_method="ngram+suffix")
    outs = run_to_completion(engine, _prompts(), GREEDY)
    for i, ref in enumerate(repeating_reference):
        assert outs[str(i)].token_ids == ref, f"prompt {i}"
    assert set(engine.metrics.drafter_stats) == {"ngram", "suffix"}


def test_sampling_with_mixed_drafters_keeps_the_target_distribution(repeating_target,
                                                                    repeating_draft):
    engine = make_engine(repeating_target, repeating_draft, RowDrafters(4, (0, 1, 2)),
                         speculative_method=ALL, prompt_lookup_min=1)
    assert_first_two_tokens_follow_the_target(engine, repeating_target)
    stats = engine.metrics.drafter_stats
    assert stats["draft"]["num_draft_tokens"] > 0 and stats["ngram"]["num_draft_tokens"] > 0
