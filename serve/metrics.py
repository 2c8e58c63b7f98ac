"""Prometheus metrics of the server (``GET /metrics``), in a registry of its own.

Three kinds of series:

* what the server observes per request (request counts by endpoint and status, finish reasons,
  TTFT / TPOT / end-to-end latency histograms, prompt and generated tokens): counters and
  histograms updated on the event loop;
* what the engine's per-step record (``jspec.step_record.StepRecord``) says: steps, step time,
  batch size and target tokens per step, the γ bucket each step ran in, time per step stage,
  prefill tokens, the vLLM-style ``spec_decode_*`` counters, accepted tokens per draft position,
  the γ chosen per sequence-step overall and per batch-size bucket, the mean γ of the latest
  step. A step listener (``AsyncLLMEngine.add_step_listener``) folds each step into
  prometheus_client metrics on the engine thread (they are thread-safe) as it ends, so nothing
  is diffed or re-read at scrape time. These count the steps run since the server took the
  engine (``ServerMetrics.attach``);
* the engine's load and the counters no step record carries (queue depth, running sequences,
  KV blocks, prefix-cache queries / hits / cached blocks, draft residency, preemptions, aborts,
  policy time): read from
  ``AsyncLLMEngine.stats()`` at scrape time by a custom collector.

Counters that only grow are exported as Prometheus counters (``_total``).

Beside the ``jspec_`` series, the ones vLLM's dashboards read are exported under vLLM's names
(``vllm:num_requests_running``, ``vllm:kv_cache_usage_perc``, ``vllm:time_to_first_token_seconds``,
``vllm:spec_decode_num_accepted_tokens_per_pos``, ...; ``VLLM_METRICS`` lists them) with vLLM's
``model_name`` and ``engine`` labels, so a Grafana board or alert built for vLLM works unchanged.
They are kept beside, not instead: the ``jspec_`` families carry what vLLM has no name for (γ
chosen, chains, draft residency, policy time, step stages).
"""

from __future__ import annotations

import logging
from typing import Callable

from prometheus_client import (CollectorRegistry, Counter, Gauge, Histogram,
                               disable_created_metrics)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from jspec.metrics import DrafterCounts, SpecCounts
from jspec.policies.base import batch_bucket, chain_label
from jspec.step_record import StepRecord
from jspec.step_state import STAGES

logger = logging.getLogger("jspec.serve")

# No "<name>_created" timestamp series next to every counter and histogram: they double the
# scrape for nothing a dashboard uses (vLLM turns them off too). The switch is process-wide.
disable_created_metrics()

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
STEP_TIME_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                     2.5, 5.0)
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)  # jspec.policies.base.batch_bucket's
STEP_TOKENS_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
REQUEST_TOKENS_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000)

# the vLLM-named families (without the ``_total`` a counter's samples gain)
VLLM_METRICS = (
    "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
    "vllm:num_preemptions", "vllm:prompt_tokens", "vllm:generation_tokens",
    "vllm:request_success", "vllm:request_prompt_tokens", "vllm:request_generation_tokens",
    "vllm:iteration_tokens_total", "vllm:time_to_first_token_seconds",
    "vllm:time_per_output_token_seconds", "vllm:e2e_request_latency_seconds",
    "vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens", "vllm:spec_decode_num_accepted_tokens_per_pos",
    "vllm:prefix_cache_queries", "vllm:prefix_cache_hits")
VLLM_LABELS = ("model_name", "engine")  # engine: vLLM's data-parallel engine index, here "0"


class ServerMetrics:
    """The server's registry. The callables are read at scrape time: the AsyncLLMEngine (None
    while loading), the server's in-flight request count and its readiness. ``attach`` starts
    recording the engine's steps, ``detach`` stops."""

    def __init__(self, engine: Callable[[], object | None], in_flight: Callable[[], int],
                 ready: Callable[[], bool], model_name: str):
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self._vllm_labels = (model_name, "0")
        # -- per request, on the event loop
        self.requests = Counter("jspec_http_requests", "HTTP requests answered, by endpoint and "
                                "status code", ["endpoint", "code"], registry=r)
        self.finished_reasons = Counter(
            "jspec_request_finished", "Generation requests ended, by reason (stop, length, "
            "abort, disconnect, error)", ["reason"], registry=r)
        self.rejected = Counter("jspec_requests_rejected_queue_full", "Requests refused with 503 "
                                "because the waiting queue was full", registry=r)
        self.ttft = Histogram("jspec_time_to_first_token_seconds", "Time from receiving a "
                              "request to its first generated token", registry=r,
                              buckets=TTFT_BUCKETS)
        self.tpot = Histogram("jspec_time_per_output_token_seconds", "Mean time per output token "
                              "after the first, per request", registry=r, buckets=TPOT_BUCKETS)
        self.e2e = Histogram("jspec_e2e_request_latency_seconds", "Time from receiving a request "
                             "to its last token", registry=r, buckets=E2E_BUCKETS)
        self.prompt_tokens = Counter("jspec_prompt_tokens", "Prompt tokens processed (counted "
                                     "when a request's first token is out)", registry=r)
        self.generation_tokens = Counter("jspec_generation_tokens", "Tokens generated for "
                                         "requests (finished or not)", registry=r)
        # -- per engine step, on the engine thread (the step listener)
        self.steps = Counter("jspec_engine_steps", "Engine steps", registry=r)
        self.step_time = Histogram("jspec_engine_step_time_seconds", "Wall-clock time of each "
                                   "engine step (while busy: from the previous step's results "
                                   "to its own)", registry=r, buckets=STEP_TIME_BUCKETS)
        self.step_batch_size = Histogram("jspec_engine_step_batch_size", "Sequences in each "
                                         "engine step (decoding and prefilling)", registry=r,
                                         buckets=BATCH_SIZE_BUCKETS)
        self.step_tokens = Histogram("jspec_engine_step_tokens", "Target tokens in each engine "
                                     "step's batch (decode, drafts to verify and prefill)",
                                     registry=r, buckets=STEP_TOKENS_BUCKETS)
        self.steps_by_gamma_bucket = Counter(
            "jspec_engine_steps_by_gamma_bucket", "Engine steps by the compiled γ bucket they "
            "ran in (0 = no draft work)", ["gamma_bucket"], registry=r)
        self.stage_time = Counter("jspec_engine_stage_time_seconds", "Time spent in each stage "
                                  "of the engine step", ["stage"], registry=r)
        self.prefill_tokens = Counter("jspec_engine_prefill_tokens", "Prompt tokens prefilled "
                                      "by the engine (recomputation after preemption included)",
                                      registry=r)
        self.spec_drafts = Counter("jspec_spec_decode_num_drafts", "Sequence-steps that drafted",
                                   registry=r)
        self.spec_draft_tokens = Counter("jspec_spec_decode_num_draft_tokens", "Draft tokens "
                                         "sent to verification", registry=r)
        self.spec_accepted_tokens = Counter("jspec_spec_decode_num_accepted_tokens", "Draft "
                                            "tokens accepted", registry=r)
        self.spec_emitted_tokens = Counter("jspec_spec_decode_num_emitted_tokens", "Tokens "
                                           "emitted by drafting sequence-steps", registry=r)
        self.spec_accepted_per_pos = Counter(
            "jspec_spec_decode_num_accepted_tokens_per_pos", "Drafts accepted at least up to "
            "this draft position (0-based)", ["position"], registry=r)
        self.spec_gamma = Counter("jspec_spec_decode_gamma", "Sequence-steps by the γ the "
                                  "policy chose (0 = no drafting)", ["gamma"], registry=r)
        self.spec_gamma_by_batch = Counter(
            "jspec_spec_decode_gamma_by_batch", "Sequence-steps by the γ chosen and the "
            "batch-size bucket of the step", ["batch_bucket", "gamma"], registry=r)
        self.spec_chain = Counter(
            "jspec_spec_decode_chain_steps", "Decoding steps by the chain of models that "
            "drafted (SpecRouter; 'target' = no draft) and the batch-size bucket",
            ["chain", "batch_bucket"], registry=r)
        self.drafter_drafts = Counter(
            "jspec_spec_decode_drafter_drafts", "Sequence-steps drafted, by drafter (its pool "
            "name: a draft model, ngram, suffix; 'target' = decoded plainly) and the "
            "batch-size bucket", ["drafter", "batch_bucket"], registry=r)
        self.drafter_draft_tokens = Counter(
            "jspec_spec_decode_drafter_draft_tokens", "Draft tokens verified, by drafter",
            ["drafter"], registry=r)
        self.drafter_accepted_tokens = Counter(
            "jspec_spec_decode_drafter_accepted_tokens", "Draft tokens accepted, by drafter",
            ["drafter"], registry=r)
        self.gamma_last_step = Gauge("jspec_spec_decode_gamma_last_step", "Mean γ the policy "
                                     "chose for the decoding sequences of the latest step",
                                     registry=r)
        self._vllm_families(r)
        # -- the engine's load and its other counters, read at scrape time
        r.register(_EngineCollector(engine, in_flight, ready, self._vllm_labels))
        self._engine = None  # the AsyncLLMEngine whose steps are recorded
        self._max_gamma = 0
        self._per_pos: list = []  # label children, looked up once
        self._gamma: list = []
        self._by_batch: dict[int, list] = {}
        self._by_gamma_bucket: dict[int, object] = {}
        self._stages: dict[str, object] = {}
        self._pool: tuple[str, ...] = ()
        self._chains: dict[tuple, object] = {}
        self._step_error_logged = False

    def _vllm_families(self, r: CollectorRegistry) -> None:
        """vLLM's names for what the server and the step records observe; one label child each
        (model, engine), bound once."""
        def bind(kind, name, doc, labels=(), **kw):
            metric = kind(name, doc, list(VLLM_LABELS) + list(labels), registry=r, **kw)
            return metric if labels else metric.labels(*self._vllm_labels)

        self.vllm_prompt_tokens = bind(Counter, "vllm:prompt_tokens", "Number of prefill "
                                       "tokens processed")
        self.vllm_generation_tokens = bind(Counter, "vllm:generation_tokens", "Number of "
                                           "generation tokens processed")
        self.vllm_request_success = bind(Counter, "vllm:request_success", "Count of "
                                         "successfully processed requests",
                                         ("finished_reason",))
        self.vllm_request_prompt_tokens = bind(
            Histogram, "vllm:request_prompt_tokens", "Number of prefill tokens processed, per "
            "request", buckets=REQUEST_TOKENS_BUCKETS)
        self.vllm_request_generation_tokens = bind(
            Histogram, "vllm:request_generation_tokens", "Number of generation tokens "
            "processed, per request", buckets=REQUEST_TOKENS_BUCKETS)
        self.vllm_iteration_tokens = bind(Histogram, "vllm:iteration_tokens_total", "Number of "
                                          "tokens per engine step", buckets=STEP_TOKENS_BUCKETS)
        self.vllm_ttft = bind(Histogram, "vllm:time_to_first_token_seconds", "Histogram of "
                              "time to first token in seconds", buckets=TTFT_BUCKETS)
        self.vllm_tpot = bind(Histogram, "vllm:time_per_output_token_seconds", "Histogram of "
                              "time per output token in seconds", buckets=TPOT_BUCKETS)
        self.vllm_e2e = bind(Histogram, "vllm:e2e_request_latency_seconds", "Histogram of "
                             "end to end request latency in seconds", buckets=E2E_BUCKETS)
        self.vllm_spec_drafts = bind(Counter, "vllm:spec_decode_num_drafts", "Number of spec "
                                     "decoding drafts")
        self.vllm_spec_draft_tokens = bind(Counter, "vllm:spec_decode_num_draft_tokens",
                                           "Number of draft tokens")
        self.vllm_spec_accepted_tokens = bind(Counter, "vllm:spec_decode_num_accepted_tokens",
                                              "Number of accepted tokens")
        self.vllm_spec_accepted_per_pos = bind(
            Counter, "vllm:spec_decode_num_accepted_tokens_per_pos", "Accepted tokens per "
            "draft position", ("position",))

    # ------------------------------------------------------------------ per request
    def generated(self, num_tokens: int) -> None:
        """``num_tokens`` more tokens generated for some request."""
        self.generation_tokens.inc(num_tokens)
        self.vllm_generation_tokens.inc(num_tokens)

    def first_token(self, seconds: float, num_prompt_tokens: int) -> None:
        """A request's first token came ``seconds`` after the request."""
        self.ttft.observe(seconds)
        self.vllm_ttft.observe(seconds)
        self.prompt_tokens.inc(num_prompt_tokens)
        self.vllm_prompt_tokens.inc(num_prompt_tokens)

    def finished(self, reason: str, num_prompt_tokens: int | None = None,
                 num_generated: int = 0, e2e: float | None = None,
                 tpot: float | None = None) -> None:
        """A request ended: ``reason`` is the engine's finish reason or the server's
        (``disconnect``, ``error``); the token counts when the engine's last output says them."""
        self.finished_reasons.labels(reason).inc()
        # vLLM counts a client that went away as an abort
        vllm_reason = "abort" if reason == "disconnect" else reason
        self.vllm_request_success.labels(*self._vllm_labels, vllm_reason).inc()
        if num_prompt_tokens is not None:
            self.vllm_request_prompt_tokens.observe(num_prompt_tokens)
            self.vllm_request_generation_tokens.observe(num_generated)
        if e2e is not None:
            self.e2e.observe(e2e)
            self.vllm_e2e.observe(e2e)
        if tpot is not None:
            self.tpot.observe(tpot)
            self.vllm_tpot.observe(tpot)

    # ------------------------------------------------------------------ the step listener
    def attach(self, engine) -> None:
        """Record every step of ``engine`` (an AsyncLLMEngine) from now on; the labelled series
        its limits fix (draft positions, γ values, γ buckets, stages) start at 0."""
        if self._engine is engine:
            return
        self.detach()
        limits = engine.limits
        self._max_gamma = g = limits.max_gamma
        self._per_pos = [(self.spec_accepted_per_pos.labels(str(p)),
                          self.vllm_spec_accepted_per_pos.labels(*self._vllm_labels, str(p)))
                         for p in range(g)]
        self._gamma = [self.spec_gamma.labels(str(k)) for k in range(g + 1)]
        self._by_gamma_bucket = {b: self.steps_by_gamma_bucket.labels(str(b))
                                 for b in limits.gamma_buckets}
        self._stages = {stage: self.stage_time.labels(stage) for stage in STAGES}
        self._pool = limits.draft_pool
        self._chains = {}
        self._engine = engine
        engine.add_step_listener(self._on_step)

    def detach(self) -> None:
        """Stop recording steps (the series keep their values); a no-op when not attached."""
        engine, self._engine = self._engine, None
        if engine is not None:
            engine.remove_step_listener(self._on_step)

    def _on_step(self, outcome: StepRecord) -> None:
        # runs on the engine thread: a failure here must not fail the engine loop
        try:
            self._observe_step(outcome)
        except Exception:
            if not self._step_error_logged:
                self._step_error_logged = True
                logger.exception("recording an engine step in the Prometheus metrics failed "
                                 "(logged once)")

    def _observe_step(self, o: StepRecord) -> None:
        self.steps.inc()
        self.step_time.observe(o.step_time)
        self.step_batch_size.observe(o.batch_size)
        self.step_tokens.observe(o.num_tokens)
        self.vllm_iteration_tokens.observe(o.num_tokens)
        self._child(self._by_gamma_bucket, o.gamma_bucket, self.steps_by_gamma_bucket,
                    str(o.gamma_bucket)).inc()
        for stage, seconds in o.stage_times.items():
            self._child(self._stages, stage, self.stage_time, stage).inc(max(0.0, seconds))
        if o.num_prefill_tokens:
            self.prefill_tokens.inc(o.num_prefill_tokens)
        if not o.num_decode:
            self.gamma_last_step.set(0.0)
            return
        self.gamma_last_step.set(float(o.gammas.mean()))
        bucket = batch_bucket(o.batch_size)
        drafter_counts = o.drafter_counts
        label = (drafter_counts.chain_label(self._pool, o.chain) if drafter_counts is not None
                 else chain_label(self._pool, o.chain))
        key = (label, bucket)
        child = self._chains.get(key)
        if child is None:
            child = self._chains[key] = self.spec_chain.labels(label, str(bucket))
        child.inc()
        self._observe_spec(o.spec_counts, bucket)
        if drafter_counts is not None:
            self._observe_drafters(drafter_counts, bucket)

    def _observe_drafters(self, counts: DrafterCounts, bucket: int) -> None:
        """Which drafter drafted each sequence and what it got accepted (the same counts
        ``EngineMetrics.drafter_stats`` adds up)."""
        for d, (rows, drafted, accepted) in counts.by_drafter.items():
            name = counts.drafter_name(self._pool, d)
            self.drafter_drafts.labels(name, str(bucket)).inc(rows)
            if d >= 0:
                self.drafter_draft_tokens.labels(name).inc(drafted)
                self.drafter_accepted_tokens.labels(name).inc(accepted)

    def _observe_spec(self, counts: SpecCounts, bucket: int) -> None:
        """Fold in one decoding step's speculation counts (the ones EngineMetrics adds up)."""
        by_batch = self._by_batch.get(bucket)
        if by_batch is None:  # a new batch-size bucket: all its γ series appear at once
            by_batch = self._by_batch[bucket] = [
                self.spec_gamma_by_batch.labels(str(bucket), str(k))
                for k in range(self._max_gamma + 1)]
        for k, count in enumerate(counts.gamma_counts.tolist()):
            if count:
                self._gamma[k].inc(count)
                by_batch[k].inc(count)
        if not counts.num_drafts:
            return
        for counters, value in (
                ((self.spec_drafts, self.vllm_spec_drafts), counts.num_drafts),
                ((self.spec_draft_tokens, self.vllm_spec_draft_tokens), counts.num_draft_tokens),
                ((self.spec_accepted_tokens, self.vllm_spec_accepted_tokens),
                 counts.num_accepted_tokens),
                ((self.spec_emitted_tokens,), counts.num_emitted_tokens)):
            for counter in counters:
                counter.inc(value)
        for p, count in enumerate(counts.accepted_per_position.tolist()):
            if count:
                for counter in self._per_pos[p]:
                    counter.inc(count)

    @staticmethod
    def _child(cache: dict, key, metric, label: str):
        child = cache.get(key)
        if child is None:
            child = cache[key] = metric.labels(label)
        return child


class _EngineCollector:
    def __init__(self, engine, in_flight, ready, vllm_labels):
        self._engine, self._in_flight, self._ready = engine, in_flight, ready
        self._vllm_labels = list(vllm_labels)

    def describe(self):
        return []  # families depend on the engine; collected only at scrape time

    def collect(self):
        yield _gauge("jspec_server_ready", "1 once models are loaded and every shape bucket is "
                     "compiled", int(self._ready()))
        yield _gauge("jspec_server_requests_in_flight", "Requests admitted by the server and "
                     "not yet answered", self._in_flight())
        engine = self._engine()
        if engine is None:
            return
        stats = engine.stats()  # waiting includes requests not yet handed to the engine
        yield _gauge("jspec_num_requests_running", "Sequences in the running batch",
                     stats.num_running)
        yield _gauge("jspec_num_requests_waiting", "Requests waiting for a slot in the running "
                     "batch (the queue depth)", stats.num_waiting)
        yield _gauge("jspec_kv_blocks_free", "Free KV-cache blocks", stats.kv_blocks_free)
        yield _gauge("jspec_kv_blocks_used", "KV-cache blocks held by sequences",
                     stats.kv_blocks_used)
        yield _gauge("jspec_kv_blocks_total", "Usable KV-cache blocks now (with elastic memory "
                     "the extension's too while the draft is offloaded)", stats.kv_blocks_total)
        yield _gauge("jspec_kv_blocks_cached", "KV-cache blocks in the prefix cache (held by "
                     "sequences or free for reuse)", stats.kv_blocks_cached)
        yield _gauge("jspec_draft_resident", "1 while the draft model's weights are on the "
                     "device", int(stats.draft_resident))
        parts = GaugeMetricFamily("jspec_device_memory_bytes", "Device memory held by the "
                                  "models' weights and KV pools (elastic memory trades the "
                                  "draft's for the target pool's extension)", labels=["part"])
        for part, value in stats.device_memory_bytes.items():
            parts.add_metric([part], value)
        yield parts
        m = stats.metrics
        for family, name, doc, value in (
                (GaugeMetricFamily, "vllm:num_requests_running", "Number of requests in model "
                 "execution batches", stats.num_running),
                (GaugeMetricFamily, "vllm:num_requests_waiting", "Number of requests waiting "
                 "to be processed", stats.num_waiting),
                (GaugeMetricFamily, "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 "
                 "percent usage.", stats.kv_blocks_used / max(1, stats.kv_blocks_total)),
                (CounterMetricFamily, "vllm:num_preemptions", "Cumulative number of preemption "
                 "from the engine.", m["num_preemptions"]),
                (CounterMetricFamily, "vllm:prefix_cache_queries", "Prefix cache queries, in "
                 "terms of number of queried tokens.", m["prefix_cache_queries"]),
                (CounterMetricFamily, "vllm:prefix_cache_hits", "Prefix cache hits, in terms of "
                 "number of cached tokens.", m["prefix_cache_hits"])):
            metric = family(name, doc, labels=VLLM_LABELS)
            metric.add_metric(self._vllm_labels, value)
            yield metric
        for name, doc, value in (
                ("jspec_engine_preemptions", "Sequences preempted for KV memory",
                 m["num_preemptions"]),
                ("jspec_engine_requests_aborted", "Requests aborted in the engine",
                 m["num_requests_aborted"]),
                ("jspec_engine_async_steps", "Steps dispatched while the host still committed "
                 "the one before (asynchronous scheduling)", m["num_async_steps"]),
                ("jspec_prefix_cache_queries", "Prompt tokens looked up in the prefix cache "
                 "(once per admitted request)", m["prefix_cache_queries"]),
                ("jspec_prefix_cache_hits", "Prompt tokens whose target K/V came from the "
                 "prefix cache", m["prefix_cache_hits"]),
                ("jspec_prefix_cache_draft_hits", "Prompt tokens whose draft K/V came from the "
                 "prefix cache (the first draft model's pool)",
                 m["prefix_cache_draft_hits"][0]),
                ("jspec_policy_time_seconds", "Time inside the policy's plan/select/observe",
                 m["policy_time"]),
                ("jspec_num_pool_expansions", "Elastic memory: draft offloads that grew the KV "
                 "pool", m["num_pool_expansions"]),
                ("jspec_num_pool_contractions", "Elastic memory: KV pool contractions (blocks "
                 "migrated out of the extension, draft reloaded)", m["num_pool_contractions"]),
                ("jspec_pool_expansion_time_seconds", "Elastic memory: time spent expanding",
                 m["pool_expansion_time"]),
                ("jspec_pool_contraction_time_seconds", "Elastic memory: time spent migrating "
                 "blocks to contract", m["pool_contraction_time"]),
                ("jspec_draft_reload_dispatch_time_seconds", "Elastic memory: host time to "
                 "start the asynchronous draft reloads", m["draft_reload_dispatch_time"])):
            yield _counter(name, doc, value)
        rate = m["prefix_cache_hit_rate"]
        yield _gauge("jspec_prefix_cache_hit_rate", "Prefix-cache hits / queries since the "
                     "engine started (tokens; NaN before the first query)",
                     float("nan") if rate is None else rate)


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)
