"""The choice of drafter and draft length per sequence, by the step's predicted goodput: what
``auto`` plans with when the engine has drafters without a model (prompt lookup, suffix
decoding) beside or instead of a draft model.

A step's cost has a shape that makes this a small search rather than a per-row one. The draft
model, if any row uses it, runs its loop f forwards for the whole batch, and the target verifies
the step at a width W the engine sets (``BatchView.verify_width``): n·(g + 1) tokens at γ
bucket g when the draft model drafts, and when only lookups draft, the token bucket of what
they found, Σ(1 + γ_i), where that costs less (``ResolvedConfig.decode_verify_width``). So

    T = a + b·W + c·f

(a, b, c fitted on the run's own whole steps, ``measured_time.StepLine``), and given (g, f)
each row takes the drafter that yields it the most tokens:

    E_i(g, f) = max(1, Σ_{j=0..f} α_{i,model}^j if the model runs,
                       Σ_{j=0..min(L_{i,d}, g)} α_{i,d}^j for each lookup d)

where L_{i,d} is how many tokens lookup d would draft for sequence i now (the planner surveys
the lookups before the plan: ``BatchView.lookup_lengths``; a lookup drafts only what it finds)
and α_{i,d} the sequence's acceptance rate of drafter d: its own judged tokens (accepted /
judged, as DSD counts them) shrunk towards the drafter's rate over all sequences, so a sequence
with little evidence starts from the drafter's record. The plan is the (g, f ≤ g) of greatest
Σ_i E_i / T, γ = 0 included (every row plain: n / T(0, 0)): the draft model may draft fewer
tokens than the lookups beside it, whose drafts cost only their verification. A row the draft
model has not followed (its KV lags after steps drafted by a lookup or not at all) must be
caught up first, Nightjar's switching cost: the model takes such a row only if its extra
tokens over the row's best lookup are worth the catch-up's seconds (measured per token) at the
step's rate, and T then includes them. Rows whose best is 1 token do not
draft. The drafter-wide rates are planned at an upper confidence bound (as DSD's α), so a
drafter with thin evidence is tried; the evidence of a drafter that verifies nothing ages as
DSD's does (``idle_decay``), so a drafter that drafted badly for a few requests is tried again.

Why per sequence: the best drafter differs by request (one that quotes its prompt accepts long
lookup drafts, a novel one accepts the model's or nothing; SuffixDecoding §3 scores each draft
for that reason, and ArcticInference switches to its suffix drafts by a fixed score threshold)
and by load (at saturation the model's draft costs a loop over the batch, a lookup only the
verification of what it found).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from jspec.policies.base import BatchView, DraftPlan, StepOutcome, judged_rows, upper_bound

_REQUEST_PRIOR = 4.0  # pseudo-tokens of the drafter-wide rate in a sequence's own rate
_REQUEST_DECAY = 0.8  # weight of a sequence's older evidence per step it drafted with a drafter
_EMA = 0.1  # the drafter-wide rate's update per step (DSD's)
_MAX_REQUESTS = 4096  # sequences remembered; the oldest are dropped beyond
_CATCH_UP_DECAY = 0.95  # weight of older catch-ups, per step that caught up


class DrafterChoice:
    """Acceptance per (sequence, drafter) and the per-step plan (module docstring)."""

    def __init__(self, alpha0: float, confidence_z: float, idle_decay: float = 0.0):
        self.alpha0 = alpha0
        self.z = confidence_z
        self.idle_decay = idle_decay  # DSD's: a drafter's evidence ages while it verifies none
        self.rate: dict[int, float] = {}  # drafter -> EMA of its per-step judged rate
        self.judged: dict[int, float] = {}  # drafter -> judged tokens the EMA remembers
        # sequence -> drafter -> [accepted, judged], decayed per step it drafted with it
        self.seqs: dict[str, dict[int, list[float]]] = {}
        self._explore = 0  # plans made before steps could be priced
        self._catch_up = [0.0, 0.0]  # decayed Σ catch-up seconds, Σ tokens caught up

    def drafter_rate(self, d: int) -> float:
        """Drafter ``d``'s rate at its upper confidence bound, at most 1."""
        return upper_bound(self.rate.get(d, self.alpha0), self.judged.get(d, 0.0), self.z)

    def seq_rates(self, request_ids, d: int) -> np.ndarray:
        """Each sequence's rate of drafter ``d``: its own judged tokens, shrunk towards the
        drafter's bound."""
        prior = self.drafter_rate(d)
        out = np.full(len(request_ids), prior)
        for i, rid in enumerate(request_ids):
            own = self.seqs.get(rid, {}).get(d)
            if own is not None:
                out[i] = (own[0] + _REQUEST_PRIOR * prior) / (own[1] + _REQUEST_PRIOR)
        return out

    def plan(self, view: BatchView, model: int | None, lookups: tuple[int, ...],
             buckets: tuple[int, ...], step_time) -> DraftPlan:
        """The plan of greatest predicted goodput. ``model``: the draft model's pool index
        (None: none, or away); ``buckets``: the drafting γ buckets; ``step_time(w, f)`` ->
        seconds of a step whose verify is w tokens wide and in which the draft model runs f
        forwards (0: it does not run), or None while the run cannot price steps yet (then the
        longest bucket, the draft model running every other step, to learn both)."""
        n = view.num_decode
        ids = view.request_ids
        top = max(buckets)
        powers = np.arange(top + 1)
        rows = np.arange(n)

        def expected(d):  # [n, top + 1]: Σ_{j=0..L} α_{i,d}^j for every length L
            return np.cumsum(self.seq_rates(ids, d)[:, None] ** powers[None, :], axis=1)

        # per bucket: each row's best lookup (tokens, which, its draft length), 1 token, -1 and
        # 0 without one
        look_tokens = np.ones((len(buckets), n))
        look_which = np.full((len(buckets), n), -1, np.int64)
        look_len = np.zeros((len(buckets), n), np.int64)
        for d in lookups:
            table = expected(d)
            found = view.lookup_lengths.get(d, np.zeros(n, np.int64))
            for b, g in enumerate(buckets):
                length = np.minimum(found, g)
                tokens = table[rows, length]
                better = tokens > look_tokens[b] + 1e-9
                look_tokens[b] = np.where(better, tokens, look_tokens[b])
                look_which[b] = np.where(better, d, look_which[b])
                look_len[b] = np.where(better, length, look_len[b])
        model_tokens = expected(model).T if model is not None else None  # [top + 1, n]

        # the draft model's catch-up before it drafts a row it has not seen for a while (its
        # KV lags by more than the 1-2 tokens the draft loop feeds): Nightjar's switching cost
        catch_up = self.catch_up_seconds() * np.maximum(view.pending_draft_tokens - 2, 0)

        def choice(b: int, model_gamma: int, rate: float | None = None):
            """(tokens, drafters, catch-up seconds) per row at bucket index b, the model
            drafting model_gamma tokens for the rows where it yields more; with ``rate``
            (tokens/s of the step without catch-up) only for rows whose extra tokens are worth
            their catch-up at that rate."""
            if not model_gamma:
                return look_tokens[b], look_which[b], 0.0
            gain = model_tokens[model_gamma] - look_tokens[b]
            better = gain > 1e-9
            if rate is not None:
                better &= gain >= rate * catch_up
            return (np.where(better, model_tokens[model_gamma], look_tokens[b]),
                    np.where(better, model, look_which[b]), float(catch_up[better].sum()))

        verify_width = view.verify_width or (lambda gammas, g, model_drafts: n * (1 + g))

        def seconds_of(b: int, drafters, model_gamma: int) -> float:
            """The step's seconds (without catch-up) with these drafters at bucket b: its
            verify width from the rows' draft lengths, the model's forwards if it drafts."""
            runs = model_gamma if model_gamma and (drafters == model).any() else 0
            gammas = np.where(drafters == model, model_gamma,
                              np.where(drafters >= 0, look_len[b], 0))
            return step_time(verify_width(gammas, buckets[b], runs > 0), runs)

        plain = step_time(verify_width(np.zeros(n, np.int64), 0, False), 0)
        if plain is None:  # cannot price steps yet: draft the most, learn both step kinds
            self._explore += 1
            model_gamma = top if model is not None and self._explore % 2 == 1 else 0
            g, best = top, (*choice(len(buckets) - 1, model_gamma)[:2], model_gamma)
        else:
            g, best, value = 0, None, n / plain
            for b, bucket in enumerate(buckets):
                for model_gamma in range(bucket + 1 if model is not None else 1):
                    tokens, drafters, _ = choice(b, model_gamma)
                    seconds = seconds_of(b, drafters, model_gamma)
                    tokens, drafters, extra = choice(b, model_gamma, tokens.sum() / seconds)
                    if model_gamma and not (drafters == model).any():
                        continue  # the same step as without the model
                    candidate = tokens.sum() / (seconds_of(b, drafters, model_gamma) + extra)
                    if candidate > value:
                        g, best, value = bucket, (tokens, drafters, model_gamma), candidate
        if best is None:
            return DraftPlan(gammas=np.zeros(n, np.int32), drafters=np.full(n, -1, np.int64))
        _, drafters, model_gamma = best
        gammas = np.where(drafters == model, model_gamma, np.where(drafters >= 0, g, 0))
        return DraftPlan(gammas=gammas.astype(np.int32), drafters=drafters)

    def catch_up_seconds(self) -> float:
        """Seconds per token of the draft model's catch-up, measured (decayed over the steps
        that caught up); 0 before any did."""
        seconds, tokens = self._catch_up
        return seconds / tokens if tokens > 0 else 0.0

    def observe(self, outcome: StepOutcome) -> None:
        if outcome.catch_up_tokens > 0:
            self._catch_up = [_CATCH_UP_DECAY * self._catch_up[0] + outcome.catch_up_time,
                              _CATCH_UP_DECAY * self._catch_up[1] + outcome.catch_up_tokens]
        if outcome.drafters is None:
            return
        accepted, judged = judged_rows(outcome)
        drafters = np.asarray(outcome.drafters)
        for d in self.judged:
            if outcome.num_decode and not judged[drafters == d].any():
                self.judged[d] *= 1.0 - self.idle_decay
        for d in set(drafters.tolist()) - {-1}:
            rows = drafters == d
            acc, jud = int(accepted[rows].sum()), int(judged[rows].sum())
            if jud:
                r = acc / jud
                self.rate[d] = (1 - _EMA) * self.rate.get(d, self.alpha0) + _EMA * r
                self.judged[d] = (1 - _EMA) * self.judged.get(d, 0.0) + jud
        for i in np.flatnonzero(drafters >= 0).tolist():
            rid = outcome.request_ids[i]
            own = self.seqs.setdefault(rid, {}).setdefault(int(drafters[i]), [0.0, 0.0])
            own[0] = _REQUEST_DECAY * own[0] + int(accepted[i])
            own[1] = _REQUEST_DECAY * own[1] + int(judged[i])
        if len(self.seqs) > _MAX_REQUESTS:
            live = set(outcome.request_ids)
            self.seqs = {rid: v for rid, v in self.seqs.items() if rid in live}

    def state_dict(self) -> dict[str, Any]:
        return {"rate": {str(d): r for d, r in self.rate.items()},
                "judged": {str(d): j for d, j in self.judged.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.rate = {int(d): float(r) for d, r in state.get("rate", {}).items()}
        self.judged = {int(d): float(j) for d, j in state.get("judged", {}).items()}
