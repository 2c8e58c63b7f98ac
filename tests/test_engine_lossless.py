"""Greedy speculative output must equal target-only greedy output token for token (fp32)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import make_engine, run_to_completion
from jspec.sampling_params import SamplingParams
from jspec.models.transformer import dense_forward
from jspec.policies.base import DraftPlan, Policy

MAX_TOKENS = 24
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)


class RandomGammaPolicy(Policy):
    """Test policy: an independent random γ_i in [0, max_gamma] per sequence per step."""

    name = "random-gamma"

    def __init__(self, max_gamma: int, seed: int = 0):
        super().__init__(max_gamma)
        self.rng = np.random.default_rng(seed)

    def plan(self, view):
        return DraftPlan(gammas=self.rng.integers(0, self.max_gamma + 1, view.num_decode))


@pytest.fixture(scope="module")
def reference(engine_models, mixed_prompts):
    """Target-only greedy outputs (no draft at all)."""
    target, _, _ = engine_models
    engine = make_engine(target, None)
    outs = run_to_completion(engine, mixed_prompts, GREEDY)
    return [outs[str(i)].token_ids for i in range(len(mixed_prompts))]


def test_reference_matches_dense_oracle(engine_models, mixed_prompts, reference):
    """The paged engine's greedy decode equals a plain dense causal forward, re-run per token."""
    target, _, _ = engine_models
    width = 128  # causal: right padding never changes earlier positions, so one shape suffices
    fwd = jax.jit(lambda p, t: dense_forward(p, t, cfg=target.cfg))
    for i in (0, 5, 13):
        tokens = list(mixed_prompts[i])
        for _ in range(MAX_TOKENS):
            padded = np.zeros(width, np.int32)
            padded[:len(tokens)] = tokens
            logits = fwd(target.params, jnp.asarray(padded))
            tokens.append(int(np.argmax(np.asarray(logits[len(tokens) - 1]))))
        assert tokens[len(mixed_prompts[i]):] == reference[i], f"prompt {i}"


@pytest.mark.parametrize("gamma", [1, 3, 7])
def test_static_gamma_batch8_equals_target(engine_models, mixed_prompts, reference, gamma):
    target, draft, _ = engine_models
    engine = make_engine(target, draft, policy_options=(("gamma", gamma),))
    outs = run_to_completion(engine, mixed_prompts, GREEDY)
    for i, ref in enumerate(reference):
        assert outs[str(i)].token_ids == ref, f"prompt {i} diverged at γ={gamma}"
    m = engine.metrics
    assert 0.2 < m.acceptance_rate < 1.0  # the draft really speculates, and is really checked
    # a prompt's last token may be fed as a decode step (and speculated from) instead
    assert m.num_prefill_tokens >= sum(map(len, mixed_prompts)) - len(mixed_prompts)
    assert engine.block_manager.num_used_blocks == 0
    engine.block_manager.check_invariants()


def test_batch1_equals_target(engine_models, mixed_prompts, reference):
    target, draft, _ = engine_models
    engine = make_engine(target, draft, policy_options=(("gamma", 3),))
    for i, prompt in enumerate(mixed_prompts[:8]):
        engine.add_request(f"b1-{i}", prompt, GREEDY)
        out = None
        while engine.has_unfinished_requests():
            for o in engine.step():
                out = o
        assert out.finished and out.token_ids == reference[i]


def test_mixed_per_sequence_gamma_including_zero(engine_models, mixed_prompts, reference):
    target, draft, _ = engine_models
    policy = RandomGammaPolicy(max_gamma=7, seed=3)
    engine = make_engine(target, draft, policy=policy)
    outs = run_to_completion(engine, mixed_prompts, GREEDY)
    for i, ref in enumerate(reference):
        assert outs[str(i)].token_ids == ref, f"prompt {i}"
    hist = engine.metrics.gamma_histogram
    assert hist[0] > 0 and hist[1:].sum() > 0 and (hist > 0).sum() >= 6
    # γ = 0 steps leave the draft behind; it must have caught up before drafting again
    assert engine.metrics.catch_up_tokens > 0


def test_unrelated_draft_equals_target(engine_models, mixed_prompts, reference):
    """A draft of another shape that almost never agrees: every step is a rejection."""
    target, _, small = engine_models
    engine = make_engine(target, small, policy_options=(("gamma", 3),))
    outs = run_to_completion(engine, mixed_prompts, GREEDY)
    for i, ref in enumerate(reference):
        assert outs[str(i)].token_ids == ref, f"prompt {i}"


def test_preemption_with_tiny_kv_pool_equals_target(engine_models, mixed_prompts, reference):
    """A pool of 16 blocks (240 usable slots) cannot hold 8 sequences of up to 124 tokens:
    sequences get preempted, recomputed and must still produce the same tokens."""
    target, draft, _ = engine_models
    engine = make_engine(target, draft, policy_options=(("gamma", 3),), num_kv_blocks=16)
    outs = run_to_completion(engine, mixed_prompts, GREEDY)
    assert engine.metrics.num_preemptions > 0
    for i, ref in enumerate(reference):
        assert outs[str(i)].token_ids == ref, f"prompt {i}"
    assert engine.block_manager.num_used_blocks == 0


def test_chunked_prefill_shares_steps_with_decode(engine_models, mixed_prompts, reference):
    """Long prompts arriving while others decode are split into chunks that share steps with
    verification windows."""
    target, draft, _ = engine_models
    engine = make_engine(target, draft, policy_options=(("gamma", 7),))
    order = sorted(range(len(mixed_prompts)), key=lambda i: len(mixed_prompts[i]))
    # short prompts first; long ones join while the short ones decode
    for i in order[:4]:
        engine.add_request(str(i), mixed_prompts[i], GREEDY)
    for _ in range(3):
        engine.step()
    for i in order[4:]:
        engine.add_request(str(i), mixed_prompts[i], GREEDY)
    done = {}
    mixed_steps = 0
    while engine.has_unfinished_requests():
        before = engine.metrics.num_prefill_tokens
        drafts = engine.metrics.spec_decode_num_drafts
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        if engine.metrics.num_prefill_tokens > before and \
                engine.metrics.spec_decode_num_drafts > drafts:
            mixed_steps += 1
    assert mixed_steps > 0
    for i, ref in enumerate(reference):
        assert done[str(i)].token_ids == ref, f"prompt {i}"


class TrimmingPolicy(Policy):
    """Test policy: drafts γ = max_gamma, then verifies only a random prefix of each draft
    (exercises select(): the host copy of draft stats and the trimmed verify batch)."""

    name = "trimming"

    def __init__(self, max_gamma: int, seed: int = 0):
        super().__init__(max_gamma)
        self.rng = np.random.default_rng(seed)
        self.trimmed = 0

    def plan(self, view):
        return DraftPlan(gammas=np.full(view.num_decode, self.max_gamma))

    def select(self, view, stats):
        assert stats.confidence.shape[0] == view.num_decode
        keep = self.rng.integers(0, stats.num_drafted + 1)
        self.trimmed += int((stats.num_drafted - keep).sum())
        return keep


def test_select_trimmed_verification_equals_target(engine_models, mixed_prompts, reference):
    target, draft, _ = engine_models
    policy = TrimmingPolicy(max_gamma=7, seed=2)
    engine = make_engine(target, draft, policy=policy)
    outs = run_to_completion(engine, mixed_prompts, GREEDY)
    for i, ref in enumerate(reference):
        assert outs[str(i)].token_ids == ref, f"prompt {i}"
    assert policy.trimmed > 0
    assert engine.metrics.gamma_histogram[:7].sum() > 0  # trimmed lengths are what was verified
