"""LLMEngine: one engine step = schedule, plan, draft, (select), verify, accept, observe, commit.

The host side is plain Python/numpy; the device work is three compiled calls at most (draft
catch-up, the draft loop, verify-and-sample) and one host<-device transfer of the step's results.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import time
from typing import Callable, Iterable

import jax
import numpy as np

from jspec import input_batch as ib
from jspec.block_manager import BlockManager, PrefixCacheStats
from jspec.config import EngineConfig, gamma_bucket, gamma_buckets, resolve
from jspec.detokenizer import IncrementalDetokenizer, find_stop
from jspec.distributed import StepSync
from jspec.elastic import DraftState, ElasticMemory, extension_blocks, tree_bytes
from jspec.engine_info import EngineLimits, EngineStats
from jspec.jsonfile import read_json
from jspec.metrics import EngineMetrics
from jspec.outputs import Logprob, RequestOutput, SpecStats
from jspec.platform import device_free_bytes
from jspec.request_checks import check_cache_salt, check_prompt
from jspec.runner import LoadedModel, ModelRunner
from jspec.sampling_params import SamplingParams
from jspec.scheduler import Scheduler, SchedulerConfig
from jspec.sequence import PENDING_TOKEN, Sequence, SequenceStatus
from jspec.step_state import StageClock, StepState
from jspec.models.sharding import check_shardable
from jspec.models.transformer import KVCache
from jspec.policies import BatchView, DraftStats, Policy, StepOutcome, make_policy
from jspec.policies.profile import StepProfile, model_signature
from jspec.policies.static import OffPolicy


@dataclasses.dataclass(eq=False)
class _Request:
    seq: Sequence
    prompt: str | None
    detok: IncrementalDetokenizer
    max_tokens: int  # the request's, which validate_request checked fits in the context
    arrival_time: float
    text_end: int | None = None  # text cut at a stop string
    finish_time: float | None = None
    last_text_len: int = 0
    last_num_tokens: int = 0
    # per output token {token id: Logprob} when the request asked for logprobs (append-only,
    # shared with its RequestOutputs like the token list)
    logprobs: list | None = None


def _draft_pool(target: LoadedModel, draft) -> list[LoadedModel]:
    """The draft models as a pool, smallest first (by parameter count: SpecRouter's chains run
    from small to large), each sharing the target's vocabulary and named uniquely."""
    if draft is None:
        return []
    pool = [draft] if isinstance(draft, LoadedModel) else list(draft)
    for m in pool:
        if not isinstance(m, LoadedModel):
            raise ValueError(f"a draft must be a LoadedModel, got {type(m).__name__}")
        if m.cfg.vocab_size != target.cfg.vocab_size:
            which = "draft" if len(pool) == 1 else f"draft {m.name!r}"
            raise ValueError(
                f"{which} vocabulary ({m.cfg.vocab_size} tokens) differs from the target's "
                f"({target.cfg.vocab_size}); speculative decoding needs a shared vocabulary")
    pool.sort(key=lambda m: m.cfg.num_params())
    names = [m.name for m in pool]
    if len(set(names)) < len(names):
        # same basename from different directories: number them, smallest first
        for i, m in enumerate(pool):
            pool[i] = dataclasses.replace(m, name=f"{m.name}{i}")
    return pool


def _check_chains(policy: Policy, pool_size: int) -> frozenset[tuple[int, ...]]:
    """The chains the policy may play, checked against the pool: indices in range, strictly
    increasing (each level a larger model than the one it verifies), at most two drafts."""
    if not pool_size:
        return frozenset()
    chains = frozenset(tuple(int(m) for m in c) for c in policy.possible_chains())
    for c in chains:
        if (len(c) > 2 or any(not 0 <= m < pool_size for m in c)
                or any(a >= b for a, b in zip(c, c[1:]))):
            raise ValueError(f"policy {policy.name!r} may play chain {c}, which the pool of "
                             f"{pool_size} draft(s) cannot run (pool indices, smallest model "
                             f"first, increasing, at most two drafts)")
    return chains


class LLMEngine:
    def __init__(self, target: LoadedModel,
                 draft: "LoadedModel | list[LoadedModel] | tuple[LoadedModel, ...] | None",
                 config: EngineConfig | None = None, tokenizer=None,
                 policy: Policy | None = None):
        config = config or EngineConfig()
        pool = _draft_pool(target, draft)
        draft = pool[0] if pool else None
        if not pool:
            # Without a draft there is nothing to speculate with: plain decoding, no lookahead.
            config = dataclasses.replace(config, num_speculative_tokens=0, policy="off")
        self.config = config
        self.tokenizer = tokenizer
        self.policy = policy or make_policy(config.policy, config.num_speculative_tokens,
                                            **config.policy_kwargs)
        if draft is None and not isinstance(self.policy, OffPolicy):
            self.policy = OffPolicy(0)
        # names of the pool's models, as chains, policy options and metrics call them: one
        # draft is "draft" whatever it was loaded as
        self.pool_names = tuple(m.name for m in pool) if len(pool) > 1 else ("draft",)
        self.policy.set_pool(self.pool_names)
        self.chains = _check_chains(self.policy, len(pool))
        if len(pool) > 1 and config.elastic_memory:
            raise ValueError("elastic_memory offloads one draft model; it does not support a "
                             f"pool of {len(pool)} drafts yet")
        if len(pool) > 1 and config.synthetic_acceptance is not None:
            raise ValueError("synthetic_acceptance models one draft's acceptance; it does not "
                             f"support a pool of {len(pool)} drafts")
        self.max_gamma = config.num_speculative_tokens
        profile = getattr(self.policy, "profile", None)
        if isinstance(profile, StepProfile) and draft is not None:
            profile.check_models(model_signature(target.cfg), model_signature(draft.cfg))
        if self.policy.max_gamma > self.max_gamma:
            raise ValueError(f"policy max_gamma={self.policy.max_gamma} exceeds "
                             f"num_speculative_tokens={self.max_gamma}")
        # the KV cache takes the models' dtype unless one is forced
        kv_dtype = (np.dtype(jax.tree_util.tree_leaves(target.params)[0].dtype)
                    if config.dtype == "auto" else np.dtype(jax.numpy.dtype(config.dtype)))
        # tensor parallel: each device holds 1/N of the target's KV heads (models/sharding.py),
        # so block bytes, the memory budget and the free memory are all per device
        tp = config.tensor_parallel_size
        if tp > 1:
            check_shardable(target.cfg, tp)
        target_block_bytes = KVCache.bytes_per_block(target.cfg, config.block_size, kv_dtype)
        # every pool model keeps its own KV pool over the same block ids
        draft_block_bytes = sum(KVCache.bytes_per_block(m.cfg, config.block_size, kv_dtype)
                                for m in pool)
        # on an accelerator the pool is sized from the memory left once the weights are loaded
        free = device_free_bytes() if config.num_kv_blocks is None else None
        self.rc = resolve(config, target.cfg.max_position_embeddings,
                          target_block_bytes // tp + draft_block_bytes, free)
        self.elastic: ElasticMemory | None = None
        self._reload_started = 0.0
        if config.elastic_memory:
            if draft is None:
                raise ValueError("elastic_memory offloads the draft model to grow the KV cache; "
                                 "it needs a draft")
            num_ext = extension_blocks(tree_bytes(draft.params), draft_block_bytes,
                                       target_block_bytes, self.rc.num_kv_blocks)
            self.rc = dataclasses.replace(self.rc, num_extension_blocks=num_ext)
            self.elastic = ElasticMemory(self.rc.num_kv_blocks - 1, num_ext,
                                         config.elastic_low_watermark,
                                         config.elastic_persist_steps)
        self.gamma_buckets = gamma_buckets(self.policy.possible_gammas(), self.max_gamma) \
            if draft is not None and self.chains else (0,)
        self.block_manager = BlockManager(
            self.rc.num_kv_blocks + self.rc.num_extension_blocks, config.block_size,
            self.rc.num_extension_blocks, enable_caching=config.enable_prefix_caching,
            num_pool_models=max(1, len(pool)),
            namespace=repr([model_signature(m.cfg) for m in [target, *pool]]).encode())
        self.scheduler = Scheduler(SchedulerConfig(
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=self.rc.max_num_batched_tokens,
            max_model_len=self.rc.max_model_len,
            # reserve only what the policy can ever use (none for "off")
            lookahead_slots=max(self.policy.possible_gammas()),
            enable_chunked_prefill=config.enable_chunked_prefill,
        ), self.block_manager)
        runner_cls = ModelRunner
        if config.synthetic_acceptance is not None and draft is not None:
            from jspec.synthetic import parse_acceptance, synthetic_runner

            runner_cls = synthetic_runner(
                ModelRunner, parse_acceptance(config.synthetic_acceptance, seed=config.seed))
        self.runner = runner_cls(target, pool, self.rc, self.gamma_buckets, kv_dtype,
                                 signals=self.policy.signals if draft is not None else (),
                                 draft_stats=self.policy.wants_draft_stats, chains=self.chains)
        self.target = target
        self.reset_metrics()
        self.eos_token_ids = set(target.cfg.eos_token_ids)
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(int(tokenizer.eos_token_id))
        self._requests: dict[str, _Request] = {}
        self._token_texts: dict[int, str] = {}  # Logprob.decoded_token, per token id
        self._arrivals = itertools.count()
        self._seed_rng = np.random.default_rng(config.seed)
        self._pending_outputs: list[RequestOutput] = []
        self.last_outcome: StepOutcome | None = None
        self.last_step: StepState | None = None  # the last step's state (benchmarks replay it)
        # Asynchronous scheduling (vLLM's name): a decode-only γ = 0 step runs while the host
        # commits the one before it, whose sampled tokens feed it on device (``step``).
        self._inflight: StepState | None = None  # dispatched, not yet committed
        # no draft, or a policy that only ever plans γ = 0: no plan to ask for
        self._never_drafts = draft is None or max(self.policy.possible_gammas()) == 0
        self._step_listeners: list[Callable[[StepOutcome], None]] = []
        # several hosts (jspec/distributed.py): the leader's requests, aborts and policy
        # decisions, shared so that every process runs the same steps
        self.sync: StepSync | None = None
        self._events: list[tuple] = []
        # benchmarks: sync between device stages so StepOutcome.stage_times splits them exactly
        self.time_stages = False
        # Streaming callers want every step's deltas; offline generation only the finished
        # requests, and skipping the per-step outputs trims host time per step.
        self.stream_outputs = True
        if config.warmup:
            self.warmup()
            self.ensure_profile()

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

    # ------------------------------------------------------------------ policy state
    def save_policy_state(self, path: str) -> None:
        """Write the policy's learned state (bandit statistics, EMAs) as JSON, so a restarted
        engine can continue from it (``load_policy_state``)."""
        state = {"policy": self.policy.name, "max_gamma": self.policy.max_gamma,
                 "state": self.policy.state_dict()}
        tmp = f"{path}.tmp"
        with open(tmp, "w") as f:
            json.dump(state, f)
        os.replace(tmp, path)  # never leave a half-written file behind

    def load_policy_state(self, path: str) -> None:
        saved = read_json(path, "policy state")
        if not isinstance(saved, dict) or "state" not in saved:
            raise ValueError(f"{path!r} is not a jspec policy state file")
        if saved.get("policy") != self.policy.name:
            raise ValueError(f"policy state {path!r} belongs to policy {saved.get('policy')!r}, "
                             f"the engine runs {self.policy.name!r}")
        self.policy.load_state_dict(saved["state"])

    # ------------------------------------------------------------------ requests
    def warmup(self, progress=None, max_rows: int | None = None) -> int:
        """Compile every shape the engine can reach (``max_rows``: only the decode-only steps
        that steps of at most that many sequences use); returns how many."""
        return self.runner.warmup(progress, max_rows)

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
        if not isinstance(sampling_params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got "
                             f"{type(sampling_params).__name__}")
        check_cache_salt(cache_salt)
        prompt = check_prompt(prompt)
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("a text prompt needs a tokenizer; pass token ids instead")
            token_ids = list(self.tokenizer.encode(prompt))
            if not token_ids:
                raise ValueError("prompt is empty")
        else:
            token_ids = prompt
        vocab = self.target.cfg.vocab_size
        bad = [t for t in token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab})")
        if sampling_params.logprobs is not None:
            self._check_logprobs(sampling_params.logprobs)
        self.limits.check_prompt_length(len(token_ids))
        self.limits.check_max_tokens(len(token_ids), sampling_params.max_tokens)
        return token_ids

    def _check_logprobs(self, k: int) -> None:
        if self.config.synthetic_acceptance is not None:
            raise ValueError("logprobs are not available with synthetic_acceptance: the "
                             "emitted tokens are drawn from an acceptance model, not sampled")
        self.limits.check_logprobs(k)

    def add_request(self, request_id: str, prompt: str | list[int],
                    sampling_params: SamplingParams | None = None,
                    arrival_time: float | None = None, *, cache_salt: str | None = None
                    ) -> None:
        """Queue a request. ``cache_salt`` (vLLM's per-request salt): the request shares
        prefix-cache blocks only with requests that gave the same salt (and a request without
        one only with others without), so tenants given distinct salts cannot time each other's
        prefixes."""
        sampling_params = sampling_params or SamplingParams()
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        token_ids = self.validate_request(prompt, sampling_params, cache_salt)
        self.ensure_profile()
        seed = sampling_params.seed
        if seed is None:
            seed = int(self._seed_rng.integers(0, 2**32))
        now = time.perf_counter() if arrival_time is None else arrival_time
        seq = Sequence(request_id=request_id, prompt_token_ids=token_ids,
                       sampling_params=sampling_params, arrival_index=next(self._arrivals),
                       arrival_time=now, seed=seed, cache_salt=cache_salt,
                       draft_computed=[0] * max(1, len(self.runner.pool)))
        self._requests[request_id] = _Request(
            seq=seq, prompt=prompt if isinstance(prompt, str) else None,
            detok=IncrementalDetokenizer(self.tokenizer), max_tokens=sampling_params.max_tokens,
            arrival_time=now, logprobs=None if sampling_params.logprobs is None else [])
        self.scheduler.add(seq)
        if self.sync is not None and self.sync.leader:
            self._events.append(("add", request_id, token_ids, sampling_params, cache_salt))

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        if self.sync is not None and self.sync.leader:
            self._events.append(("abort", ids))
        for rid in ids:
            req = self._requests.get(rid)
            if req is None:
                continue
            self.scheduler.abort(rid)
            req.seq.status = SequenceStatus.FINISHED_ABORTED
            self.metrics.num_requests_aborted += 1
            self._pending_outputs.append(self._finish(req))

    def drop_requests(self) -> list[str]:
        """End every request without an output and forget the step in flight: what a caller
        does after ``step`` raised and it has failed the requests itself (the engine's state
        is then not known to be fit for another step). The queues empty and the requests' KV
        blocks go back to the pool, so ``stats()`` says nothing runs. Returns their ids."""
        self._inflight = None
        self._pending_outputs = []
        scheduler = self.scheduler
        dropped = [seq.request_id for seq in scheduler.running + scheduler.waiting]
        for request_id in dropped:
            scheduler.abort(request_id)
        self._requests.clear()
        return dropped

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    @property
    def num_unfinished_requests(self) -> int:
        return self.scheduler.num_waiting + self.scheduler.num_running

    # ------------------------------------------------------------------ the step
    def add_step_listener(self, fn: Callable[[StepOutcome], None]) -> None:
        """Call ``fn(outcome)`` after every step that ran (on the engine's thread)."""
        # the list is replaced, never changed in place: a step iterating the old one is unharmed
        self._step_listeners = self._step_listeners + [fn]

    def remove_step_listener(self, fn: Callable[[StepOutcome], None]) -> None:
        listeners = list(self._step_listeners)
        listeners.remove(fn)
        self._step_listeners = listeners

    def set_step_sync(self, sync: StepSync) -> None:
        """Run as one of several processes (jspec/distributed.py): as the leader, publish
        every step's requests, aborts and policy decisions; as a follower, take them from the
        leader (a follower's own add_request / abort_request calls are the replayed ones)."""
        self.sync = sync

    def _replay(self, events: list[tuple]) -> None:
        for event in events:
            if event[0] == "add":
                _, request_id, token_ids, sampling_params, cache_salt = event
                self.add_request(request_id, token_ids, sampling_params, cache_salt=cache_salt)
            else:
                self.abort_request(event[1])

    def _take_events(self) -> list[tuple]:
        events, self._events = self._events, []
        return events

    def _decide(self, decide: Callable):
        """A policy decision: the leader's on every process of a multi-process run."""
        return decide() if self.sync is None else self.sync.share(decide)

    def step(self) -> list[RequestOutput]:
        """One engine step: schedule, plan, draft, verify, commit; returns the outputs committed.

        Asynchronous scheduling: a decode-only step that drafts nothing (``_defers``) is left
        in flight, and the next call dispatches its successor before committing it. The host's
        work for step N (read back the tokens, detokenize, check stops, build outputs, the
        record) then overlaps the device's step N + 1, whose input tokens are step N's, still
        on device. Meanwhile each sequence holds ``PENDING_TOKEN`` where its step-N token goes
        (``_hold``), so the scheduler and the plan see the lengths they would after the commit.
        A sequence that stops at step N wasted its slot of step N + 1, which is dropped.
        """
        if self.sync is not None:
            events = self.sync.share(self._take_events)
            if not self.sync.leader:
                self._replay(events)
        if self.elastic is not None:
            self._elastic_tick()
        outputs, self._pending_outputs = self._pending_outputs, []
        prev, self._inflight = self._inflight, None
        if prev is not None:
            if self._continues(prev):
                self._hold(prev)
            else:
                outputs += self._complete(prev)
                prev = None
        clock = StageClock(sync=self.time_stages or self.policy.timed_stages)
        sched = self.scheduler.schedule()
        self.metrics.num_preemptions += len(sched.preempted)
        if prev is not None and not self._runs_on(prev, sched):
            raise RuntimeError("asynchronous scheduling: the step after an in-flight step "
                               "changed its sequences")  # _continues rules this out
        if not sched.scheduled:
            return outputs
        clock.lap("schedule")
        st = self._plan(sched)
        clock.lap("plan")
        if prev is not None and st.gamma:
            # the policy drafts: catch-up and the draft read step N's tokens, so commit it first
            outputs += self._complete(prev)
            clock.skip()
            prev = None
            st = self._replan(st)
            if st is None:  # every sequence ended at step N
                return outputs
        if st.gamma:
            self._catch_up(st)
            clock.lap("catch_up")  # synced: its time is Nightjar's switching cost
            self._draft(st)
            if self.policy.wants_select:
                self._select(st)
            clock.lap("draft", st.num_drafted)
            if len(st.chain) > 1:
                self._intermediate(st)
                clock.lap("intermediate", st.num_drafted)
        # decode-only steps sample in the same call
        st.logits, st.result = self._verify(st, prev)
        clock.lap("verify", st.logits)
        if prev is not None:  # step N + 1 is running: commit step N meanwhile
            self.metrics.num_async_steps += 1
            outputs += self._complete(prev, successor=st)
            clock.skip()
        if st.result is None:
            st.result = self.runner.run_accept(st.logits, st.draft_logits, st.draft_tokens,
                                               st.num_drafted, st.sampling, st.gamma)
        # only when a request asked: a step without such requests runs nothing for them
        if st.wants_logprobs:
            st.logprobs = self.runner.run_logprobs(st.logits, st.result.tokens, st.gamma)
        clock.lap("accept", st.result, st.logprobs)
        if st.gamma and self.runner.signals:
            st.signals = self.runner.run_signals(st.logits, st.draft_logits, st.draft_tokens,
                                                 st.gamma)
        clock.lap("signals", st.signals)
        st.clock = clock
        if self._defers(st):
            self._inflight = st
            return outputs
        return outputs + self._complete(st)

    def _complete(self, st: StepState, successor: StepState | None = None
                  ) -> list[RequestOutput]:
        """Read back a dispatched step's results, commit them and record the step.
        ``successor``: the step already running on this one's tokens (asynchronous
        scheduling), whose batch gets them written in for the record."""
        clock = st.clock
        clock.skip()  # since its dispatch the host did other work (the next step's, a caller's)
        # the step's one host<-device transfer of results (a stage of the commit; it also
        # waits for whatever device work is still running, so it counts as verify time)
        t_fetch = time.perf_counter()
        result, signals, drafted, logprobs = self.runner.fetch(
            st.result, st.signals, st.num_drafted, st.draft_tokens, st.row_gammas(),
            st.logprobs)
        if st.intermediate is not None:  # done by now: the transfer above waited for it
            st.first_drafted, st.intermediate = jax.device_get((st.first_drafted,
                                                                st.intermediate))
        st.fetch_time = time.perf_counter() - t_fetch
        if st.held:
            self._release(st)
        outputs = self._commit(st, result, drafted, logprobs)
        if successor is not None:
            successor.batch = ib.with_carried_tokens(successor.batch, successor.carry_rows,
                                                     result.tokens[:, 0])
        clock.lap("commit")
        self._observe(st, result, signals, drafted, clock)
        st.result = st.logits = st.signals = st.logprobs = None  # device buffers: let go
        if self.elastic is not None and not self.scheduler.has_unfinished():
            self._elastic_tick()  # idle from now on: contract while nothing runs
        return outputs

    # ------------------------------------------------------------------ asynchronous scheduling
    def _async_ready(self) -> bool:
        """Whether the engine may leave a step in flight at all: a single process, no elastic
        memory, no synced stage timing, and a policy that learns nothing from the host between
        its draft and the verification (no ``select``, no stage times)."""
        return (self.config.async_scheduling and self.sync is None and self.elastic is None
                and not self.time_stages and not self.policy.timed_stages
                and not self.policy.wants_select)

    def _replan(self, st: StepState) -> StepState | None:
        """``st`` was planned while the previous step was in flight and drafts after all, so
        that step was committed first: drop the rows whose sequence ended there, and reserve
        again the lookahead slots its commit gave back (truncation), on blocks that may differ,
        hence a new page table. Only frees happened since the schedule, so the reservation
        holds. None when no sequence is left."""
        keep = [i for i, r in enumerate(st.rows) if r.seq.status is SequenceStatus.RUNNING]
        for i in keep:
            row = st.rows[i]
            if not self.block_manager.allocate(row.seq.request_id,
                                               row.seq.num_tokens + row.lookahead):
                raise RuntimeError(f"asynchronous scheduling: sequence {row.seq.request_id!r} "
                                   f"lost its lookahead slots")
        if not keep:
            return None
        if len(keep) < len(st.rows):  # all rows decode here: row i is decode row i
            rows = [st.rows[i] for i in keep]
            plan = st.plan

            def pick(per_row):
                return None if per_row is None else np.asarray(per_row)[keep]

            decode_idx = np.arange(len(rows))
            kept = StepState(rows=rows, decode_idx=decode_idx,
                             num_rows=self._row_bucket(rows, decode_idx),
                             num_prefill_tokens=0, chain=st.chain)
            kept.view = self._batch_view(kept)
            kept.plan = dataclasses.replace(plan, gammas=pick(plan.gammas),
                                            stop_confidence=pick(plan.stop_confidence),
                                            stop_entropy=pick(plan.stop_entropy))
            st = kept
        self._device_inputs(st)
        if not st.gamma:  # the rows that drafted ended
            st.chain = ()
        return st

    def _defers(self, st: StepState) -> bool:
        """Leave ``st`` in flight? Only a decode-only γ = 0 step without logprobs whose every
        sequence is still running and cannot end by length at this step (the last step of a
        request commits at once, so a finished request never waits for the next call)."""
        if (st.gamma or st.has_prefill or st.logprobs is not None or st.result is None
                or not self._async_ready()):
            return False
        for row in st.rows:
            seq = row.seq
            if (seq.status is not SequenceStatus.RUNNING
                    or seq.num_output_tokens + 1 >= self._requests[seq.request_id].max_tokens):
                return False
        return True

    def _continues(self, prev: StepState) -> bool:
        """Whether the next step can run on ``prev``'s tokens before they are committed: the
        same sequences again (nothing aborted or waiting to be admitted), a KV block free for
        each (so nothing is preempted), and the engine still able to run asynchronously."""
        sched = self.scheduler
        n = len(prev.rows)
        return (self._async_ready() and not sched.num_waiting and sched.num_running == n
                and self.block_manager.num_free_blocks >= n
                and all(r.seq.status is SequenceStatus.RUNNING for r in prev.rows))

    @staticmethod
    def _hold(prev: StepState) -> None:
        """Give each of ``prev``'s sequences its uncommitted token as ``PENDING_TOKEN``, and
        count the K/V ``prev`` is writing as computed."""
        for row in prev.rows:
            seq = row.seq
            seq.output_token_ids.append(PENDING_TOKEN)
            seq.num_computed = seq.num_tokens - 1
        prev.held = True

    @staticmethod
    def _release(prev: StepState) -> None:
        """Undo ``_hold`` before the commit appends the real tokens."""
        for row in prev.rows:
            seq = row.seq
            seq.output_token_ids.pop()
            seq.num_computed = seq.num_tokens - 1
        prev.held = False

    @staticmethod
    def _runs_on(prev: StepState, sched) -> bool:
        """The step ``sched`` decodes exactly ``prev``'s sequences, one token each."""
        rows = sched.scheduled
        return (not sched.preempted and len(rows) == len(prev.rows)
                and all(s.is_decode for s in rows)
                and {id(s.seq) for s in rows} == {id(r.seq) for r in prev.rows})

    # ------------------------------------------------------------------ elastic memory
    @property
    def draft(self) -> LoadedModel | None:
        """The draft model (None without one); while elastic memory has it offloaded, its
        params are the host copy. The runner holds it: offload and reload replace it there."""
        return self.runner.draft

    @property
    def draft_resident(self) -> bool:
        """Whether the draft can run this step (False while elastic memory has it offloaded or
        its reload is still in flight)."""
        return self.draft is not None and (self.elastic is None or self.elastic.draft_resident)

    def _elastic_tick(self) -> None:
        """Before a step: finish a reload that has landed, then expand or contract the pool when
        Nightjar's §5.1 conditions hold (jspec/elastic.py)."""
        e, bm = self.elastic, self.block_manager
        if e.state is DraftState.RELOADING and self.runner.draft_ready():
            e.reloaded_now()
            self.metrics.draft_reload_time += time.perf_counter() - self._reload_started
        if e.should_expand():
            self._expand()
        elif e.should_contract(bm.num_free_blocks, self.scheduler.num_waiting):
            self._contract()

    def _expand(self) -> None:
        t0 = time.perf_counter()
        self.runner.offload_draft()
        self.runner.expand_target_pool()
        self.block_manager.expand()
        # the draft's K/V went with it: after the reload it catches up from the first token
        for seq in self.scheduler.running:
            seq.forget_draft_kv()
        self.block_manager.forget_pool_models()
        self.elastic.expanded_now()
        self.metrics.num_pool_expansions += 1
        self.metrics.pool_expansion_time += time.perf_counter() - t0

    def _contract(self) -> None:
        bm = self.block_manager
        t0 = time.perf_counter()
        moves = bm.contraction_plan()
        if moves is None:  # cannot happen while free > extension + τ_low; wait if it does
            return
        self.runner.contract_target_pool(moves)
        bm.contract(moves)
        jax.block_until_ready(self.runner.target_kv)
        t1 = time.perf_counter()
        self.runner.reload_draft()
        self._reload_started = t2 = time.perf_counter()
        self.elastic.contracted_now()
        self.metrics.num_pool_contractions += 1
        self.metrics.num_migrated_blocks += len(moves)
        self.metrics.pool_contraction_time += t1 - t0
        self.metrics.draft_reload_dispatch_time += t2 - t1

    def _plan(self, sched) -> StepState:
        """The step's rows, the policy's plan (γ per decoding row, clipped), the γ bucket and
        the host-side tensors every device call of the step shares."""
        rows = [ib.RowWork(s.seq, s.num_new_tokens, s.is_decode, s.samples, s.num_lookahead_slots)
                for s in sched.scheduled]
        decode_idx = np.array([i for i, r in enumerate(rows) if r.is_decode], np.int64)
        num_prefill_tokens = sum(r.num_new_tokens for r in rows if not r.is_decode)
        st = StepState(rows=rows, decode_idx=decode_idx,
                       num_rows=self._row_bucket(rows, decode_idx),
                       num_prefill_tokens=num_prefill_tokens)
        st.view = self._batch_view(st)
        if len(decode_idx) and self.chains and not self._never_drafts:
            t_policy = time.perf_counter()
            st.plan = self._decide(lambda: self.policy.plan(st.view))
            self.metrics.policy_time += time.perf_counter() - t_policy
            self.metrics.policy_calls += 1
            self._apply_plan(st)
            self._reclaim(sched, st)
        self._device_inputs(st)
        return st

    def _device_inputs(self, st: StepState) -> None:
        """The γ bucket, page table and sampling tensors of the planned rows: what every device
        call of the step shares."""
        st.gamma = gamma_bucket(self.gamma_buckets,
                                max((r.gamma_planned for r in st.decode_rows), default=0))
        st.table = ib.page_tables(st.rows, st.num_rows, self.rc.max_pages, self.block_manager)
        st.sampling = ib.sampling_tensors(st.rows, st.num_rows)

    def _row_bucket(self, rows, decode_idx) -> int:
        """The row bucket a step pads to; steps that carry prefill run at the widest one
        (config.ResolvedConfig)."""
        return (self.rc.seq_bucket(len(rows)) if len(decode_idx) == len(rows)
                else self.rc.seq_buckets[-1])

    def _reclaim(self, sched, st: StepState) -> None:
        """Spend the lookahead budget the plan left unused on prefill (Scheduler.reclaim): a
        policy that plans γ = 0 under load must not slow prefill down to the pace of Γmax."""
        kept = [r.gamma_planned if r.is_decode else 0 for r in st.rows]
        if not self.scheduler.reclaim(sched, kept):
            return
        rows = st.rows
        for i, s in enumerate(sched.scheduled):
            if i >= len(rows):  # admitted: a prefill chunk
                rows.append(ib.RowWork(s.seq, s.num_new_tokens, s.is_decode, s.samples,
                                       s.num_lookahead_slots))
            elif not rows[i].is_decode:  # a prefill chunk that grew
                rows[i].num_new_tokens, rows[i].samples = s.num_new_tokens, s.samples
        st.num_prefill_tokens = sum(r.num_new_tokens for r in rows if not r.is_decode)
        st.num_rows = self._row_bucket(rows, st.decode_idx)

    def _apply_plan(self, st: StepState) -> None:
        plan = st.plan
        decode_rows = st.decode_rows
        if len(plan.gammas) != len(decode_rows):
            raise RuntimeError(f"policy {self.policy.name!r} planned {len(plan.gammas)} "
                               f"draft lengths for {len(decode_rows)} decoding sequences")
        if (plan.stop_confidence is not None or plan.stop_entropy is not None) \
                and not self.policy.wants_draft_stats:
            raise RuntimeError(f"policy {self.policy.name!r} sets a draft stop rule but does not "
                               f"declare draft_stops = True (the draft loop is compiled without "
                               f"confidence and entropy)")
        chain = tuple(int(m) for m in plan.chain)
        if chain and chain not in self.chains:
            raise RuntimeError(f"policy {self.policy.name!r} planned chain {chain}, which is not "
                               f"among its possible_chains() {sorted(self.chains)}")
        st.chain = chain
        resident = self.draft_resident and bool(chain)
        for row, gamma in zip(decode_rows, plan.gammas.tolist()):
            req = self._requests[row.seq.request_id]
            # never draft past the request's last token or the reserved KV slots, and never
            # while the draft is away
            room = req.max_tokens - row.seq.num_output_tokens - 1 if resident else 0
            row.gamma_planned = row.gamma_verify = max(0, min(int(gamma), room, row.lookahead))
        if not any(r.gamma_planned for r in decode_rows):
            st.chain = ()

    def _catch_up(self, st: StepState) -> None:
        """Feed the draft the tokens it missed while γ was 0 (or the prompt), leaving the newest
        one for the draft loop: Nightjar's switching cost."""
        for model in st.chain:  # every model of the chain runs this step
            segments = ib.catch_up_segments(st.rows, model)
            if not segments:
                continue
            rows = self.runner.catch_up_rows
            for chunk in ib.pack_catch_up(segments, self.rc.max_num_batched_tokens, rows):
                n = sum(end - first for _, _, first, end in chunk)
                st.catch_up_tokens += n
                self.runner.run_catch_up(
                    ib.catch_up_input(chunk, self.runner.catch_up_tokens(n), rows, st.table),
                    model)
            for seq, _, _, end in segments:
                seq.draft_computed[model] = end
            self.runner.sync_draft(model)

    def _draft(self, st: StepState) -> None:
        """The on-device draft loop over the step's rows."""
        model = st.chain[0]
        first, next_positions, gammas = ib.draft_first_input(st.rows, st.num_rows, st.table,
                                                             model)
        stop_conf = np.zeros(st.num_rows, np.float32)
        stop_ent = np.full(st.num_rows, np.inf, np.float32)
        if st.plan.stop_confidence is not None:
            stop_conf[st.decode_idx] = st.plan.stop_confidence
        if st.plan.stop_entropy is not None:
            stop_ent[st.decode_idx] = st.plan.stop_entropy
        st.draft_inputs = (first, next_positions, st.table, gammas, stop_conf, stop_ent)
        st.draft = self.runner.run_draft(*st.draft_inputs, st.sampling, st.gamma, model)
        st.num_drafted = st.draft.num_drafted

    def _intermediate(self, st: StepState) -> None:
        """A two-level chain: the middle model verifies the first model's draft on device
        (``device_steps.intermediate_verify``); what it keeps, with its own distribution as q,
        is the draft the target verifies. Nothing visits the host."""
        model = st.chain[1]
        batch, slots = ib.intermediate_input(st.rows, st.num_rows, st.gamma, st.table, model)
        st.first_drafted = st.draft.num_drafted
        st.draft, st.intermediate = self.runner.run_intermediate(batch, st.sampling, st.draft,
                                                                 slots, st.gamma, model)
        st.num_drafted = st.draft.num_drafted

    def _select(self, st: StepState) -> None:
        """Let the policy trim the verify lengths after seeing the draft (one host sync)."""
        idx = st.decode_idx
        drafted, conf, ent = jax.device_get((st.draft.num_drafted, st.draft.confidence,
                                             st.draft.entropy))
        stats = DraftStats(num_drafted=drafted[idx], confidence=conf[idx],
                           draft_entropy=ent[idx])
        t_policy = time.perf_counter()
        lens = self._decide(lambda: self.policy.select(st.view, stats))
        self.metrics.policy_time += time.perf_counter() - t_policy
        if lens is None:
            return
        lens = np.minimum(np.maximum(np.asarray(lens, np.int64), 0), drafted[idx])
        out = np.array(drafted, np.int32)
        for row, i, n in zip(st.decode_rows, idx, lens.tolist()):
            # verify only the kept prefix; the slots past it are dropped from the target batch
            row.gamma_verify = n
            out[i] = n
        st.num_drafted = out

    def _verify(self, st: StepState, prev: StepState | None = None):
        """One target pass over the ragged batch (drafts scattered in on device): (logits,
        VerifyResult). A decode-only step samples in the same executable (one dispatch fewer
        per step); a step carrying prefill returns no result and samples in run_accept.
        ``prev``: the in-flight step whose sampled tokens (on device) this one feeds."""
        num_tokens = sum((1 + r.gamma_verify) if r.is_decode else r.num_new_tokens
                         for r in st.rows)
        st.num_padded_tokens = self.rc.verify_tokens(num_tokens, st.num_rows, st.gamma,
                                                     st.has_prefill)
        st.batch, st.draft_slots = ib.verify_input(
            st.rows, st.num_padded_tokens, st.num_rows, st.gamma, st.table)
        st.num_tokens = num_tokens
        if st.has_prefill:
            return self.runner.run_verify_forward(st.batch, st.draft_tokens, st.draft_slots,
                                                  st.gamma), None
        carry = None
        if prev is not None:
            where = {id(r.seq): i for i, r in enumerate(prev.rows)}
            st.carry_rows = np.full(st.num_rows, -1, np.int32)
            st.carry_rows[:len(st.rows)] = [where[id(r.seq)] for r in st.rows]
            carry = (prev.result.tokens, st.carry_rows)
        result, logits = self.runner.run_verify_accept(
            st.batch, st.draft_tokens, st.draft_slots, st.draft_logits, st.num_drafted,
            st.sampling, st.gamma, carry)
        return logits, result

    def _batch_view(self, st: StepState) -> BatchView:
        decode_rows = st.decode_rows
        return BatchView(
            request_ids=[r.seq.request_id for r in decode_rows],
            context_lens=np.array([r.seq.num_tokens for r in decode_rows], np.int64),
            pending_draft_tokens=np.array(
                [r.seq.num_tokens - r.seq.num_draft_computed for r in decode_rows], np.int64),
            batch_size=len(st.rows),
            num_prefill_tokens=st.num_prefill_tokens,
            num_waiting=self.scheduler.num_waiting,
            num_free_blocks=self.block_manager.num_free_blocks,
            num_total_blocks=self.block_manager.num_usable_blocks,
            draft_resident=self.draft_resident,
            max_gamma=self.max_gamma,
            remaining_tokens=np.array(
                [self._requests[r.seq.request_id].max_tokens - r.seq.num_output_tokens
                 for r in decode_rows], np.int64),
        )

    def _observe(self, st: StepState, result, signals, drafted, clock: "StageClock") -> None:
        """The step's one record: to the metrics, the policy and the step listeners."""
        outcome = self._outcome(st, result, signals, drafted, clock)
        self.metrics.observe(outcome)
        if self.elastic is not None:
            sched = self.scheduler
            kv_bound = sched.num_waiting > 0 and sched.num_running < self.config.max_num_seqs
            self.elastic.observe_step(outcome.num_decode > 0, st.gamma,
                                      self.block_manager.num_free_blocks, kv_bound)
        if outcome.num_decode and self.draft is not None:
            t_policy = time.perf_counter()
            self.policy.observe(outcome)
            self.metrics.policy_time += time.perf_counter() - t_policy
        self.last_outcome, self.last_step = outcome, st
        for fn in self._step_listeners:
            fn(outcome)

    def _outcome(self, st: StepState, result, signals, drafted, clock: "StageClock"
                 ) -> StepOutcome:
        idx = st.decode_idx
        decode_rows = st.decode_rows
        n = len(decode_rows)
        gamma = st.gamma
        planned = np.array([r.gamma_planned for r in decode_rows], np.int64)
        verify = np.array([r.gamma_verify for r in decode_rows], np.int64)
        num_drafted = np.asarray(drafted)[idx] if gamma else np.zeros(n, np.int64)
        verified = np.minimum(num_drafted, verify)
        accepted = np.minimum(result.num_accepted[idx], verified)
        inter_accepted = inter_prob = None
        if gamma and st.intermediate is not None:
            # the first model drafted; the middle one accepted some and sent the target its own
            num_drafted = np.asarray(st.first_drafted)[idx].astype(np.int64)
            inter_accepted = np.minimum(st.intermediate.accepted[idx], num_drafted)
            inter_prob = np.full((n, self.max_gamma), np.nan, np.float32)
            if "accept_prob" in self.runner.signals:
                mask = np.arange(gamma)[None, :] < num_drafted[:, None]
                inter_prob[:, :gamma] = np.where(mask, st.intermediate.accept_prob[idx], np.nan)
        emitted = np.array([r.num_emitted for r in decode_rows], np.int64)

        computed = signals if gamma and signals is not None else {}
        unread = np.full((n, self.max_gamma), np.nan, np.float32)
        unread.flags.writeable = False  # one array shared by every signal not computed

        def signal(name):
            if name not in computed:
                return unread
            out = np.full((n, self.max_gamma), np.nan, np.float32)
            vals = np.asarray(signals[name])[idx]
            mask = np.arange(gamma)[None, :] < verified[:, None]
            out[:, :gamma] = np.where(mask, vals, np.nan)
            return out

        t = clock.times
        return StepOutcome(
            request_ids=st.view.request_ids, gammas=planned, num_drafted=num_drafted,
            num_verified=verified, num_accepted=accepted, num_emitted=emitted,
            batch_size=len(st.rows), step_time=clock.total,
            draft_time=t["draft"],
            verify_time=t["verify"] + t["accept"] + t["signals"] + st.fetch_time,
            catch_up_time=t["catch_up"], catch_up_tokens=st.catch_up_tokens,
            num_prefill_tokens=st.num_prefill_tokens,
            accept_prob=signal("accept_prob"), kl=signal("kl"),
            draft_entropy=signal("draft_entropy"), confidence=signal("confidence"),
            stage_times=dict(t), gamma_bucket=gamma, num_tokens=st.num_tokens,
            num_padded_tokens=st.num_padded_tokens,
            num_running=self.scheduler.num_running, num_waiting=self.scheduler.num_waiting,
            chain=st.chain if gamma else (), intermediate_time=t["intermediate"],
            intermediate_accepted=inter_accepted, intermediate_accept_prob=inter_prob)

    # ------------------------------------------------------------------ commit
    def _commit(self, st: StepState, result, drafted, logprobs) -> list[RequestOutput]:
        outputs = []
        now = time.perf_counter()
        # Python lists: indexing them per row is several times cheaper than numpy scalars
        accepted_all = result.num_accepted.tolist()
        tokens_all = result.tokens.tolist()
        drafted = np.asarray(drafted).tolist() if st.gamma else None
        if st.intermediate is not None:
            first_drafted = np.asarray(st.first_drafted).tolist()
            inter_accepted = np.asarray(st.intermediate.accepted).tolist()
        for i, row in enumerate(st.rows):
            seq = row.seq
            row.num_emitted = 0
            if seq.status.finished:  # it ended while this step ran (asynchronous scheduling)
                continue
            req = self._requests[seq.request_id]
            old_num_tokens = seq.num_tokens
            if not row.samples:  # a prefill chunk that does not reach the end yet
                seq.num_computed += row.num_new_tokens
                self._cache_blocks(seq)
                continue
            if row.is_decode:
                n = min(accepted_all[i], row.gamma_verify)
                new_tokens = tokens_all[i][:n + 1]
                seq.num_computed = old_num_tokens + n
                if row.gamma_verify > 0:
                    d = min(drafted[i], row.gamma_verify)
                    if st.intermediate is None:
                        # the draft fed its first d - 1 tokens; those the target kept stay
                        seq.draft_computed[st.chain[0]] = min(old_num_tokens + max(d - 1, 0),
                                                              old_num_tokens + n)
                    else:
                        # the first model fed d1 - 1 of its tokens, the middle one all d1; a
                        # token stays valid while it is in the output: among the middle
                        # model's accepted a1 and the target's accepted n
                        d1, a1 = first_drafted[i], inter_accepted[i]
                        seq.draft_computed[st.chain[0]] = old_num_tokens + min(max(d1 - 1, 0),
                                                                               n, a1)
                        seq.draft_computed[st.chain[1]] = old_num_tokens + min(d1, n, a1)
                    seq.num_drafted += d
                    seq.num_accepted += n
                    seq.num_spec_steps += 1
            else:
                new_tokens = tokens_all[i][:1]
                seq.num_computed += row.num_new_tokens
            if seq.first_token_time is None:
                seq.first_token_time = now
            seq.num_steps += 1
            status = None
            for tok in new_tokens:
                status = self._append(req, tok)
                row.num_emitted += 1
                if status is not None:
                    break
            self.metrics.num_generated_tokens += row.num_emitted
            if logprobs is not None and seq.sampling_params.logprobs is not None:
                self._add_logprobs(req, logprobs, i, row.num_emitted)
            self._cache_blocks(seq)
            if status is not None:
                seq.status = status
                self.scheduler.finish(seq, status)
                self.metrics.num_requests_finished += 1
                outputs.append(self._finish(req))
            else:
                # roll back: free whole blocks past the tokens we keep (rejected drafts' KV)
                self.block_manager.truncate(seq.request_id, seq.num_tokens)
                if self.stream_outputs:
                    outputs.append(self._output(req))
        return outputs

    def _cache_blocks(self, seq: Sequence) -> None:
        """Offer the sequence's newly completed blocks to the prefix cache (before a finish
        frees them). K/V past the last kept token (a draft accepted after an EOS) are not
        counted: their tokens are not in the sequence."""
        self.block_manager.cache_blocks(seq.request_id, min(seq.num_computed, seq.num_tokens),
                                        seq.draft_computed, seq.token_ids, seq.cache_salt)

    def _add_logprobs(self, req: _Request, logprobs, row: int, count: int) -> None:
        """vLLM's per-token ``{token id: Logprob}``: the request's top ``logprobs`` tokens at
        each of the ``count`` places row ``row`` emitted, and the emitted token itself."""
        if not count:
            return
        k = req.seq.sampling_params.logprobs
        tokens = req.seq.output_token_ids[-count:]
        chosen = logprobs.logprob[row, :count].tolist()
        ranks = logprobs.rank[row, :count].tolist()
        top_ids = logprobs.top_ids[row, :count, :k].tolist()
        top_lps = logprobs.top_logprobs[row, :count, :k].tolist()
        for j, token in enumerate(tokens):
            entry = {t: Logprob(lp, r + 1, self._token_text(t))
                     for r, (t, lp) in enumerate(zip(top_ids[j], top_lps[j]))}
            if token not in entry:
                entry[token] = Logprob(chosen[j], ranks[j], self._token_text(token))
            req.logprobs.append(entry)

    def _token_text(self, token: int) -> str | None:
        """One token's text (cached: a request asking for 20 logprobs names 21 tokens a step)."""
        text = self._token_texts.get(token)
        if text is None and self.tokenizer is not None:
            text = self._token_texts[token] = self.tokenizer.decode([token])
        return text

    def _append(self, req: _Request, token: int) -> SequenceStatus | None:
        seq = req.seq
        sp: SamplingParams = seq.sampling_params
        seq.output_token_ids.append(token)
        before = len(req.detok.text)
        delta = req.detok.add(token)
        if not sp.ignore_eos and token in self.eos_token_ids:
            return SequenceStatus.FINISHED_STOPPED
        if token in sp.stop_token_ids:
            return SequenceStatus.FINISHED_STOPPED
        if sp.stop and delta:
            idx = find_stop(req.detok.text, len(req.detok.text) - before, sp.stop)
            if idx != -1:
                req.text_end = idx
                return SequenceStatus.FINISHED_STOPPED
        if seq.num_output_tokens >= req.max_tokens:
            return SequenceStatus.FINISHED_LENGTH
        return None

    def _finish(self, req: _Request) -> RequestOutput:
        req.finish_time = time.perf_counter()
        self._requests.pop(req.seq.request_id, None)
        return self._output(req)

    def _output(self, req: _Request) -> RequestOutput:
        seq = req.seq
        text = req.detok.text if req.text_end is None else req.detok.text[:req.text_end]
        finished = seq.status.finished
        stops = seq.sampling_params.stop
        if stops and not finished:
            # hold back what could be the start of a stop string: streamed text is never
            # retracted, so deltas always add up to the final text
            text = text[:max(len(text) - (max(map(len, stops)) - 1), req.last_text_len)]
        delta_text = text[req.last_text_len:]
        delta_ids = seq.output_token_ids[req.last_num_tokens:]
        req.last_text_len, req.last_num_tokens = len(text), seq.num_output_tokens
        return RequestOutput(
            request_id=seq.request_id, prompt=req.prompt,
            prompt_token_ids=seq.prompt_token_ids, text=text,
            token_source=seq.output_token_ids, num_tokens=seq.num_output_tokens,
            delta_text=delta_text,
            delta_token_ids=delta_ids, finished=finished,
            finish_reason=seq.status.value if finished else None,
            spec=SpecStats(seq.num_drafted, seq.num_accepted, seq.num_spec_steps, seq.num_steps),
            metrics={"arrival_time": req.arrival_time, "first_token_time": seq.first_token_time,
                     "finish_time": req.finish_time},
            logprob_source=req.logprobs,
            num_cached_tokens=seq.num_cached_tokens or 0,
        )

    # ------------------------------------------------------------------ accessors (serve/, bench)
    # The engine's read-only surface for the server, the CLI and the benchmarks (they never
    # reach into the scheduler, the block manager or the resolved config).
    @property
    def limits(self) -> EngineLimits:
        """What the engine can hold (fixed once it is built; computed on first use)."""
        limits = self.__dict__.get("_limits")
        if limits is None:
            capacity = self.block_manager.num_base_usable_blocks * self.config.block_size
            limits = self._limits = EngineLimits(
                max_model_len=self.rc.max_model_len, kv_capacity_tokens=capacity,
                context_limit=min(self.rc.max_model_len, capacity),
                max_num_seqs=self.config.max_num_seqs,
                max_num_batched_tokens=self.rc.max_num_batched_tokens,
                block_size=self.config.block_size,
                num_kv_blocks=self.block_manager.num_base_usable_blocks,
                num_kv_extension_blocks=self.block_manager.num_extension_blocks,
                vocab_size=self.target.cfg.vocab_size, has_draft=self.draft is not None,
                policy=self.policy.name, max_gamma=self.max_gamma,
                gamma_buckets=tuple(self.gamma_buckets),
                draft_pool=self.pool_names if self.runner.pool else (),
                max_logprobs=(self.runner.logprobs_width
                              if self.config.synthetic_acceptance is None else 0))
        return limits

    def stats(self) -> EngineStats:
        """A snapshot of the load, the KV cache and the counters; safe to call from another
        thread while the engine steps (each value is read whole; see EngineStats)."""
        bm = self.block_manager
        total = bm.num_usable_blocks
        free = bm.num_free_blocks
        return EngineStats(num_running=self.scheduler.num_running,
                           num_waiting=self.scheduler.num_waiting, kv_blocks_total=total,
                           kv_blocks_used=total - free, kv_blocks_free=free,
                           kv_blocks_cached=bm.num_cached_blocks,
                           draft_resident=self.draft_resident,
                           device_memory_bytes=self.runner.device_bytes(),
                           metrics=self.metrics.as_dict())
