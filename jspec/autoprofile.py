"""The step-time profile an engine measures for itself, so cost-aware policies need no manual step.

AdaSpec and DSD reason from a ``jspec.policies.profile.StepProfile``. Given none (``needs_profile``
and ``profile is None``), ``LLMEngine.ensure_profile`` calls ``engine_profile`` after the warm-up
(or before the first request of an engine nobody warmed up): it loads the profile cached for this
engine's cost signature, or measures one with the engine itself and caches it under
``<cache dir>/profiles/``.

Measured, not modelled: the engine decodes B fresh sequences (random prompts of ``context``
tokens, greedy, no EOS) and, for each γ it can run, times a few real ``LLMEngine.step`` calls
(median), so the profile holds what a step costs the engine, scheduling, sampling and the host
included, not the bare forward that `jspec profile` times:

* ``target_time[B, γ+1, context]`` = step time − draft loop − catch-up (everything but the draft);
* ``draft_time[B, context]`` = the draft loop at the largest γ / that γ (one draft forward), the
  loop's device time (the engine syncs between stages while it measures, ``time_stages``);
* ``catch_up_time[C, B]``: after C − 1 steps at γ = 0 every sequence's draft lags C tokens, and
  the next step with γ > 0 reports the catch-up it ran (Nightjar's c_prefill).

The grid is the batch sizes 1, 2, 4, ... up to ``max_num_seqs`` (the engine's own row buckets
sit at the same powers of two), every γ from 0 to Γmax, one context (128 tokens, less when the
model is short) and catch-up lengths 2 and 8. On the 2-vCPU development machine the built-in
pair takes 12-15 s at max_num_seqs 32, Γmax 5 (docs/benchmarks.md). The cache key is every
input that changes a step's cost: both models' shapes, the target's weight layout, backend and
device kind, the host's CPU model and usable cores, the KV dtype, and the engine's batch shape
options.
``JSPEC_PROFILE_CACHE=off`` measures afresh every time without reading or writing the cache.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import statistics
import sys
import time

import numpy as np

from jspec.policies.profile import FORMAT, StepProfile, model_signature
from jspec.policies.static import StaticPolicy

# Bump when what is measured changes: older cached profiles are then ignored. Version 4 times
# catch-up lags without the draft reading a fresh sequence's prompt, and decode-only verifies
# that attend in one query tile per sequence.
VERSION = 4
CONTEXT = 128
CATCH_UP_LENS = (2, 8)
STEPS = 3  # measured steps per (B, γ), after one settling step


class ForcedGamma(StaticPolicy):
    """The profiler's policy: a static γ that the profiler sets between steps, declaring every γ
    the engine compiled for (so the engine's executables and lookahead stay as they are)."""

    name = "profiler"

    def __init__(self, max_gamma: int, possible: set[int]):
        super().__init__(max_gamma, gamma=0)
        self._possible = set(possible)

    def possible_gammas(self) -> set[int]:
        return self._possible


def host_signature() -> str:
    """The host CPU's model and the cores this process may run on, e.g. "AMD EPYC (family 25
    model 1) x2": a step's cost depends on them (on a CPU backend they are the device; on an
    accelerator they run the host's share), and a cache directory shared between machines (a
    home directory on a network file system) must not hand one machine's profile to another.
    Family and model numbers are part of it because a virtual machine may name its CPU only
    "AMD EPYC", whatever the generation."""
    import platform

    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if not line.strip():  # the first processor's block is enough
                    break
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
    except OSError:  # not Linux
        pass
    name = (fields.get("model name") or platform.processor() or platform.machine()
            or "unknown CPU")
    if "cpu family" in fields and "model" in fields:
        name += f" (family {fields['cpu family']} model {fields['model']})"
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return f"{name} x{cores}"


def cache_enabled() -> bool:
    """False when ``JSPEC_PROFILE_CACHE`` turns the cache of measured machine facts off."""
    return os.environ.get("JSPEC_PROFILE_CACHE", "on").lower() not in ("0", "off", "false")


def cache_key(engine) -> str:
    import jax

    rc = engine.rc
    parts = {
        "version": VERSION, "format": FORMAT,
        "target": model_signature(engine.target.cfg),
        "weight_layout": engine.target.cfg.weight_layout,
        "layer_buffers": engine.target.cfg.layer_buffers,
        "min_dot_rows": [engine.target.cfg.min_dot_rows, engine.draft.cfg.min_dot_rows],
        "draft": model_signature(engine.draft.cfg),
        "backend": jax.default_backend(), "device": jax.devices()[0].device_kind,
        "host": host_signature(),
        "kv_dtype": str(engine.runner.kv_dtype), "max_num_seqs": engine.config.max_num_seqs,
        "max_num_batched_tokens": rc.max_num_batched_tokens,
        "block_size": engine.config.block_size, "gamma_buckets": list(engine.gamma_buckets),
        # a benchmark's synthetic acceptance (jspec/synthetic.py) changes what steps accept
        "synthetic_acceptance": getattr(engine.runner, "synthetic_acceptance", None),
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:20]


def engine_profile(engine, log=None) -> StepProfile:
    """The cached profile for this engine, or a fresh measurement (then cached). Says what it
    did on ``log`` (default: stderr)."""
    log = log or sys.stderr
    from jspec.default_models import cache_dir

    use_cache = cache_enabled()
    path = cache_dir() / "profiles" / f"{cache_key(engine)}.json"
    if use_cache and path.exists():
        try:
            profile = StepProfile.load(path)
            profile.check_models(model_signature(engine.target.cfg),
                                 model_signature(engine.draft.cfg))
            return profile
        except ValueError as e:  # a damaged cache entry: measure again and overwrite it
            print(f"jspec: ignoring cached step profile {path}: {e}", file=log)
    t0 = time.perf_counter()
    profile = measure(engine)
    if use_cache:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        profile.save(tmp)
        os.replace(tmp, path)  # never a half-written profile
    print(f"jspec: measured the step-time profile for policy {engine.policy.name!r} in "
          f"{time.perf_counter() - t0:.1f} s"
          + (f" (cached in {path})" if use_cache else ""), file=log, flush=True)
    return profile


def measure(engine, context: int = CONTEXT, steps: int = STEPS) -> StepProfile:
    """Time the engine's own steps over the grid (see the module docstring). The engine is
    left as it was: its policy, metrics and request counters are restored, the profiling
    requests aborted and their KV blocks freed."""
    import jax

    if engine.draft is None:
        raise ValueError("a step profile needs a draft model")
    if engine.has_unfinished_requests():
        raise RuntimeError("measure a step profile before serving any request")
    grid = _plan_grid(engine, context, steps)
    forced = ForcedGamma(engine.max_gamma,
                         engine.policy.possible_gammas() | set(grid.gammas))
    seqs = _ProfileSequences(engine, forced, grid)
    target_time = np.zeros((len(grid.batch_sizes), len(grid.gammas), 1))
    draft_time = np.zeros((len(grid.batch_sizes), 1))
    catch_up = np.zeros((len(CATCH_UP_LENS), len(grid.batch_sizes)))
    # measuring: every stage is synced, so a step's draft_time is the loop's device time, not
    # its dispatch; otherwise the draft's cost lands in target_time's γ > 0 entries and a
    # verifier (AdaSpec's select) would think that dropping a drafted token saves the draft
    # forward that produced it. The profiling steps are not served (fresh metrics).
    with engine.probe.measuring(forced):
        try:
            for bi, batch in enumerate(grid.batch_sizes):
                seqs.fresh(batch)
                target_time[bi, :, 0], draft_time[bi, 0] = _measure_gammas(seqs, batch)
                if engine.max_gamma:
                    catch_up[:, bi] = _measure_catch_up(seqs, batch)
        finally:
            seqs.abort()
    device = f"{jax.default_backend()}: {jax.devices()[0].device_kind} ({host_signature()})"
    return StepProfile(model_signature(engine.target.cfg), model_signature(engine.draft.cfg),
                       device, str(engine.runner.kv_dtype), grid.batch_sizes,
                       [g + 1 for g in grid.gammas], [grid.context], list(CATCH_UP_LENS),
                       target_time, draft_time, catch_up)


@dataclasses.dataclass(frozen=True)
class _Grid:
    """What ``measure`` times and the room a measuring sequence needs for it."""

    context: int  # prompt tokens of each measuring sequence
    steps: int  # measured steps per (B, γ)
    gammas: list[int]
    batch_sizes: list[int]
    # tokens a sequence gains while one γ is measured (each step emits up to γ + 1) and during
    # the catch-up rounds; sequences are replaced by fresh ones when the next round would not fit
    need: dict[int, int]
    need_catch_up: int
    # a measuring sequence never holds more than its prompt plus one round's growth (fresh()
    # replaces it before the next round would not fit)
    cap: int


def _plan_grid(engine, context: int, steps: int) -> _Grid:
    """The grid for this engine: the context its max_model_len leaves room for and the batch
    sizes its KV cache holds (ValueError when it is too small for any)."""
    rc = engine.rc
    max_gamma = engine.max_gamma
    gammas = list(range(max_gamma + 1))
    need = {g: (g + 1) * (steps + 1) for g in gammas}
    # the catch-up rounds, plus the step that lets the draft read fresh sequences' prompts
    need_catch_up = sum(CATCH_UP_LENS) + 2 * len(CATCH_UP_LENS) + 2
    widest = max(max(need.values()), need_catch_up) + max_gamma + 1
    context = max(1, min(context, rc.max_model_len // 4, rc.max_model_len - widest - 1))
    if context + widest >= rc.max_model_len:
        raise ValueError(f"max_model_len {rc.max_model_len} is too short to measure a step "
                         f"profile (needs about {widest + 2} tokens per sequence); pass one "
                         f"made by `jspec profile` with --policy-option profile=PROFILE.json")
    cap = context + widest + max_gamma + 1
    blocks_per_seq = -(-cap // engine.config.block_size) + 1
    usable = engine.block_manager.num_usable_blocks
    top = min(engine.config.max_num_seqs, usable // blocks_per_seq)
    if top < 1:
        raise ValueError("the KV cache is too small to measure a step profile")
    batch_sizes = [b for b in (1 << k for k in range(top.bit_length())) if b <= top]
    if batch_sizes[-1] != top:
        batch_sizes.append(top)
    return _Grid(context=context, steps=steps, gammas=gammas, batch_sizes=batch_sizes,
                 need=need, need_catch_up=need_catch_up, cap=cap)


class _ProfileSequences:
    """The sequences ``measure`` decodes, replaced by fresh ones when a round would not fit."""

    def __init__(self, engine, forced: ForcedGamma, grid: _Grid):
        from jspec.sampling_params import SamplingParams

        self.engine, self.forced, self.grid = engine, forced, grid
        rng = np.random.default_rng(0)
        vocab = engine.target.cfg.vocab_size
        # as long as the context allows: fresh() replaces the sequences before they get there
        self.sp = SamplingParams(max_tokens=engine.limits.context_limit - grid.context,
                                 temperature=0.0, ignore_eos=True, seed=0)
        self.ids: list[str] = []
        self.serial = 0
        # One prompt per row, drawn once: a replacement sequence starts with the prompt of the
        # one it replaces, so with prefix caching its prefill reads all but the prompt's last
        # block from the cache. The grid replaces its sequences about 27 times, and prefilling
        # each set afresh took two thirds of the measurement (21.6 of 32.1 s for the built-in
        # pair).
        self.prompts = [rng.integers(0, vocab, grid.context).tolist()
                        for _ in range(grid.batch_sizes[-1])]

    def fresh(self, batch: int) -> None:
        """Replace the running sequences by ``batch`` new ones, prefilled and decoding."""
        engine = self.engine
        if self.ids:
            engine.abort_request(self.ids)
            engine.step()  # deliver the aborts
        self.ids = [f"__jspec-profile-{self.serial}-{i}" for i in range(batch)]
        self.serial += 1
        for rid, prompt in zip(self.ids, self.prompts):
            engine.add_request(rid, prompt, self.sp)
        self.forced.gamma = 0
        while engine.scheduler.num_waiting or any(not s.is_decoding
                                                  for s in engine.scheduler.running):
            engine.step()

    def room(self) -> int:
        return self.grid.cap - max(s.num_tokens for s in self.engine.scheduler.running) - 1

    def abort(self) -> None:
        """End the profiling requests (their KV blocks freed)."""
        if self.ids:
            self.engine.abort_request(self.ids)
            self.engine.step()


def _measure_gammas(seqs: _ProfileSequences, batch: int) -> tuple[list[float], float]:
    """At one batch size: the median step time less the draft loop and its catch-up per γ, and
    the draft loop's time per draft forward at the largest γ (0 when Γmax is 0)."""
    engine, forced, grid = seqs.engine, seqs.forced, seqs.grid
    max_gamma = engine.max_gamma
    target_times, draft_time = [], 0.0
    for gamma in grid.gammas:
        if seqs.room() < grid.need[gamma] + max_gamma:
            seqs.fresh(batch)
        forced.gamma = gamma
        engine.step()  # settle: the draft catches up after γ = 0, compiles if lazy
        rest, drafts = [], []
        for _ in range(grid.steps):
            engine.step()
            o = engine.last_outcome
            rest.append(o.step_time - o.draft_time - o.catch_up_time)
            drafts.append(o.draft_time)
        target_times.append(statistics.median(rest))
        if gamma == max_gamma and gamma > 0:
            draft_time = statistics.median(drafts) / engine.last_step.gamma
    return target_times, draft_time


def _measure_catch_up(seqs: _ProfileSequences, batch: int) -> list[float]:
    """At one batch size: the catch-up time after each lag of CATCH_UP_LENS."""
    engine, forced = seqs.engine, seqs.forced
    if seqs.room() < seqs.grid.need_catch_up + engine.max_gamma:
        seqs.fresh(batch)
        # the draft has not read the new prompts yet: one drafting step lets it, or the first
        # lag below would time the prompts' catch-up instead
        forced.gamma = 1
        engine.step()
    return [_catch_up_step(engine, forced, lag).catch_up_time for lag in CATCH_UP_LENS]


def _catch_up_step(engine, forced: ForcedGamma, lag: int):
    """``lag`` - 1 steps at γ = 0, then one at γ = 1, whose outcome holds the catch-up the draft
    needed after lagging ``lag`` tokens (the draft must be level with the target before)."""
    forced.gamma = 0
    for _ in range(lag - 1):
        engine.step()
    forced.gamma = 1
    engine.step()
    return engine.last_outcome
