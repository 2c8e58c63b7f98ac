"""The marginal cost of prefill tokens (policies/prefill_cost.py): the online fit of a step's
target time against its forward's width, and the decode time it leaves (no model, no JAX)."""

from __future__ import annotations

import pytest

from jspec.policies.prefill_cost import PrefillCost
from policy_helpers import make_outcome, make_view

A, B = 0.02, 0.0005  # seconds per step and per token of the forward's width


def _step(width: int, prefill: int = 0, decode: int = 32, draft: float = 0.0):
    """A step of ``decode`` rows at γ = 0 whose target time is exactly A + B·width."""
    view = make_view(decode, num_prefill_tokens=prefill)
    return make_outcome(view, [0] * decode, [0] * decode, step_time=A + B * width + draft,
                        draft_time=draft, num_padded_tokens=width)


def test_the_fit_recovers_the_cost_per_token():
    cost = PrefillCost()
    for width in (32, 64, 192, 256) * 3:
        cost.observe(_step(width))
    assert cost.slope() == pytest.approx(B)


def test_a_chunk_is_charged_its_tokens_at_the_marginal_cost():
    cost = PrefillCost()
    for width in (32, 192, 256) * 4:
        cost.observe(_step(width))
    # 32 decode tokens and a 100-token chunk run in the 256-token bucket: the chunk adds its
    # 100 tokens' worth (50 ms), the fixed cost and the padding stay with decoding
    mixed = _step(256, prefill=100, draft=0.01)
    assert mixed.step_time == pytest.approx(0.158)
    assert cost.decode_time(mixed) == pytest.approx(0.158 - 100 * B)
    # the proportional split charges the chunk 100 of 132 tokens' share of the target's time
    assert mixed.decode_time == pytest.approx(0.01 + 0.148 * 32 / 132)
    assert cost.decode_time(mixed) > mixed.decode_time


def test_the_proportional_split_stands_in_until_the_fit_can_tell():
    cost = PrefillCost()
    mixed = _step(256, prefill=100)
    assert cost.slope() is None and cost.decode_time(mixed) == mixed.decode_time  # no steps
    for _ in range(20):  # many steps, one width: a and b cannot be told apart
        cost.observe(_step(32))
    assert cost.slope() is None and cost.decode_time(mixed) == mixed.decode_time
    cost.observe(make_outcome(make_view(2), [0, 0], [0, 0]))  # no width given: not a point
    assert cost.sums[0] == pytest.approx(sum(0.99 ** k for k in range(20)))
    decode_only = _step(32)
    assert cost.decode_time(decode_only) == decode_only.step_time


def test_a_chunk_is_never_charged_more_than_its_proportional_share():
    cost = PrefillCost()
    for width in (32, 256) * 5:  # steep: 0.1 s per token
        view = make_view(32)
        cost.observe(make_outcome(view, [0] * 32, [0] * 32, step_time=0.1 * width,
                                  num_padded_tokens=width))
    mixed = _step(256, prefill=100)
    assert cost.slope() == pytest.approx(0.1)
    assert cost.decode_time(mixed) == pytest.approx(mixed.decode_time)


def test_older_steps_fade_so_the_fit_follows_the_machine():
    cost = PrefillCost()
    for width in (32, 256) * 50:
        cost.observe(_step(width))
    slow = PrefillCost()
    slow.load_state_dict(cost.state_dict())
    for width in (32, 256) * 200:  # the per-token cost doubles
        view = make_view(32)
        slow.observe(make_outcome(view, [0] * 32, [0] * 32, step_time=A + 2 * B * width,
                                  num_padded_tokens=width))
    assert slow.slope() == pytest.approx(2 * B, rel=0.05)
    with pytest.raises(ValueError, match="3 sums, expected 5"):
        slow.load_state_dict({"sums": [1, 2, 3]})


def test_the_runs_time_model_fits_the_target_line_and_the_draft_forward():
    """policies/measured_time.py: the target's a + b·w once the widths tell a from b, and one
    draft forward's seconds once a draft has run (None before: the profile stands in)."""
    from jspec.policies.measured_time import MeasuredTime

    time = MeasuredTime()
    assert time.target([32, 64]) is None and time.draft_forward() is None
    for width in (32,) * 6:
        time.observe(_step(width))
    assert time.target(32) is None  # one width: a and b cannot be told apart
    for width in (64, 192, 256) * 3:
        time.observe(_step(width))
    assert time.target([0, 100]) == pytest.approx([A, A + 100 * B])
    view = make_view(4)
    drafted = make_outcome(view, [3] * 4, [2] * 4, step_time=0.05, draft_time=0.012,
                           num_padded_tokens=16)
    time.observe(drafted)
    assert time.draft_forward() == pytest.approx(0.004)  # 12 ms over 3 forwards
