"""SpecRouter: choose the chain of draft models per step by the predicted time per target token
(the SpecRouter paper, §4.2: the ModelChainScheduler and its Algorithm 1).

The engine holds a pool of draft models, smallest first (``Policy.pool``). A chain is what one
step runs for the whole batch (``DraftPlan.chain``):

* ``()``: the target alone (plain decoding);
* ``(i,)``: model i drafts W tokens, the target verifies them;
* ``(i, j)``, i < j: model i drafts W tokens, model j verifies them with the lossless rejection
  rule, and j's draft (the tokens it accepted plus its correction token, at most W) is verified
  by the target.

What the paper specifies, and what is kept as written:

* T_i, the per-token time of model i, is an EMA with weight α_time of the measured time:
  T_new = α_time·T_measured + (1 − α_time)·T_old (``time_ema``, default 0.3).
* SimScore(M_i, M_j) = 1 − EMA(D_TV(p_i, p_j)) (Eq. 6), the EMA of 1 − TV, which is exactly the
  per-position acceptance probability of the rejection rule, Σ_v min(p, q): the engine reports it
  as ``StepOutcome.accept_prob`` (the last draft level against the target) and
  ``intermediate_accept_prob`` (model i against the intermediate model j). Weight ``sim_ema``
  (default 0.1); one sample per step, the mean over the step's finite positions. A step without
  a finite value leaves the score as it was.
* α_ij = f(SimScore(M_i, M_j)) with f the identity by default (the paper's f is a calibrated
  mapping such as a sigmoid; the identity needs no calibration data).
* T_eff(C) = expected time per cycle / expected target tokens per cycle (Eq. 7), with the
  expected number of a level's accepted tokens from a draft of W at acceptance α being
  Σ_{k=1..W} α^k; Algorithm 1 plays the chain of minimum T_eff, the target alone included.

Choices the paper leaves open, and how they are resolved here:

* Per-token time: per forward call of the whole batch, at the batch bucket
  (``batch_bucket(outcome.batch_size)``): T_draft[i][B] = draft_time / γ (the draft loop runs γ
  = W forwards), so a model's time, which grows with the load, is learned per bucket. The
  similarities belong to the model pairs and the text, not to the load, and are global.
* Verification passes are timed per pass, not per token: T_inter[j][B] = the intermediate
  model's verification pass (``intermediate_time``), T_verify[B] = the rest of a drafting step's
  decode time (``decode_time`` less the draft loop, the intermediate pass and the catch-up,
  floored at 0: the target's verification pass of W + 1 tokens per row plus the engine's own
  work), learned on every drafting step whatever its chain. T_plain[B] = ``decode_time`` of a
  target-only step. Every time excludes the prefill chunks' share (``decode_time``).
* Reaching a level: the paper weights the verification cost of level j by "the probability that
  verification reaches level j" (a scheme that stops the chain once a level rejects everything).
  This engine always runs every level of the chain over the whole batch (one executable per
  chain, rows whose draft was rejected verify padding), so every level is paid every cycle:
      cost(())     = T_plain
      cost((i,))   = W·T_draft[i] + T_verify
      cost((i, j)) = W·T_draft[i] + T_inter[j] + T_verify
  and the expected target tokens per cycle (geometric acceptance, ``chain_tokens``) are
      tokens(())     = 1
      tokens((i,))   = Σ_{k=0..W} α_{i,t}^k
      tokens((i, j)) = 1 + Σ_{k=1..W} α_{j,t}^k · α_{i,j}^{k−1}
  (the second: j accepts a of i's W tokens with P(a ≥ k) = α_{i,j}^k, its draft has
  L = min(a + 1, W) tokens, so P(L ≥ k) = P(a ≥ k − 1) = α_{i,j}^{k−1} for k ≤ W; the target
  accepts the first k of them with probability α_{j,t}^k given L ≥ k, because j's tokens, its
  correction included, are exact samples of j; plus the target's own bonus/correction token).
* Switching chains: a model that did not draft in the last steps must catch up on the tokens it
  missed (``catch_up_time``). That cost is not priced into T_eff (it is taken out of T_verify
  too): it is paid once per switch, not per cycle, and the choice is re-made every step.
* Exploration: a chain whose estimates are missing at this bucket (times) or globally
  (similarities) is unexplored; unexplored chains are played first, in a fixed order ((), the
  single drafts smallest first, then the pairs (i, j) in lexicographic order), so every chain is
  measured once per bucket. A chain tried ``_MAX_TRIES`` times at a bucket whose estimates still
  miss (an engine that reports no signal for it) is no longer unexplored there and scores ∞.
  Then ε-greedy: with probability ``explore`` (default 0.02; a numpy Generator seeded by
  ``seed``) a uniformly drawn chain of ``possible_chains``, else the argmin of T_eff (ties go to
  the earlier chain of the fixed order). Algorithm 1 is pure exploitation, but the estimates of a
  chain not played go stale (times move with the load and the text, the similarities with the
  text), so a small share of steps re-measures them.
* Calibrated f (``calibrate``, default off): 1 − TV is exactly the mean per-position acceptance
  probability, but the geometric model wants the α whose powers give the expected accepted
  prefix, and acceptance varies between positions (a mean of products is not a product of
  means), so the identity misjudges a pair's accepted tokens. With ``calibrate`` the policy keeps,
  per pair, token-weighted sums decayed by ``_CALIBRATION_DECAY`` (0.99) per step that updated
  them: A = accepted draft tokens, J = judged tokens (the accepted prefix plus the first
  rejection, ``jspec.policies.base.judged_rows``; for the target level num_accepted against
  num_verified, for the intermediate level intermediate_accepted against num_drafted), and
  P = Σ step SimScore sample × judged tokens (the accepted tokens the identity f predicts). A/J is
  the measured acceptance rate (its expectation is exactly α under the geometric model), P/J the
  SimScore over the same tokens, and
      α = clip(SimScore · (A + K) / (P + K), 0, 1)
  with K = ``_CALIBRATION_PSEUDO`` (8) pseudo-tokens at ratio 1, so f starts as the identity and
  follows the measured/similarity ratio as evidence accumulates. The ratio is kept slow on
  purpose: with the same weight as the SimScore, α would collapse to the measured rate and the
  similarity would play no part; this way the similarity tracks the text step by step and the
  ratio corrects its bias. The statistics are kept whether or not ``calibrate`` is on.
* The window W: the paper configures it globally but names the effective window among the
  parameters SpecRouter adapts (§3.3). With ``window`` unset the policy plays the (chain, W) of
  least T_eff, W among the engine's drafting buckets (powers of two below Γmax, and Γmax), so
  after a load step that makes verification dear it drafts 1 or 2 tokens rather than choosing
  only between Γmax and none. The verification and intermediate passes are timed per window
  (T_verify[B][W], T_inter[j][B][W]); a window not yet measured at a bucket is priced piecewise
  linearly in the tokens a row verifies (W + 1) through the measured windows and the plain step
  (T_verify), or scaled from the nearest measured window (T_inter); unexplored chains are
  played first at the largest window. The exploration draws over (chain, W).
* Chain length: at most two draft levels (``max_levels``, default 2; 1 allows single drafts
  only). Longer chains are not run by this engine.
* Draft not resident (offloaded) or W = 0 (``max_gamma`` 0): the target alone is planned.
  Learning uses the chain the engine reports it ran (``outcome.chain``), not the plan.

Options: ``window`` (W fixed, an integer in [1, max_gamma]; unset: chosen per step), ``time_ema``,
``sim_ema`` (in (0, 1]), ``calibrate`` (bool), ``explore`` (in [0, 1]), ``seed`` (integer ≥ 0),
``max_levels`` (1 or 2).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from jspec.policies.base import (BatchView, DraftPlan, Policy, StepOutcome, batch_bucket,
                                 drafting_buckets, judged_rows, option_bool, option_int,
                                 option_number)
from jspec.policies.profile import interpolate

TARGET = "target"  # the verifier of a chain's last draft level, in similarity keys
_MAX_TRIES = 3  # plays of an unexplored chain per bucket before it stops being played first
_CALIBRATION_DECAY = 0.99  # per update: the calibration sums remember about 100 steps
_CALIBRATION_PSEUDO = 8.0  # pseudo-tokens at measured/similarity ratio 1 (the identity f)


def chain_tokens(window: int, alpha_target: float, alpha_inter: float | None = None) -> float:
    """Expected target tokens per cycle of a drafting chain with window W (module docstring):
    Σ_{k=0..W} α_t^k for a single draft (``alpha_inter`` None), 1 + Σ_{k=1..W} α_t^k·α_i^(k−1)
    for a two-level chain, α_t the last draft level's acceptance by the target and α_i the
    first model's acceptance by the intermediate one."""
    a_i = 1.0 if alpha_inter is None else float(alpha_inter)
    a_t = float(alpha_target)
    return 1.0 + sum(a_t ** k * a_i ** (k - 1) for k in range(1, int(window) + 1))


def chain_effective_time(window: int, draft_time: float, verify_time: float,
                         alpha_target: float, inter_time: float = 0.0,
                         alpha_inter: float | None = None) -> float:
    """T_eff of a drafting chain, seconds per target token: (W·draft_time + inter_time +
    verify_time) / ``chain_tokens``. ``draft_time`` is the first model's per-forward time, the
    others per pass; a single draft has no intermediate level (inter_time 0, alpha_inter None).
    The target alone has T_eff = its plain step time (one token per cycle)."""
    cost = int(window) * float(draft_time) + float(inter_time) + float(verify_time)
    return cost / chain_tokens(window, alpha_target, alpha_inter)


def chain_key(chain: tuple[int, ...]) -> str:
    """A chain as a string: '0>target', '0>1>target', 'target' for the target alone."""
    return ">".join([*(str(i) for i in chain), TARGET])


def pair_key(draft: int, verifier: int | str) -> str:
    """A (draft, verifier) pair of the similarity tables: '0>1', '1>target'."""
    return f"{int(draft)}>{verifier}"


def _ema(old: float | None, new: float, weight: float) -> float:
    return float(new) if old is None else (1.0 - weight) * old + weight * float(new)


def _finite_mean(values: np.ndarray | None) -> float | None:
    if values is None:
        return None
    a = np.asarray(values, np.float64)
    a = a[np.isfinite(a)]
    return float(a.mean()) if a.size else None


class SpecRouterPolicy(Policy):
    """Per step, the chain of pool models with the least predicted time per target token (see
    the module docstring)."""

    name = "specrouter"
    signals = frozenset({"accept_prob"})
    wants_pool = True
    timed_stages = True  # T_i are learned from the draft / intermediate / verify stage times

    def __init__(self, max_gamma: int = 4, window: int | None = None, time_ema: float = 0.3,
                 sim_ema: float = 0.1, calibrate: bool = False, explore: float = 0.02,
                 seed: int = 0, max_levels: int = 2):
        super().__init__(max_gamma)
        if max_gamma == 0:
            if window not in (None, 0):
                raise ValueError(f"{self.name} option window must be 0 (or unset) with "
                                 f"max_gamma 0, got {window!r}")
            self.window: int | None = 0
            self.windows: tuple[int, ...] = ()
        elif window is None:
            self.window = None  # adaptive: W is chosen with the chain
            self.windows = drafting_buckets(max_gamma)
        else:
            self.window = option_int(self.name, "window", window, 1, max_gamma)
            self.windows = (self.window,)
        self.time_ema = option_number(self.name, "time_ema", time_ema, 0.0, 1.0, low_open=True)
        self.sim_ema = option_number(self.name, "sim_ema", sim_ema, 0.0, 1.0, low_open=True)
        self.calibrate = option_bool(self.name, "calibrate", calibrate)
        self.explore = option_number(self.name, "explore", explore, 0.0, 1.0)
        self.seed = option_int(self.name, "seed", seed, 0)
        self.max_levels = option_int(self.name, "max_levels", max_levels, 1, 2)
        self._rng = np.random.default_rng(seed)
        self._reset()

    def _reset(self) -> None:
        """Forget everything learned (a new pool invalidates the per-model tables)."""
        self.draft_time: dict[int, dict[int, float]] = {}  # T_draft[i][B], s per forward
        # T_inter[j][B][W] and T_verify[B][W], s per pass of a window W
        self.inter_time: dict[int, dict[int, dict[int, float]]] = {}
        self.verify_time: dict[int, dict[int, float]] = {}
        self.plain_time: dict[int, float] = {}  # T_plain[B], s per target-only step
        self.similarity: dict[str, float] = {}  # SimScore by pair_key
        # by pair_key: decayed accepted, judged and identity-predicted tokens (calibration)
        self.calibration: dict[str, dict[str, float]] = {}
        self.plays: dict[int, dict[str, int]] = {}  # per bucket, steps observed per chain_key
        self.last_chain: dict[int, tuple[int, ...]] = {}  # per bucket, the last chain planned

    def set_pool(self, names: tuple[str, ...]) -> None:
        names = tuple(names)
        if names != self.pool:
            self._reset()
        super().set_pool(names)

    # ------------------------------------------------------------------ chains
    def possible_gammas(self) -> set[int]:
        return {0, *self.windows}

    def chains(self) -> list[tuple[int, ...]]:
        """Every chain this policy may plan, in the fixed order: (), (0,), (1,), ..., then the
        pairs (i, j), i < j, lexicographically (pairs only with max_levels 2 and ≥ 2 models)."""
        if not self.windows:
            return [()]
        n = len(self.pool)
        out: list[tuple[int, ...]] = [()] + [(i,) for i in range(n)]
        if self.max_levels >= 2:
            out += [(i, j) for i in range(n) for j in range(i + 1, n)]
        return out

    def possible_chains(self) -> set[tuple[int, ...]]:
        return set(self.chains())

    # ------------------------------------------------------------------ estimates
    def acceptance(self, draft: int, verifier: int | str) -> float | None:
        """α of ``verifier`` (a pool index or TARGET) verifying ``draft``'s tokens: the SimScore
        (identity f), or with ``calibrate`` the SimScore times the measured/similarity ratio
        (module docstring); None before the pair has been measured."""
        key = pair_key(draft, verifier)
        sim = self.similarity.get(key)
        if sim is None:
            return None
        if not self.calibrate:
            return sim
        cal = self.calibration.get(key, {"accepted": 0.0, "predicted": 0.0})
        ratio = (cal["accepted"] + _CALIBRATION_PSEUDO) / (cal["predicted"] + _CALIBRATION_PSEUDO)
        return min(max(sim * ratio, 0.0), 1.0)

    def verify_estimate(self, bucket: int, window: int) -> float | None:
        """T_verify[B][W]: measured, else piecewise linear in the tokens a row verifies (W + 1)
        through the windows measured at this bucket and the plain step (one token per row);
        None before any window was measured there."""
        measured = self.verify_time.get(bucket, {})
        if window in measured:
            return measured[window]
        if not measured:
            return None
        points = {w + 1: t for w, t in measured.items()}
        if bucket in self.plain_time:
            points.setdefault(1, self.plain_time[bucket])
        xs = sorted(points)
        return interpolate([np.array(xs)], np.array([points[x] for x in xs]), [window + 1])

    def inter_estimate(self, model: int, bucket: int, window: int) -> float | None:
        """T_inter[j][B][W]: measured, else scaled from the nearest measured window by the
        tokens per row it verifies (W + 1); None before any was measured."""
        measured = self.inter_time.get(model, {}).get(bucket, {})
        if window in measured:
            return measured[window]
        if not measured:
            return None
        near = min(measured, key=lambda w: (abs(w - window), w))
        return measured[near] * (window + 1) / (near + 1)

    def effective_time(self, chain: tuple[int, ...], bucket: int,
                       window: int | None = None) -> float:
        """Predicted seconds per target token of ``chain`` with window W (default the largest
        this policy plays) at batch bucket ``bucket`` (module docstring); ∞ when an estimate
        it needs is missing."""
        chain = tuple(chain)
        if not chain:
            t = self.plain_time.get(bucket)
            return math.inf if t is None else t
        window = self.windows[-1] if window is None else int(window)
        first, last = chain[0], chain[-1]
        draft = self.draft_time.get(first, {}).get(bucket)
        verify = self.verify_estimate(bucket, window)
        alpha_t = self.acceptance(last, TARGET)
        inter, alpha_i = 0.0, None
        if len(chain) == 2:
            inter = self.inter_estimate(last, bucket, window)
            alpha_i = self.acceptance(first, last)
            if inter is None or alpha_i is None:
                return math.inf
        if draft is None or verify is None or alpha_t is None:
            return math.inf
        return chain_effective_time(window, draft, verify, alpha_t, inter, alpha_i)

    def chain_scores(self, batch_size: int) -> dict[tuple[int, ...], float]:
        """T_eff of every possible chain at this batch size's bucket, at its best window, in the
        fixed order."""
        bucket = batch_bucket(batch_size)
        return {c: min((self.effective_time(c, bucket, w) for w in self.windows or (0,)))
                for c in self.chains()}

    def _unexplored(self, chain: tuple[int, ...], bucket: int) -> bool:
        return (math.isinf(self.effective_time(chain, bucket))
                and self.plays.get(bucket, {}).get(chain_key(chain), 0) < _MAX_TRIES)

    # ------------------------------------------------------------------ decisions
    def choose(self, batch_size: int) -> tuple[tuple[int, ...], int]:
        """The chain and window for a step of this batch size: the first unexplored chain at
        the largest window, else with probability ``explore`` a uniformly drawn chain and
        window, else the argmin of T_eff over both (window 0 for the target alone)."""
        bucket = batch_bucket(batch_size)
        chains = self.chains()
        if len(chains) == 1:
            return chains[0], 0
        largest = self.windows[-1]
        for chain in chains:
            if self._unexplored(chain, bucket):
                return chain, (largest if chain else 0)
        options = [((), 0)] + [(c, w) for c in chains if c for w in self.windows]
        if self.explore > 0 and self._rng.random() < self.explore:
            return options[int(self._rng.integers(len(options)))]
        scores = [self.effective_time(c, bucket, w) for c, w in options]
        return options[int(np.argmin(scores))]  # first minimum: the earlier chain, shorter W

    def plan(self, view: BatchView) -> DraftPlan:
        n = view.num_decode
        if n == 0:
            return DraftPlan(gammas=np.zeros(0, np.int32), chain=())
        if not view.draft_resident or not self.windows:
            chain, window = (), 0
        else:
            chain, window = self.choose(view.batch_size)
        self.last_chain[batch_bucket(view.batch_size)] = chain
        return DraftPlan(gammas=np.full(n, window, np.int32), chain=chain)

    # ------------------------------------------------------------------ learning
    def _update_similarity(self, key: str, values: np.ndarray | None, accepted: np.ndarray,
                           judged: np.ndarray) -> None:
        sim = _finite_mean(values)
        if sim is None:
            return
        self.similarity[key] = _ema(self.similarity.get(key), sim, self.sim_ema)
        tokens = int(np.sum(judged))
        if tokens > 0:
            cal = self.calibration.setdefault(key, {"accepted": 0.0, "judged": 0.0,
                                                    "predicted": 0.0})
            d = _CALIBRATION_DECAY
            cal["accepted"] = d * cal["accepted"] + int(np.sum(accepted))
            cal["judged"] = d * cal["judged"] + tokens
            cal["predicted"] = d * cal["predicted"] + sim * tokens

    def observe(self, outcome: StepOutcome) -> None:
        if outcome.num_decode == 0:
            return
        chain = tuple(int(i) for i in outcome.chain)
        if len(chain) > 2 or any(not 0 <= i < len(self.pool) for i in chain):
            return  # not a chain of this pool that this policy could plan: nothing to learn
        bucket = batch_bucket(outcome.batch_size)
        gamma = int(np.max(outcome.gammas)) if len(outcome.gammas) else 0
        decode = float(outcome.decode_time)
        if not chain:
            self.plain_time[bucket] = _ema(self.plain_time.get(bucket), decode, self.time_ema)
        elif gamma <= 0:
            return  # a chain that drafted nothing: neither a plain nor a drafting step
        else:
            first, last = chain[0], chain[-1]
            table = self.draft_time.setdefault(first, {})
            table[bucket] = _ema(table.get(bucket), outcome.draft_time / gamma, self.time_ema)
            inter = float(outcome.intermediate_time) if len(chain) == 2 else 0.0
            if len(chain) == 2:
                table = self.inter_time.setdefault(last, {}).setdefault(bucket, {})
                table[gamma] = _ema(table.get(gamma), inter, self.time_ema)
            verify = max(decode - outcome.draft_time - inter - outcome.catch_up_time, 0.0)
            table = self.verify_time.setdefault(bucket, {})
            table[gamma] = _ema(table.get(gamma), verify, self.time_ema)
            accepted, judged = judged_rows(outcome)
            self._update_similarity(pair_key(last, TARGET), outcome.accept_prob, accepted, judged)
            if len(chain) == 2 and outcome.intermediate_accept_prob is not None:
                drafted = np.asarray(outcome.num_drafted, np.int64)
                if outcome.intermediate_accepted is None:
                    inter_acc = inter_judged = np.zeros(0, np.int64)
                else:
                    inter_acc = np.minimum(
                        np.asarray(outcome.intermediate_accepted, np.int64), drafted)
                    inter_judged = np.minimum(inter_acc + 1, drafted)
                self._update_similarity(pair_key(first, last), outcome.intermediate_accept_prob,
                                        inter_acc, inter_judged)
        plays = self.plays.setdefault(bucket, {})
        plays[chain_key(chain)] = plays.get(chain_key(chain), 0) + 1

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        def per_bucket(table: dict[int, float]) -> dict[str, float]:
            return {str(b): float(t) for b, t in sorted(table.items())}

        def per_window(table: dict[int, dict[int, float]]) -> dict[str, dict[str, float]]:
            return {str(b): per_bucket(t) for b, t in sorted(table.items())}

        return {
            "policy": self.name,
            "max_gamma": self.max_gamma,
            "pool": list(self.pool),
            "window": self.window,
            "draft_time": {str(i): per_bucket(t) for i, t in sorted(self.draft_time.items())},
            "inter_time": {str(j): per_window(t) for j, t in sorted(self.inter_time.items())},
            "verify_time": per_window(self.verify_time),
            "plain_time": per_bucket(self.plain_time),
            "similarity": {k: float(v) for k, v in sorted(self.similarity.items())},
            "calibration": {k: {s: float(x) for s, x in sorted(c.items())}
                            for k, c in sorted(self.calibration.items())},
            "plays": {str(b): dict(sorted(p.items())) for b, p in sorted(self.plays.items())},
            "last_chain": {str(b): list(c) for b, c in sorted(self.last_chain.items())},
            "rng": self._rng.bit_generator.state,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.check_state(state)
        pool = state.get("pool")
        if not isinstance(pool, list) or tuple(pool) != self.pool:
            raise ValueError(f"{self.name} state was learned with the draft pool {pool!r}, this "
                             f"engine's pool is {list(self.pool)!r}; its chains do not match")
        if state.get("window") != self.window:
            raise ValueError(f"{self.name} state was learned with window={state.get('window')!r}, "
                             f"this policy has window={self.window}; its times do not match")
        n = len(self.pool)

        def model(key: str) -> int:
            i = int(key)
            if not 0 <= i < n:
                raise ValueError(f"model index {i} outside the pool of {n}")
            return i

        def per_bucket(table: dict[str, Any]) -> dict[int, float]:
            return {int(b): float(t) for b, t in table.items()}

        def per_window(table: dict[str, Any]) -> dict[int, dict[int, float]]:
            return {int(b): per_bucket(t) for b, t in table.items()}

        def pair(key: str) -> str:
            draft, sep, verifier = str(key).partition(">")
            if not sep:
                raise ValueError(f"bad pair {key!r}")
            return pair_key(model(draft), verifier if verifier == TARGET else model(verifier))

        try:
            draft_time = {model(i): per_bucket(t) for i, t in state["draft_time"].items()}
            inter_time = {model(j): per_window(t) for j, t in state["inter_time"].items()}
            verify_time = per_window(state["verify_time"])
            plain_time = per_bucket(state["plain_time"])
            similarity = {pair(k): float(v) for k, v in state["similarity"].items()}
            calibration = {pair(k): {s: float(c[s]) for s in ("accepted", "judged", "predicted")}
                           for k, c in state["calibration"].items()}
            plays = {int(b): {str(k): int(v) for k, v in p.items()}
                     for b, p in state["plays"].items()}
            last_chain = {int(b): tuple(model(str(i)) for i in c)
                          for b, c in state["last_chain"].items()}
            rng = np.random.default_rng()
            rng.bit_generator.state = state["rng"]
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ValueError(f"malformed {self.name} state: {e}") from None
        # only now, so a bad state leaves the policy as it was
        self.draft_time, self.inter_time = draft_time, inter_time
        self.verify_time, self.plain_time = verify_time, plain_time
        self.similarity, self.calibration = similarity, calibration
        self.plays, self.last_chain = plays, last_chain
        self._rng = rng
