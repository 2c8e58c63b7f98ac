"""The target batch a step builds (jspec/input_batch.py): the steps of plain decoding take a
short path that must build what the general one does."""

from __future__ import annotations

import jax
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from jspec import input_batch as ib
from jspec.sequence import Sequence


@settings(max_examples=60, deadline=None)
@given(lengths=st.lists(st.tuples(st.integers(1, 30), st.integers(0, 30)), min_size=1,
                        max_size=8),
       pad_rows=st.integers(0, 3), pad_tokens=st.integers(0, 9), seed=st.integers(0, 99))
def test_a_plain_decoding_steps_batch_is_the_general_one(lengths, pad_rows, pad_tokens, seed):
    """Every row decodes one token and none drafts: each array of the batch (ids, positions,
    query and KV lengths, page table, logits rows) and the empty draft slots equal the general
    builder's."""
    rng = np.random.default_rng(seed)
    rows = []
    for i, (prompt, output) in enumerate(lengths):
        seq = Sequence(f"r{i}", rng.integers(0, 1000, prompt).tolist(), None, 0)
        seq.output_token_ids = rng.integers(0, 1000, output).tolist()
        seq.num_computed = seq.num_tokens - 1  # all but the newest token are in the KV cache
        rows.append(ib.RowWork(seq, 1, True, True))
    n = len(rows)
    num_rows, num_tokens = n + pad_rows, n + pad_rows + pad_tokens
    table = rng.integers(0, 50, (num_rows, 4)).astype(np.int32)
    short = ib._plain_decode_input(rows, num_tokens, num_rows, table)
    general = ib._ragged_input(rows, num_tokens, num_rows, 0, table)
    assert ib.verify_input(rows, num_tokens, num_rows, 0, table)[0].input_ids.tolist() == \
        short[0].input_ids.tolist()
    for a, b in zip(jax.tree_util.tree_leaves(short), jax.tree_util.tree_leaves(general)):
        assert a.dtype == b.dtype and a.shape == b.shape and a.tolist() == b.tolist()
