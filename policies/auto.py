"""`auto`: the policy for users who do not want to choose one.

It is Nightjar (policies/nightjar.py) with its defaults. Among the adaptive policies it is the one
that learns from what a step really delivers, the measured goodput per batch-size bucket, rather
than from a cost model, so it holds when the model's acceptance or the machine's step costs differ
from what a profile says (DSD and AdaSpec trust the profile: on the built-in pair DSD drafted
γ ≈ 1.4 at 1 request/s where γ = 5 was best, docs/benchmarks.md). Its guard against speculation
that does not pay is part of the mechanism: γ = 0 is always one of its arms, and once the measured
goodput of a batch-size bucket shows a speculative γ below plain decoding's with confidence, that
γ is no longer explored there (it returns only as its evidence ages, Nightjar's ``drift``).
Options are Nightjar's; learned state is saved and loaded like Nightjar's (``--policy-state``),
under the name ``auto``.

It is not yet the default of `LLM`, `jspec generate` and `jspec serve` (still ``static``): on this
project's 2-vCPU machine the same policy run twice in one headline run (as `nightjar` and as
`auto`) delivered 559 and 822 tok/s at saturation, more than the differences being judged, and an
adaptive policy costs start-up time: it compiles every γ bucket (three drafting buckets for Γmax =
4 against static's one) and, for its priors, measures a step-time profile on first use (about 23 s
for the built-in pair on that machine, cached afterwards). The headline's numbers are in
docs/benchmarks.md.
"""

from __future__ import annotations

from jspec.policies.nightjar import NightjarPolicy


class AutoPolicy(NightjarPolicy):
    name = "auto"
