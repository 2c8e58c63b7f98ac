"""DSDE: per-sequence speculation length from the stability of KL(p‖q) (the DSDE paper, "DSDE:
Dynamic Speculative Decoding with KLD Stability for Real-World Serving", §III).

After every step the target's verification gives, per verified draft position, the divergence
KL(p‖q) between target and draft distributions. DSDE keeps a short history of these per sequence
and predicts the next speculation length (SL) of each sequence from two numbers:

- SF = exp(2·μ_KLD,last) − 1 (eq. 3): the mean KL of the sequence's last step; large when the
  models disagreed just now.
- WVIR = Var_w(last 10 KLDs) / Var_w(last 30 KLDs) (eqs. 4-7): recent vs. longer-term weighted
  variance; > 1 when the KL signal is becoming less stable.

SL = (1 − SF·WVIR)·(SL_max − SL_min) + SL_min if SF·WVIR ≤ 1, else SL_min (eq. 8). SL_max is
calibrated once from the first few speculative steps (§III-A1, eq. 1), and the batch cap SL_cap =
mean of the predicted SLs (§III-C, eqs. 9-11, the MSE-minimising constant) bounds every sequence,
so a few optimistic sequences do not make the whole batch wait for their long drafts.

Choices the paper leaves open (all documented where they are made):

- Calibration is global (one SL_max for the engine), from the first ``warmup_steps`` steps in
  which at least one sequence verified a drafted token. During warm-up every sequence drafts
  ``warmup_gamma`` (default max_gamma), so SL_A,max can reach the largest γ the engine runs.
- SL_max is clamped to [SL_min, max_gamma]: eq. 1 can give up to 2·SL_A,max, but the engine
  cannot draft more than max_gamma; and a warm-up with nothing accepted (SL_A,max = 0) must not
  push SL_max below the floor eq. 8 guarantees.
- A sequence with no verified KL yet (new, or only ever drafted γ = 0) gets SL_max: it is
  optimistic until evidence arrives, the same treatment every sequence gets in warm-up. It still
  takes part in the batch cap.
- The real-valued min(SL_i, SL_cap) is rounded half up to the integer γ_i (floor(x + 0.5)); the
  result lies in [SL_min, max_gamma] because every SL_i, and hence their mean, lies in
  [SL_min, SL_max].
- Negative KL values (float error; KL ≥ 0) are clipped to 0 when recorded.
- Histories keep the newest ``long_window`` KLs per sequence (older ones are never used) and are
  dropped for request ids no longer in the view, so memory is O(batch · long_window). A request
  that leaves the view (finished, preempted) and comes back starts fresh.
"""

from __future__ import annotations

import collections
import math
from typing import Any, Sequence

import numpy as np

from jspec.policies.base import (BatchView, DraftPlan, Policy, StepOutcome, option_bool,
                                 option_int)
from jspec.policies.goodput_gate import GoodputGate


def weighted_variance(kls: Sequence[float], delta: float) -> float:
    """Var_w of eq. 7 over ``kls`` given oldest first (the newest value is the last one).

    With i = 1 for the newest value, i = N for the oldest, the weights are α_i = δ^(i−1) (eq. 5),
    μ_w = Σ α_i·KLD_i / Σ α_i (eq. 6) and Var_w = Σ α_i·(KLD_i − μ_w)² / Σ α_i (eq. 7): the biased
    (population) weighted variance, normalised by the weight sum. One value or none: 0.
    """
    x = np.asarray(kls, np.float64)
    if x.size < 2:
        return 0.0
    # x[-1] is the newest (i = 1, weight δ^0); x[0] the oldest (i = N, weight δ^(N−1))
    w = delta ** np.arange(x.size - 1, -1, -1, dtype=np.float64)
    mu = float(np.dot(w, x) / w.sum())
    return float(np.dot(w, (x - mu) ** 2) / w.sum())


def wvir(kls: Sequence[float], delta: float = 0.85, short: int = 10, long: int = 30) -> float:
    """WVIR (eq. 4): Var_w of the newest ``short`` KLs over Var_w of the newest ``long`` KLs.

    Fewer values than a window: the window holds what there is (so with ≤ ``short`` values both
    windows are the same and WVIR = 1). Zero long-term variance: all values in the long window are
    equal, so the short one is constant too (0/0); WVIR = 1, "no change in stability", which
    leaves the penalty to SF alone rather than letting a constantly high KL pass unpenalised.
    """
    var_long = weighted_variance(kls[-long:], delta)
    if var_long <= 1e-18:  # 0/0: a constant history, nothing to compare
        return 1.0
    return weighted_variance(kls[-short:], delta) / var_long


def scale_factor(mu_last: float) -> float:
    """SF = exp(2·μ_KLD,last) − 1 (eq. 3): 0 for a perfect draft, grows fast with disagreement."""
    return math.expm1(2.0 * mu_last)


def predict_sl(sf: float, wvir_value: float, sl_max: float, sl_min: float) -> float:
    """Eq. 8: the penalty SF·WVIR scales the range down from SL_max; beyond 1 it is SL_min."""
    penalty = sf * wvir_value
    if penalty > 1.0:
        return float(sl_min)
    return (1.0 - penalty) * (sl_max - sl_min) + sl_min


def calibrate_sl_max(sl_a_max: float, kl_mean: float, kl_max: float, eps: float,
                     sl_min: float, max_gamma: int) -> float:
    """Eq. 1, SL_max = SL_A,max·(1 + μ_KLD,pre/(KLD_pre,max + ε)), clamped to [SL_min, max_gamma]
    (the engine cannot draft past max_gamma; eq. 8 needs SL_max ≥ SL_min).

    SL_A,max: most draft tokens accepted by one sequence in one warm-up step. μ_KLD,pre: mean KL
    over all verified tokens of the warm-up. KLD_pre,max: the largest single such KL.
    """
    raw = sl_a_max * (1.0 + kl_mean / (kl_max + eps))
    return float(min(max(raw, sl_min), max_gamma))


class _Sequence:
    """KL history of one request: newest ``long_window`` values and the last step's mean."""

    __slots__ = ("kls", "last_mean")

    def __init__(self, maxlen: int, kls=(), last_mean: float | None = None):
        self.kls: collections.deque[float] = collections.deque(kls, maxlen=maxlen)
        self.last_mean = last_mean


class DSDEPolicy(Policy):
    """Per-sequence ragged γ_i from KL stability (DSDE §III), capped by the batch mean.

    Options: ``warmup_steps`` (speculative steps used to calibrate SL_max; 0 skips calibration
    and uses SL_max = max_gamma), ``warmup_gamma`` (γ during warm-up, default max_gamma),
    ``sl_min`` (default min(2, max_gamma), the paper's 2; with the gate, the floor it prefers),
    ``delta`` (weight decay δ, 0.85), ``short_window``/``long_window`` (10/30 KLs), ``eps`` (ε of eq. 1, 1e-6), ``batch_cap``
    (apply SL_cap, default True; False is the paper's "No Cap" ablation), ``gate`` (default
    True: the floor of eq. 8, or one length below SL_max for every row, chosen per step by
    predicted goodput, plain decoding included, policies/goodput_gate.py; False: the paper's
    DSDE, which always speculates at least SL_min).
    """

    name = "dsde"
    signals = frozenset({"kl"})

    def __init__(self, max_gamma: int = 4, warmup_steps: int = 5, warmup_gamma: int | None = None,
                 sl_min: int | None = None, delta: float = 0.85, short_window: int = 10,
                 long_window: int = 30, eps: float = 1e-6, batch_cap: bool = True,
                 gate: bool = True):
        super().__init__(max_gamma)
        self.warmup_steps = option_int("dsde", "warmup_steps", warmup_steps, 0)
        self.warmup_gamma = option_int(
            "dsde", "warmup_gamma", max_gamma if warmup_gamma is None else warmup_gamma, 0,
            max_gamma)
        self.sl_min = option_int("dsde", "sl_min",
                                 min(2, max_gamma) if sl_min is None else sl_min, 0, max_gamma)
        if not 0.0 < float(delta) <= 1.0:
            raise ValueError(f"delta must be in (0, 1], got {delta!r}")
        self.delta = float(delta)
        self.short_window = option_int("dsde", "short_window", short_window, 1)
        self.long_window = option_int("dsde", "long_window", long_window, self.short_window)
        if not float(eps) > 0.0:
            raise ValueError(f"eps must be > 0, got {eps!r}")
        self.eps = float(eps)
        if not isinstance(batch_cap, bool):
            raise ValueError(f"batch_cap must be a bool, got {batch_cap!r}")
        self.batch_cap = batch_cap
        self.gate = GoodputGate(max_gamma) if option_bool("dsde", "gate", gate) else None
        self.needs_profile = self.gate is not None  # the gate's time model starts from one

        # calibration (§III-A1): None until warm-up is over
        self.sl_max: float | None = float(max_gamma) if self.warmup_steps == 0 else None
        self._warm = {"steps": 0, "kl_sum": 0.0, "kl_count": 0, "kl_max": 0.0, "accepted_max": 0}
        self._seqs: dict[str, _Sequence] = {}

    # -- planning -------------------------------------------------------------------------------

    def possible_gammas(self) -> set[int]:
        # 0 (draft offloaded), the warm-up γ, and every rounded SL in [floor, max_gamma]: the
        # paper's floor SL_min, or any the gate may choose
        floor = 0 if self.gate is not None else self.sl_min
        return {0, self.warmup_gamma} | set(range(floor, self.max_gamma + 1))

    @property
    def calibrated(self) -> bool:
        return self.sl_max is not None

    def penalty(self, request_id: str) -> float:
        """SF·WVIR of one sequence (eqs. 3-4); 0 with no verified KL yet (optimistic)."""
        seq = self._seqs.get(request_id)
        if seq is None or seq.last_mean is None:
            return 0.0
        w = wvir(list(seq.kls), self.delta, self.short_window, self.long_window)
        return scale_factor(seq.last_mean) * w

    def _gammas(self, penalties: np.ndarray, floor: float, top: float) -> np.ndarray:
        """Eq. 8 over the range [``floor``, ``top``] in place of [SL_min, SL_max], the batch cap,
        rounded half up."""
        sls = np.where(penalties > 1.0, floor, (1.0 - penalties) * (top - floor) + floor)
        # §III-C: the constant minimising the MSE to all predictions is their mean
        cap = float(sls.mean()) if self.batch_cap else math.inf
        gammas = np.floor(np.minimum(sls, cap) + 0.5).astype(np.int32)
        return np.clip(gammas, 0, self.max_gamma)

    def plan(self, view: BatchView) -> DraftPlan:
        # bound memory: sequences that left the batch (finished, aborted, preempted) are dropped
        live = set(view.request_ids)
        for rid in [r for r in self._seqs if r not in live]:
            del self._seqs[rid]

        n = view.num_decode
        if not view.draft_resident or n == 0:
            return DraftPlan(gammas=np.zeros(n, np.int32))
        if self.gate is not None and view.prefill_bound:  # the gate's rule, in warm-up too
            return DraftPlan(gammas=np.zeros(n, np.int32))
        if not self.calibrated:
            return DraftPlan(gammas=np.full(n, self.warmup_gamma, np.int32))
        penalties = np.array([self.penalty(rid) for rid in view.request_ids], np.float64)
        paper = self._gammas(penalties, self.sl_min, self.sl_max)
        if self.gate is None:
            return DraftPlan(gammas=paper)
        # the paper's floor first: another wins only where it is predicted strictly better
        floors = [f for f in range(self.max_gamma + 1) if f != self.sl_min]
        candidates = [paper] + [self._gammas(penalties, f, max(self.sl_max, float(f)))
                                for f in floors]
        # and a top below SL_max, with the floor raised to it: one short length for every row,
        # the plan no range up to SL_max yields (module docstring of policies/goodput_gate.py)
        candidates += [np.full(n, top, np.int32) for top in range(1, self.max_gamma + 1)
                       if top < self.sl_max]
        return self.gate.choose(view, candidates)

    def set_profile(self, profile: Any) -> None:
        super().set_profile(profile)
        if self.gate is not None:
            self.gate.set_profile(profile)

    # -- learning -------------------------------------------------------------------------------

    def observe(self, outcome: StepOutcome) -> None:
        if self.gate is not None:
            self.gate.observe(outcome)
        verified_any = False
        for i, rid in enumerate(outcome.request_ids):
            # verified positions only: the first num_verified, minus any NaN (nothing verified)
            row = np.asarray(outcome.kl[i], np.float64)[:int(outcome.num_verified[i])]
            kls = np.maximum(row[~np.isnan(row)], 0.0)
            if kls.size == 0:
                continue
            verified_any = True
            seq = self._seqs.get(rid)
            if seq is None:
                seq = self._seqs[rid] = _Sequence(self.long_window)
            seq.kls.extend(kls.tolist())
            seq.last_mean = float(kls.mean())
            if not self.calibrated:
                w = self._warm
                w["kl_sum"] += float(kls.sum())
                w["kl_count"] += int(kls.size)
                w["kl_max"] = max(w["kl_max"], float(kls.max()))
                w["accepted_max"] = max(w["accepted_max"], int(outcome.num_accepted[i]))
        # a warm-up step is one where something was verified: steps with γ = 0 carry no signal
        if not self.calibrated and verified_any:
            self._warm["steps"] += 1
            if self._warm["steps"] >= self.warmup_steps:
                w = self._warm
                self.sl_max = calibrate_sl_max(w["accepted_max"], w["kl_sum"] / w["kl_count"],
                                               w["kl_max"], self.eps, self.sl_min, self.max_gamma)

    # -- persistence ----------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {
            "max_gamma": self.max_gamma,
            "sl_max": self.sl_max,
            "warmup": dict(self._warm),
            "sequences": {rid: {"kls": list(s.kls), "last_mean": s.last_mean}
                          for rid, s in self._seqs.items()},
            "gate": None if self.gate is None else self.gate.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.check_state(state)
        sl_max = state["sl_max"]
        self.sl_max = None if sl_max is None else float(sl_max)
        w = state["warmup"]
        self._warm = {"steps": int(w["steps"]), "kl_sum": float(w["kl_sum"]),
                      "kl_count": int(w["kl_count"]), "kl_max": float(w["kl_max"]),
                      "accepted_max": int(w["accepted_max"])}
        self._seqs = {
            rid: _Sequence(self.long_window, (float(k) for k in s["kls"]),
                           None if s["last_mean"] is None else float(s["last_mean"]))
            for rid, s in state["sequences"].items()}
        # a state saved without a gate's (gate=False, or older) leaves this gate's estimate fresh
        if self.gate is not None and state.get("gate"):
            self.gate.load_state_dict(state["gate"])
