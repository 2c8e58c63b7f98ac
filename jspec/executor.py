"""The target's side of a step on the device: one ragged verification pass over every row (the
drafts scattered in on device), then acceptance, the requested logprobs and the policy's
signals. Everything stays on device until the step's one transfer (``LLMEngine.complete``)."""

from __future__ import annotations

from jspec import input_batch as ib
from jspec.device_steps import Drafts
from jspec.step_state import StageClock, StepState


class Executor:
    def __init__(self, runner, rc):
        self.runner = runner
        self.rc = rc

    def verify(self, st: StepState, carry=None) -> None:
        """One target pass over the ragged batch. A decode-only step samples in the same
        executable (one dispatch fewer per step); a step carrying prefill samples in
        ``accept``. ``carry``: the in-flight step's sampled tokens (on device) this one feeds
        (``jspec/overlap.py``)."""
        num_tokens = sum((1 + r.gamma_verify) if r.is_decode else r.num_new_tokens
                         for r in st.rows)
        st.num_padded_tokens = self.rc.verify_tokens(num_tokens, st.num_rows, st.gamma,
                                                     st.has_prefill)
        st.batch, st.draft_slots = ib.verify_input(
            st.rows, st.num_padded_tokens, st.num_rows, st.gamma, st.table)
        st.num_tokens = num_tokens
        if st.has_prefill:
            st.logits = self.runner.run_verify_forward(st.batch, st.draft_tokens,
                                                       st.draft_slots, st.gamma)
            return
        feed = carry
        if st.gamma:
            feed = Drafts(st.draft_tokens, st.draft_slots, st.draft_logits, st.num_drafted,
                          st.onehot_rows)
        st.result, st.logits = self.runner.run_verify_accept(st.batch, feed, st.sampling,
                                                             st.gamma)

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
