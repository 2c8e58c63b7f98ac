"""LLMEngine: requests in, ``RequestOutput``s out, one pipelined step at a time.

A step: memory tick → schedule → plan → propose → (select) → verify and accept → commit →
observe. Each stage lives in the module named for it: ``elastic`` (memory), ``scheduler``,
``planner`` (the policy's plan and select), ``proposers`` (the drafters), ``executor`` (the
target's verification on device), ``commit`` and ``output_processor`` (tokens, stops, text),
``step_record`` (the one per-step record every observer reads); ``overlap`` wraps dispatch and
fetch for asynchronous scheduling. The host side is plain Python/numpy; the device work is a
few compiled calls and one host<-device transfer of the step's results.
"""

from __future__ import annotations

import dataclasses
import gc
import time
from typing import Callable, Iterable


from jspec import commit, engine_setup, policy_state
from jspec.block_manager import PrefixCacheStats
from jspec.commit import Committer
from jspec.config import EngineConfig, gamma_buckets
from jspec.distributed import EngineEvents, StepSync
from jspec.elastic import ElasticController
from jspec.engine_info import EngineLimits, EngineStats
from jspec.engine_probe import EngineProbe
from jspec.executor import Executor
from jspec.input_processor import InputProcessor
from jspec.metrics import EngineMetrics
from jspec.output_processor import OutputProcessor
from jspec.outputs import RequestOutput
from jspec.overlap import AsyncSteps, SyncSteps
from jspec.planner import Planner, Speculation
from jspec.proposers import make_proposers
from jspec.runner import CompileSpec, LoadedModel, ModelRunner
from jspec.sampling_params import SamplingParams
from jspec.step_record import StepRecord, build_record
from jspec.step_state import Fetched, StageClock, StepState
from jspec.policies import Policy


def freeze_heap() -> None:
    """Take every object alive now out of the cyclic garbage collector's walks (``gc.freeze``).
    After a warm-up that is the models, the compiled executables and the tokenizer: some 400k
    objects for the built-in pair, which every full collection would walk again while requests
    wait (215-265 ms a time on the 2-vCPU AMD EPYC, every time the heap has grown by a
    quarter). What is allocated afterwards is collected as before. What was frozen and became
    cyclic garbage since (an engine dropped in a notebook) is collected first: the heap is
    thawed, collected and frozen again, so engines built one after another do not pile up."""
    gc.unfreeze()
    gc.collect()
    gc.freeze()


class LLMEngine:
    def __init__(self, target: LoadedModel,
                 draft: "LoadedModel | list[LoadedModel] | tuple[LoadedModel, ...] | None",
                 config: EngineConfig | None = None, tokenizer=None,
                 policy: Policy | None = None):
        config = config or EngineConfig()
        pool = engine_setup.draft_pool(target, draft)
        target, pool = engine_setup.lay_out_weights(config, target, pool)
        # a lookup drafts from the sequences' own tokens: no draft model
        self.lookups = engine_setup.check_lookup(config, pool)
        if not pool and not self.lookups:
            # Without a draft there is nothing to speculate with: plain decoding, no lookahead.
            config = dataclasses.replace(config, num_speculative_tokens=0, policy="off")
        self.config, self.tokenizer, self.target = config, tokenizer, target
        policy, self.pool_names = engine_setup.engine_policy(config, policy, target, pool)
        self.max_gamma = config.num_speculative_tokens
        engine_setup.check_pool(config, pool)
        kv_dtype = engine_setup.kv_dtype_of(config, target)
        self.rc, memory = engine_setup.size_cache(config, target, pool, kv_dtype)
        speculates = bool(pool) or bool(self.lookups)
        chains = engine_setup.check_chains(
            policy, len(self.pool_names) if speculates else 0, len(pool),
            frozenset(i for i, m in enumerate(pool) if m.eagle is not None))
        self.gamma_buckets = gamma_buckets(policy.possible_gammas(), self.max_gamma) \
            if speculates and chains else (0,)
        policy.set_gamma_buckets(self.gamma_buckets)  # the shapes its plans will run at
        self.block_manager, self.scheduler = engine_setup.make_scheduler(
            self.rc, [target, *pool], max(policy.possible_gammas()))
        self.runner = ModelRunner(target, pool, self.rc, kv_dtype, CompileSpec(
            self.gamma_buckets, signals=policy.signals if pool else (),
            draft_stats=policy.wants_draft_stats,
            chains=frozenset(c for c in chains if c and c[0] < len(pool)),
            lookup=any(c and c[0] >= len(pool) for c in chains)))
        self.elastic = None if memory is None else ElasticController(
            memory, self.runner, self.block_manager, self.scheduler)
        self.planner = Planner(self.rc, self.scheduler, self.block_manager, policy, Speculation(
            self.gamma_buckets, chains, make_proposers(self.runner, chains, config, len(pool)),
            self.max_gamma, drafts=speculates and max(policy.possible_gammas()) > 0,
            num_models=len(pool)))
        self.planner.decide = self._decide
        self.planner.draft_resident = lambda: self.draft_resident
        self.chains = chains
        self.executor = Executor(self.runner, self.rc)
        self.planner.head_share = self.executor.head_share
        self.outputs = OutputProcessor(tokenizer, target.cfg.eos_token_ids)
        self.committer = Committer(self.scheduler, self.block_manager, self.outputs)
        self.inputs = InputProcessor(tokenizer, len(pool), config.seed)
        self.reset_metrics()
        self.last_outcome: StepRecord | None = None
        self.last_step: StepState | None = None  # the last step's state (benchmarks replay it)
        # when the last committed step's results reached the host (None: idle since)
        self._last_done: float | None = None
        # committed steps whose records wait for the next dispatch (``observe_pending``)
        self._unobserved: list[tuple] = []
        self.overlap = AsyncSteps(self) if config.async_scheduling else SyncSteps(self)
        self.probe = EngineProbe(self)  # benchmarks' and the step-time profile's hooks
        self._step_listeners: list[Callable[[StepRecord], None]] = []
        # several hosts (jspec/distributed.py): the leader's requests, aborts and policy
        # decisions, shared so that every process runs the same steps
        self.sync: EngineEvents | None = None
        # benchmarks: sync between device stages so StepRecord.stage_times splits them exactly
        self.time_stages = False
        if config.warmup:
            self.warmup()
            self.ensure_profile()

    # ------------------------------------------------------------------ state shared by stages
    @property
    def policy(self) -> Policy:
        return self.planner.policy

    @policy.setter
    def policy(self, policy: Policy) -> None:
        self.planner.policy = policy

    @property
    def metrics(self) -> EngineMetrics:
        return self._metrics

    @metrics.setter
    def metrics(self, metrics: EngineMetrics) -> None:
        self._metrics = self.planner.metrics = self.committer.metrics = metrics
        if self.elastic is not None:
            self.elastic.metrics = metrics

    @property
    def stream_outputs(self) -> bool:
        """Whether every step returns the running requests' deltas (streaming) or only the
        finished requests (offline generation: less host time per step)."""
        return self.outputs.stream

    @stream_outputs.setter
    def stream_outputs(self, value: bool) -> None:
        self.outputs.stream = bool(value)

    @property
    def draft(self) -> LoadedModel | None:
        """The draft model (None without one); while elastic memory has it offloaded, its
        params are the host copy. The runner holds it: offload and reload replace it there."""
        return self.runner.draft

    @property
    def speculates(self) -> bool:
        """Whether anything can draft: a draft model, or a lookup."""
        return bool(self.lookups) or self.draft is not None

    @property
    def draft_resident(self) -> bool:
        """Whether the drafter can run this step (False while elastic memory has the draft
        model offloaded or its reload is still in flight; a lookup is always there)."""
        if self.lookups and self.draft is None:
            return True
        return self.draft is not None and (self.elastic is None or self.elastic.draft_resident)

    def reset_metrics(self) -> EngineMetrics:
        """Start the counters afresh (after a warm-up that should not count); returns them."""
        bm = self.block_manager
        bm.stats = PrefixCacheStats(bm.num_pool_models)
        self.metrics = EngineMetrics(max_gamma=self.max_gamma, pool_names=self.pool_names,
                                     prefix_cache=bm.stats)
        return self.metrics

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix (vLLM's name), e.g. so that a benchmark's warm-up requests
        do not serve the measured ones; running requests keep their blocks. Returns how many
        blocks were cached."""
        return self.block_manager.reset_prefix_cache()

    def reset_suffix_cache(self) -> int:
        """Forget the finished requests' outputs that suffix decoding drafts from, e.g. so that
        a benchmark's warm-up requests do not hand the measured ones their own outputs as
        drafts; running requests join the cache when they finish. Returns how many outputs
        were forgotten (0 without suffix decoding)."""
        return sum(p.reset_cache() for p in self.planner.spec.proposers.values())

    # ------------------------------------------------------------------ policy state
    def save_policy_state(self, path: str) -> None:
        """Write the policy's learned state (bandit statistics, EMAs) as JSON, so a restarted
        engine can continue from it (``load_policy_state``)."""
        policy_state.save(self.policy, path)

    def load_policy_state(self, path: str) -> None:
        policy_state.load(self.policy, path)

    # ------------------------------------------------------------------ requests
    def warmup(self, progress=None, max_rows: int | None = None) -> int:
        """Compile every shape the engine can reach (``max_rows``: only those that steps of at
        most that many sequences reach); returns how many. Then freeze the heap
        (``freeze_heap``)."""
        n = self.runner.warmup(progress, max_rows)
        freeze_heap()
        return n

    def ensure_profile(self) -> None:
        """Hand a policy that reasons from a step-time profile (``needs_profile``) and was given
        none the one cached for this engine, or one measured now (jspec/autoprofile.py). Called
        after the warm-up, so that the measurement times steps rather than compilations; an
        engine that is never warmed up measures before its first request, compiling on the
        way. Does nothing once the policy has a profile."""
        if self.policy.needs_profile and self.policy.profile is None and self.draft is not None:
            from jspec.autoprofile import engine_profile

            self.policy.set_profile(engine_profile(self))

    def validate_request(self, prompt: str | list[int], sampling_params: SamplingParams,
                         cache_salt: str | None = None) -> list[int]:
        """Tokenize and check a request; raise ValueError naming the problem before anything
        runs (the server's checks are these same ones: ``jspec.request_checks``,
        ``EngineLimits``)."""
        return self.inputs.validate(prompt, sampling_params, cache_salt, self.limits)

    def refuse_logprobs(self, reason: str) -> None:
        """From now on refuse requests for logprobs, saying ``reason`` (a benchmark's
        transform that rewrites the sampled tokens: jspec/synthetic.py)."""
        self.inputs.logprobs_refusal = reason
        self.__dict__.pop("_limits", None)  # max_logprobs is 0 now

    def add_request(self, request_id: str, prompt: str | list[int],
                    sampling_params: SamplingParams | None = None,
                    arrival_time: float | None = None, *, cache_salt: str | None = None
                    ) -> None:
        """Queue a request. ``cache_salt`` (vLLM's per-request salt): the request shares
        prefix-cache blocks only with requests that gave the same salt (and a request without
        one only with others without), so tenants given distinct salts cannot time each other's
        prefixes."""
        sampling_params = sampling_params or SamplingParams()
        if request_id in self.outputs.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        token_ids = self.validate_request(prompt, sampling_params, cache_salt)
        self.ensure_profile()
        seq = self.inputs.sequence(request_id, token_ids, sampling_params, arrival_time,
                                   cache_salt)
        self.outputs.add(seq, prompt if isinstance(prompt, str) else None, seq.arrival_time)
        self.scheduler.add(seq)
        if self.sync is not None:
            self.sync.record("add", request_id, token_ids, sampling_params, cache_salt)

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        if self.sync is not None:
            self.sync.record("abort", ids)
        for rid in ids:
            req = self.outputs.requests.get(rid)
            if req is None:
                continue
            self.scheduler.abort(rid)  # the sequence's status becomes FINISHED_ABORTED
            self.metrics.num_requests_aborted += 1
            self.outputs.pending.append(self.outputs.finish(req))

    def drop_requests(self) -> list[str]:
        """End every request without an output and forget the step in flight: what a caller
        does after ``step`` raised and it has failed the requests itself (the engine's state
        is then not known to be fit for another step). The queues empty and the requests' KV
        blocks go back to the pool, so ``stats()`` says nothing runs. Returns their ids."""
        self.overlap.drop()
        self.observe_pending()  # the steps committed before the failure
        self.outputs.take_pending()
        scheduler = self.scheduler
        dropped = [seq.request_id for seq in scheduler.running + scheduler.waiting]
        for request_id in dropped:
            scheduler.abort(request_id)
        self.outputs.requests.clear()
        return dropped

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    @property
    def num_unfinished_requests(self) -> int:
        return self.scheduler.num_waiting + self.scheduler.num_running

    # ------------------------------------------------------------------ observers, hosts
    def add_step_listener(self, fn: Callable[[StepRecord], None]) -> None:
        """Call ``fn(outcome)`` after every step that ran (on the engine's thread)."""
        # the list is replaced, never changed in place: a step iterating the old one is unharmed
        self._step_listeners = self._step_listeners + [fn]

    def remove_step_listener(self, fn: Callable[[StepRecord], None]) -> None:
        listeners = list(self._step_listeners)
        listeners.remove(fn)
        self._step_listeners = listeners

    def set_step_sync(self, sync: StepSync) -> None:
        """Run as one of several processes (jspec/distributed.py): as the leader, publish
        every step's requests, aborts and policy decisions; as a follower, take them from the
        leader (a follower's own add_request / abort_request calls are the replayed ones)."""
        self.sync = EngineEvents(sync)

    def _decide(self, decide: Callable):
        """A policy decision: the leader's on every process of a multi-process run."""
        return decide() if self.sync is None else self.sync.decide(decide)

    # ------------------------------------------------------------------ the step
    def step(self) -> list[RequestOutput]:
        """One engine step; returns the outputs committed (``jspec/overlap.py``: with
        asynchronous scheduling, a step's commit may come with the next call)."""
        if self.sync is not None:
            self.sync.replay(self)                      # the leader's requests and aborts
        self._memory_tick()
        outputs = self.outputs.take_pending()
        self.overlap.begin(outputs)                     # the in-flight step: held, or committed
        clock = StageClock(sync=self.time_stages or self.policy.timed_stages)
        sched = self._schedule(clock)
        if not sched.scheduled:
            self.observe_pending()
            return outputs
        st = self.overlap.planned(self._plan(sched, clock), outputs, clock)
        if st is None:                                  # every sequence ended at the step before
            self.observe_pending()
            return outputs
        self._propose(st, clock)
        self._verify(st, clock, outputs)
        self.executor.accept(st, clock)
        self.planner.after_dispatch(st)                 # drafters' host work, device busy
        self.observe_pending()                          # the steps before it, device busy
        clock.lap("deferred")
        return outputs + self.overlap.finish(st)        # fetch → commit → observe, or in flight

    def _memory_tick(self) -> None:
        if self.elastic is not None:
            self.elastic.tick()

    def _schedule(self, clock: StageClock):
        sched = self.scheduler.schedule()
        self.metrics.num_preemptions += len(sched.preempted)
        clock.lap("schedule")
        return sched

    def _plan(self, sched, clock: StageClock) -> StepState:
        st = self.planner.plan(sched)
        st.clock = clock
        clock.lap("plan")
        return st

    def _propose(self, st: StepState, clock: StageClock) -> None:
        """The chain's proposer catches up and drafts; the policy may trim the draft."""
        if not st.gamma:
            return
        st.catch_up_tokens += st.proposer.catch_up(st)
        clock.lap("catch_up")  # synced: its time is Nightjar's switching cost
        st.proposer.propose(st)
        self.planner.select(st)
        clock.lap("draft", st.num_drafted)
        st.proposer.refine(st, clock)

    def _verify(self, st: StepState, clock: StageClock, outputs: list) -> None:
        """The target's pass; the in-flight step (if any) commits while it runs."""
        self.executor.verify(st, self.overlap.carry(st))
        clock.lap("verify", st.logits)
        self.overlap.dispatched(st, outputs)

    def complete(self, st: StepState) -> list[RequestOutput]:
        """Read back a dispatched step's results, commit them and record the step."""
        clock = st.clock
        clock.skip()  # since its dispatch the host did other work (the next step's, a caller's)
        # the step's one host<-device transfer of results (a stage of the commit; it also
        # waits for whatever device work is still running, so it counts as verify time)
        t_fetch = time.perf_counter()
        fetched = Fetched(*self.runner.fetch(st.result, st.signals, st.num_drafted,
                                             st.draft_tokens, st.row_gammas(), st.logprobs))
        if st.gamma:
            st.proposer.read_back(st)
        done = time.perf_counter()
        st.fetch_time = done - t_fetch
        if self._last_done is not None:
            # while the engine is busy a step costs the interval between the previous step's
            # results and its own: a step left in flight ran on the device while the host worked
            # on the next one, which its own laps miss, and the host's work between steps (the
            # commit of the step before, the caller's) is paid per step whatever it drafted
            clock.period = done - self._last_done
        self._last_done = done
        if st.held:
            commit.release(st)
        outputs = self.committer.commit(st, fetched.result, fetched.drafted, fetched.logprobs)
        st.tokens = fetched.result.tokens
        clock.lap("commit")
        sched = self.scheduler
        observation = (st, fetched, clock, (sched.num_running, sched.num_waiting))
        self.last_step = st
        st.drop_device_buffers()
        if self.overlap.defers_observation():
            # recorded once the next step is dispatched, while the device runs it
            self._unobserved.append(observation)
        else:
            self._observe(*observation)
        if not sched.has_unfinished():
            self._last_done = None  # idle from now on: the next step is timed by its laps
            self.observe_pending()  # every record in place before the caller looks
            if self.elastic is not None:
                self.elastic.tick()  # contract while nothing runs
        return outputs

    def observe_pending(self) -> None:
        """Record the committed steps whose records wait for the device's next step."""
        pending, self._unobserved = self._unobserved, []
        for observation in pending:
            self._observe(*observation)

    def _observe(self, st: StepState, fetched: Fetched, clock: StageClock,
                 queue: tuple[int, int]) -> None:
        """The step's one record: to the metrics, elastic memory, the policy and the step
        listeners."""
        outcome = build_record(st, fetched, clock, queue, self.planner.spec.num_models)
        self.metrics.observe(outcome)
        if self.elastic is not None:
            self.elastic.observe(outcome.num_decode > 0, st.gamma, self.config.max_num_seqs)
        if outcome.num_decode and self.speculates:
            t_policy = time.perf_counter()
            self.policy.observe(outcome)
            self.metrics.policy_time += time.perf_counter() - t_policy
        self.last_outcome = outcome
        for fn in self._step_listeners:
            fn(outcome)

    # ------------------------------------------------------------------ accessors (serve/, bench)
    # The engine's read-only surface for the server, the CLI and the benchmarks (they never
    # reach into the scheduler, the block manager or the resolved config).
    @property
    def limits(self) -> EngineLimits:
        """What the engine can hold (fixed once it is built; computed on first use)."""
        limits = self.__dict__.get("_limits")
        if limits is None:
            limits = self._limits = EngineLimits.of(self)
        return limits

    def stats(self) -> EngineStats:
        """A snapshot of the load, the KV cache and the counters; safe to call from another
        thread while the engine steps (each value is read whole; see EngineStats)."""
        return EngineStats.of(self)
