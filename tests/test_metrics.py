"""EngineMetrics' speculation counters against a per-sequence reference loop."""

from __future__ import annotations

import numpy as np

from jspec.metrics import EngineMetrics, SpecCounts
from jspec.policies.base import batch_bucket


def test_record_spec_counts_what_a_loop_over_sequences_counts():
    rng = np.random.default_rng(0)
    max_gamma = 5
    m = EngineMetrics(max_gamma=max_gamma)
    hist = np.zeros(max_gamma + 1, np.int64)
    by_batch: dict[int, np.ndarray] = {}
    per_pos = np.zeros(max_gamma, np.int64)
    drafts = draft_tokens = accepted_tokens = emitted_tokens = 0
    for _ in range(200):
        n = int(rng.integers(0, 9))
        gammas = rng.integers(0, max_gamma + 3, n)  # planned beyond Γmax is clipped
        verified = np.minimum(gammas, rng.integers(0, max_gamma + 1, n))
        accepted = np.minimum(verified, rng.integers(0, max_gamma + 1, n))
        emitted = accepted + (rng.random(n) < 0.9)
        batch = int(rng.integers(1, 40))
        m.record_spec(SpecCounts.count(gammas, verified, accepted, emitted, max_gamma), batch)
        h = by_batch.setdefault(batch_bucket(batch), np.zeros(max_gamma + 1, np.int64))
        for g, v, a, e in zip(gammas, verified, accepted, emitted):
            hist[min(g, max_gamma)] += 1
            h[min(g, max_gamma)] += 1
            if v > 0:
                drafts += 1
                draft_tokens += v
                accepted_tokens += a
                emitted_tokens += e
                per_pos[:a] += 1
    assert m.gamma_histogram.tolist() == hist.tolist()
    assert {b: h.tolist() for b, h in m.gamma_histogram_by_batch.items()} == \
        {b: h.tolist() for b, h in by_batch.items()}
    assert m.accepted_per_position.tolist() == per_pos.tolist() and per_pos[0] > 0
    assert (m.spec_decode_num_drafts, m.spec_decode_num_draft_tokens,
            m.spec_decode_num_accepted_tokens, m.spec_decode_num_emitted_tokens) == \
        (drafts, draft_tokens, accepted_tokens, emitted_tokens)


def test_a_plain_steps_counts_are_what_counting_its_zeros_gives():
    """The record of a step in which no row drafted takes its counts without counting
    (``SpecCounts.plain``, ``DrafterCounts.plain``): the same as counting its all-zero
    arrays."""
    from jspec.metrics import DrafterCounts

    for n, max_gamma in ((1, 4), (7, 5), (32, 1)):
        zeros = np.zeros(n, np.int64)
        emitted = np.ones(n, np.int64)
        plain, counted = SpecCounts.plain(n, max_gamma), SpecCounts.count(
            zeros, zeros, zeros, emitted, max_gamma)
        assert plain.gamma_counts.tolist() == counted.gamma_counts.tolist()
        assert plain.accepted_per_position.tolist() == counted.accepted_per_position.tolist()
        assert (plain.num_drafts, plain.num_draft_tokens, plain.num_accepted_tokens,
                plain.num_emitted_tokens) == (counted.num_drafts, counted.num_draft_tokens,
                                              counted.num_accepted_tokens,
                                              counted.num_emitted_tokens)
        assert DrafterCounts.plain(n) == DrafterCounts.count(np.full(n, -1), zeros, zeros, ())
