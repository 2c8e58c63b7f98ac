"""Builders of BatchView / StepOutcome / DraftStats for policy tests (no model, no JAX)."""

from __future__ import annotations

import numpy as np

from jspec.policies.base import BatchView, DraftStats, StepOutcome
from jspec.policies.profile import StepProfile, model_signature


def make_view(num_decode: int = 1, batch_size: int | None = None, max_gamma: int = 4, *,
              context_lens=None, pending=None, request_ids=None, num_waiting: int = 0,
              num_free_blocks: int = 100, num_total_blocks: int = 100,
              draft_resident: bool = True, num_prefill_tokens: int = 0,
              remaining=None, prefill_backlog_tokens: int = 0,
              prefill_backlog_requests: int = 0) -> BatchView:
    """A view of ``num_decode`` decoding sequences (ids 'r0'..) in a step of ``batch_size``,
    each with ``remaining`` output tokens left (default 100)."""
    ids = request_ids if request_ids is not None else [f"r{i}" for i in range(num_decode)]
    n = len(ids)
    return BatchView(
        request_ids=list(ids),
        context_lens=np.asarray(context_lens if context_lens is not None else [100] * n),
        pending_draft_tokens=np.asarray(pending if pending is not None else [1] * n),
        batch_size=batch_size if batch_size is not None else n,
        num_prefill_tokens=num_prefill_tokens, num_waiting=num_waiting,
        num_free_blocks=num_free_blocks, num_total_blocks=num_total_blocks,
        draft_resident=draft_resident, max_gamma=max_gamma,
        remaining_tokens=np.asarray(remaining if remaining is not None else [100] * n),
        prefill_backlog_tokens=prefill_backlog_tokens,
        prefill_backlog_requests=prefill_backlog_requests)


def make_outcome(view: BatchView, gammas, num_accepted, *, step_time: float = 0.01,
                 kl=None, confidence=None, accept_prob=None, draft_entropy=None,
                 num_drafted=None, num_verified=None, num_emitted=None,
                 catch_up_time: float = 0.0, catch_up_tokens: int = 0,
                 draft_time: float = 0.0, num_padded_tokens: int = 0,
                 plan_note=None) -> StepOutcome:
    """An outcome for ``view``: per-sequence planned γ and accepted counts; per-position signals
    [n, max_gamma] default to NaN (not verified). Emitted = accepted + 1 unless given; the
    forward's padded width is not given (0) unless ``num_padded_tokens`` says it; ``plan_note``:
    the note of the plan the step ran (``DraftPlan.note``)."""
    n = view.num_decode
    g = view.max_gamma
    gammas = np.asarray(gammas, np.int64).reshape(n)
    accepted = np.asarray(num_accepted, np.int64).reshape(n)
    drafted = gammas if num_drafted is None else np.asarray(num_drafted, np.int64)
    verified = drafted if num_verified is None else np.asarray(num_verified, np.int64)
    emitted = accepted + 1 if num_emitted is None else np.asarray(num_emitted, np.int64)

    def signal(a):
        out = np.full((n, g), np.nan, np.float32)
        if a is not None:
            a = np.asarray(a, np.float32)
            out[:, :a.shape[1]] = a
        return out

    return StepOutcome(
        request_ids=list(view.request_ids), gammas=gammas, num_drafted=drafted,
        num_verified=verified, num_accepted=accepted, num_emitted=emitted,
        batch_size=view.batch_size, step_time=step_time, draft_time=draft_time,
        verify_time=max(step_time - draft_time - catch_up_time, 0.0),
        catch_up_time=catch_up_time, catch_up_tokens=catch_up_tokens,
        num_prefill_tokens=view.num_prefill_tokens, accept_prob=signal(accept_prob),
        num_tokens=int((1 + verified).sum()) + view.num_prefill_tokens,
        num_padded_tokens=num_padded_tokens,
        kl=signal(kl), draft_entropy=signal(draft_entropy), confidence=signal(confidence),
        plan_note=plan_note)


def make_stats(confidence, num_drafted=None, draft_entropy=None) -> DraftStats:
    conf = np.asarray(confidence, np.float32)
    drafted = (np.full(conf.shape[0], conf.shape[1]) if num_drafted is None
               else np.asarray(num_drafted))
    ent = np.zeros_like(conf) if draft_entropy is None else np.asarray(draft_entropy, np.float32)
    return DraftStats(num_drafted=drafted, confidence=conf, draft_entropy=ent)


class SyntheticEnv:
    """A load-dependent environment: the goodput of a step with γ at batch size B is
    ``reward(B, γ)`` tokens/s times (1 + noise). Used to drive policies without a model."""

    def __init__(self, reward, noise: float = 0.05, seed: int = 0):
        self.reward = reward
        self.noise = noise
        self.rng = np.random.default_rng(seed)

    def outcome(self, view: BatchView, gamma: int, plan_note=None) -> StepOutcome:
        """A step where every sequence used ``gamma``; emitted tokens fixed at 1 + γ/2 each,
        step time set so the goodput is the noisy reward; ``plan_note`` as make_outcome's."""
        n = view.num_decode
        emitted = np.full(n, 1 + gamma // 2, np.int64)
        goodput = max(self.reward(view.batch_size, gamma) * (1 + self.noise *
                                                            self.rng.standard_normal()), 1e-6)
        step_time = float(emitted.sum()) / goodput
        return make_outcome(view, [gamma] * n, emitted - 1, step_time=step_time,
                            num_emitted=emitted, plan_note=plan_note)


def linear_profile() -> StepProfile:
    """A hand-made profile with linear costs: target_step(B, q, L) = 10 + B·q and
    draft_step(B, L) = 1 for any B, q, L, so at B = n = 2 a plan of γ for both takes
    T(γ) = 12 + 3γ."""
    batch, query, ctx = [1, 4], [1, 5], [100, 1000]
    target = [[[10.0 + b * q] * len(ctx) for q in query] for b in batch]
    return StepProfile("t", "d", "hand", "none", batch, query, ctx, [1], target,
                       np.ones((len(batch), len(ctx))), np.ones((1, len(batch))))


def synthetic_profile(target_cost: float = 0.02, draft_cost: float = 0.002,
                      per_token: float = 0.0004, batch_sizes=(1, 2, 4, 8, 16, 32, 64),
                      query_lens=(1, 2, 4, 8), context_lens=(128, 1024),
                      catch_up_lens=(1, 8, 64)) -> StepProfile:
    """A profile from a simple cost model (fixed cost + per-token cost; draft catch-up linear in
    tokens)."""
    b = np.asarray(batch_sizes, float)[:, None, None]
    q = np.asarray(query_lens, float)[None, :, None]
    ctx = np.asarray(context_lens, float)[None, None, :]
    target = target_cost + per_token * b * q * (1 + ctx / 4096)
    draft = (draft_cost + per_token / 10 * b[:, :, 0] * (1 + ctx[:, 0, :] / 4096))
    c = np.asarray(catch_up_lens, float)[:, None]
    catch_up = draft_cost + per_token / 10 * c * np.asarray(batch_sizes, float)[None, :]
    return StepProfile("synthetic-target", "synthetic-draft", "synthetic", "none",
                       list(batch_sizes), list(query_lens), list(context_lens),
                       list(catch_up_lens), target, draft, catch_up)


def free_draft_profile(target_cfg, draft_cfg) -> StepProfile:
    """A synthetic cost model where drafting is nearly free, labelled for the given models
    (policies check the labels): the cost-aware policies then speculate whatever this machine's
    step times are, and a test's premise that they do cannot depend on timing."""
    p = synthetic_profile(target_cost=0.02, draft_cost=1e-6, per_token=1e-7)
    p.target, p.draft = model_signature(target_cfg), model_signature(draft_cfg)
    return p
