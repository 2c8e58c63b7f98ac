"""The choice of drafter and draft length per sequence, by the step's predicted goodput: what
``auto`` plans with when the engine has drafters without a model (prompt lookup, suffix
decoding) beside or instead of a draft model.

A step's cost has a shape that makes this a small search rather than a per-row one. The draft
model, if any row uses it, runs its loop f forwards for the whole batch, and the target verifies
the step at a width W the engine sets (``BatchView.verify_width``): n·(g + 1) tokens at γ
bucket g when the draft model drafts, and when only lookups draft, the token bucket of what
they found, Σ(1 + γ_i), where that costs less (``ResolvedConfig.decode_verify_width``). So

    T = a + b·(W + D) + c·f

(a, b, c fitted on the run's own whole steps, ``measured_time.StepLine``; D the prompt tokens
the drafts keep out of the step while prompts wait for the token budget, which later steps
run: ``BatchView.displaced_prompt_tokens``; with lookups alone f is 1 for a step that drafts at
all, whose host work no longer overlaps the device's), and given (g, f)
each row takes the drafter that yields it the most tokens:

    E_i(g, f) = max(1, Σ_{j=0..f} α_{i,model}^j if the model runs,
                       Σ_{j=0..min(L_{i,d}, g)} α_{i,d}^j for each lookup d)

where L_{i,d} is how many tokens lookup d would draft for sequence i now (the planner surveys
the lookups before the plan: ``BatchView.lookup_lengths``; a lookup drafts only what it finds)
and α_{i,d} the sequence's acceptance rate of drafter d: its own judged tokens (accepted /
judged, as DSD counts them) shrunk towards the drafter's rate over all sequences, so a sequence
with little evidence starts from the drafter's record. A lookup that estimates its own draft
(suffix decoding's chained frequencies P_{i,j} that the first j tokens are all accepted,
SuffixDecoding §3.3, ``BatchView.lookup_probs``) is predicted by that estimate instead,
calibrated per depth: 1 + Σ_{j=1..L} Π_{k≤j} min(1, κ_{d,k}·P_{i,k}/P_{i,k-1}), P_{i,0} = 1,
with κ_{d,k} the drafter's accepted tokens at depth k per predicted one (decayed, shrunk towards
1; ``calibration``). The estimate reads the sequence's
context now: a sequence whose output turns repetitive drafts long at once, where the per-
sequence rate would follow only after several steps (or never, once another drafter took the
row). The plan is the (g, f ≤ g) of greatest Σ_i E_i / T, γ = 0 included (every row plain: n /
T(0, 0)): the draft model may draft fewer tokens than the lookups beside it, whose drafts cost
only their verification. A row the draft model has not followed (its KV lags after steps drafted
by a lookup or not at all) must be caught up first, Nightjar's switching cost: the model takes
such a row only if its extra tokens over the row's best lookup are worth the catch-up's seconds
(measured per token) at the step's rate, and T then includes them. Rows whose best is 1 token do
not draft. The drafter-wide rates are planned at an upper confidence bound (as DSD's α), so a
drafter with thin evidence is tried; the evidence of a drafter that verifies nothing ages as
DSD's does (``idle_decay``), so a drafter that drafted badly for a few requests is tried again.

Planning itself costs host time on the cores the forward runs on: the survey and the plan took
~0.35 ms of a ~2.6-ms B = 1 step on the 2-vCPU AMD EPYC. Where the plans' predicted gain (the
seconds their drafts save over plain decoding, 0 for a plan that drafts nothing; decayed per
plan) has been less than what they took, the next steps decode plainly without a plan or a
survey, one plan every ``plan_every`` steps keeping the evidence current; a plan whose drafts
pay raises the gain above the cost, and every step plans again.

Why per sequence: the best drafter differs by request (one that quotes its prompt accepts long
lookup drafts, a novel one accepts the model's or nothing; SuffixDecoding §3 scores each draft
for that reason, and ArcticInference switches to its suffix drafts by a fixed score threshold)
and by load (at saturation the model's draft costs a loop over the batch, a lookup only the
verification of what it found).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import numpy as np

from jspec.policies.base import BatchView, DraftPlan, StepOutcome, judged_rows, upper_bound

_REQUEST_PRIOR = 4.0  # pseudo-tokens of the drafter-wide rate in a sequence's own rate
_REQUEST_DECAY = 0.8  # weight of a sequence's older evidence per step it drafted with a drafter
_EMA = 0.1  # the drafter-wide rate's update per step (DSD's)
_MAX_REQUESTS = 4096  # sequences remembered; the oldest are dropped beyond
_CATCH_UP_DECAY = 0.95  # weight of older catch-ups, per step that caught up
# weight of a lookup's older estimates, per row judged with one: a memory of ~200 rows, for the
# estimator's bias (a few steps at saturation would make the factors noise)
_CALIBRATION_DECAY = 0.995
# planning that pays for itself: the decay of the per-plan means of its gain and its cost, and
# the most steps in a row decoded plainly without a plan
_PLAN_DECAY = 0.8
_PLAN_EVERY = 8
# the most decoding rows a plan computes on Python floats (``DrafterChoice._choose_few``);
# above, on arrays. In a tight loop the arrays are as fast from 4 rows, but between the
# device's passes the Python form took 0.25-0.3 ms at 8-12 rows against 0.4-0.5 ms (2-vCPU
# AMD EPYC, Zen 5)
_FEW_ROWS = 8


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
        # lookup -> per draft depth, decayed Σ accepted and Σ predicted tokens of the rows it
        # drafted with estimates
        self._calibration: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self._cands: dict[tuple[tuple[int, ...], bool], _Candidates] = {}  # by (buckets, model)
        # per plan, decayed means of the seconds its drafts were predicted to save over plain
        # decoding (0 for a plain plan) and of the seconds it took (survey included); None
        # until a plan could price steps
        self._plan_gain: float | None = None
        self._plan_cost = 0.0
        self._unplanned = 0  # steps in a row decoded plainly without a plan
        self.plan_every = _PLAN_EVERY
        # what a plan over a few rows reads of the evidence, computed when the evidence
        # arrives (``observe``: the engine records a step while the device runs the next one)
        # for the rows just judged: ((drafters, longest bucket), request -> its rate tables,
        # lookup -> its calibration factors); the key is the last such plan's
        self._ready: tuple[tuple, dict[str, list], dict[int, list[float]]] | None = None

    def drafter_rate(self, d: int) -> float:
        """Drafter ``d``'s rate at its upper confidence bound, at most 1."""
        return upper_bound(self.rate.get(d, self.alpha0), self.judged.get(d, 0.0), self.z)

    def seq_rates(self, request_ids, drafters) -> np.ndarray:
        """[len(drafters), n]: each sequence's rate of each drafter, its own judged tokens
        shrunk towards the drafter's bound."""
        return np.array(self._rate_rows(request_ids, drafters), np.float64).reshape(
            len(request_ids), len(drafters)).T

    def _tables(self, request_ids, drafters, top: int) -> list[list[list[float]]]:
        """[n][drafter][top + 1]: each sequence's Σ_{j=0..L} α_{i,d}^j for L = 0..top."""
        return [[_partial_sums(rate, top) for rate in row]
                for row in self._rate_rows(request_ids, drafters)]

    def _rate_rows(self, request_ids, drafters) -> list[list[float]]:
        """``seq_rates`` as a list of rows, one per sequence."""
        priors = [self.drafter_rate(d) for d in drafters]
        out = []
        for rid in request_ids:
            own = self.seqs.get(rid)
            if own is None:
                out.append(priors)
                continue
            row = list(priors)
            for k, d in enumerate(drafters):
                judged = own.get(d)
                if judged is not None:
                    row[k] = (judged[0] + _REQUEST_PRIOR * priors[k]) / (judged[1] + _REQUEST_PRIOR)
            out.append(row)
        return out

    def plan(self, view: BatchView, model: int | None, lookups: tuple[int, ...],
             buckets: tuple[int, ...], step_time) -> DraftPlan:
        """The plan of greatest predicted goodput. ``model``: the draft model's pool index
        (None: none, or away); ``buckets``: the drafting γ buckets; ``step_time(w, f, d)`` ->
        seconds of a step whose verify is w tokens wide, in which the draft model runs f
        forwards (0: it does not run) and (d) any row drafts (w, f and d may be arrays of
        candidates), or None while the run cannot price steps yet (then the longest bucket,
        the draft model running every other step, to learn both; with lookups alone, every
        other step plain).

        It runs on the host between two device passes of every step: over a few rows it is
        computed on Python floats (``_choose_few``), over more as operations on [candidates,
        rows] arrays (``_choose``), whose count, not the rows, is their cost."""
        n = view.num_decode
        if self._skips_plan():
            return plain_plan(n)
        started = time.perf_counter()
        view.surveyed()
        cands = self._candidates(buckets, model is not None)
        verify_width = view.verify_width or (lambda drafted, g, model_drafts: n * (1 + g))
        plain = step_time(verify_width(0, 0, False), 0, False)
        choose = self._choose_few if plain is not None and n <= _FEW_ROWS else self._choose
        g, best, gain = choose(view, model, lookups, buckets, cands, step_time, verify_width,
                               plain)
        if plain is not None:
            self._planned(gain, time.perf_counter() - started)
        if best is None:
            return plain_plan(n)
        _, chosen, model_gamma = best
        gammas = np.where(chosen == model, model_gamma, np.where(chosen >= 0, g, 0))
        # request -> (lookup, its estimates) of the rows given a lookup that estimates its
        # drafts: calibrated against what the step accepts (``observe``, from the step's own
        # plan note)
        ids, probs = view.request_ids, view.lookup_probs
        predicted = {ids[i]: (d, probs[d][i]) for i, d in enumerate(chosen.tolist())
                     if d in lookups and probs.get(d) is not None
                     and not np.isnan(probs[d][i, 0])}
        return DraftPlan(gammas=gammas.astype(np.int32), drafters=chosen,
                         note={"predicted": predicted} if predicted else None)

    def _choose(self, view, model, lookups, buckets, cands, step_time, verify_width, plain):
        """(γ bucket, (tokens, drafter per row, the draft model's γ) or None for a plain
        step, the plan's predicted gain): the plan as a few operations on [candidates, rows]
        arrays. ``plain``: a plain step's seconds, None while steps cannot be priced."""
        n = view.num_decode
        top = cands.top
        # [drafter, n, top + 1]: Σ_{j=0..L} α_{i,d}^j for every length L, lookups then model
        drafters = (*lookups, model) if model is not None else lookups
        tables = np.cumsum(self.seq_rates(view.request_ids, drafters)[:, :, None]
                           ** cands.powers, axis=2)

        # per bucket: each row's best lookup (tokens, which, its draft length), 1 token, -1 and
        # 0 without one
        look_tokens = np.ones((len(buckets), n))
        look_which = np.full((len(buckets), n), -1, np.int64)
        look_len = np.zeros((len(buckets), n), np.int64)
        rows = np.arange(n)
        for k, d in enumerate(lookups):
            found = view.lookup_lengths.get(d)
            if found is None:  # drafts nothing: 1 token, never better than no draft
                continue
            length = np.minimum(found[None, :], cands.bucket_col)
            table = tables[k]
            probs = view.lookup_probs.get(d)
            if probs is not None:
                own_rows = ~np.isnan(probs[:, 0])
                if own_rows.any():
                    # 1 + Σ_{j<L} Π_{k≤j} min(1, κ_k·p_k), p_k = P_k / P_{k-1} the estimate
                    # of token k given those before it; NaN only past a row's draft, which
                    # no length reads
                    own = np.ones((n, top + 1))
                    given = _given(probs[:, :top])
                    np.cumsum(np.cumprod(np.minimum(self.calibration(d, top) * given, 1.0),
                                         axis=1), axis=1, out=own[:, 1:])
                    own[:, 1:] += 1.0
                    table = np.where(own_rows[:, None], own, table)
            tokens = table[rows, length]
            better = tokens > look_tokens + 1e-9
            look_tokens = np.where(better, tokens, look_tokens)
            look_which = np.where(better, d, look_which)
            look_len = np.where(better, length, look_len)

        # the candidate steps: (bucket index, tokens the draft model drafts), 0: it does not run
        cand_b, cand_m = cands.bucket, cands.model_gamma
        tokens, drafters_c, lengths = look_tokens[cand_b], look_which[cand_b], look_len[cand_b]
        # the draft model's catch-up before it drafts a row it has not seen for a while (its
        # KV lags by more than the 1-2 tokens the draft loop feeds): Nightjar's switching cost
        catch_up = self.catch_up_seconds() * np.maximum(view.pending_draft_tokens - 2, 0)
        gain = model_tokens = None
        if model is not None:
            model_tokens = tables[-1].T[cand_m]  # [C, n]
            gain = np.where(cands.model_runs[:, None], model_tokens - tokens, 0.0)

        def choose(worth):
            """Tokens, drafters and catch-up seconds per candidate: the model takes the rows
            where it yields more (``worth``: and where that is worth its catch-up)."""
            if gain is None:
                return tokens, drafters_c, 0.0
            better = (gain > 1e-9) & worth
            return (np.where(better, model_tokens, tokens), np.where(better, model, drafters_c),
                    better @ catch_up)

        no_model = model if model is not None else -2  # -1: no draft
        bucket_gammas = [buckets[b] for b in cands.bucket_list]

        def seconds_of(chosen) -> tuple[np.ndarray, np.ndarray]:
            """Each candidate step's seconds without catch-up (its verify width from the rows'
            draft lengths, the model's forwards if it drafts for any row), and those forwards."""
            by_model = chosen == no_model
            runs = np.where(by_model.any(axis=1), cand_m, 0)
            gammas = np.where(by_model, cand_m[:, None], np.where(chosen >= 0, lengths, 0))
            totals = gammas.sum(axis=1)
            # the width rule reads the drafts through their sum; the prompt tokens the drafts
            # keep out cost what as many verified tokens do
            width = np.array([verify_width(total, g, r > 0) for g, total, r in
                              zip(bucket_gammas, totals.tolist(), runs.tolist())], np.float64)
            width += view.displaced_prompt_tokens(totals)
            drafts = (chosen >= 0).any(axis=1)
            return np.asarray(step_time(width, runs, drafts), np.float64), runs

        if plain is None:  # cannot price steps yet: draft the most, learn both step kinds
            self._explore += 1
            odd = self._explore % 2 == 1
            if model is None and not odd:  # lookups alone: every other step plain
                return 0, None, 0.0  # (StepLine.drafting_steps)
            model_gamma = top if model is not None and odd else 0
            k = len(cand_m) - 1 - top + model_gamma if model is not None else len(cand_m) - 1
            return top, (*[x[k] for x in choose(True)[:2]], model_gamma), 0.0
        first = priced = None  # the choice with every row's catch-up paid, and its price
        worth = True
        if gain is not None and catch_up.any():  # the model's rows worth their catch-up
            first = choose(True)
            priced = seconds_of(first[1])
            worth = gain >= (first[0].sum(axis=1) / priced[0])[:, None] * catch_up[None, :]
            if ((gain > 1e-9) & ~worth).any():  # a row the model would take is not
                first = priced = None
        final_tokens, final_drafters, extra = first or choose(worth)
        seconds, runs = priced or seconds_of(final_drafters)
        values = final_tokens.sum(axis=1) / (seconds + extra)
        values[cands.model_runs & (runs == 0)] = -np.inf  # the same step as without it
        k = int(np.argmax(values))
        if values[k] <= n / plain:
            return 0, None, 0.0
        # the gain: its tokens' seconds at plain decoding's rate, less its own
        return (buckets[cand_b[k]], (final_tokens[k], final_drafters[k], int(cand_m[k])),
                float(final_tokens[k].sum() * (plain / n - 1.0 / values[k])))

    def _choose_few(self, view, model, lookups, buckets, cands, step_time, verify_width,
                    plain):
        """``_choose`` for a priced step of a few rows, on Python floats, candidate by candidate
        and row by row: the same arithmetic, the same plan. At one row the array form's ~60
        numpy calls took 0.34 ms (median) of a ~5-ms step inside the decoding loop on the
        2-vCPU AMD EPYC, with the device idle."""
        n, top = view.num_decode, cands.top
        drafters = (*lookups, model) if model is not None else lookups
        # [n][drafter][top + 1]: Σ_{j=0..L} α_{i,d}^j for every length L
        key = (drafters, top)
        ready = self._ready if self._ready is not None and self._ready[0] == key else None
        self._ready = (key, {}, {})  # what the next evidence prepares for the next plan
        tables = [ready[1].get(rid) if ready else None for rid in view.request_ids]
        missing = [rid for rid, table in zip(view.request_ids, tables) if table is None]
        if missing:
            fresh = iter(self._tables(missing, drafters, top))
            tables = [next(fresh) if table is None else table for table in tables]
        # [bucket][n]: each row's best lookup (tokens, which, its draft length)
        look_tokens = [[1.0] * n for _ in buckets]
        look_which = [[-1] * n for _ in buckets]
        look_len = [[0] * n for _ in buckets]
        for k, d in enumerate(lookups):
            found = view.lookup_lengths.get(d)
            if found is None:
                continue
            found = found.tolist()
            probs = view.lookup_probs.get(d)
            factors = None
            for i in range(n):
                table = tables[i][k]
                if probs is not None and not np.isnan(probs[i, 0]):
                    if factors is None:
                        factors = (ready[2].get(d) if ready else None) \
                            or self.calibration(d, top).tolist()
                    table = _own_sums(probs[i, :min(found[i], top)].tolist(), factors)
                for b, bucket in enumerate(buckets):
                    length = min(found[i], bucket)
                    if table[length] > look_tokens[b][i] + 1e-9:
                        look_tokens[b][i], look_which[b][i], look_len[b][i] = \
                            table[length], d, length
        lookups_only = [(sum(tokens), 0.0, sum(lengths), 0, max(which) >= 0)
                        for tokens, lengths, which in zip(look_tokens, look_len, look_which)]
        catch_up = [self.catch_up_seconds() * max(p - 2, 0)
                    for p in view.pending_draft_tokens.tolist()]
        cand_b, cand_m = cands.bucket_list, cands.model_list
        # per candidate the draft model runs in, per row: its tokens over the best lookup's
        gains = [[tables[i][-1][m] - look_tokens[b][i] for i in range(n)]
                 if m and model is not None else None for b, m in zip(cand_b, cand_m)]

        def takes(c: int, i: int, worth) -> bool:
            """Whether the model drafts row i in candidate c."""
            return gains[c][i] > 1e-9 and (worth is None or worth[c][i])

        def evaluate(worth) -> list:
            """Per candidate: (Σ tokens, catch-up seconds, Σ γ, the model's forwards, whether
            any row drafts); None where the model runs but takes no row (the same step as the
            candidate without it). ``worth``: [C][n], the model's rows worth their catch-up,
            None: all."""
            out = []
            for c, (b, m) in enumerate(zip(cand_b, cand_m)):
                if gains[c] is None:
                    out.append(lookups_only[b])
                    continue
                tokens, lengths = look_tokens[b], look_len[b]
                total_tokens, extra, total, taken = 0.0, 0.0, 0, False
                for i in range(n):
                    if takes(c, i, worth):
                        total_tokens += tables[i][-1][m]
                        extra += catch_up[i]
                        total += m
                        taken = True
                    else:
                        total_tokens += tokens[i]
                        total += lengths[i]
                out.append((total_tokens, extra, total, m, True) if taken else None)
            return out

        def seconds_of(steps) -> list:
            """Per candidate: its step's seconds without catch-up (None where ``steps`` is)."""
            live = [c for c, step in enumerate(steps) if step is not None]
            totals = [steps[c][2] for c in live]
            runs = [steps[c][3] for c in live]
            width = np.array([verify_width(total, buckets[cand_b[c]], r > 0)
                              for c, total, r in zip(live, totals, runs)], np.float64)
            width += view.displaced_prompt_tokens(np.array(totals, np.int64))
            seconds = np.asarray(step_time(width, np.array(runs, np.int64),
                                           np.array([steps[c][4] for c in live])), np.float64)
            out = [None] * len(steps)
            for c, sec in zip(live, seconds.tolist() if seconds.ndim else
                              [float(seconds)] * len(live)):
                out[c] = sec
            return out

        worth = None
        steps = evaluate(None)  # every row's catch-up paid
        seconds = seconds_of(steps)
        if model is not None and any(catch_up):  # the model's rows worth their catch-up
            worth = [None if step is None or gains[c] is None else
                     [gain >= step[0] / sec * cu for gain, cu in zip(gains[c], catch_up)]
                     for c, (step, sec) in enumerate(zip(steps, seconds))]
            if any(gains[c][i] > 1e-9 and not worth[c][i] for c in range(len(steps))
                   if worth[c] is not None for i in range(n)):
                steps = evaluate(worth)  # a row the model would take is not
                seconds = seconds_of(steps)
            else:
                worth = None
        values = [-np.inf if step is None else step[0] / (sec + step[1])
                  for step, sec in zip(steps, seconds)]
        k = max(range(len(values)), key=values.__getitem__)
        if values[k] <= n / plain:
            return 0, None, 0.0
        b, m = cand_b[k], cand_m[k]
        model_rows = [gains[k] is not None and takes(k, i, worth) for i in range(n)]
        which = [model if own else look_which[b][i] for i, own in enumerate(model_rows)]
        tokens = [tables[i][-1][m] if own else look_tokens[b][i]
                  for i, own in enumerate(model_rows)]
        # the gain: its tokens' seconds at plain decoding's rate, less its own
        return (buckets[b], (np.array(tokens), np.array(which, np.int64), m),
                float(steps[k][0] * (plain / n - 1.0 / values[k])))

    def _skips_plan(self) -> bool:
        """Whether this step decodes plainly without a plan (module docstring): sampling at
        temperature 1.0, lookups rarely find what the target samples, and at B = 1 plans
        decided to decode plainly in 94% of the steps."""
        if (self._plan_gain is None or self._plan_gain >= self._plan_cost
                or self._unplanned >= self.plan_every - 1):
            self._unplanned = 0
            return False
        self._unplanned += 1
        return True

    def _planned(self, gain: float, seconds: float) -> None:
        """A priced plan's predicted gain and what it took (``_skips_plan``)."""
        if self._plan_gain is None:
            self._plan_gain, self._plan_cost = gain, seconds
            return
        d = _PLAN_DECAY
        self._plan_gain = d * self._plan_gain + (1 - d) * gain
        self._plan_cost = d * self._plan_cost + (1 - d) * seconds

    def _candidates(self, buckets: tuple[int, ...], with_model: bool) -> "_Candidates":
        key = (buckets, with_model)
        cands = self._cands.get(key)
        if cands is None:
            cands = self._cands[key] = _Candidates.of(buckets, with_model)
        return cands

    def calibration(self, d: int, depths: int) -> np.ndarray:
        """[depths]: lookup ``d``'s accepted tokens per token its own estimates predicted, at
        each draft depth (a token's estimate given all before it accepted), decayed over the
        rows it drafted with them and shrunk towards 1 (the estimates as they are).

        Per depth because the estimates' error is: suffix decoding's frequencies promised 0.89
        for a draft's first token where 0.63 were accepted, and 0.98-1.00 for later ones where
        0.88-0.98 were (mixed workload, 16 sequences); one factor for all depths made long
        drafts look ~1.6× better at depth 8 than they were."""
        accepted, predicted = self._calibration.get(d, (np.zeros(0), np.zeros(0)))
        out = np.ones(depths)
        k = min(depths, len(accepted))
        out[:k] = (accepted[:k] + _REQUEST_PRIOR) / (predicted[:k] + _REQUEST_PRIOR)
        return out

    def _calibrate(self, d: int, probs: np.ndarray, accepted: int, verified: int) -> None:
        """One row's evidence on lookup ``d``'s estimates: the depths the target judged (the
        accepted ones and the first rejection), each token's estimate given those before it."""
        judged = min(accepted + 1, verified)
        known = np.isfinite(probs[:judged])
        if not known.all():  # the step drafted past the surveyed draft (redrawn after a commit)
            judged = int(np.argmin(known))
            if not judged:
                return
        given = _given(probs[:judged])
        acc, pred = self._calibration.get(d, (np.zeros(0), np.zeros(0)))
        if len(acc) < judged:
            acc, pred = (np.concatenate([a, np.zeros(judged - len(a))]) for a in (acc, pred))
        acc, pred = _CALIBRATION_DECAY * acc, _CALIBRATION_DECAY * pred
        acc[:judged] += np.arange(judged) < accepted
        pred[:judged] += given
        self._calibration[d] = (acc, pred)

    def catch_up_seconds(self) -> float:
        """Seconds per token of the draft model's catch-up, measured (decayed over the steps
        that caught up); 0 before any did."""
        seconds, tokens = self._catch_up
        return seconds / tokens if tokens > 0 else 0.0

    def observe(self, outcome: StepOutcome) -> None:
        self._learn(outcome)
        self._prepare(outcome.request_ids)

    def _learn(self, outcome: StepOutcome) -> None:
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
        verified = np.asarray(outcome.num_verified, np.int64)
        predicted = outcome.plan_note["predicted"] if outcome.plan_note else {}
        for i in np.flatnonzero(drafters >= 0).tolist():
            rid = outcome.request_ids[i]
            d, probs = predicted.get(rid, (None, None))
            if d == drafters[i] and verified[i] > 0:
                self._calibrate(d, probs, int(accepted[i]), int(verified[i]))
            own = self.seqs.setdefault(rid, {}).setdefault(int(drafters[i]), [0.0, 0.0])
            own[0] = _REQUEST_DECAY * own[0] + int(accepted[i])
            own[1] = _REQUEST_DECAY * own[1] + int(judged[i])
        if len(self.seqs) > _MAX_REQUESTS:
            live = set(outcome.request_ids)
            self.seqs = {rid: v for rid, v in self.seqs.items() if rid in live}

    def _prepare(self, request_ids) -> None:
        """The rate tables and calibration factors the next plan over a few rows reads, for
        ``request_ids`` (``_ready``)."""
        if self._ready is None or not 0 < len(request_ids) <= _FEW_ROWS:
            self._ready = None
            return
        key = (drafters, top) = self._ready[0]
        self._ready = (key, dict(zip(request_ids, self._tables(request_ids, drafters, top))),
                       {d: self.calibration(d, top).tolist() for d in self._calibration})

    def state_dict(self) -> dict[str, Any]:
        return {"rate": {str(d): r for d, r in self.rate.items()},
                "judged": {str(d): j for d, j in self.judged.items()},
                "calibration": {str(d): [acc.tolist(), pred.tolist()]
                                for d, (acc, pred) in self._calibration.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.rate = {int(d): float(r) for d, r in state.get("rate", {}).items()}
        self.judged = {int(d): float(j) for d, j in state.get("judged", {}).items()}
        self._calibration = {int(d): _calibration_of(c)
                             for d, c in state.get("calibration", {}).items()}
        self._ready = None


def plain_plan(n: int) -> DraftPlan:
    """A plan with a drafter per row in which no row drafts."""
    return DraftPlan(gammas=np.zeros(n, np.int32), drafters=np.full(n, -1, np.int64))


def _partial_sums(rate: float, top: int) -> list[float]:
    """Σ_{j=0..L} rate^j for L = 0..top."""
    out, total = [], 0.0
    for j in range(top + 1):
        total += rate ** j
        out.append(total)
    return out


def _own_sums(chained: list[float], factors: list[float]) -> list[float]:
    """A lookup's own estimate of the tokens its draft yields at each length L up to the draft's
    (``DrafterChoice.plan``: 1 + Σ_{j<L} Π_{k≤j} min(1, κ_k·p_k)), from its chained
    estimates P_j and the calibration factors κ_j."""
    out, before, product, total = [1.0], 1.0, 1.0, 0.0
    for p, factor in zip(chained, factors):
        product *= min(factor * (p / before), 1.0)
        before = p
        total += product
        out.append(total + 1.0)
    return out


def _given(chained: np.ndarray) -> np.ndarray:
    """Per draft token (last axis), its estimate given all before it accepted: the chained
    estimates P_j over P_{j-1}, P_0 = 1."""
    before = np.concatenate([np.ones_like(chained[..., :1]), chained[..., :-1]], axis=-1)
    return chained / before


def _calibration_of(saved) -> tuple[np.ndarray, np.ndarray]:
    """A saved calibration: [accepted, predicted] per depth, or a state saved before depths
    were told apart, one [accepted, predicted] pair over whole drafts. A factor on whole chained
    estimates is a factor on their first token's, so that pair is the first depth's."""
    accepted, predicted = saved
    if np.ndim(accepted) == 0:
        accepted, predicted = [accepted], [predicted]
    accepted, predicted = np.asarray(accepted, np.float64), np.asarray(predicted, np.float64)
    if accepted.shape != predicted.shape or accepted.ndim != 1:
        raise ValueError(f"a lookup's calibration needs equal-length accepted and predicted "
                         f"lists, got {saved!r}")
    return accepted, predicted


@dataclasses.dataclass(frozen=True)
class _Candidates:
    """The candidate steps of a plan over γ buckets: every (bucket, draft-model γ ≤ bucket),
    draft-model γ 0 meaning it does not run (only 0 without a draft model)."""

    top: int  # the longest bucket
    powers: np.ndarray  # 0..top
    bucket_col: np.ndarray  # [B, 1]: the buckets
    bucket: np.ndarray  # [C]: each candidate's bucket index
    bucket_list: list[int]  # the same, for host loops
    model_gamma: np.ndarray  # [C]
    model_list: list[int]  # the same, for host loops
    model_runs: np.ndarray  # [C]: model_gamma > 0

    @classmethod
    def of(cls, buckets: tuple[int, ...], with_model: bool) -> "_Candidates":
        pairs = [(b, m) for b, g in enumerate(buckets) for m in range(g + 1 if with_model else 1)]
        model_gamma = np.array([m for _, m in pairs], np.int64)
        top = max(buckets)
        return cls(top=top, powers=np.arange(top + 1),
                   bucket_col=np.asarray(buckets, np.int64)[:, None],
                   bucket=np.array([b for b, _ in pairs], np.int64),
                   bucket_list=[b for b, _ in pairs], model_gamma=model_gamma,
                   model_list=model_gamma.tolist(),
                   model_runs=model_gamma > 0)
