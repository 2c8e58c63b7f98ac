"""Incremental detokenization equals decoding the whole output, through the fast path (the Rust
tokenizer's own decode) and through transformers' generic decode."""

from __future__ import annotations

import numpy as np
import pytest

from jspec.detokenizer import IncrementalDetokenizer


@pytest.mark.parametrize("fast", [True, False])
def test_incremental_text_equals_full_decode(tiny_tokenizer, fast):
    rng = np.random.default_rng(0)
    texts = ["héllo wörld — ünïcode ✓", "def f(x):\n    return x  # ok", "a\tb\n\nc"]
    sequences = [tiny_tokenizer.encode(t) for t in texts]
    sequences += [rng.integers(0, len(tiny_tokenizer), 30).tolist() for _ in range(20)]
    for ids in sequences:
        d = IncrementalDetokenizer(tiny_tokenizer)
        assert (d._raw_decode is not None) == hasattr(tiny_tokenizer, "backend_tokenizer")
        if not fast:
            d._raw_decode = None  # transformers' decode
        deltas = [d.add(t) for t in ids]
        full = tiny_tokenizer.decode(ids, skip_special_tokens=True,
                                     clean_up_tokenization_spaces=False)
        # held-back text is an incomplete UTF-8 tail; everything else has been emitted
        assert "".join(deltas) == d.text and full.startswith(d.text)
        if not full.endswith("\ufffd"):
            assert d.text == full
