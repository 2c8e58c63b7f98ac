"""What a step's prefill chunk adds to the step: the marginal cost of its tokens, learned online.

A step that admits a prompt computes the prompt's tokens in the same forward as the decoding
rows, so a policy that judges decoding by the step's time must take the chunk's part out, and
that part must not depend on the γ the decoding rows played: the prompt costs what it costs
whatever the arm. Splitting the target's time in proportion to tokens (``StepOutcome.
decode_time``) does not do that. The target's time is a fixed cost (dispatch, reading the weights,
sampling, the commit) plus a cost per token, so the proportional split also charges the chunk
part of the fixed cost, and more of it the fewer decode tokens sit beside it: at B = 32 a 100-token
chunk beside γ = 0's 32 tokens takes 76% of the target's time, beside γ = 5's 192 only 34%, and
γ = 0's mixed steps look cheaper than they are (docs/benchmarks.md, "Adaptation under load").

``PrefillCost`` fits the target's part of a step (``StepOutcome.target_time``) as a + b·w, w the
verify forward's width with padding (what the forward computes), by least squares over
exponentially decayed sums of the observed steps, so the fit follows the machine's current state.
A chunk of P prompt tokens is then charged b·P, never more than its proportional share. Until the
steps seen spread their widths enough to separate a from b, the proportional split stands in.
"""

from __future__ import annotations

from typing import Any

from jspec.policies.base import StepOutcome

_DECAY = 0.99  # weight of older steps, per observed step: the fit spans ~100 steps
_MIN_WEIGHT = 5.0  # decayed steps before the fit is trusted
_MIN_REL_SPREAD = 0.1  # widths' standard deviation, relative to their mean, to tell a from b


class PrefillCost:
    """Online least squares of a step's target time against its padded width (module doc)."""

    def __init__(self, decay: float = _DECAY):
        self.decay = decay
        # decayed Σ1, Σw, Σw², Σt, Σw·t
        self.sums = [0.0] * 5

    def observe(self, outcome: StepOutcome) -> None:
        w = float(outcome.num_padded_tokens)
        if w <= 0:  # an outcome that does not say its width
            return
        t = outcome.target_time
        self.sums = [self.decay * s + x for s, x in zip(self.sums, (1.0, w, w * w, t, w * t))]

    def line(self) -> tuple[float, float] | None:
        """(a, b): the target's seconds at width 0 and per token of the forward's width, or None
        while the fit cannot tell them apart."""
        n, sw, sww, st, swt = self.sums
        if n < _MIN_WEIGHT:
            return None
        mean_w = sw / n
        var_w = sww / n - mean_w * mean_w
        if var_w <= (_MIN_REL_SPREAD * mean_w) ** 2:
            return None
        b = max((swt / n - mean_w * st / n) / var_w, 0.0)
        return max(st / n - b * mean_w, 0.0), b

    def slope(self) -> float | None:
        """Seconds per token of the forward's width (b), or None while the fit cannot tell."""
        line = self.line()
        return None if line is None else line[1]

    def decode_time(self, outcome: StepOutcome) -> float:
        """The step's time less its prefill chunks' marginal cost (b per prompt token, at most
        their proportional share); ``outcome.decode_time`` while the fit cannot tell."""
        proportional = outcome.decode_time
        if proportional == outcome.step_time:  # no prefill tokens: nothing to take out
            return proportional
        b = self.slope()
        if b is None:
            return proportional
        return outcome.step_time - min(b * outcome.num_prefill_tokens,
                                       outcome.step_time - proportional)

    def state_dict(self) -> dict[str, Any]:
        return {"sums": list(self.sums)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        sums = [float(x) for x in state["sums"]]
        if len(sums) != 5:
            raise ValueError(f"prefill cost has {len(sums)} sums, expected 5")
        self.sums = sums
