"""The commit of a step: the one writer of a running sequence's tokens and computed counts.

After the step's results are on the host, ``Committer.commit`` walks the rows: the target
accepted ``n`` of row i's drafts, so the sequence gains ``n + 1`` tokens (fewer when it stops on
the way), its K/V is computed up to the last kept token, the drafter keeps its own state in step
(``Proposer.commit_row``), rejected drafts' blocks go back, and the output processor says where
a request stops and builds its output. A finished sequence leaves through the scheduler
(``Scheduler.finish``), which owns statuses.

Asynchronous scheduling (``jspec/overlap.py``) holds a step's sequences at the length they
will have after its commit while the device still computes it: ``hold`` and ``release`` write
the placeholder token for it, here beside the commit that replaces it.
"""

from __future__ import annotations

import time

import numpy as np

from jspec.output_processor import OutputProcessor
from jspec.outputs import RequestOutput
from jspec.sequence import PENDING_TOKEN, Sequence
from jspec.step_state import StepState


class Committer:
    def __init__(self, scheduler, block_manager, outputs: OutputProcessor):
        self.scheduler = scheduler
        self.block_manager = block_manager
        self.outputs = outputs
        self.metrics = None  # the engine's EngineMetrics, set by the engine

    def commit(self, st: StepState, result, drafted, logprobs) -> list[RequestOutput]:
        """Append each row's emitted tokens and return the outputs of the step."""
        outputs = []
        now = time.perf_counter()
        # Python lists: indexing them per row is several times cheaper than numpy scalars
        accepted_all = result.num_accepted.tolist()
        tokens_all = result.tokens.tolist()
        drafted = np.asarray(drafted).tolist() if st.gamma else None
        for i, row in enumerate(st.rows):
            seq = row.seq
            row.num_emitted = 0
            if seq.status.finished:  # it ended while this step ran (asynchronous scheduling)
                continue
            if not row.samples:  # a prefill chunk that does not reach the end yet
                seq.num_computed += row.num_new_tokens
                self._cache_blocks(seq)
                continue
            if row.is_decode:
                new_tokens = self._accept_row(st, i, seq, accepted_all[i], tokens_all[i],
                                              drafted)
            else:
                new_tokens = tokens_all[i][:1]
                seq.num_computed += row.num_new_tokens
            output = self._emit(st, i, seq, new_tokens, logprobs, now)
            if output is not None:
                outputs.append(output)
        return outputs

    def _accept_row(self, st: StepState, i: int, seq: Sequence, accepted: int, tokens: list,
                    drafted) -> list[int]:
        """A decoding row: the target kept ``n`` drafts and the token after them."""
        row = st.rows[i]
        old_num_tokens = seq.num_tokens
        n = min(accepted, row.gamma_verify)
        seq.num_computed = old_num_tokens + n
        if row.gamma_verify > 0:
            d = min(drafted[i], row.gamma_verify)
            st.proposer.commit_row(st, i, seq, old_num_tokens, n, d)
            seq.num_drafted += d
            seq.num_accepted += n
            seq.num_spec_steps += 1
        return tokens[:n + 1]

    def _emit(self, st: StepState, i: int, seq: Sequence, new_tokens: list[int], logprobs,
              now: float) -> RequestOutput | None:
        """Append the row's new tokens up to a stop; the request's output, if it streams or
        ended."""
        row = st.rows[i]
        req = self.outputs.requests[seq.request_id]
        if seq.first_token_time is None:
            seq.first_token_time = now
        seq.num_steps += 1
        status = None
        for tok in new_tokens:
            seq.output_token_ids.append(tok)
            row.num_emitted += 1
            status = self.outputs.check_stop(req, tok)
            if status is not None:
                break
        self.metrics.num_generated_tokens += row.num_emitted
        if logprobs is not None and seq.sampling_params.logprobs is not None:
            self.outputs.add_logprobs(req, logprobs, i, row.num_emitted)
        self._cache_blocks(seq)
        if status is not None:
            self.scheduler.finish(seq, status)
            self.metrics.num_requests_finished += 1
            return self.outputs.finish(req)
        # roll back: free whole blocks past the tokens we keep (rejected drafts' KV)
        self.block_manager.truncate(seq.request_id, seq.num_tokens)
        return self.outputs.output(req) if self.outputs.stream else None

    def _cache_blocks(self, seq: Sequence) -> None:
        """Offer the sequence's newly completed blocks to the prefix cache (before a finish
        frees them). K/V past the last kept token (a draft accepted after an EOS) are not
        counted: their tokens are not in the sequence."""
        self.block_manager.cache_blocks(seq.request_id, min(seq.num_computed, seq.num_tokens),
                                        seq.draft_computed, seq.token_ids, seq.cache_salt)


def hold(st: StepState) -> None:
    """Give each of ``st``'s sequences its uncommitted token as ``PENDING_TOKEN``, and count
    the K/V ``st`` is writing as computed."""
    for row in st.rows:
        seq = row.seq
        seq.output_token_ids.append(PENDING_TOKEN)
        seq.num_computed = seq.num_tokens - 1
    st.held = True


def release(st: StepState) -> None:
    """Undo ``hold`` before the commit appends the real tokens."""
    for row in st.rows:
        seq = row.seq
        seq.output_token_ids.pop()
        seq.num_computed = seq.num_tokens - 1
    st.held = False
