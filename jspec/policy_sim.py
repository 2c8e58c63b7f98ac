"""A seeded, host-only simulator of the engine's step for judging speculation policies.

A policy is driven exactly as the engine drives it (jspec/engine.py): each step it gets a
``BatchView`` (decoding sequences, their context lengths and draft lag, the step's rows and
prefill tokens), answers with a ``DraftPlan``, may trim verify lengths in ``select`` from the
draft's confidences and entropies, and learns from a ``StepOutcome`` carrying the same fields
the engine fills (planned / drafted / verified / accepted / emitted tokens, the step's time split
into draft, catch-up and target parts, the padded verify width, and the per-position signals the
policy declares it reads). Nothing runs a model: the environment (``Environment``) supplies

* the step time, a cost model with the engine's shape (``StepCost``): a target forward of fixed
  cost plus a cost per token of its padded width (a decode-only step's is every row at the
  compiled γ bucket of the step's longest draft, as the engine's) and per context token its rows
  attend to, the
  draft loop's forwards (as many as the longest draft, each over every decoding row), and the
  draft's catch-up on tokens it missed (Nightjar's switching cost), all multiplied by
  log-normal noise whose log follows an Ornstein-Uhlenbeck process in simulated time
  (correlation time ``noise_tau``), and in spells of contention by a slowdown: step times on a
  shared CPU drift, so neighbouring steps are not independent samples. The machine's slowness
  is a function of the clock, not of the step count, as another process's load is: every
  policy on a seed meets the same slow stretches at the same moments, so a fixed arm that runs
  fewer, longer steps is not luckier or unluckier with the noise than one that runs many;
* acceptance: every request draws its own rate α_i from a Beta distribution around the phase's
  mean; each drafted token gets a draft confidence q ~ Beta(κα_i, κ(1 − α_i)) and is accepted
  with probability q (calibrated confidences), its entropy and KL(p‖q) derived from q;
* load: the number of decoding sequences, their acceptance and prompt lengths follow phases
  (``Phase``) over the run, standing in for arrivals; finished requests are replaced by new ones
  whose prompt the draft must catch up on.

The clock is simulated, so thousands of steps take a fraction of a second and nothing depends on
the machine. ``run_policy`` runs one policy on one environment and seed; ``regret`` compares
policies with the fixed arms (off and static γ = 1..Γmax) on the same seeds: the ratio of a
policy's throughput to the best fixed arm in hindsight on each seed. ``jspec bench simulate``
prints that table for the built-in environments (``ENVIRONMENTS``).
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Callable

import numpy as np

from jspec.config import gamma_bucket, gamma_buckets
from jspec.policies import make_policy
from jspec.policies.base import BatchView, DraftPlan, DraftStats, Policy
from jspec.policies.profile import StepProfile
from jspec.step_record import StepRecord

_ENTROPY_TAIL = 20  # tokens sharing a draft distribution's mass beside its top token
_TOKEN_BUCKET = 64  # a step with prefill pads its verify width to a multiple of this
NOISE_DT = 0.005  # seconds: the grid the machine's slowness is drawn on
_NOISE_CHUNK = 4096  # grid points of it drawn at a time


@dataclasses.dataclass(frozen=True)
class StepCost:
    """Seconds of one step's parts (see the module docstring); defaults: a memory-bound target."""

    fixed: float = 0.020  # target forward: weights, dispatch, sampling, commit
    per_token: float = 1e-4  # per token of the forward's padded width
    per_context: float = 2e-8  # per (query token x context token) of attention
    draft_fixed: float = 0.003  # one draft forward
    draft_per_seq: float = 3e-5  # one draft forward, per decoding row
    catch_up_fixed: float = 0.002  # a catch-up pass of the draft
    catch_up_per_token: float = 2e-5  # per token caught up

    def target(self, width: int, attended: float) -> float:
        return self.fixed + self.per_token * width + self.per_context * attended

    def draft(self, forwards: int, rows: int) -> float:
        return forwards * (self.draft_fixed + self.draft_per_seq * rows) if forwards else 0.0

    def catch_up(self, tokens: int) -> float:
        return self.catch_up_fixed + self.catch_up_per_token * tokens if tokens else 0.0


@dataclasses.dataclass(frozen=True)
class Phase:
    """The load from ``start`` (a fraction of the run) until the next phase starts."""

    start: float  # fraction of the run's simulated time
    batch: int  # decoding sequences
    alpha: float = 0.8  # mean per-token acceptance rate of requests arriving in it
    prompt_len: int = 170  # prompt tokens of requests arriving in it
    output_len: int = 128  # their mean output tokens (uniform in [½, 1½] of it)


@dataclasses.dataclass(frozen=True)
class Environment:
    """A workload and machine: cost, load phases, acceptance spread and step-time noise."""

    name: str
    phases: tuple[Phase, ...]
    cost: StepCost = StepCost()
    alpha_concentration: float = 20.0  # Beta concentration of the per-request α_i
    confidence_concentration: float = 2.0  # Beta concentration of a token's confidence q
    noise_sd: float = 0.1  # standard deviation of the log step-time noise
    # its correlation time in seconds: exp(−Δ/τ) between moments Δ apart (0.82 for steps of
    # 50 ms, about the lag-1 autocorrelation of step times on the development machine)
    noise_tau: float = 0.25
    # (slowdown, mean spell in seconds): another process takes a core in spells, slowing every
    # step that starts in a spell by ``slowdown``; spells and free stretches last ``mean spell``
    # seconds on average (a two-state Markov process). None: no contention.
    contention: tuple[float, float] | None = None
    prefill_chunk: int = 256  # most prompt tokens a step prefills (chunked prefill)
    max_gamma: int = 4
    # the cost the policies' step-time profile is measured from (None: the true one); another
    # cost stands for a profile measured in other conditions than the run's
    profile_cost: StepCost | None = None

    def phase(self, progress: float) -> Phase:
        """The phase at ``progress``, the fraction of the run's simulated time gone."""
        return [p for p in self.phases if p.start <= progress][-1]


def ar1_noise(rng: np.random.Generator, steps: int, rho: float,
              last: float | None = None) -> np.ndarray:
    """A stationary AR(1) series of unit variance, x_t = ρ x_{t−1} + √(1 − ρ²) ε_t, going on
    from ``last`` (None: a fresh start from the stationary distribution)."""
    eps = rng.standard_normal(steps)
    x = np.empty(steps)
    scale = np.sqrt(1.0 - rho * rho)
    prev = last
    for t in range(steps):
        prev = x[t] = eps[t] if prev is None else rho * prev + scale * eps[t]
    return x


def profile_of(env: Environment) -> StepProfile:
    """The step-time profile the engine would measure for this environment (noise-free, from
    ``profile_cost`` when given), for the policies that reason from one (the engine measures
    one at start-up)."""
    batches = [1, 2, 4, 8, 16, 32, 64]
    queries = list(range(1, env.max_gamma + 2))
    contexts = [128, 512, 2048]
    catch_ups = [1, 8, 64, 512]
    c = env.profile_cost or env.cost
    target = np.array([[[c.target(b * q, b * q * ctx) for ctx in contexts] for q in queries]
                       for b in batches])
    draft = np.array([[c.draft(1, b) for _ in contexts] for b in batches])
    catch_up = np.array([[c.catch_up(n * b) for b in batches] for n in catch_ups])
    return StepProfile("sim-target", "sim-draft", "simulated", "none", batches, queries,
                       contexts, catch_ups, target, draft, catch_up)


class _Requests:
    """The requests holding the batch's slots: decoding ones (per request its id, α, context
    length, tokens left to emit, and draft lag: tokens the draft has not computed) and admitted
    ones whose prompt is still being prefilled, oldest first."""

    def __init__(self, rng: np.random.Generator):
        self.rng = rng
        self.ids: list[str] = []
        self.alpha = np.zeros(0)
        self.context = np.zeros(0, np.int64)
        self.left = np.zeros(0, np.int64)
        # max_tokens less the tokens a request will emit: a policy sees left + slack (the
        # engine knows max_tokens, not where a request will stop)
        self.slack = np.zeros(0, np.int64)
        self.lag = np.zeros(0, np.int64)
        self.prefilling: list[dict] = []  # id, alpha, prompt, left, done (prompt tokens computed)
        self.issued = 0

    @property
    def slots(self) -> int:
        return len(self.ids) + len(self.prefilling)

    def _admit(self, count: int, phase: Phase, concentration: float) -> None:
        """``count`` new requests take free slots: at saturation a request is admitted as one
        finishes, so prefill work follows completions, not steps."""
        k = concentration
        alpha = self.rng.beta(k * phase.alpha, k * (1.0 - phase.alpha), count)
        # outputs of different lengths, so requests do not all finish in the same step
        max_tokens = phase.output_len * 3 // 2
        left = self.rng.integers(phase.output_len // 2, max_tokens + 1, count)
        for a, n in zip(alpha.tolist(), left.tolist()):
            self.prefilling.append({"id": f"sim{self.issued}", "alpha": a, "left": n,
                                    "slack": max_tokens - n, "prompt": phase.prompt_len,
                                    "done": 0})
            self.issued += 1

    def _keep(self, mask: np.ndarray) -> None:
        self.ids = [r for r, m in zip(self.ids, mask) if m]
        self.alpha, self.context = self.alpha[mask], self.context[mask]
        self.left, self.lag, self.slack = self.left[mask], self.lag[mask], self.slack[mask]

    def settle(self, phase: Phase, concentration: float) -> None:
        """Replace finished requests and resize to the phase's batch (a load drop ends the
        newest decoding requests first)."""
        self._keep(self.left > 0)
        if self.slots > phase.batch:
            self._keep(np.arange(len(self.ids)) < max(phase.batch - len(self.prefilling), 0))
        if self.slots < phase.batch:
            self._admit(phase.batch - self.slots, phase, concentration)

    def prefill(self, chunk: int) -> tuple[int, int, float]:
        """This step's prefill chunks, oldest prompt first, at most ``chunk`` tokens: (tokens,
        rows, tokens x context they attend to)."""
        tokens = rows = 0
        attended = 0.0
        for req in self.prefilling:
            n = min(req["prompt"] - req["done"], chunk - tokens)
            if n <= 0:
                break
            attended += n * (req["done"] + n / 2)
            req["done"] += n
            tokens += n
            rows += 1
        return tokens, rows, attended

    def start_decoding(self) -> int:
        """Prompts fully prefilled join the decoding batch, their first token sampled by the
        prefill (returned: tokens emitted outside decoding); the draft has not seen the prompt,
        so it must catch up on it before it drafts."""
        done = [r for r in self.prefilling if r["done"] >= r["prompt"]]
        self.prefilling = [r for r in self.prefilling if r["done"] < r["prompt"]]
        if not done:
            return 0
        self.ids += [r["id"] for r in done]
        self.alpha = np.concatenate([self.alpha, [r["alpha"] for r in done]])
        self.context = np.concatenate([self.context, [r["prompt"] + 1 for r in done]])
        self.left = np.concatenate([self.left, [r["left"] - 1 for r in done]])
        self.slack = np.concatenate([self.slack, [r["slack"] for r in done]])
        self.lag = np.concatenate([self.lag, [r["prompt"] + 1 for r in done]])
        return len(done)

    def advance(self, emitted: np.ndarray, gammas: np.ndarray) -> None:
        self.context = self.context + emitted
        self.left = self.left - emitted
        # a row that drafted was caught up first: the draft lags by its newest token only
        self.lag = np.where(gammas > 0, 1, self.lag + emitted)


@dataclasses.dataclass
class _Draft:
    """What the draft loop produced for one step: per row, tokens drafted, their confidences,
    entropies, acceptance and KL."""

    drafted: np.ndarray  # [n]
    confidence: np.ndarray  # [n, G]
    entropy: np.ndarray  # [n, G]
    accepted: np.ndarray  # [n, G] bool: the target would accept this position
    kl: np.ndarray  # [n, G]


def _draft(env: Environment, rng: np.random.Generator, alpha: np.ndarray, gammas: np.ndarray,
           plan) -> _Draft:
    """The on-device draft loop (jspec/device_steps.py): token j is drafted iff j < γ_i, the
    product of the confidences before it is ≥ stop_confidence_i and its distribution's entropy is
    ≤ stop_entropy_i (and every token before it was drafted)."""
    n, g = len(alpha), env.max_gamma
    k = env.confidence_concentration
    a = np.clip(alpha, 1e-3, 1 - 1e-3)[:, None]
    q = rng.beta(k * a, k * (1.0 - a), (n, g))
    accepted = rng.random((n, g)) < q
    rest = np.maximum(1.0 - q, 1e-9)
    entropy = -q * np.log(np.maximum(q, 1e-9)) - rest * np.log(rest / _ENTROPY_TAIL)
    # KL(p‖q) grows as the draft's confidence falls, more where the target disagreed
    kl = -np.log(np.maximum(q, 1e-3)) * np.where(accepted, 0.5, 1.5)
    stop_conf = np.zeros(n) if plan.stop_confidence is None else np.asarray(plan.stop_confidence)
    stop_ent = (np.full(n, np.inf) if plan.stop_entropy is None
                else np.asarray(plan.stop_entropy))
    before = np.cumprod(np.concatenate([np.ones((n, 1)), q[:, :-1]], axis=1), axis=1)
    ok = ((np.arange(g)[None, :] < gammas[:, None]) & (before >= stop_conf[:, None])
          & (entropy <= stop_ent[:, None]))
    drafted = np.cumprod(ok, axis=1).sum(axis=1)
    return _Draft(drafted, q, entropy, accepted, kl)


def _signals(policy: Policy, draft: _Draft, verified: np.ndarray) -> dict[str, np.ndarray]:
    """The per-position signals the engine hands over: those the policy reads, at verified
    positions; NaN elsewhere."""
    n, g = draft.confidence.shape
    mask = np.arange(g)[None, :] < verified[:, None]
    values = {"confidence": draft.confidence, "draft_entropy": draft.entropy, "kl": draft.kl,
              "accept_prob": draft.confidence}
    unread = np.full((n, g), np.nan, np.float32)
    return {name: np.where(mask, v, np.nan).astype(np.float32) if name in policy.signals
            else unread for name, v in values.items()}


@dataclasses.dataclass
class SimResult:
    """One run: throughput in emitted tokens per simulated second, and per-step records."""

    tokens: int
    seconds: float
    records: dict[str, np.ndarray]

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


class _Simulation:
    """One policy on one environment and seed (``run_policy``)."""

    def __init__(self, env: Environment, policy: Policy, seed: int):
        self.env, self.policy = env, policy
        streams = np.random.default_rng(seed).spawn(3)
        # separate streams, so every policy on a seed meets the same noise and requests
        self.noise_rng = streams[0]
        self.noise_rho = float(np.exp(-NOISE_DT / env.noise_tau))  # per grid point
        self.noise = ar1_noise(self.noise_rng, _NOISE_CHUNK, self.noise_rho)
        self.spells = self._spells(_NOISE_CHUNK, None)
        self.requests = _Requests(streams[1])
        self.rng = streams[2]
        policy.set_pool(("draft",))
        # the γ buckets the engine would compile for this policy (jspec/engine.py)
        self.buckets = gamma_buckets(policy.possible_gammas(), env.max_gamma)
        policy.set_gamma_buckets(self.buckets)
        if policy.needs_profile and policy.profile is None:
            policy.set_profile(profile_of(env))

    def view(self, prefill: int, prefill_rows: int) -> BatchView:
        r = self.requests
        return BatchView(request_ids=list(r.ids), context_lens=r.context.copy(),
                         pending_draft_tokens=r.lag.copy(),
                         batch_size=len(r.ids) + prefill_rows, num_prefill_tokens=prefill,
                         num_waiting=0, num_free_blocks=1000, num_total_blocks=1000,
                         draft_resident=True, max_gamma=self.env.max_gamma,
                         remaining_tokens=r.left + r.slack,
                         prefill_backlog_tokens=sum(q["prompt"] - q["done"] for q in r.prefilling),
                         prefill_backlog_requests=sum(q["done"] < q["prompt"]
                                                      for q in r.prefilling))

    def noise_at(self, clock: float) -> float:
        """The step-time factor of a step starting at ``clock`` seconds: exp(σ x), x the noise
        process there, times the slowdown of a contention spell (both grown on use)."""
        t = int(clock / NOISE_DT)
        while t >= len(self.noise):
            more = ar1_noise(self.noise_rng, _NOISE_CHUNK, self.noise_rho, self.noise[-1])
            self.noise = np.concatenate([self.noise, more])
            self.spells = np.concatenate([self.spells,
                                          self._spells(_NOISE_CHUNK, bool(self.spells[-1]))])
        factor = float(np.exp(self.env.noise_sd * self.noise[t]))
        if self.env.contention is not None and self.spells[t]:
            factor *= self.env.contention[0]
        return factor

    def _spells(self, steps: int, last: bool | None) -> np.ndarray:
        """Whether each of the next ``steps`` grid points falls in a contention spell, going on
        from ``last`` (None: a fresh start, in a spell with probability ½): the state flips
        with probability grid step / mean spell at each point."""
        if self.env.contention is None:
            return np.zeros(steps, bool)
        switch = self.noise_rng.random(steps) < NOISE_DT / self.env.contention[1]
        if last is None:
            last = bool(self.noise_rng.random() < 0.5)
        return (np.cumsum(switch) + last) % 2 == 1

    def step(self, clock: float, progress: float) -> dict[str, float]:
        env, policy, r = self.env, self.policy, self.requests
        phase = env.phase(progress)
        r.settle(phase, env.alpha_concentration)
        prefill, rows, prefill_attended = r.prefill(env.prefill_chunk)
        view = self.view(prefill, rows)
        # as the engine: a policy plans and learns only in steps with decoding sequences
        plan = policy.plan(view) if view.num_decode else DraftPlan(np.zeros(0, np.int32))
        # the engine's clip: never draft past a request's last token, nor with no chain
        room = np.maximum(r.left - 1, 0) if plan.chain else np.zeros(len(r.ids), np.int64)
        gammas = np.clip(np.asarray(plan.gammas, np.int64), 0, room)
        draft = _draft(env, self.rng, r.alpha, gammas, plan)
        verified = draft.drafted
        if policy.wants_select and verified.any():
            stats = DraftStats(num_drafted=draft.drafted, confidence=draft.confidence,
                               draft_entropy=draft.entropy)
            lens = policy.select(view, stats)
            if lens is not None:
                verified = np.minimum(np.maximum(np.asarray(lens, np.int64), 0), draft.drafted)
        noise = self.noise_at(clock)
        outcome = self.outcome(view, gammas, draft, verified, (prefill_attended, noise))
        outcome.plan_note = plan.note
        if view.num_decode:
            policy.observe(outcome)
        r.advance(outcome.num_emitted, gammas)
        first_tokens = r.start_decoding()
        return {"step_time": outcome.step_time,
                "emitted": float(outcome.num_emitted.sum() + first_tokens),
                "gamma": float(gammas.mean()) if len(gammas) else 0.0,
                "batch_size": view.batch_size, "prefill_tokens": prefill,
                "phase": env.phases.index(phase), "noise": noise}

    def outcome(self, view: BatchView, gammas: np.ndarray, draft: _Draft, verified: np.ndarray,
                step: tuple[float, float]) -> StepRecord:
        """The step's StepRecord as the engine fills it; ``step``: the tokens x context its
        prefill chunks attend to, and its noise factor."""
        env, r = self.env, self.requests
        prefill_attended, noise = step
        n = view.num_decode
        g = env.max_gamma
        lead = np.cumprod(draft.accepted & (np.arange(g)[None, :] < verified[:, None]), axis=1)
        accepted = lead.sum(axis=1)
        emitted = np.minimum(accepted + 1, r.left)
        # the step runs at the compiled bucket of its longest γ: every decoding row verifies
        # that wide (the draft loop stops after the longest draft)
        bucket = gamma_bucket(self.buckets, int(gammas.max(initial=0)))
        tokens = int((1 + verified).sum()) + view.num_prefill_tokens
        if view.num_prefill_tokens:
            width = -(-tokens // _TOKEN_BUCKET) * _TOKEN_BUCKET
        else:
            width = n * (1 + bucket)
        attended = float((r.context * (1 + verified)).sum()) + prefill_attended
        caught = int(np.maximum(r.lag - 1, 0)[gammas > 0].sum()) if bucket else 0
        target = env.cost.target(width, attended) * noise
        # the draft loop's first forward runs whenever anything may draft, even if a stop rule
        # then drafts nothing; each further one feeds a drafted token
        forwards = max(int(draft.drafted.max(initial=0)), 1) if bucket else 0
        draft_time = env.cost.draft(forwards, n) * noise
        catch_up = env.cost.catch_up(caught) * noise
        signals = _signals(self.policy, draft, verified)
        return StepRecord(
            request_ids=view.request_ids, gammas=gammas, num_drafted=draft.drafted,
            num_verified=verified, num_accepted=accepted, num_emitted=emitted,
            batch_size=view.batch_size, step_time=target + draft_time + catch_up,
            draft_time=draft_time, verify_time=target, catch_up_time=catch_up,
            catch_up_tokens=caught, num_prefill_tokens=view.num_prefill_tokens,
            stage_times={"draft": draft_time, "catch_up": catch_up, "verify": target},
            gamma_bucket=bucket, num_tokens=tokens, num_padded_tokens=width,
            num_running=n, chain=(0,) if bucket else (), **signals)


def run_policy(env: Environment, policy: Policy, seed: int, seconds: float) -> SimResult:
    """Run ``policy`` on ``env`` and ``seed`` for ``seconds`` of simulated time: throughput and
    per-step records (step_time, emitted, gamma (mean planned), batch_size, prefill_tokens,
    phase (index into env.phases), noise (the machine's slowness factor the step met)).

    The phases follow simulated time, as arrivals do, so every policy spends the same time in
    each and its throughput weighs them alike. Phases placed by step count would not: a policy
    that emits more per step at low load would spend more of its time there, and its overall
    throughput would fall below a fixed arm's that it beats in every phase."""
    if not seconds > 0:
        raise ValueError(f"seconds must be > 0, got {seconds!r}")
    sim = _Simulation(env, policy, seed)
    rows, clock = [], 0.0
    while clock < seconds:
        rows.append(sim.step(clock, clock / seconds))
        clock += rows[-1]["step_time"]
    records = {key: np.array([row[key] for row in rows]) for key in rows[0]}
    return SimResult(int(records["emitted"].sum()), clock, records)


# ---------------------------------------------------------------------- comparisons
ADAPTIVE = ("nightjar", "auto", "dsd", "adaspec", "dsde", "ucb", "heuristic", "adaedl",
            "specrouter")


def fixed_arms(max_gamma: int) -> dict[str, Callable[[], Policy]]:
    """The fixed choices a policy is judged against: off and static γ = 1..Γmax."""
    arms = {"off": lambda: make_policy("off", max_gamma)}
    for gamma in range(1, max_gamma + 1):
        arms[f"static γ={gamma}"] = (lambda g=gamma: make_policy("static", max_gamma, gamma=g))
    return arms


def throughputs(env: Environment, make: Callable[[], Policy], seeds, seconds: float
                ) -> np.ndarray:
    """Tokens per simulated second of a fresh policy from ``make`` on each seed."""
    return np.array([run_policy(env, make(), seed, seconds).tokens_per_s for seed in seeds])


@dataclasses.dataclass
class Regret:
    """Per policy, its throughput on each seed over the best fixed arm's on that seed."""

    env: str
    fixed: dict[str, np.ndarray]  # arm -> tokens/s per seed
    ratios: dict[str, np.ndarray]  # policy -> ratio to the best fixed arm per seed

    @property
    def best_fixed(self) -> str:
        """The fixed arm with the best mean throughput over the seeds."""
        return max(self.fixed, key=lambda arm: float(self.fixed[arm].mean()))


def regret(env: Environment, policies, seeds, seconds: float) -> Regret:
    """Every fixed arm and every policy in ``policies`` (names, default options, Γmax of the
    environment) on the same seeds; ratios to the best fixed arm in hindsight, per seed."""
    fixed = {arm: throughputs(env, make, seeds, seconds)
             for arm, make in fixed_arms(env.max_gamma).items()}
    best = np.max(np.stack(list(fixed.values())), axis=0)
    ratios = {name: throughputs(env, lambda n=name: make_policy(n, env.max_gamma), seeds,
                                seconds) / best for name in policies}
    return Regret(env.name, fixed, ratios)


# ---------------------------------------------------------------------- environments
# A memory-bound target at B = 32: a step's cost grows slowly with its tokens, so drafting pays
# (static γ = 4 ≈ 1.43× off, as the engine measured on the code workload at saturation).
_MEMORY_BOUND = StepCost(per_token=1e-4, draft_fixed=0.003)
# A compute-bound target: every verified token costs nearly as much as a decoded one.
_COMPUTE_BOUND = StepCost(fixed=0.01, per_token=8e-4, draft_fixed=0.006)
# arrivals with long prompts and short answers: most steps carry a prefill chunk
_BURST = dict(prompt_len=1500, output_len=64)

ENVIRONMENTS = {env.name: env for env in (
    Environment("saturation-pays", (Phase(0.0, 32, 0.88),), cost=_MEMORY_BOUND),
    Environment("saturation-no-pay", (Phase(0.0, 32, 0.5),), cost=_COMPUTE_BOUND),
    Environment("low-load", (Phase(0.0, 2, 0.85),)),
    Environment("load-step", (Phase(0.0, 2, 0.75), Phase(1 / 3, 32, 0.75), Phase(2 / 3, 2, 0.75)),
                cost=StepCost(fixed=0.015, per_token=6e-4, draft_fixed=0.004)),
    Environment("prefill-bursts", (Phase(0.0, 32, 0.85), Phase(0.2, 32, 0.85, **_BURST),
                                   Phase(0.35, 32, 0.85), Phase(0.6, 32, 0.85, **_BURST),
                                   Phase(0.75, 32, 0.85)), cost=_MEMORY_BOUND),
    Environment("acceptance-drift", (Phase(0.0, 16, 0.85), Phase(0.4, 16, 0.45),
                                     Phase(0.7, 16, 0.85)), cost=_MEMORY_BOUND),
    # saturation-pays, but the profile was measured where tokens cost what they cost in
    # saturation-no-pay: a start-up profile taken in other conditions than the run's
    Environment("saturation-stale-profile", (Phase(0.0, 32, 0.88),), cost=_MEMORY_BOUND,
                profile_cost=_COMPUTE_BOUND),
    # saturation-pays on a CPU shared with another process: spells of ~1.5 s (~20 steps) at 2x
    # the step time (as on the development machine beside a competing load, where Nightjar
    # collapsed)
    Environment("saturation-contended", (Phase(0.0, 32, 0.88),), cost=_MEMORY_BOUND,
                contention=(2.0, 1.5)),
)}


def format_tables(results: list[Regret]) -> str:
    """Markdown: per policy (and fixed arm) and environment, the worst-seed and the mean ratio
    of throughput to the best fixed arm in hindsight on each seed; then each environment's fixed
    arms in tokens per simulated second."""
    envs = [r.env for r in results]
    head = "| policy | " + " | ".join(envs) + " |\n|---|" + "---|" * len(envs) + "\n"
    lines = []
    for title, reduce in (("worst seed", np.min), ("mean over seeds", np.mean)):
        rows = []
        for name in results[0].ratios:
            rows.append(f"| {name} | " + " | ".join(f"{reduce(r.ratios[name]):.2f}"
                                                   for r in results) + " |")
        for arm in results[0].fixed:
            rows.append(f"| {arm} | " + " | ".join(
                f"{reduce(r.fixed[arm] / np.max(np.stack(list(r.fixed.values())), axis=0)):.2f}"
                for r in results) + " |")
        lines.append(f"× best fixed arm, {title}:\n\n" + head + "\n".join(rows) + "\n")
    arms = list(results[0].fixed)
    rows = [f"| {r.env} | " + " | ".join(f"{r.fixed[a].mean():.0f}" for a in arms)
            + f" | {r.best_fixed} |" for r in results]
    lines.append("fixed arms, tokens per simulated second (mean over seeds):\n\n| environment | "
                 + " | ".join(arms) + " | best |\n|---|" + "---|" * (len(arms) + 1) + "\n"
                 + "\n".join(rows) + "\n")
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--environments", default=",".join(ENVIRONMENTS),
                   help="comma-separated environments (default: all)")
    p.add_argument("--policies", default=",".join(ADAPTIVE),
                   help="comma-separated policies judged against the fixed arms")
    p.add_argument("--seeds", type=int, default=5, help="seeds per environment")
    p.add_argument("--seconds", type=float, default=100.0,
                   help="simulated seconds per run (thousands of steps)")


def run(args: argparse.Namespace) -> int:
    from jspec.policies import POLICIES

    envs = [e.strip() for e in args.environments.split(",") if e.strip()]
    unknown = [e for e in envs if e not in ENVIRONMENTS]
    if unknown:
        raise ValueError(f"unknown environment {unknown[0]!r}; known: {', '.join(ENVIRONMENTS)}")
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    unknown = [p for p in policies if p not in POLICIES]
    if unknown:
        raise ValueError(f"unknown policy {unknown[0]!r}; known: {', '.join(sorted(POLICIES))}")
    if args.seeds < 1 or not args.seconds > 0:
        raise ValueError(f"--seeds must be >= 1 and --seconds > 0, got {args.seeds} and "
                         f"{args.seconds}")
    seeds = range(args.seeds)
    print(f"simulated: {args.seconds:g} s x {args.seeds} seeds per policy and environment "
          f"(jspec/policy_sim.py; the clock is simulated)\n")
    results = [regret(ENVIRONMENTS[e], policies, seeds, args.seconds) for e in envs]
    print(format_tables(results))
    return 0
