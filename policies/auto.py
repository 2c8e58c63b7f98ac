"""`auto`: the policy for users who do not want to choose one.

It is Nightjar (policies/nightjar.py) with its defaults. Among the adaptive policies it is the one
that learns from what a step really delivers, the measured goodput per batch-size bucket, rather
than from a cost model. Its guard against speculation that does not pay is part of the mechanism:
γ = 0 is always one of its arms, and once the measured goodput of a batch-size bucket shows a
speculative γ below plain decoding's with confidence, that γ is no longer explored there (it
returns as its evidence ages, Nightjar's ``drift``). Options are Nightjar's; learned state is
saved and loaded like Nightjar's (``--policy-state``), under the name ``auto``.

It is not yet the default of `LLM`, `jspec generate` and `jspec serve` (still ``static``): the
evidence for it is not complete (docs/benchmarks.md, "Policies in a simulated environment": in
the simulator Nightjar's worst of 50 seeds is 0.934 of the best fixed arm on a contended CPU and
0.939 after a load step; "Headline": in the current three-round run `auto`'s worst round at
saturation is 0.903× static γ = 4 and its worst p90 TPOT below saturation 1.27×), and
an adaptive policy costs start-up time: it compiles every γ bucket (three drafting buckets for
Γmax = 4 against static's one) and, for its priors, measures a step-time profile on first use
(about 5-23 s for the built-in pair, cached afterwards).
"""

from __future__ import annotations

from jspec.policies.nightjar import NightjarPolicy


class AutoPolicy(NightjarPolicy):
    name = "auto"
