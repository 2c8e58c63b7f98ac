"""The target's side of a step on the device: one ragged verification pass over every row (the
drafts scattered in on device), then acceptance, the requested logprobs and the policy's
signals. Everything stays on device until the step's one transfer (``LLMEngine.complete``)."""

from __future__ import annotations

import dataclasses

import numpy as np

from jspec import input_batch as ib
from jspec.device_steps import Drafts
from jspec.step_state import StageClock, StepState


class Executor:
    def __init__(self, runner, rc):
        self.runner = runner
        self.rc = rc
        self.head_share = head_share(runner.target.cfg)

    def verify(self, st: StepState, carry=None) -> None:
        """One target pass over the ragged batch. A decode-only step samples in the same
        executable (one dispatch fewer per step); a step carrying prefill, or a decode-only one
        whose lookups' drafts are short enough to verify at a token bucket
        (``ResolvedConfig.decode_verify_width``), samples in ``accept``. ``carry``: the in-flight
        step's sampled tokens (on device) this one feeds (``jspec/overlap.py``)."""
        num_tokens = sum((1 + r.gamma_verify) if r.is_decode else r.num_new_tokens
                         for r in st.rows)
        if not st.has_prefill and self.rc.decode_verify_width(
                num_tokens, st.num_rows, st.gamma, st.draft_logits is None, self.head_share)[1]:
            self._widen(st)
        st.num_padded_tokens = self.rc.verify_tokens(num_tokens, st.num_rows, st.gamma,
                                                     st.verified_ragged)
        st.batch, st.draft_slots = ib.verify_input(
            st.rows, st.num_padded_tokens, st.num_rows, st.gamma, st.table)
        st.num_tokens = num_tokens
        if st.verified_ragged:
            st.logits = self.runner.run_verify_forward(st.batch, st.draft_tokens,
                                                       st.draft_slots, st.gamma,
                                                       decode_only=not st.has_prefill)
            return
        feed = carry
        if st.gamma:
            feed = Drafts(st.draft_tokens, st.draft_slots, st.draft_logits, st.num_drafted,
                          st.onehot_rows)
        st.result, st.logits = self.runner.run_verify_accept(st.batch, feed, st.sampling,
                                                             st.gamma)

    def _widen(self, st: StepState) -> None:
        """Pad a decode-only step whose drafts came from lookups (on the host, no
        distribution) to the widest row bucket, so it verifies at a token bucket like a step
        with prefill: the verify forward then costs the tokens the lookups found, not
        rows * (1 + γ)."""
        rows = self.rc.seq_buckets[-1]
        pad = rows - st.num_rows
        if pad:
            st.table = np.pad(st.table, ((0, pad), (0, 0)))
            st.sampling = ib.sampling_tensors(st.rows, rows)

            def grow(a):
                return np.pad(np.asarray(a), [(0, pad)] + [(0, 0)] * (np.ndim(a) - 1))

            d = st.draft
            st.draft = dataclasses.replace(d, tokens=grow(d.tokens),
                                           num_drafted=grow(d.num_drafted),
                                           confidence=grow(d.confidence),
                                           entropy=grow(d.entropy))
            st.num_drafted = grow(st.num_drafted)
            if st.onehot_rows is not None:
                st.onehot_rows = grow(st.onehot_rows)
            st.num_rows = rows
        st.ragged = True

    def replay_forward(self, st: StepState):
        """A call of the target forward alone over the batch ``st`` verified (its compiled
        executable on the same inputs; it rewrites the same K/V, so the engine's state is
        kept): what benchmarks time beside the step."""
        runner = self.runner
        exe = runner.verify_executable(st.batch.input_ids.shape[0], st.num_rows, st.gamma,
                                       decode_only=not st.has_prefill)
        args = (st.draft_tokens, st.draft_slots) if st.gamma else ()

        def call():
            logits, runner.target_kv = exe(runner.target.params, runner.target_kv, st.batch,
                                           *args)
            return logits

        return call

    def accept(self, st: StepState, clock: StageClock) -> None:
        """Sampling of a step that carried prefill, the logprobs a request asked for, and the
        signals the policy reads (stages "accept" and "signals")."""
        runner = self.runner
        if st.result is None:
            st.result = runner.run_accept(st.logits, st.draft_logits, st.draft_tokens,
                                          st.num_drafted, st.sampling, st.gamma, st.onehot_rows)
        # only when a request asked: a step without such requests runs nothing for them
        if st.wants_logprobs:
            st.logprobs = runner.run_logprobs(st.logits, st.result.tokens, st.gamma)
        clock.lap("accept", st.result, st.logprobs)
        if st.gamma and runner.signals:
            st.signals = runner.run_signals(st.logits, st.draft_logits, st.draft_tokens,
                                            st.gamma)
        clock.lap("signals", st.signals)


def head_share(cfg) -> float:
    """The LM head's work per logits row as a share of the model's per token: vocabulary x
    hidden against each layer's projections and MLP."""
    h = cfg.hidden_size
    per_layer = h * (2 * cfg.q_size + 2 * cfg.kv_size) + 3 * h * cfg.intermediate_size
    return cfg.vocab_size * h / (cfg.num_layers * per_layer)
