"""Prometheus metrics of the server (``GET /metrics``), in a registry of its own.

Two kinds of series:

* what the server observes per request (request counts by endpoint and status, finish reasons,
  TTFT / TPOT / end-to-end latency histograms, prompt and generated tokens): prometheus_client
  counters and histograms, updated on the event loop;
* what the engine already counts (queue depth, running sequences, KV blocks, steps, the vLLM-style
  ``spec_decode_*`` counters, accepted tokens per draft position, the γ chosen per sequence-step
  overall and per batch-size bucket, draft residency): read from ``LLMEngine`` at scrape time by
  a custom collector, so the engine thread never touches prometheus objects and nothing is
  counted twice. Engine counters are exported as Prometheus counters (``_total``) because they
  only grow.

The engine thread mutates those counters while a scrape reads them. Every read is a single
attribute or ``len`` read, a numpy ``tolist()`` or ``list(dict.items())``, each atomic under the
GIL, so a scrape sees each value whole (though values from one step may mix with the next's).
"""

from __future__ import annotations

from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

# No "<name>_created" timestamp series next to every counter and histogram: they double the
# scrape for nothing a dashboard uses (vLLM turns them off too). The switch is process-wide.
disable_created_metrics()

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)


class ServerMetrics:
    """The server's registry. The callables are read at scrape time: the AsyncLLMEngine (None
    while loading), the server's in-flight request count and its readiness."""

    def __init__(self, engine: Callable[[], object | None], in_flight: Callable[[], int],
                 ready: Callable[[], bool]):
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("jspec_http_requests", "HTTP requests answered, by endpoint and "
                                "status code", ["endpoint", "code"], registry=r)
        self.finished = Counter("jspec_request_finished", "Generation requests ended, by reason "
                                "(stop, length, abort, disconnect, error)", ["reason"],
                                registry=r)
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
        r.register(_EngineCollector(engine, in_flight, ready))


class _EngineCollector:
    def __init__(self, engine, in_flight, ready):
        self._engine, self._in_flight, self._ready = engine, in_flight, ready

    def describe(self):
        return []  # families depend on the engine (γ range); collected only at scrape time

    def collect(self):
        yield _gauge("jspec_server_ready", "1 once models are loaded and every shape bucket is "
                     "compiled", int(self._ready()))
        yield _gauge("jspec_server_requests_in_flight", "Requests admitted by the server and "
                     "not yet answered", self._in_flight())
        async_engine = self._engine()
        if async_engine is None:
            return
        engine = async_engine.engine
        sched, blocks, m = engine.scheduler, engine.block_manager, engine.metrics
        running = sched.num_running
        # requests handed to the engine thread but not yet added count as waiting too
        waiting = max(0, async_engine.num_unfinished - running)
        yield _gauge("jspec_num_requests_running", "Sequences in the running batch", running)
        yield _gauge("jspec_num_requests_waiting", "Requests waiting for a slot in the running "
                     "batch (the queue depth)", waiting)
        free = blocks.num_free_blocks
        yield _gauge("jspec_kv_blocks_free", "Free KV-cache blocks", free)
        yield _gauge("jspec_kv_blocks_used", "KV-cache blocks held by sequences",
                     blocks.num_usable_blocks - free)
        yield _gauge("jspec_draft_resident", "1 while the draft model's weights are on the "
                     "device", int(engine.draft is not None))
        outcome = engine.last_outcome
        yield _gauge("jspec_spec_decode_gamma_last_step", "Mean γ the policy chose for the "
                     "decoding sequences of the latest step",
                     float(outcome.gammas.mean()) if outcome is not None and
                     len(outcome.gammas) else 0.0)
        for name, doc, value in (
                ("jspec_engine_steps", "Engine steps", m.num_steps),
                ("jspec_engine_preemptions", "Sequences preempted for KV memory",
                 m.num_preemptions),
                ("jspec_engine_requests_aborted", "Requests aborted in the engine",
                 m.num_requests_aborted),
                ("jspec_spec_decode_num_drafts", "Sequence-steps that drafted",
                 m.spec_decode_num_drafts),
                ("jspec_spec_decode_num_draft_tokens", "Draft tokens sent to verification",
                 m.spec_decode_num_draft_tokens),
                ("jspec_spec_decode_num_accepted_tokens", "Draft tokens accepted",
                 m.spec_decode_num_accepted_tokens),
                ("jspec_spec_decode_num_emitted_tokens", "Tokens emitted by drafting "
                 "sequence-steps", m.spec_decode_num_emitted_tokens),
                ("jspec_policy_time_seconds", "Time inside the policy's plan/select/observe",
                 m.policy_time)):
            yield _counter(name, doc, value)
        per_pos = CounterMetricFamily(
            "jspec_spec_decode_num_accepted_tokens_per_pos", "Drafts accepted at least up to "
            "this draft position (0-based)", labels=["position"])
        for position, count in enumerate(m.accepted_per_position.tolist()):
            per_pos.add_metric([str(position)], count)
        yield per_pos
        gamma = CounterMetricFamily("jspec_spec_decode_gamma", "Sequence-steps by the γ the "
                                    "policy chose (0 = no drafting)", labels=["gamma"])
        for g, count in enumerate(m.gamma_histogram.tolist()):
            gamma.add_metric([str(g)], count)
        yield gamma
        by_batch = CounterMetricFamily(
            "jspec_spec_decode_gamma_by_batch", "Sequence-steps by the γ chosen and the "
            "batch-size bucket of the step", labels=["batch_bucket", "gamma"])
        for bucket, hist in sorted(list(m.gamma_histogram_by_batch.items())):
            for g, count in enumerate(hist.tolist()):
                by_batch.add_metric([str(bucket), str(g)], count)
        yield by_batch


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)
