"""Nightjar: a contextual bandit over the speculation length γ, with the batch size as context
(the Nightjar paper, "Nightjar: Dynamic Adaptive Speculative Decoding for Large Language Models
Serving", §4.2, Algorithm 1 and Eq. (3)).

Arms are γ ∈ {0..Γmax}; γ = 0 is plain decoding. Every sequence of a step drafts the same γ (the
arm). The paper's reward of a step is its realized goodput, ``StepOutcome.goodput`` = emitted
tokens / step wall time (we take the prefill chunks' cost and the draft's catch-up out of the
time, see "Deviations").

Per context B the policy keeps Algorithm 1's counters (j_B, H_B, b_B, τ_B), all starting at 1,
and per (B, γ) a play count and the estimated goodput g̃_{B,γ}. At the first step of a bin
(τ_B = 1) the bin becomes an exploration bin with probability 1/√b_B, playing one arm drawn
uniformly for the whole bin; otherwise it is an exploitation bin, which solves Eq. (3) at every
one of its steps:

    γ* = argmin_γ 1/g̃_{B,γ} + 1[γ_{t−1} = 0 ∧ γ > 0] · c_prefill(L_max, B) / γ

After each step τ_B += 1; τ_B > √H_B ends the bin (b_B += 1, τ_B = 1); b_B > √H_B ends the block
(j_B += 1, H_B = 2^(j_B−1), b_B = 1). The comparisons are done on integers (τ² > H), which is
exact because H_B is an integer. Eq. (3) as printed mixes units (1/g̃ is seconds per token,
c_prefill/γ seconds per drafted token): at saturation a catch-up of tens of milliseconds dwarfs
differences of 1/g̃ of a fraction of a millisecond, so once γ = 0 is played the term keeps it
(while the lag, and with it the term, grows every step): ``catch_up`` below.

Deviations from Algorithm 1, each an option (``reward=step, eliminate=false, drift=0,
prior=false, explore=uniform, explore_steps=∞, whiten=false, catch_up=paper, model_weight=0`` is
the algorithm as published), with the evidence in docs/benchmarks.md ("Why Nightjar picks the
wrong arm at saturation", "Adaptation under load", "Adaptation that never collapses"):

- ``reward`` (default ``decode_marginal``): the reward of a step is its *decode* goodput, emitted
  tokens / (step time less what the step's prefill chunks added to it). The paper's reward
  (``reward=step``) charges a step's whole time to its decoding rows, and at saturation that poisons
  the arm that matters: a γ = 0 step that admits a prompt takes 4-5× a decode-only one (111 ms
  against 23 ms at B ≈ 29, 16 requests/s), while a γ = 4 step hides its prefill chunk among its
  verify tokens (196 against 158 ms). With the published reward, γ = 0 was played twice in the B =
  32 context of each run, scored 104-113 tok/s, and never again: Nightjar decoded at γ = 3-5 there,
  down to 0.73× of ``off`` although γ = 0's decode-only goodput was 1.7× γ = 4's. A prompt's tokens
  must be computed whatever γ the decoding rows play, so their cost is taken out of the reward
  rather than charged to the arm that happened to carry them, and it must be the same whatever the
  arm: the chunk is charged its tokens at the forward's marginal cost per token, fitted online
  against the forward's padded width (policies/prefill_cost.py). ``reward=decode_share`` splits
  the target's time in proportion to tokens instead; that charges the chunk part of the step's
  fixed cost too, the more the fewer decode tokens sit beside it. In an
  environment with the engine's cost shape, γ = 0's mixed steps then look 1.5× faster than its
  decode-only ones and ``decode_share`` settles on γ = 0, the arm that delivers least
  (``test_the_marginal_reward_finds_the_arm_the_proportional_one_misses``).
  ``reward=decode_only`` (also spelt ``decode_only_reward=true``) keeps steps with prefill out of
  g̃ altogether (they still count as plays and advance the counters); it was not better than the
  published reward beyond noise, because at saturation most speculative steps carry an arrival and
  their arms are then rarely sampled.
- ``catch_up`` (default ``amortized``): the draft's catch-up on what it missed (a run of γ = 0,
  arrivals' prompts) is paid by whichever γ > 0 step comes next, so it is left out of that
  step's reward and charged in Eq. (3) instead, in the units of 1/g̃: the catch-up that
  speculating now would run, c_prefill, spread over the tokens it serves, whatever γ_{t−1} was.
  Those are the tokens the sequences have left to emit (``BatchView.remaining_tokens``, from
  their max_tokens): playing γ = 0 does not avoid a catch-up, it defers it and makes it longer,
  unless the sequences end first, so its price per token is what it buys until they end. Spread
  over the rest of the bin instead (steps left × n × E(γ)), a catch-up looked 10-30× dearer in
  the short bins of a young context: at 1 request/s every new request decoded its first 10-30
  tokens at γ = 0, each making the eventual catch-up longer (docs/benchmarks.md, "Adaptation
  that never collapses"). Charged to the arm that ran it, the catch-up condemned whichever arm
  was explored in a burst of arrivals or right after γ = 0 (the longer γ = 0 ran, the larger
  the lag and the worse the next γ > 0 sample: γ = 0 locked itself in; under contention a
  switch step's catch-up was half its 73 ms); and Eq. (3)'s printed term then kept γ = 0. ``catch_up=paper``: the catch-up stays in the reward and Eq. (3) adds
  1[γ_{t−1} = 0]·c_prefill(L_max)/γ.
- ``whiten`` (default on): a reward of an arm other than the context's leading (most sampled)
  one is measured against the leading arm's steps just before it, dividing out the AR(1)
  forecast of the machine's current slowness (``_whitened``): slow spells of tens of steps
  otherwise fall on a whole exploration bin and condemn its arm. Confidence bounds take a
  sample's variance as at least the leading arm's (measured over many spells) and count
  consecutive samples at their effective number, (1 − ρ)/(1 + ρ) each (``_Context._mean_var``).
- ``explore`` (default ``thompson``): an exploration bin plays an arm measured fewer than twice
  if there is one, else the plausible arm whose draw from N(g̃, sd²) is highest (Thompson
  sampling), so each arm is explored about as often as it could be the best; ``uniform`` draws
  uniformly as Algorithm 1 does. At saturation an exploring step of a poor arm costs up to 3×
  a good one, and Algorithm 1 explores 40-45% of the bins at the horizons of a serving run
  (1/√b, b restarting every block).
- ``explore_steps`` (default 4): an exploration bin explores at most this many steps and
  exploits the rest of the bin. Bins grow to √H steps (32 at H = 1024); shorter stints cost
  less and spread an arm's samples over more spells of the machine's noise.
- ``eliminate`` (default on): an exploration bin draws its arm uniformly among the *plausible*
  arms only, those with fewer than two samples or whose upper confidence bound g̃ + z·sd reaches
  the best arm's lower bound (z = ``confidence_z``, default 2), and a bin whose arm stops being
  plausible mid-bin exploits for the rest of it (action elimination, Even-Dar et al., 2006,
  inside Algorithm 1's bin schedule). Algorithm 1 counts regret in steps, but at saturation an
  exploring γ > 0 step costs 3-7× a γ = 0 step: there the published rule kept 14-66% of late
  steps exploring (52-91% of the time) in a synthetic environment where γ = 0 was known best.
  The best arm stays plausible with high probability, so exploitation is unchanged.
- ``drift`` (default 0.1): g̃ is a Kalman estimate under a random-walk model in which an arm's
  true goodput moves by a relative ``drift`` (one standard deviation) per 100 steps of its
  context that do not sample it. An arm played step after step averages its first 100 samples
  (the paper's cumulative moving average) and then keeps an exponential average with weight
  1/100, so a regime is forgotten (the paper's average never forgets one); an arm left out
  grows uncertain with age, so an eliminated arm returns to exploration after a while
  (hundreds of steps when it was 30% behind, thousands when it was 2× behind) and its first
  fresh sample moves g̃ most of the way. With drift 0 the update is exactly the 1/n average.

- Prefill-bound steps decode plainly, outside the bandit: in a step where prompts wait for the
  token budget (``BatchView.prefill_bound``) the engine's throughput is the pace of its steps,
  not the decoding rows' goodput the reward measures, so the step plays γ = 0 as a forced step
  (learned from, not counted in the bin schedule), as with the draft offloaded. In the
  simulator's prefill-bursts the bandit otherwise kept speculating through bursts of long
  prompts (0.97 of the best fixed arm; with the rule 1.10 on its worst seed).
- ``prior`` (default on, so that a new context converges faster): an arm with no sample in a context
  is judged by a prior instead of being played first, g̃⁰_{B,γ} = n·E(γ)/T(B, γ), with T the
  step-time profile's (the engine measures one at start-up when none is given,
  jspec/autoprofile.py, so it holds the engine's real step cost) at the step's rows and mean
  context, and E(γ) = Σ_{j≤γ} α^j tokens per sequence (geometric acceptance). α is learned
  across all contexts from the judged acceptances of every step (jspec.policies.base
  .judged_acceptance; decay 0.99 per step that verified drafts, ``alpha0`` = 0.6 worth 8
  tokens before any), because acceptance belongs to the model pair and the text, not to the
  load, while the step cost, which does depend on the load, comes from the profile. So a batch
  size seen for the first time starts at the arm the profile and the acceptance seen so far
  favour, rather than spending one step on every arm (explore-first). The prior only orders:
  it never excludes an arm from exploration (elimination needs two measured samples), because
  a profile measured in other conditions than the run's is wrong by more than any spread we
  could give it (in the simulator's saturation-stale-profile a prior that excluded arms kept
  the best arms out: worst seed 0.90× the best fixed arm, docs/benchmarks.md). The first real
  sample of an arm replaces its prior, so a wrong prior costs at most the steps until each arm
  was sampled. ``prior=false`` restores explore-first and needs no profile. The prior ignores the
  prefill tokens a step carries (the profile cannot price them per γ); it errs towards arms
  not yet sampled, which is the safe direction for a bandit.
- ``model_weight`` (default 4): once the run's own step-time model is fitted (policies/
  measured_time.py: the target's time as a + b·w over the forward's width, a draft forward's
  measured seconds), exploitation scores an arm by its g̃ pulled towards that model's goodput
  n·E(γ)/T(γ), the model worth ``model_weight`` samples and g̃ its weight in effective samples
  (its Kalman weight over the autocorrelation's inflation). A phase of a few hundred steps (a
  load step to B = 32 and back) leaves each arm a handful of samples taken in a few spells of
  autocorrelated noise, and g̃ alone then ranks arms 5-10% apart by chance; the model, fitted
  on every step whatever its arm, ranks them by structure, and after a few dozen samples of an
  arm its measurements rule. It is the run's model, never the profile's: pulled towards a
  profile measured in other conditions, the arms were ranked as the profile says (0.87-0.94× the
  best fixed arm in saturation-stale-profile). Exploration and elimination read g̃ alone.

Choices the paper leaves open:

- Context: ``batch_bucket(view.batch_size)`` (policies/base.py): the smallest power of two ≥ the
  number of sequences in the step (decode + prefill), so neighbouring batch sizes share what they
  learn and the number of contexts stays logarithmic in the maximum batch.
- Unvisited arms (g̃ = 0, so 1/g̃ = ∞): explore-first. In an exploitation bin an arm never
  played in this context is chosen before any visited one, lowest γ first (0, 1, ..., Γmax):
  deterministic, and γ = 0 (the safe arm under load) is measured first. Among visited arms, ties
  of Eq. (3) go to the lowest γ (np.argmin), and an arm with no sample (played only in steps
  that carried prefill) or with g̃ = 0 scores ∞.
- γ_{t−1} is global, not per context: the indicator stands for "the draft fell behind", which
  is a property of the running sequences, and they carry over when B changes; a per-context
  γ_{t−1} could refer to a step long ago and charge (or forgive) a catch-up that is not there.
  It is the γ the engine actually ran in the last observed step (max of ``outcome.gammas``, so
  a plan clipped to 0 counts as 0); before the first step there is none (no switching term).
- B changing mid-bin: the counters, bin type and exploration arm are per context, so a bin of
  context B pauses while other contexts run and resumes (same type, same arm, τ_B where it
  stopped) the next time B comes back; τ_B counts only steps taken in context B.
- Draft not resident (offloaded, §5): γ = 0 is forced. The step is a genuine sample of arm 0 in
  context B, so it updates g̃_{B,0}, but the bandit did not play it, so the counters do not move.
  A step observed without a plan (an engine that skips ``plan`` while the draft is away) is
  treated the same way, crediting the γ it ran. Steps with no decoding sequence teach nothing.
- Each plan's decision (context, arm, whether the bandit chose it) travels with its step
  (``DraftPlan.note``, back as ``StepOutcome.plan_note``): with asynchronous scheduling the next
  step is planned before this one is observed. A plan the engine clipped (its rows at their
  last tokens) is credited to the arm that ran.
- c_prefill(L_max, B), with L_max = max(view.pending_draft_tokens) (§4.2, "Prefill Cost
  Modeling"):
  * with a profile (option ``profile``, a path or a StepProfile from ``jspec profile``, or the
    one the engine measured for the prior): the profile's ``c_prefill(L, n_decode)``, its
    catch-up table interpolated as the paper's Table 3; the batch axis is the number of
    decoding sequences, the ones that catch up; L is L_max with ``catch_up=paper``, else
    1 + the mean of max(pending_i − 1, 0) (the engine catches up ragged, see below);
  * without (``prior=false`` and no profile given): estimated online. Each observed step with catch-up work adds its
    (catch_up_time, catch_up_tokens) to exponentially decayed sums (factor 0.95 per such step,
    so the estimate follows the hardware's current state); seconds per catch-up token
    s = Σ time / Σ tokens (the least-squares slope through the origin with weights 1/tokens).
    c_prefill = s · Σ_i max(pending_i − 1, 0): the engine packs catch-up ragged, feeding every
    lagging token but the newest (which the draft loop consumes), so the cost scales with the
    tokens themselves, not with L_max·B of a padded batch. Until a catch-up has been seen the
    estimate is 0 (no evidence of a cost, no penalty).
  Nothing lags (every pending_i ≤ 1): c_prefill = 0. Option ``switching_cost=False`` drops the
  term (plain ADA-BINGREEDY with contexts).
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any

import numpy as np

from jspec.policies.base import (BatchView, DraftPlan, Policy, StepOutcome, batch_bucket,
                           expected_tokens, gamma_range, judged_acceptance, option_bool,
                           option_int, option_number)
from jspec.policies.measured_time import MeasuredTime
from jspec.policies.prefill_cost import PrefillCost
from jspec.policies.profile import StepProfile, load_profile

EXPLORE, EXPLOIT = "explore", "exploit"
# the ``reward`` option's values
REWARDS = ("decode_marginal", "decode_share", "step", "decode_only")
EXPLORATIONS = ("thompson", "uniform")  # the ``explore`` option's values
CATCH_UPS = ("amortized", "paper")  # the ``catch_up`` option's values
_CATCH_UP_DECAY = 0.95  # weight of older catch-up observations, per new one
_MIN_REL_SD = 0.02  # floor of a reward's standard deviation, relative to its mean
_WINDOW = 100  # most samples an arm's mean averages (beyond: an exponential average)
_ALPHA_DECAY = 0.99  # weight of older acceptance evidence, per step that verified drafts
_ALPHA_PSEUDO = 8.0  # tokens of evidence alpha0 is worth
_MAX_INFLATION = 20.0  # most a sample's variance is inflated for autocorrelation
_RHO_DECAY = 0.995  # weight of older residual pairs in the autocorrelation estimate
# an unmeasured arm the run's model puts below this fraction of the best arm is not explored
# first; it is drawn around the model's value with this relative sd (``_explore_arm``)
_FAR_BEHIND = 0.75
_MODEL_EXPLORE_SD = 0.3


@dataclasses.dataclass
class _Context:
    """Algorithm 1's state of one batch-size context, plus its per-arm statistics."""

    counts: list[int]  # plays per γ (the paper's visit counts: explore-first reads them)
    goodput: list[float]  # g̃_{B,γ}: estimated decode goodput per γ (see "Deviations")
    samples: list[int] = dataclasses.field(default_factory=list)  # decode-only steps per γ
    weight: list[float] = dataclasses.field(default_factory=list)  # information in g̃, in samples
    var: list[float] = dataclasses.field(default_factory=list)  # a sample's variance (estimate)
    last: list[int] = dataclasses.field(default_factory=list)  # clock of each arm's last sample
    clock: int = 0  # decode-only steps observed in this context
    j: int = 1  # block index
    H: int = 1  # block size 2^(j−1)
    b: int = 1  # bin index within the block
    tau: int = 1  # round within the bin
    mode: str | None = None  # type of the open bin; None until its first step is planned
    explore_arm: int = 0  # the arm of an exploration bin (fixed for the bin)
    lead_residual: float | None = None  # the leading arm's last log residual (``_whitened``)
    lead_age: int = 0  # steps of this context since it

    def advance(self) -> None:
        """Lines 16-22 of Algorithm 1, after a step played in this context."""
        self.tau += 1
        if self.tau * self.tau > self.H:  # τ_B > √H_B: bin completed
            self.b += 1
            self.tau = 1
            self.mode = None
            if self.b * self.b > self.H:  # b_B > √H_B: block completed
                self.j += 1
                self.H = 2 ** (self.j - 1)
                self.b = 1

    def _mean_var(self, arm: int, drift: float, ahead: int = 0,
                  spread: tuple[float, float] = (0.0, 1.0)) -> float:
        """Variance of g̃ for ``arm``, ``ahead`` steps from now: a sample's variance / weight,
        plus the drift its true goodput may have made while other arms were played, (drift ·
        g̃)² per 100 steps of the context that did not sample it. Confidence bounds pass
        ``spread`` (``NightjarPolicy.spread``): a sample's variance at least ``spread[0]``·g̃²
        (the machine's noise, measured on the leading arm over many spells: a few samples from
        one spell vary little among themselves) and the samples counted at their effective
        number, ``spread[1]`` = (1 + ρ)/(1 − ρ) of them being worth one (consecutive steps share
        their noise); the Kalman update uses the samples' own variance."""
        rel_floor, inflation = spread
        noise = max(self._noise(arm), rel_floor * self.goodput[arm] ** 2) * inflation
        gap = max(self.clock + ahead - self.last[arm] - 1, 0)
        return noise / self.weight[arm] + (drift * self.goodput[arm]) ** 2 * gap / 100.0

    def _noise(self, arm: int) -> float:
        """A sample's variance: the estimate, at least (_MIN_REL_SD · g̃)²."""
        return max(self.var[arm], (_MIN_REL_SD * self.goodput[arm]) ** 2)

    def record(self, arm: int, reward: float, drift: float) -> None:
        """One decode-only sample of ``arm``: a Kalman update of g̃ in which the arm's true
        goodput may drift while the arm is not played. Played every step, the gain is
        1 / (n + 1), at least 1 / ``_WINDOW`` when drift > 0: the paper's cumulative moving
        average over the first ``_WINDOW`` samples, then an exponential one, so a regime is
        forgotten. An arm sampled again after a gap (its variance grown by the drift) jumps to
        the fresh evidence. With drift 0 the update is exactly the paper's 1/n average."""
        if self.samples[arm] == 0:
            self.goodput[arm] = reward
            self.weight[arm] = 1.0
        else:
            prior = self._mean_var(arm, drift, ahead=1)  # this sample's step has passed too
            noise = self._noise(arm)
            gain = prior / (prior + noise)
            if drift > 0:
                gain = max(gain, 1.0 / _WINDOW)
            delta = reward - self.goodput[arm]
            self.goodput[arm] += gain * delta
            self.weight[arm] = noise / ((1.0 - gain) * prior)
            # the reward's own variance, averaged with the same weights as g̃ (innovations
            # include g̃'s own uncertainty, so this errs on the wide side)
            w = max(1.0 / (self.samples[arm] + 1), gain)
            self.var[arm] = (1.0 - w) * self.var[arm] + w * delta * delta
        self.clock += 1
        self.samples[arm] += 1
        self.last[arm] = self.clock

    def plausible(self, z: float, drift: float,
                  spread: tuple[float, float] = (0.0, 1.0)) -> list[int]:
        """Arms whose goodput could still be the best: g̃ + z·sd at least the best g̃ − z·sd,
        with sd from ``_mean_var`` (so an arm left out comes back into exploration after a
        while, the sooner the closer it was). An arm with fewer than two samples is always
        plausible: its spread is unknown, and a prior is a model, not evidence (a step-time
        profile measured in other conditions than the run's made its prior exclude the arms
        that were best, docs/benchmarks.md, "Adaptation that never collapses")."""
        bounds = {}
        for a in range(len(self.counts)):
            if self.samples[a] >= 2:
                mean, half = self.goodput[a], z * math.sqrt(self._mean_var(a, drift, spread=spread))
            else:
                continue
            bounds[a] = (mean - half, mean + half)
        if not bounds:
            return list(range(len(self.counts)))
        best_lo = max(lo for lo, _ in bounds.values())
        return [a for a in range(len(self.counts)) if a not in bounds or bounds[a][1] >= best_lo]


class NightjarPolicy(Policy):
    name = "nightjar"

    def __init__(self, max_gamma: int = 4, profile: "str | os.PathLike | StepProfile | None" = None,
                 seed: int = 0, switching_cost: bool = True,
                 eliminate: bool = True, reward: str = "decode_marginal",
                 decode_only_reward: bool | None = None,
                 confidence_z: float = 2.0, drift: float = 0.1, prior: bool = True,
                 alpha0: float = 0.6, whiten: bool = True, explore: str = "thompson",
                 catch_up: str = "amortized", explore_steps: int = 4,
                 model_weight: float = 4.0):
        super().__init__(max_gamma)
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ValueError(f"{self.name} option seed must be an integer >= 0, got {seed!r}")
        for key, value in (("switching_cost", switching_cost), ("eliminate", eliminate),
                           ("prior", prior)):
            option_bool(self.name, key, value)
        if decode_only_reward is not None:  # true/false spells reward=decode_only / step
            option_bool(self.name, "decode_only_reward", decode_only_reward)
            if reward != "decode_marginal":
                raise ValueError(f"{self.name}: give reward or decode_only_reward, not both")
            reward = "decode_only" if decode_only_reward else "step"
        if reward not in REWARDS:
            raise ValueError(f"{self.name} option reward must be one of {', '.join(REWARDS)}, "
                             f"got {reward!r}")
        confidence_z = option_number(self.name, "confidence_z", confidence_z, low_open=True)
        drift = option_number(self.name, "drift", drift)
        alpha0 = option_number(self.name, "alpha0", alpha0, high=1.0)
        # the engine checks `profile` against its models
        self.profile = load_profile(self.name, profile)
        self.switching_cost = switching_cost
        self.eliminate = eliminate
        self.reward = reward
        self.confidence_z = float(confidence_z)
        self.drift = float(drift)
        self.prior = prior
        self.needs_profile = prior  # the prior's step times: an engine measures a profile
        self.whiten = option_bool(self.name, "whiten", whiten)
        if explore not in EXPLORATIONS:
            raise ValueError(f"{self.name} option explore must be one of "
                             f"{', '.join(EXPLORATIONS)}, got {explore!r}")
        self.explore = explore
        if catch_up not in CATCH_UPS:
            raise ValueError(f"{self.name} option catch_up must be one of "
                             f"{', '.join(CATCH_UPS)}, got {catch_up!r}")
        self.catch_up = catch_up
        self.explore_steps = option_int(self.name, "explore_steps", explore_steps, 1)
        self.model_weight = float(option_number(self.name, "model_weight", model_weight))
        self.alpha0 = float(alpha0)
        self._accepted = 0.0  # decayed sums of judged_acceptance, for the prior's α
        self._judged = 0.0
        self._rng = np.random.default_rng(seed)
        self._contexts: dict[int, _Context] = {}
        self._prev_gamma: int | None = None  # γ_{t−1}, global (see the module docstring)
        self._catch_up_time = 0.0  # decayed sums for the online c_prefill estimate
        self._catch_up_tokens = 0.0
        self._prefill_cost = PrefillCost()  # the marginal cost of prefill tokens (reward)
        self._time = MeasuredTime(self._prefill_cost)  # the run's step-time model (shrinkage)
        # decayed sums of the leading arms' consecutive log residuals, for their lag-1
        # autocorrelation (``_whitened``): Σ e_{t−1}·e_t, Σ e_{t−1}², pairs
        self._rho_sums = [0.0, 0.0, 0.0]
        self._lead_sq = [0.0, 0.0]  # decayed Σ e², count: the relative noise variance

    # ------------------------------------------------------------------ decisions
    def plan(self, view: BatchView) -> DraftPlan:
        n = view.num_decode
        if n == 0:
            return DraftPlan(gammas=np.zeros(0, np.int32))
        key = batch_bucket(view.batch_size)
        if not view.draft_resident or view.prefill_bound:
            return DraftPlan(gammas=np.zeros(n, np.int32),
                             note={"context": key, "gamma": 0, "forced": True})
        ctx = self._context(key)
        # the prior only judges arms without a sample: once every arm has one, skip its lookups
        prior = self.prior_goodput(view) if 0 in ctx.samples else None
        if ctx.mode is None:  # τ_B = 1: bin initialization (lines 6-8)
            explore = self._rng.random() < 1.0 / math.sqrt(ctx.b)
            ctx.mode = EXPLORE if explore else EXPLOIT
            if explore:  # one arm for the whole bin (lines 9-11), among the arms not shown
                # to be worse, drawn as the ``explore`` option says (see "Deviations")
                ctx.explore_arm = self._explore_arm(ctx, view)
        if (ctx.mode == EXPLORE and self.eliminate
                and ctx.explore_arm not in self._plausible(ctx)):
            ctx.mode = EXPLOIT  # the bin's arm was shown to be worse: exploit the rest of it
        if ctx.mode == EXPLORE and ctx.tau > self.explore_steps:
            ctx.mode = EXPLOIT  # the bin explored long enough: exploit the rest of it
        gamma = ctx.explore_arm if ctx.mode == EXPLORE else self._exploit(ctx, view, prior)
        return DraftPlan(gammas=np.full(n, gamma, np.int32),
                         note={"context": key, "gamma": gamma, "forced": False})

    def _explore_arm(self, ctx: _Context, view: BatchView) -> int:
        """The arm of a new exploration bin among the plausible ones: uniformly (Algorithm 1),
        or by Thompson sampling: an arm measured fewer than twice in this context first
        (uniformly among those), else the arm whose draw from N(g̃, sd²) is highest, so each
        is explored as often as it could be the best. Once the run's own step-time model is
        fitted (``model_goodput``; not with ``model_weight=0``), an unmeasured arm that model
        puts below ``_FAR_BEHIND`` of the best arm's goodput is not explored first: it joins
        the Thompson draw around the model's value (relative sd ``_MODEL_EXPLORE_SD``). A
        context seen for a few dozen steps at a time (two requests at once at low load) would
        otherwise spend its first exploration bins on arms like γ = 0 at half the goodput, and
        the requests decoding then are the slowest of the run."""
        arms = self._plausible(ctx)
        if self.explore == "thompson":
            unmeasured = [a for a in arms if ctx.samples[a] < 2]
            model = (self.model_goodput(view) if unmeasured and self.model_weight > 0
                     else None)
            first = unmeasured if model is None else [
                a for a in unmeasured if model[a] >= _FAR_BEHIND * model.max()]
            if not first:
                spread = self.spread
                draws = [self._rng.normal(model[a], _MODEL_EXPLORE_SD * model[a])
                         if ctx.samples[a] < 2 else
                         self._rng.normal(ctx.goodput[a],
                                          math.sqrt(ctx._mean_var(a, self.drift, spread=spread)))
                         for a in arms]
                return int(arms[int(np.argmax(draws))])
            arms = first
        return int(arms[int(self._rng.integers(len(arms)))])

    def _plausible(self, ctx: _Context) -> list[int]:
        if not self.eliminate:
            return list(range(self.max_gamma + 1))
        return ctx.plausible(self.confidence_z, self.drift, self.spread)

    @property
    def spread(self) -> tuple[float, float]:
        """(the leading arms' relative noise variance, the autocorrelation's variance inflation
        (1 + ρ)/(1 − ρ)) for confidence bounds (``_Context._mean_var``); (0, 1) with
        ``whiten=false``."""
        if not self.whiten:
            return 0.0, 1.0
        sq, count = self._lead_sq
        rel_var = sq / count if count >= 20 else 0.0
        rho = self.rho
        return rel_var, min((1.0 + rho) / (1.0 - rho), _MAX_INFLATION)

    def _exploit(self, ctx: _Context, view: BatchView, prior: np.ndarray | None) -> int:
        """Eq. (3); without a prior, explore-first for arms never played in this context
        (lines 12-14)."""
        if prior is None:
            for gamma, count in enumerate(ctx.counts):
                if count == 0:
                    return gamma
        scores = self._scores(ctx, view, prior)
        return min(range(len(scores)), key=scores.__getitem__)

    def _scores(self, ctx: _Context, view: BatchView, prior: np.ndarray | None) -> list[float]:
        """Eq. (3)'s objective per γ (∞ for an arm with neither a sample nor a prior), on
        Python floats: over six arms numpy's per-call overhead was most of an exploiting
        plan's time (a plan's median 59 → 46 µs in the simulator's loop, Nightjar's host time
        0.33-0.43 → 0.27-0.28 ms a step in a B = 1 serving loop, where host work runs on the
        cores the forward uses; 2-vCPU AMD EPYC, Zen 5; static γ = 4: 0.02-0.03 ms)."""
        arms = len(ctx.goodput)
        g = list(ctx.goodput)
        model = self._model_goodput(view) if self.model_weight > 0 else None
        if model is not None:  # measured arms pulled towards the run's model (``model_weight``)
            inflation = self.spread[1]
            mw = self.model_weight
            for a in range(arms):
                if ctx.samples[a] > 0:
                    w = ctx.weight[a] / inflation
                    g[a] = (mw * model[a] + w * g[a]) / (mw + w)
        if prior is not None:  # an arm without a sample is scored by its prior
            g = [x if ctx.samples[a] > 0 else float(prior[a]) for a, x in enumerate(g)]
        scores = [1.0 / x if x > 0 and (prior is not None or ctx.samples[a] > 0) else math.inf
                  for a, x in enumerate(g)]
        if self.max_gamma == 0:
            return scores
        if self.catch_up == "paper":
            if self.switching_cost and self._prev_gamma == 0:
                c = self.c_prefill(view)
                for a in range(1, arms):
                    scores[a] += c / a
            return scores
        # seconds per token, as 1/g̃: the catch-up that speculating now runs (on what the draft
        # missed: a γ = 0 run, arrivals' prompts) over the tokens it serves, which are the
        # tokens the sequences have left to emit (see "Deviations")
        if self.switching_cost:
            extra = self.c_prefill(view) / max(float(np.sum(view.remaining_tokens)), 1.0)
            for a in range(1, arms):
                scores[a] += extra
        return scores

    def scores(self, view: BatchView) -> np.ndarray:
        """Eq. (3)'s objective per γ for this view's context (∞ for unvisited arms)."""
        ctx = self._contexts.get(batch_bucket(view.batch_size)) or self._new_context()
        return np.asarray(self._scores(ctx, view, self.prior_goodput(view)))

    @property
    def alpha(self) -> float:
        """The per-token acceptance rate the prior assumes: judged acceptances (decayed by
        ``_ALPHA_DECAY`` per step that verified something) with ``alpha0`` worth
        ``_ALPHA_PSEUDO`` tokens (jspec.policies.base.judged_acceptance)."""
        return ((self._accepted + self.alpha0 * _ALPHA_PSEUDO)
                / (self._judged + _ALPHA_PSEUDO))

    def prior_goodput(self, view: BatchView) -> np.ndarray | None:
        """The prior g̃ per γ for this view (None without a profile or with ``prior=false``):
        n·E(γ)/T(γ), with T from the step profile at this step's rows and mean context and E(γ)
        the geometric model's tokens per sequence at the acceptance rate ``alpha``."""
        if not self.prior or self.profile is None or view.num_decode == 0:
            return None
        n = view.num_decode
        gammas = gamma_range(self.max_gamma + 1)
        times = self.profile.step_times(max(view.batch_size, n), gammas,
                                        float(np.mean(view.context_lens)))
        return n * expected_tokens(self.alpha, gammas) / times

    def model_goodput(self, view: BatchView) -> np.ndarray | None:
        """n·E(γ)/T(γ) per γ from the run's own step-time model (``MeasuredTime``: the target's
        line over the forward's width n·(γ' + 1), γ' the compiled bucket γ runs in, plus γ
        draft forwards) and the judged acceptance rate ``alpha``; None until that model is
        fitted."""
        goodput = self._model_goodput(view)
        return None if goodput is None else np.asarray(goodput)

    def _model_goodput(self, view: BatchView) -> list[float] | None:
        """``model_goodput`` on Python floats (``_scores``)."""
        if not self._time.ready or view.num_decode == 0:
            return None
        n = view.num_decode
        a, b = self._time.line()
        draft = self._time.draft_forward()
        gammas = gamma_range(self.max_gamma + 1)
        tokens = expected_tokens(self.alpha, gammas).tolist()
        out = []
        for gamma, wide in enumerate(self.padded_gamma(gammas).tolist()):
            seconds = a + b * float(n * (wide + 1)) + gamma * draft
            out.append(n * tokens[gamma] / max(seconds, 1e-9))
        return out

    def c_prefill(self, view: BatchView) -> float:
        """Seconds the draft would need to catch up before drafting this view (see module
        docstring: the profile's table if given, else the online estimate)."""
        pending = np.asarray(view.pending_draft_tokens, np.int64)
        if pending.size == 0:
            return 0.0
        if pending.max() <= 1:  # the draft loop consumes the newest token itself
            return 0.0
        if self.profile is not None:
            # the engine catches up ragged: the cost follows the lagging tokens (their mean per
            # row), where the paper pads every row to L_max
            lag = pending.max() if self.catch_up == "paper" else 1.0 + np.maximum(pending - 1,
                                                                                     0).mean()
            return self.profile.c_prefill(float(lag), view.num_decode)
        if self._catch_up_tokens <= 0:
            return 0.0
        seconds_per_token = self._catch_up_time / self._catch_up_tokens
        return seconds_per_token * float(np.maximum(pending - 1, 0).sum())

    # ------------------------------------------------------------------ learning
    def observe(self, outcome: StepOutcome) -> None:
        decision = outcome.plan_note
        if len(outcome.request_ids) == 0:
            return
        if outcome.catch_up_tokens > 0 and outcome.catch_up_time > 0:
            self._catch_up_time = _CATCH_UP_DECAY * self._catch_up_time + outcome.catch_up_time
            self._catch_up_tokens = (_CATCH_UP_DECAY * self._catch_up_tokens
                                     + outcome.catch_up_tokens)
        accepted, judged = judged_acceptance(outcome)
        if judged:
            self._accepted = _ALPHA_DECAY * self._accepted + accepted
            self._judged = _ALPHA_DECAY * self._judged + judged
        played = int(np.max(outcome.gammas))
        self._prev_gamma = played
        if decision is None:  # a step this policy did not plan: learn, but do not count it
            decision = {"context": batch_bucket(outcome.batch_size), "gamma": played,
                        "forced": True}
        ctx = self._context(decision["context"])
        # the arm that ran: the engine clips a plan to the rows' last tokens, and a step
        # clipped to fewer tokens is a sample of what it ran, not of what was planned
        arm = min(decision["gamma"], played)
        ctx.counts[arm] += 1
        self._time.observe(outcome)  # the target line in it is the reward's prefill cost too
        reward = self._reward(outcome)
        ctx.lead_age += 1
        if reward is not None:
            ctx.record(arm, self._whitened(ctx, arm, reward), self.drift)
        if not decision["forced"]:
            ctx.advance()

    def _reward(self, outcome: StepOutcome) -> float | None:
        """The step's reward under the ``reward`` option (None: the step is no sample). With
        ``catch_up=amortized`` the draft's catch-up is left out of it and charged in Eq. (3)
        instead (``_scores``): catch-up is paid for what the draft missed (a γ = 0 run, the
        prompts of arrivals), not for the arm that happens to be played when it comes due, so
        charging it to that arm condemns whichever arm was explored in a burst of arrivals or
        right after γ = 0 (and the longer γ = 0 runs, the larger the lag and the worse the next
        γ > 0 sample: γ = 0 locks itself in)."""
        if self.reward == "decode_marginal":
            seconds = self._prefill_cost.decode_time(outcome)
        elif self.reward == "decode_share":
            seconds = outcome.decode_time
        elif self.reward == "step" or outcome.num_prefill_tokens == 0:
            seconds = outcome.step_time
        else:
            return None
        if self.catch_up == "amortized":
            seconds = max(seconds - outcome.catch_up_time, 0.1 * seconds)
        return outcome.emitted_per_second(seconds)

    @property
    def rho(self) -> float:
        """Lag-1 autocorrelation of the leading arm's log rewards (0 until 20 pairs were seen;
        at most 0.95)."""
        xy, xx, pairs = self._rho_sums
        if pairs < 20 or xx <= 0:
            return 0.0
        return min(max(xy / xx, 0.0), 0.95)

    def _whitened(self, ctx: _Context, arm: int, reward: float) -> float:
        """``reward`` measured against the leading arm's steps just before it.

        Step times on a shared CPU drift: slow spells last tens of steps (another process takes
        a core; the development machine's step-time noise has a lag-1 autocorrelation of
        0.8-0.9). Algorithm 1 explores an arm for a whole bin of consecutive steps, so all of a
        bin's samples can fall in one spell: the arm is judged 40% worse than it is, its bound
        shrinks as if the samples were independent, and it is eliminated, or never exploited,
        for the rest of the run (docs/benchmarks.md, "Adaptation that never collapses").

        The leading arm (the context's most sampled one) is played most of the time, so its
        g̃ averages over many spells, and its last log residual e = log(r / g̃) says how slow
        the machine is right now. Any other arm's reward is divided by exp(ρ^k e), the AR(1)
        forecast of that slowness k steps of the context later, as a treatment is compared
        with the control measured beside it. The leading arm's own rewards are kept as they
        are (correcting an arm by its own residual would anchor it to its current g̃); they
        update e and, pair by pair, the autocorrelation ρ."""
        samples = ctx.samples
        lead = max(range(len(samples)), key=samples.__getitem__)  # the first most sampled
        if arm == lead and ctx.samples[arm] >= 2 and ctx.goodput[arm] > 0 and reward > 0:
            residual = math.log(reward / ctx.goodput[arm])
            if ctx.lead_residual is not None and ctx.lead_age == 1:
                d = _RHO_DECAY
                xy, xx, pairs = self._rho_sums
                self._rho_sums = [d * xy + ctx.lead_residual * residual,
                                  d * xx + ctx.lead_residual ** 2, d * pairs + 1.0]
            ctx.lead_residual, ctx.lead_age = residual, 0
            self._lead_sq = [_RHO_DECAY * self._lead_sq[0] + residual * residual,
                             _RHO_DECAY * self._lead_sq[1] + 1.0]
            return reward
        if arm == lead or ctx.lead_residual is None or not self.whiten:
            return reward
        return reward * math.exp(-(self.rho ** ctx.lead_age) * ctx.lead_residual)

    # ------------------------------------------------------------------ introspection
    def context_stats(self) -> dict[int, dict[str, Any]]:
        """Per batch bucket: Algorithm 1's counters, the open bin, visit counts and g̃ per γ."""
        return {key: dataclasses.asdict(ctx) for key, ctx in sorted(self._contexts.items())}

    def greedy_gamma(self, batch_size: int) -> int | None:
        """The arm with the best g̃ in this batch size's context, ignoring switching costs and
        unvisited arms (None if nothing was learned there): what the policy has learned."""
        ctx = self._contexts.get(batch_bucket(batch_size))
        if ctx is None or not any(ctx.samples):
            return None
        g = np.where(np.asarray(ctx.samples) > 0, ctx.goodput, -np.inf)
        return int(np.argmax(g))

    @property
    def prev_gamma(self) -> int | None:
        return self._prev_gamma

    # ------------------------------------------------------------------ state
    def _new_context(self) -> _Context:
        arms = self.max_gamma + 1
        return _Context(counts=[0] * arms, goodput=[0.0] * arms, samples=[0] * arms,
                        weight=[0.0] * arms, var=[0.0] * arms, last=[0] * arms)

    def _context(self, key: int) -> _Context:
        if key not in self._contexts:
            self._contexts[key] = self._new_context()
        return self._contexts[key]

    def state_dict(self) -> dict[str, Any]:
        return {
            "policy": self.name,
            "max_gamma": self.max_gamma,
            "contexts": {str(k): dataclasses.asdict(c) for k, c in sorted(self._contexts.items())},
            "prev_gamma": self._prev_gamma,
            "catch_up": {"time": self._catch_up_time, "tokens": self._catch_up_tokens},
            "acceptance": {"accepted": self._accepted, "judged": self._judged},
            "prefill_cost": self._prefill_cost.state_dict(),
            "measured_time": self._time.state_dict(),
            "rng": self._rng.bit_generator.state,
            "rho_sums": list(self._rho_sums),
            "lead_sq": list(self._lead_sq),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.check_state(state)
        arms = self.max_gamma + 1
        try:
            contexts = {}
            for key, c in state["contexts"].items():
                ctx = _Context(**c)
                if "samples" not in c:  # saved before decode-only samples were kept apart:
                    # its means averaged every played step, so each play was a sample
                    ctx.samples, ctx.weight = list(ctx.counts), [float(x) for x in ctx.counts]
                    ctx.var, ctx.last = [0.0] * arms, [0] * arms
                for name in ("counts", "goodput", "samples", "weight", "var", "last"):
                    if len(getattr(ctx, name)) != arms:
                        raise ValueError(f"context {key} has {len(getattr(ctx, name))} arms in "
                                         f"{name}, expected {arms}")
                if ctx.mode not in (None, EXPLORE, EXPLOIT):
                    raise ValueError(f"context {key} has bin type {ctx.mode!r}")
                ctx.counts = [int(x) for x in ctx.counts]
                ctx.goodput = [float(x) for x in ctx.goodput]
                ctx.samples = [int(x) for x in ctx.samples]
                ctx.weight = [float(x) for x in ctx.weight]
                ctx.var = [float(x) for x in ctx.var]
                ctx.last = [int(x) for x in ctx.last]
                ctx.clock = int(ctx.clock)
                ctx.lead_age = int(ctx.lead_age)
                if ctx.lead_residual is not None:
                    ctx.lead_residual = float(ctx.lead_residual)
                contexts[int(key)] = ctx
            rng = np.random.default_rng()
            rng.bit_generator.state = state["rng"]
            prev = state["prev_gamma"]
            catch_up = (float(state["catch_up"]["time"]), float(state["catch_up"]["tokens"]))
            # saved before the prior existed: no acceptance evidence yet
            acceptance = state.get("acceptance", {"accepted": 0.0, "judged": 0.0})
            acceptance = (float(acceptance["accepted"]), float(acceptance["judged"]))
            prefill_cost = PrefillCost()  # saved before the marginal reward: nothing fitted yet
            if "prefill_cost" in state:
                prefill_cost.load_state_dict(state["prefill_cost"])
            measured = MeasuredTime(prefill_cost)  # saved before the model: no draft timed yet
            if "measured_time" in state:
                measured.load_state_dict(state["measured_time"])
            rho_sums = [float(x) for x in state.get("rho_sums", [0.0, 0.0, 0.0])]
            lead_sq = [float(x) for x in state.get("lead_sq", [0.0, 0.0])]
            if len(rho_sums) != 3 or len(lead_sq) != 2:
                raise ValueError(f"rho_sums / lead_sq have {len(rho_sums)} / {len(lead_sq)} "
                                 f"sums, expected 3 / 2")
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"malformed {self.name} state: {e}") from None
        # only now, so a bad state leaves the policy as it was
        self._contexts = contexts
        self._rng = rng
        self._prev_gamma = None if prev is None else int(prev)
        self._catch_up_time, self._catch_up_tokens = catch_up
        self._accepted, self._judged = acceptance
        self._prefill_cost = prefill_cost
        self._time = measured
        self._rho_sums, self._lead_sq = rho_sums, lead_sq
