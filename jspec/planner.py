"""The plan of a step: which rows run, the policy's draft length per decoding row (clipped to
what the request, the KV reservation and the draft's residency allow), the draft chain, the γ
bucket, and the host-side tensors every device call of the step shares.

The planner is the engine's only caller of the policy's ``plan`` and ``select``; it writes the
step's ``StepState`` (rows, plan, γ) and nothing of the sequences.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Callable

import jax
import numpy as np

from jspec import input_batch as ib
from jspec.config import ResolvedConfig, gamma_bucket
from jspec.policies import BatchView, DraftStats, Policy
from jspec.proposers.mixed import MixedProposer
from jspec.step_state import StepState

# width rules ``Planner._verify_width`` keeps, one per (decoding rows, prompt tokens) seen;
# past this many (prompt chunks of many lengths) they start over
_MAX_WIDTH_RULES = 256


@dataclasses.dataclass(frozen=True)
class Speculation:
    """What the engine can speculate with: the compiled γ buckets, a proposer per chain the
    policy may play (``DraftPlan.chain``), Γmax, and whether any plan can draft at all."""

    gamma_buckets: tuple[int, ...]
    chains: frozenset[tuple[int, ...]]
    proposers: dict  # chain -> jspec.proposers.Proposer
    max_gamma: int
    drafts: bool  # False: no draft, or a policy that only ever plans γ = 0
    num_models: int = 1  # pool indices below this are draft models; the rest are lookups


class Planner:
    def __init__(self, rc: ResolvedConfig, scheduler, block_manager, policy: Policy,
                 spec: Speculation):
        self.rc = rc
        self.scheduler = scheduler
        self.block_manager = block_manager
        self.policy = policy
        self.spec = spec
        self.metrics = None  # the engine's EngineMetrics (policy time), set by the engine
        # a policy decision: the leader's on every process of a multi-process run
        self.decide: Callable[[Callable], object] = lambda fn: fn()
        self.draft_resident: Callable[[], bool] = lambda: True
        # the LM head's share of the target's work per token (``executor.head_share``)
        self.head_share = 0.0
        self._width_rules: dict[tuple[int, int], Callable] = {}  # ``_verify_width``'s

    def plan(self, sched) -> StepState:
        """The step's rows, the policy's plan (γ per decoding row, clipped), the γ bucket and
        the device inputs."""
        rows = [ib.RowWork(s.seq, s.num_new_tokens, s.is_decode, s.samples, s.num_lookahead_slots)
                for s in sched.scheduled]
        decode_idx = np.array([i for i, r in enumerate(rows) if r.is_decode], np.int64)
        num_prefill_tokens = sum(r.num_new_tokens for r in rows if not r.is_decode)
        st = StepState(rows=rows, decode_idx=decode_idx,
                       num_rows=self.row_bucket(rows, decode_idx),
                       num_prefill_tokens=num_prefill_tokens)
        st.view = self.batch_view(st)
        if len(decode_idx) and self.spec.chains and self.spec.drafts:
            t_policy = time.perf_counter()
            st.plan = self.decide(lambda: self.policy.plan(st.view))
            self.metrics.policy_time += time.perf_counter() - t_policy
            self.metrics.policy_calls += 1
            self._apply_plan(st)
            self._reclaim(sched, st)
        self.device_inputs(st)
        return st

    def device_inputs(self, st: StepState) -> None:
        """The γ bucket, page table and sampling tensors of the planned rows: what every device
        call of the step shares."""
        st.gamma = gamma_bucket(self.spec.gamma_buckets,
                                max((r.gamma_planned for r in st.decode_rows), default=0))
        st.table = ib.page_tables(st.rows, st.num_rows, self.rc.max_pages, self.block_manager)
        st.sampling = ib.sampling_tensors(st.rows, st.num_rows)
        used = sorted({r.drafter for r in st.decode_rows if r.gamma_planned > 0})
        if not st.gamma or not used:
            st.chain, st.proposer = (), None
        elif st.chain:
            st.proposer = self.spec.proposers[st.chain]
        else:  # rows draft with different drafters (DraftPlan.drafters)
            st.proposer = MixedProposer({d: self.spec.proposers[(d,)] for d in used})

    def row_bucket(self, rows, decode_idx) -> int:
        """The row bucket a step pads to; steps that carry prefill run at the widest one
        (config.ResolvedConfig)."""
        return (self.rc.seq_bucket(len(rows)) if len(decode_idx) == len(rows)
                else self.rc.seq_buckets[-1])

    def _reclaim(self, sched, st: StepState) -> None:
        """Spend the lookahead budget the plan left unused on prefill (Scheduler.reclaim): a
        policy that plans γ = 0 under load must not slow prefill down to the pace of Γmax."""
        kept = [r.gamma_planned if r.is_decode else 0 for r in st.rows]
        if not self.scheduler.reclaim(sched, kept):
            return
        rows = st.rows
        for i, s in enumerate(sched.scheduled):
            if i >= len(rows):  # admitted: a prefill chunk
                rows.append(ib.RowWork(s.seq, s.num_new_tokens, s.is_decode, s.samples,
                                       s.num_lookahead_slots))
            elif not rows[i].is_decode:  # a prefill chunk that grew
                rows[i].num_new_tokens, rows[i].samples = s.num_new_tokens, s.samples
        st.num_prefill_tokens = sum(r.num_new_tokens for r in rows if not r.is_decode)
        st.num_rows = self.row_bucket(rows, st.decode_idx)

    def _apply_plan(self, st: StepState) -> None:
        plan, policy = st.plan, self.policy
        decode_rows = st.decode_rows
        if len(plan.gammas) != len(decode_rows):
            raise RuntimeError(f"policy {policy.name!r} planned {len(plan.gammas)} "
                               f"draft lengths for {len(decode_rows)} decoding sequences")
        if (plan.stop_confidence is not None or plan.stop_entropy is not None) \
                and not policy.wants_draft_stats:
            raise RuntimeError(f"policy {policy.name!r} sets a draft stop rule but does not "
                               f"declare draft_stops = True (the draft loop is compiled without "
                               f"confidence and entropy)")
        chain = tuple(int(m) for m in plan.chain)
        if plan.drafters is not None:
            drafters = self._row_drafters(plan.drafters, len(decode_rows))
        else:
            if chain and chain not in self.spec.chains:
                raise RuntimeError(f"policy {policy.name!r} planned chain {chain}, which is not "
                                   f"among its possible_chains() {sorted(self.spec.chains)}")
            drafters = np.full(len(decode_rows), chain[0] if chain else -1, np.int64)
        resident = self.draft_resident()
        for row, gamma, drafter in zip(decode_rows, plan.gammas.tolist(), drafters.tolist()):
            seq = row.seq
            # never draft past the request's last token or the reserved KV slots, and never
            # while the draft model is away
            room = seq.sampling_params.max_tokens - seq.num_output_tokens - 1
            if drafter < 0 or (drafter < self.spec.num_models and not resident):
                room = 0
            row.gamma_planned = row.gamma_verify = max(0, min(int(gamma), room, row.lookahead))
            row.drafter = drafter if row.gamma_planned else -1
        used = {r.drafter for r in decode_rows if r.gamma_planned}
        if plan.drafters is not None:  # one drafter for every drafting row: its own step
            chain = (next(iter(used)),) if len(used) == 1 else ()
        st.chain = chain if used else ()

    def _row_drafters(self, drafters, n: int) -> np.ndarray:
        """A plan's drafter per row, checked: one per row, each among the policy's
        ``possible_drafters``, at most one draft model among the rows."""
        policy = self.policy
        drafters = np.asarray(drafters, np.int64).reshape(-1)
        if len(drafters) != n:
            raise RuntimeError(f"policy {policy.name!r} named {len(drafters)} drafters for {n} "
                               f"decoding sequences")
        allowed = {c[0] for c in self.spec.chains if len(c) == 1}
        bad = sorted(set(drafters.tolist()) - allowed - {-1})
        if bad:
            raise RuntimeError(f"policy {policy.name!r} named drafter {bad[0]}, which is not "
                               f"among its possible_drafters() {sorted(allowed)}")
        models = {int(d) for d in drafters if 0 <= d < self.spec.num_models}
        if len(models) > 1:
            raise RuntimeError(f"policy {policy.name!r} named draft models {sorted(models)} in "
                               f"one step; a step drafts with one draft model at most")
        return drafters

    def select(self, st: StepState) -> None:
        """Let the policy trim the verify lengths after seeing the draft (one host sync)."""
        if not self.policy.wants_select:
            return
        idx = st.decode_idx
        drafted, conf, ent = jax.device_get((st.draft.num_drafted, st.draft.confidence,
                                             st.draft.entropy))
        stats = DraftStats(num_drafted=drafted[idx], confidence=conf[idx],
                           draft_entropy=ent[idx])
        t_policy = time.perf_counter()
        lens = self.decide(lambda: self.policy.select(st.view, stats))
        self.metrics.policy_time += time.perf_counter() - t_policy
        if lens is None:
            return
        lens = np.minimum(np.maximum(np.asarray(lens, np.int64), 0), drafted[idx])
        out = np.array(drafted, np.int32)
        for row, i, n in zip(st.decode_rows, idx, lens.tolist()):
            # verify only the kept prefix; the slots past it are dropped from the target batch
            row.gamma_verify = n
            out[i] = n
        st.num_drafted = out

    def batch_view(self, st: StepState) -> BatchView:
        decode_rows = st.decode_rows
        scheduler, bm = self.scheduler, self.block_manager
        backlog_tokens, backlog_requests = scheduler.prefill_backlog(st.rows)
        return BatchView(
            request_ids=[r.seq.request_id for r in decode_rows],
            context_lens=np.array([r.seq.num_tokens for r in decode_rows], np.int64),
            pending_draft_tokens=np.array(
                [r.seq.num_tokens - r.seq.num_draft_computed for r in decode_rows], np.int64),
            batch_size=len(st.rows),
            num_prefill_tokens=st.num_prefill_tokens,
            num_waiting=scheduler.num_waiting,
            num_free_blocks=bm.num_free_blocks,
            num_total_blocks=bm.num_usable_blocks,
            draft_resident=self.draft_resident(),
            max_gamma=self.spec.max_gamma,
            remaining_tokens=np.array(
                [r.seq.sampling_params.max_tokens - r.seq.num_output_tokens
                 for r in decode_rows], np.int64),
            prefill_backlog_tokens=backlog_tokens,
            prefill_backlog_requests=backlog_requests,
            lookahead_tokens=sum(r.lookahead for r in decode_rows),
            survey=(functools.partial(self._survey, decode_rows)
                    if self.policy.reads_lookups and decode_rows else None),
            verify_width=self._verify_width(len(decode_rows), st.num_prefill_tokens),
        )

    def _verify_width(self, n: int, prefill_tokens: int):
        """The width rule of ``Executor.verify`` for a step of ``n`` decoding rows and
        ``prefill_tokens`` prompt tokens (``BatchView.verify_width``). One rule per (n,
        prefill tokens), remembering its widths: a plan prices a dozen candidate steps every
        step, on the host between two device passes, and the rule's inputs repeat."""
        rule = self._width_rules.get((n, prefill_tokens))
        if rule is not None:
            return rule
        if len(self._width_rules) >= _MAX_WIDTH_RULES:
            self._width_rules.clear()
        rc, rows = self.rc, self.rc.seq_bucket(max(n, 1))
        widths: dict[tuple[int, int, bool], int] = {}

        def width(drafted: int, gamma: int, model_drafts: bool) -> int:
            key = (drafted, gamma, model_drafts)
            w = widths.get(key)
            if w is None:
                tokens = prefill_tokens + n + drafted
                if prefill_tokens:
                    w = rc.token_bucket(min(tokens, rc.max_num_batched_tokens))
                else:
                    w = rc.decode_verify_width(tokens, rows, gamma, not model_drafts,
                                               self.head_share)[0]
                widths[key] = w
            return w

        self._width_rules[(n, prefill_tokens)] = width
        return width

    def after_dispatch(self, st: StepState) -> None:
        """``st``'s verification is running: each drafter's deferred host work."""
        for proposer in self.spec.proposers.values():
            proposer.after_dispatch(st)

    def _survey(self, decode_rows) -> tuple[dict[int, np.ndarray], dict[int, np.ndarray]]:
        """What each lookup would draft for each decoding row, for a policy that reads it:
        ``BatchView.lookup_lengths`` and ``lookup_probs`` (the drafts are kept for the step)."""
        seqs = [r.seq for r in decode_rows]
        surveys = {i: self.spec.proposers[(i,)].survey(seqs, self.spec.max_gamma)
                   for i in self.policy.lookups if (i,) in self.spec.proposers}
        return ({i: s.lengths for i, s in surveys.items()},
                {i: s.probs for i, s in surveys.items()})
