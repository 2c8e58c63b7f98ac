"""AdaSpec: efficiency-maximising draft and verify lengths from draft confidence and a cost model.

AdaSpec ("AdaSpec: Adaptive Speculative Decoding for Fast, SLO-Aware Large Language Model
Serving", §4–5) maximises the efficiency of a speculative step, expected accepted tokens per
second of step time, E = N/T:

* N (§4.2, Eq. 6–7): c_{i,j} = Π_{t≤j} q_i(x_t) estimates the probability that the first j draft
  tokens of request i are all accepted (c_{i,0} = 1 is the bonus/correction token, always
  emitted), so N = Σ_i Σ_{j=0..γ_i} c_{i,j}.
* T (§4.1): γ draft forwards then one target forward. The paper fits a linear model; we read the
  profiled table of `jspec profile` instead (either gives T for the same formula):
  T = D·draft_step(B, L) + target_step(B, q, L), with B = view.batch_size (every row of the step
  runs through both forwards), L = the mean context length of the decoding sequences, D = draft
  forwards (the largest γ_i) and q = 1 + Σ_i γ_i / B. The profile's grid has one query length q
  per sequence, so ragged verify lengths are mapped to the same total token count spread evenly:
  B·q = B + Σ_i γ_i tokens (each row's own token plus all verified draft tokens). Prefill tokens
  beyond a row's first are left out: they cost the same whatever γ is, and pushing them into a
  per-sequence q would send lookups far past the grid.
* SLO (§5.3): if T > tpot_slo while anything is speculated, E = −1, so any γ > 0 loses to γ = 0.

Three pieces (§5):

(a) Adaptive drafter, plan(). The paper's "predict–execute–correct" loop (Alg. 1) decides after
every draft forward on the host; our draft loop runs on device with no round trip per token, so
the rule is compiled into a draft length and a per-sequence confidence threshold.

  Cap γ*: predict every c_{i,j} by c̄^j (c̄ = running mean of observed per-token confidence, prior
  0.6) and walk γ = 0, 1, ... while the predicted E(γ) still rises (E is unimodal in γ, §4.3
  Theorem 4.3 and its Remark), γ* = the first local maximum, i.e. the largest γ reached by a
  rising step. Every sequence plans γ*.

  Threshold: adding a token with expected gain g (accepted tokens) and time cost τ moves E to
  (N + g)/(T + τ), which lies between N/T and g/τ, so it raises E iff g/τ > E. At the optimum E*
  (Dinkelbach's condition for maximising a ratio) a token is worth verifying iff g/τ > E*. For
  token j+1 of request i the predict step gives g = c_{i,j}·c̄, and τ is the cost of one drafted
  token, taken as the mean over the planned range,
      τ = (T(γ*) − T(0)) / (γ*·n),
  the draft forward shared by the n drafting sequences plus the target's cost of one more verify
  token (for linear costs exactly draft_step/n + the target's per-token slope). Hence
      draft token j+1  ⇔  c_{i,j}·c̄ > τ·E*  ⇔  c_{i,j} > stop_confidence := τ·E*/c̄,
  which is exactly the device rule: token j (0-based) is drafted iff the product of the
  confidences of the tokens before it is ≥ stop_confidence_i. A sequence whose real confidences
  equal c̄ drafts all γ* tokens (γ* was a rising step, so c̄^γ*/τ > E(γ*) = E*); one whose product
  drops below the threshold stops early: that is the "correct" step, with the real product in
  place of the prediction. The token that dropped the product has been drafted already; with
  ``verifier=true`` select() removes it if it does not pay. E* comes from the c̄ prediction, and
  τ amortises the draft forward over all n sequences even when fewer are still drafting: both are
  approximations that select() repairs with the real confidences.

  The price of a token (``stop_price``, default ``draft``): this engine verifies every row of a
  step at the plan's γ bucket ((b)), so a token one row stops short of saves none of the
  target's time, only the draft forwards once every row has stopped: τ = the draft's forward
  over the n rows, (T_draft(γ*) − T_draft(1))/((γ* − 1)·n). Priced with the target's cost per
  verify token as well (``stop_price=paper``, τ as above), rows stopped at tokens that cost
  nothing to verify. In the simulator (worst of 20 seeds, verifier off) the draft price moved
  saturation-pays 0.993 → 1.005, prefill-bursts 1.107 → 1.140, the rest within 0.005; at
  saturation on the built-in pair one round with the paper's price gave 0.868× static γ = 4,
  two with the draft's 0.859× and 0.972× (docs/benchmarks.md).

(b) Confidence-prior verifier, select() (Alg. 2): after drafting, remove draft tokens in ascending
order of c_{i,j} while E rises. A token can only go after every token behind it in its request,
so the candidates are the requests' LAST KEPT tokens (a heap of tails; re-pushing a request's new
tail after each removal is what the released code got wrong when it kept looking at the last
drafted token). c_{i,j} never grows with j (confidences ≤ 1), so this is also the global ascending
order. The draft time is already spent and stays in T: E is the step's real efficiency. The loop
ends when a removal no longer raises E or nothing is left. One exception: while the kept set
breaks the SLO (E = −1) removing a token leaves E at −1, which is no rise, yet fewer tokens are
the only way back under the SLO, so removal goes on until the SLO holds (or nothing is left; with
nothing speculated the SLO rule no longer applies).

Off by default (``verifier``): Alg. 2 prices the kept tokens as a ragged verify, q = 1 + Σγ_i/B,
so each removal saves its token's share of the target's forward. This engine verifies every row
of a step at the γ bucket it compiled for the plan (``ResolvedConfig.verify_tokens``; only
lookups' drafts go ragged), so a removal saves no time and only loses the token's chance of
acceptance: priced at the step's real width, E never rises and Alg. 2 keeps everything, at the
price of a host sync between draft and verify that also ends asynchronous scheduling's
overlap. Run with the paper's ragged price, the verifier trimmed the built-in pair's drafts to
an acceptance of 0.95 at saturation (0.64-0.66× static γ = 4 on the built-in pair, against 0.87×
without it in the same run) and to 0.948× the best fixed arm after a load step in the simulator
(0.995 without; docs/benchmarks.md, "Policies in a simulated environment").
``verifier=true`` runs it as published.

(c) c̄ is the running mean of the per-token confidences q(x_j) of verified tokens
(outcome.confidence, NaN where not verified). Verified tokens are the ones select() kept, a
sample biased towards confident tokens; the paper does not say which tokens its history holds.

(d) Three deviations, each an option (``calibrate=false, probe_tokens=0, confidence_z=0`` is the
paper's rule):

  Calibration (``calibrate``, default on). The paper takes a draft token's confidence q(x) for
  its acceptance probability. With the built-in pair and greedy verification (a token is
  accepted when the draft's choice is the target's) they differ: the mean confidence of
  verified tokens is 0.49-0.59 while the judged acceptance rate is 0.87 (docs/benchmarks.md,
  "Adaptation under load", "AdaSpec and DSD at low load"),
  so the model predicted 2.1 tokens per γ = 4 step where 3.8 came, and γ = 0 won a comparison
  it should have lost. κ = Σ accepted / Σ q over judged draft tokens (the accepted prefix and
  the first rejection of each sequence, the tokens whose fate says something about their q;
  4 tokens of κ = 1 as a prior) rescales every estimate: c_{i,j} = Π min(1, κ·q), c̄' =
  min(1, κ·c̄). The device stop rule compares the raw product c_{i,j} = Π q with one threshold
  per sequence, while the calibrated rule for token j+1 is κ^j·c_{i,j}·c̄' > τ·E*, a threshold
  that changes with j. The device gets τ·E*/(c̄'·max(κ, κ^(γ*−1))), the most permissive of
  those for j = 1..γ*−1: it may draft a token the calibrated rule would not, and select(), which
  ranks the calibrated products exactly, removes it from verification; a stricter threshold
  would stop drafts that nothing could restore (with κ = 1.55 a κ^1 threshold cut the built-in
  pair's drafts to 1.6 tokens of a planned 4).
  Under sampling, acceptance min(1, p/q) is also not q, and κ measures that gap the same way.

  Probe (``probe_tokens``, default 16). c̄ is learned only from verified tokens, so a prior under
  which γ = 0 wins is never corrected (on the built-in pair at B = 1 the engine-measured step
  costs and the 0.6 prior gave γ = 0 for every step). Until ``probe_tokens`` confidences were
  seen, every plan drafts at least one token with no stop rule, and select() keeps all of it.

  Optimism (``confidence_z``, default 2). A probe is a start, not a cure: 16 tokens drafted
  right after prompts had c̄ = 0.40 (κ·c̄ = 0.62) where the steady value is near 0.85, and from
  there γ = 0 won again and nothing more was seen. The drafter plans with an upper confidence
  bound, min(1, c̄' + z·√(c̄'(1 − c̄')/n)) (n = confidences seen), the rule that keeps a
  bandit from locking on a pessimistic early estimate: while evidence is thin, speculation is
  given the benefit of the doubt and its outcome is observed; with n in the thousands the bound
  is within a percent or two of c̄'. If even the bound says γ = 0, plain decoding is chosen
  with confidence.

(e) The fixed cost of speculating. E(γ) is unimodal when T grows linearly in γ (§4.3), but a
real step pays once for speculating at all: the draft's first forward over its pending tokens,
the loop, a wider verify. The engine-measured profile of the built-in pair at B = 1 has
T = 3.3, 6.6, 7.6, 7.6, 8.3, 8.7 ms for γ = 0..5: going from γ = 0 to 1 costs 3.3 ms, each
further token under 1 ms. E(1) < E(0) there although E(5) is 1.8× E(0), so the walk from γ = 0
stopped at once, and the threshold's τ = (T(γ*) − T(0))/γ* charged that fixed cost to every
token. So the walk starts at γ = 1, its peak is compared with γ = 0, and τ is the marginal cost
(T(γ*) − T(1))/((γ* − 1)·n): once drafting has begun the fixed cost is spent, and the stop rule
only weighs one more token (for linear costs this is the same τ as the paper's).

(f) Prefill-bound steps. The efficiency model counts the decoding rows' tokens; when prompts wait
for the token budget (``BatchView.prefill_bound``) the engine's throughput is the pace of its
steps instead, and the plan is γ = 0 (as DSD's, policies/dsd.py).

Options: ``profile`` (path or StepProfile; default: the one the engine measures at start-up,
jspec/autoprofile.py), ``tpot_slo`` (seconds, None = no SLO),
``confidence_prior`` (c̄ before anything was observed, 0.6), ``verifier`` (False: no select()
and no host sync, the paper's AdaSpec− ablation; True: Alg. 2 as published, (b)), ``calibrate``,
``probe_tokens``, ``confidence_z`` ((d)), ``stop_price`` ((a)), ``measured`` (True: once the
run's own steps tell the target's cost per token from its fixed cost, its linear time model
replaces the profile's, policies/measured_time.py; False: the profile throughout, as the paper's
offline fit).
"""

from __future__ import annotations

import heapq
from typing import Any

import numpy as np

from jspec.policies.base import (BatchView, DraftPlan, DraftStats, Policy, StepOutcome, judged_rows,
                           option_bool, option_number)
from jspec.policies.measured_time import MeasuredTime
from jspec.policies.profile import StepProfile, load_profile

STOP_PRICES = ("draft", "paper")  # the ``stop_price`` option's values
_KAPPA_PSEUDO = 4.0  # judged tokens of evidence the calibration prior κ = 1 is worth


def cumulative_confidence(confidence: np.ndarray, num_drafted: np.ndarray) -> np.ndarray:
    """c_{i,j} = Π_{t≤j} q_i(x_t) as [n, G] (column j−1 holds c_{i,j}); 0 past num_drafted_i.

    Confidences are clipped to [0, 1] (they are probabilities; float noise must not make a
    product grow along a request), and positions past what was drafted are ignored.
    """
    conf = np.clip(np.nan_to_num(np.asarray(confidence, np.float64), nan=0.0), 0.0, 1.0)
    drafted = np.asarray(num_drafted, np.int64).reshape(-1, 1)
    conf = np.where(np.arange(conf.shape[1])[None, :] < drafted, conf, 0.0)
    return np.cumprod(conf, axis=1)


class AdaSpecPolicy(Policy):
    """AdaSpec (the AdaSpec paper, §4–5): see the module docstring for the derivations."""

    name = "adaspec"
    signals = frozenset({"confidence"})
    draft_stops = True
    needs_profile = True

    def __init__(self, max_gamma: int = 4, profile: "str | StepProfile | None" = None,
                 tpot_slo: float | None = None, confidence_prior: float = 0.6,
                 verifier: bool = False, calibrate: bool = True, probe_tokens: int = 16,
                 confidence_z: float = 2.0, measured: bool = True, stop_price: str = "draft"):
        super().__init__(max_gamma)
        self.profile = load_profile(self.name, profile)
        self.measured = option_bool(self.name, "measured", measured)
        self._time = MeasuredTime()  # the run's own linear time model (``measured``)
        if tpot_slo is not None:
            if isinstance(tpot_slo, bool) or not isinstance(tpot_slo, (int, float)) \
                    or not tpot_slo > 0:
                raise ValueError(f"tpot_slo must be a number of seconds > 0 (or None), "
                                 f"got {tpot_slo!r}")
            tpot_slo = float(tpot_slo)
        self.tpot_slo = tpot_slo
        if isinstance(confidence_prior, bool) or not isinstance(confidence_prior, (int, float)) \
                or not 0.0 < confidence_prior <= 1.0:
            raise ValueError(f"confidence_prior must be in (0, 1], got {confidence_prior!r}")
        self.confidence_prior = float(confidence_prior)
        if not isinstance(verifier, bool):
            raise ValueError(f"verifier must be true or false, got {verifier!r}")
        self.verifier = verifier
        if stop_price not in STOP_PRICES:
            raise ValueError(f"stop_price must be one of {', '.join(STOP_PRICES)}, "
                             f"got {stop_price!r}")
        self.stop_price = stop_price
        self.calibrate = option_bool(self.name, "calibrate", calibrate)
        if isinstance(probe_tokens, bool) or not isinstance(probe_tokens, int) or probe_tokens < 0:
            raise ValueError(f"probe_tokens must be an integer >= 0, got {probe_tokens!r}")
        self.probe_tokens = probe_tokens
        self.confidence_z = option_number(self.name, "confidence_z", confidence_z)
        self._probing = False  # this step's plan is a probe: verify everything drafted
        # running mean of per-token draft confidence, and counters (state_dict)
        self.conf_sum = 0.0
        self.conf_count = 0
        self.num_steps = 0
        self.num_planned = 0  # draft tokens planned (γ_i summed)
        self.num_removed = 0  # draft tokens the verifier removed
        # judged draft tokens (accepted + the first rejection of each sequence): accepted ones
        # and their summed confidence, for the calibration κ
        self.judged_accepted = 0.0
        self.judged_confidence = 0.0

    # ------------------------------------------------------------------ the model
    @property
    def mean_confidence(self) -> float:
        """c̄: the running mean of observed per-token confidence (the prior until one is seen)."""
        return self.conf_sum / self.conf_count if self.conf_count else self.confidence_prior

    @property
    def calibration(self) -> float:
        """κ = judged accepted tokens / their summed confidence, with 4 tokens of κ = 1 as a
        prior (1 with ``calibrate=false``): how much likelier a draft token is accepted than
        its confidence says (module docstring, (d))."""
        if not self.calibrate:
            return 1.0
        return (self.judged_accepted + _KAPPA_PSEUDO) / (self.judged_confidence + _KAPPA_PSEUDO)

    def calibrated(self, confidence: np.ndarray) -> np.ndarray:
        """Per-token acceptance estimates min(1, κ·q) from draft confidences q."""
        return np.minimum(np.asarray(confidence, np.float64) * self.calibration, 1.0)

    @property
    def predicted_confidence(self) -> float:
        """c̄ as the predict step uses it: c̄' = min(1, κ·c̄) plus ``confidence_z`` standard
        errors of a rate seen over ``conf_count`` tokens, at most 1 (module docstring, (d))."""
        c = min(self.mean_confidence * self.calibration, 1.0)
        if self.confidence_z > 0:
            c += self.confidence_z * float(np.sqrt(c * (1.0 - c) / max(self.conf_count, 1)))
        return min(c, 1.0)

    @staticmethod
    def _load(view: BatchView) -> tuple[float, float]:
        """(B, L): rows in the step and mean context of the decoding sequences."""
        batch = max(view.batch_size, view.num_decode, 1)
        ctx = float(np.mean(view.context_lens)) if view.num_decode else 1.0
        return float(batch), ctx

    def step_time(self, view: BatchView, verify_tokens: float, draft_steps: int) -> float:
        """T = draft_steps·draft_step(B, L) + target_step(B, 1 + verify_tokens/B, L) (§4.1)."""
        return float(self.target_costs(view, 0, verify_tokens)[0]
                     + self.draft_time(view, draft_steps))

    def draft_time(self, view: BatchView, draft_steps: int) -> float:
        """draft_steps forwards of the draft, one token per row each: the run's measured
        forward (``measured``), else the profile's."""
        if draft_steps <= 0:
            return 0.0
        forward = self._time.draft_forward() if self.measured else None
        if forward is None:
            forward = self.step_profile.draft_step(*self._load(view))
        return draft_steps * forward

    def target_costs(self, view: BatchView, max_tokens: int, first: float = 0.0) -> np.ndarray:
        """target_step(B, 1 + K/B, L) for K = first..first + max_tokens verify tokens, in one
        numpy pass: select() runs between the draft and the verify forward, so its time adds to
        every step, and one scalar lookup per removed token would cost ~10 µs each. With
        ``measured`` (once the run's steps tell a from b) the run's own linear model of the
        target over the decode rows' width, n + K (policies/measured_time.py: a profile taken
        in other conditions than the run's is not trusted over the run's measurements)."""
        tokens = first + np.arange(max_tokens + 1)
        measured = self._time.target(view.num_decode + tokens) if self.measured else None
        if measured is not None:
            return measured
        batch, ctx = self._load(view)
        return self.step_profile.target_steps(batch, 1.0 + tokens / batch, ctx)

    def _efficiency(self, accepted: float, time: float, speculating: bool) -> float:
        """N/T, or −1 when a speculating step would break the TPOT SLO (§5.3)."""
        if speculating and self.tpot_slo is not None and time > self.tpot_slo:
            return -1.0
        return accepted / time

    def predicted_efficiency(self, view: BatchView, gamma: int) -> float:
        """E(γ) with every sequence drafting γ and c_{i,j} predicted as c̄^j."""
        n = view.num_decode
        accepted = n * float(np.sum(self.predicted_confidence ** np.arange(gamma + 1)))
        # verified as wide as the compiled bucket γ runs in (Policy.padded_gamma)
        verify = n * int(self.padded_gamma(gamma))
        return self._efficiency(accepted, self.step_time(view, verify, gamma), gamma > 0)

    def plan_gamma(self, view: BatchView) -> tuple[int, float]:
        """(γ*, E*): walk γ up from 1 while the predicted efficiency rises (first local maximum
        of the speculative steps), then keep γ = 0 if plain decoding is better still (module
        docstring, (e)). A γ that runs in a larger compiled bucket verifies as wide as the
        bucket for fewer tokens, a dip the walk steps over rather than stopping at."""
        best_gamma, best = 0, self.predicted_efficiency(view, 0)
        if self.max_gamma == 0:
            return best_gamma, best
        peak_gamma, peak = 1, self.predicted_efficiency(view, 1)
        for gamma in range(2, self.max_gamma + 1):
            e = self.predicted_efficiency(view, gamma)
            if e <= peak:
                if self.padded_gamma(gamma) > gamma:
                    continue
                break
            peak_gamma, peak = gamma, e
        return (peak_gamma, peak) if peak > best else (best_gamma, best)

    def stop_threshold(self, view: BatchView, gamma: int, best: float) -> float:
        """stop_confidence = τ·E*/(c̄'·max(κ, κ^(γ*−1))), τ the price of a token
        (``stop_price``: the draft's forwards, or the paper's (T(γ*) − T(1))/((γ*−1)·n)),
        c̄' the predicted confidence and κ the calibration (module docstring, (a), (d), (e));
        0 (no stop) for γ* = 1, where the only drafted token is never stopped."""
        n = view.num_decode
        if gamma <= 1 or n == 0:
            return 0.0
        if self.stop_price == "paper":
            tau = ((self.step_time(view, n * gamma, gamma) - self.step_time(view, n, 1))
                   / ((gamma - 1) * n))
        else:  # the draft forwards alone, shared by the n rows ((a), last paragraph)
            tau = (self.draft_time(view, gamma) - self.draft_time(view, 1)) / ((gamma - 1) * n)
        kappa = self.calibration
        return max(tau, 0.0) * best / (self.predicted_confidence
                                       * max(kappa, kappa ** (gamma - 1)))

    # ------------------------------------------------------------------ the protocol
    def plan(self, view: BatchView) -> DraftPlan:
        n = view.num_decode
        if not view.draft_resident or n == 0 or self.max_gamma == 0 or view.prefill_bound:
            return DraftPlan(gammas=np.zeros(n, np.int32))
        gamma, best = self.plan_gamma(view)
        threshold = self.stop_threshold(view, gamma, best)
        # probe (module docstring, (d)): until probe_tokens confidences were seen, draft at least
        # one token and verify all of it, so a prior that says "never" can be corrected
        self._probing = self.conf_count < self.probe_tokens
        if self._probing:
            gamma, threshold = max(gamma, 1), 0.0
        self.num_planned += gamma * n
        return DraftPlan(gammas=np.full(n, gamma, np.int32),
                         stop_confidence=np.full(n, threshold, np.float32))

    def eliminate(self, view: BatchView, stats: DraftStats) -> tuple[np.ndarray, list]:
        """The confidence-prior verifier (§5.2, Alg. 2). Returns (verify lengths, removed tokens
        in removal order as (request index, 1-based position))."""
        drafted = np.asarray(stats.num_drafted, np.int64)
        c = cumulative_confidence(self.calibrated(np.nan_to_num(stats.confidence, nan=0.0)),
                                  drafted)
        lengths = drafted.copy()
        draft_steps = int(drafted.max(initial=0))  # spent already; stays in T
        accepted = len(drafted) + float(c.sum())
        total = int(drafted.sum())
        # T(K) for K verify tokens kept: the spent draft forwards plus the target's forward
        times = self.draft_time(view, draft_steps) + self.target_costs(view, total)
        current = self._efficiency(accepted, times[total], total > 0)
        # each request's last kept token; (c, request) so ties go to the lower index
        tails = [(c[i, k - 1], i) for i, k in enumerate(drafted) if k > 0]
        heapq.heapify(tails)
        removed = []
        while tails:  # nothing left: stop
            value, i = tails[0]
            e = self._efficiency(accepted - value, times[total - 1], total > 1)
            if e <= current and current != -1.0:  # under a broken SLO, keep removing
                break
            heapq.heappop(tails)
            removed.append((i, int(lengths[i])))
            lengths[i] -= 1
            accepted, total, current = accepted - value, total - 1, e
            if lengths[i] > 0:  # the request's new tail: its last KEPT token
                heapq.heappush(tails, (c[i, lengths[i] - 1], i))
        return lengths, removed

    def select(self, view: BatchView, stats: DraftStats) -> np.ndarray | None:
        if self._probing:
            return None  # a probe verifies everything it drafted
        lengths, removed = self.eliminate(view, stats)
        self.num_removed += len(removed)
        return lengths

    @property
    def wants_select(self) -> bool:
        return self.verifier

    def observe(self, outcome: StepOutcome) -> None:
        self._time.observe(outcome)
        conf = np.asarray(outcome.confidence, np.float64)
        seen = conf[~np.isnan(conf)]
        self.conf_sum += float(seen.sum())
        self.conf_count += int(seen.size)
        self.num_steps += 1
        # judged positions (jspec.policies.base.judged_rows) of the rows whose confidences were all
        # recorded
        accepted, judged = judged_rows(outcome)
        mask = np.arange(conf.shape[1])[None, :] < judged[:, None]
        rows = (judged > 0) & ~np.any(mask & np.isnan(conf), axis=1)
        if rows.any():
            self.judged_accepted += float(accepted[rows].sum())
            self.judged_confidence += float(np.where(mask[rows], conf[rows], 0.0).sum())

    # ------------------------------------------------------------------ state
    _STATE_KEYS = ("conf_sum", "conf_count", "num_steps", "num_planned", "num_removed",
                   "judged_accepted", "judged_confidence")
    _NEWER_KEYS = {"judged_accepted", "judged_confidence"}  # states saved before lack them

    def state_dict(self) -> dict[str, Any]:
        state = {k: getattr(self, k) for k in self._STATE_KEYS}
        state["mean_confidence"] = self.mean_confidence  # for reading; derived, not loaded
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        unknown = set(state) - set(self._STATE_KEYS) - {"mean_confidence"}
        missing = set(self._STATE_KEYS) - set(state) - self._NEWER_KEYS
        if unknown or missing:
            raise ValueError(f"adaspec state: unknown keys {sorted(unknown)}, "
                             f"missing keys {sorted(missing)}")
        self.conf_sum = float(state["conf_sum"])
        for k in self._NEWER_KEYS:
            setattr(self, k, float(state.get(k, 0.0)))
        for k in ("conf_count", "num_steps", "num_planned", "num_removed"):
            setattr(self, k, int(state[k]))
