"""Drafting with an EAGLE-3 head (``models/eagle.py``): a one-layer drafter that reads the
target's hidden states.

The head's position p takes token p + 1, so how far a sequence is in the head's KV pool is
counted in tokens taken (``Sequence.draft_computed[model]`` = c: tokens 1..c-1 at positions
0..c-2; token 0 is never an input). A token can be taken once the target has computed the
position before it, which in steady decoding is every token but none ahead: after a step that
kept a drafted tokens, the head takes those a and the bonus token in its next first forward
(up to ``ModelRunner.eagle_first_width`` tokens per row), each beside the target's hidden state,
overwriting what it wrote while drafting them from its own states. Longer lags (plain steps,
a prompt) are caught up first, in the catch-up executables.

Prefix caching needs nothing more: the target's hidden states live in its pool's blocks (same
block ids), and a cached block's head K/V is valid for every position but possibly its last,
which a sequence that reuses it feeds again (its count starts at the match, c = matched tokens,
so position c - 1 is recomputed).
"""

from __future__ import annotations

import numpy as np

from jspec import input_batch as ib
from jspec.proposers.draft_model import DraftModelProposer, feed_segments


class EagleProposer(DraftModelProposer):
    """Pool model ``model``, an EAGLE-3 head, drafts every drafting row: a draft model's
    proposer but for what the head takes (``input_batch.draft_first_input(head_width=)``),
    its catch-up and its commit."""

    name = "eagle3"

    def catch_up(self, st) -> int:
        segments = ib.catch_up_segments(st.rows, self.model, self.runner.eagle_first_width,
                                        first_token=1)
        return feed_segments(self.runner, st.table, self.model, segments, _catch_up_input)

    def _first_input(self, st):
        return ib.draft_first_input(st.rows, st.num_rows, st.table, self.model,
                                    head_width=self.runner.eagle_first_width)

    def commit_row(self, st, row, seq, old_num_tokens, num_accepted, num_drafted) -> None:
        # the first forward took every token up to the step's newest beside the target's
        # states; the drafted ones were taken beside the head's own and are taken again
        seq.draft_computed[self.model] = old_num_tokens


def _catch_up_input(chunk, num_tokens: int, num_rows: int, table: np.ndarray):
    """``input_batch.catch_up_input`` for a head: token t at position t - 1."""
    batch = ib.catch_up_input(chunk, num_tokens, num_rows, table)
    total = sum(end - first for _, _, first, end in chunk)
    batch.attn.positions[:total] -= 1
    batch.attn.kv_lens[:len(chunk)] -= 1
    return batch
