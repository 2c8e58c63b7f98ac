"""`jspec bench serving`: online serving benchmark, in process, on ``AsyncLLMEngine``.

One workload (``jspec.bench.workloads``) and one arrival schedule (``jspec.bench.arrivals``) are
built once; then each policy given to ``--policy`` runs on them in turn, in this one process,
each on a fresh engine over the same models, compiled before its clock starts. So the policies
are compared side by side on identical requests at identical times. For example:

    jspec bench serving --policy off static:gamma=2 nightjar --workload code \\
        --arrivals poisson --rate 4 --num-requests 200 --max-tokens 128 --out run.json

The driver is open-loop (single-request workloads): every request is sent at its scheduled arrival
time (an asyncio task sleeping until then) whatever the engine's state, and its stream is consumed
as it comes; the time each chunk reaches the client is recorded (``serving_metrics`` has every
definition). The engine's own steps are recorded by a step listener (``StepRecorder``), which gets
each step's ``StepRecord`` on the engine thread: per step, its time, the draft loop's and the
catch-up's share of it, its batch size and decoding sequences, the γ the policy chose for them
(summed, with the max), verified / accepted / emitted tokens, prefill, total and padded tokens,
and the running and waiting queues' lengths.

Workloads (``--workload``, ``jspec.bench.workloads``): code, code-continuation (held-out functions
cut part way through their body), spec-bench, alpaca, sharegpt and mixed (every prompt of
spec-bench, sharegpt, code and code-continuation, each keeping its category; ``--category`` picks
among them) are single requests; ``multiturn`` is conversations, each arrival the start of one
(``--num-requests`` counts conversations). Its driver is closed-loop per conversation: turn k+1
is sent ``--think-time`` seconds after turn k's last chunk arrived, its prompt the token ids of
turn k's prompt + turn k's output (the engine's own answer, as a chat client resends it) + the
new user message wrapped as
``"\\n\\nUser: {msg}\\n\\nAssistant:"``, so every turn's prompt starts with the previous one bit for
bit: what prefix caching reuses. A conversation ends early (counted as truncated) when its next
prompt + output budget would exceed the engine's context limit. The conversations come from a
ShareGPT-format file (``--workload-file``; default: the shared ``ShareGPT_V3_filtered_500.json``).
That shipped file holds only each conversation's FIRST human message, so there a conversation is
``--turns K`` (default 4) consecutive entries, i.e. several users' opening messages in a row, not
real follow-ups; a full ShareGPT file (alternating "human" / "gpt" turns) gives real conversations,
their first K human turns (the "gpt" replies are dropped for the engine's). Records carry
``conversation_id`` and ``turn`` (1 = the first message; request ids ``conv-C-turn-T``), and the
metrics add ``by_turn``: TTFT / TPOT / E2E statistics of first turns, of later turns (turn ≥ 2,
TTFT from when the message was due) and of each turn, and ``conversations`` (how many ran, were
truncated or failed, turns sent).

Prefix caching (``--prefix-caching on|off|both``): on (the engine's default) or off in every engine,
or ``both``: each policy runs with it and then without it (labelled ``NAME -prefix-cache``, engine
option ``enable_prefix_caching=False``), and the table is followed by the with / without ratios of
throughput and TTFT p50 (all, first turns, later turns). Every run's metrics copy the engine's
prefix-cache counters (``prefix_cache_queries``, ``prefix_cache_hits`` in tokens,
``prefix_cache_hit_rate``; ``prefix_cache_blocks``, the blocks cached at the end).

Batch-invariant numerics (``--deterministic on|off|both``): on (the engine's default) or off in every
engine, or ``both``: each policy runs with them and then without (labelled ``NAME -deterministic``,
engine option ``deterministic=False``): what the mode costs.

Asynchronous scheduling (``--async-scheduling on|off|both``): on (the engine's default) or off in
every engine, or ``both``: each policy runs with it and then without it (labelled ``NAME -async``,
engine option ``async_scheduling=False``). Every run's metrics count the steps that overlapped
(``num_async_steps``).

``--warmup-requests N`` lets each adaptive policy (not off / static) serve the first N requests of
the schedule, unmeasured, on the engine it is then measured on (policy state kept, engine counters
reset, prefix cache and suffix decoding's cache of outputs emptied): a long-running server's state
rather than a cold start. ``--synthetic SHAPE`` and ``--synthetic-acceptance SPEC`` select the
cost-realistic mode (``jspec.synthetic``); its results are labelled SYNTHETIC in the table, the JSON
and the figures.

Policies: ``NAME`` or ``NAME:KEY=VALUE[,KEY=VALUE]`` (``static:gamma=2``); ``--policy-option
KEY=VALUE`` applies to every listed policy except ``off``, ``--policy-option NAME.KEY=VALUE`` to
policy NAME only (e.g. ``adaspec.profile=profile.json``).

Output: a table comparing the runs (throughput relative to the first run and to the best fixed
choice, ``off`` and ``static``, of this invocation; with conversations also TTFT p50 of first and
later turns, and the later turns' relative to the first run) and, with ``--out``, one JSON file:
config, workload, arrivals, and per policy run the metrics, γ per batch-size bucket, the binned time
series, the per-step records and the per-request records (arrival, chunk times and token counts,
finish, speculation counters; multiturn: conversation and turn, and per conversation its turns'
prompt and output lengths; with prompts of several categories, the metrics' ``by_category``:
acceptance and TPOT per category), and with ``--prefix-caching both`` the
``prefix_cache_comparison`` ratios. ``--plot DIR`` draws ``jspec.bench.plots``' figures.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime
import json
import math
import os
import sys
import time
import zlib
from typing import Any

from jspec.bench import arrivals as arr
from jspec.bench import workloads as wl
from jspec.cli_common import add_tensor_parallel_argument
from jspec.config import drafts_with_model, parse_methods
from jspec.bench.serving_metrics import (RequestRecord, StepRecords, category_metrics,
                                         compute_metrics, gamma_by_batch, summarize,
                                         time_series, turn_metrics)

FORMAT = "jspec-serving-bench-v1"
ARRIVALS = ("poisson", "batch", "step", "burst", "trace")
DEFAULT_TRACE = "conv"  # what --arrivals trace replays without --trace
DEFAULT_NUM_REQUESTS = 64  # when an open-ended arrival process is given no limit
# options that shape only one arrival schedule, with their defaults: given with another
# schedule they would be ignored, so they are refused instead
SCHEDULE_DEFAULTS = {
    "trace": {"trace": None, "time_scale": 1.0, "rate_scale": 1.0, "window_start": 0.0},
    "step": {"steps": None},
    "burst": {"burst_period": 10.0, "burst_size": 8, "burst_base_rate": 0.0},
    "poisson": {"rate": 2.0},
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    models = p.add_argument_group("models and engine")
    models.add_argument("--target", metavar="DIR", help="default: the built-in pair's target")
    models.add_argument("--draft", metavar="DIR", action="append",
                        help="draft checkpoint directory sharing the target's vocabulary; "
                             "repeat it for a pool of drafts (SpecRouter's chains, "
                             "--policy specrouter); with --target but no --draft, decoding is "
                             "plain (no speculation)")
    models.add_argument("--dtype", choices=["auto", "bfloat16", "float32"], default="auto")
    models.add_argument("--num-speculative-tokens", type=int, default=4, metavar="N",
                        help="Γmax of every engine (default: %(default)s)")
    models.add_argument("--max-num-seqs", type=int, default=16)
    models.add_argument("--max-model-len", type=int, default=None,
                        help="context limit (default: the target's, at most 4096)")
    for name in ("max-num-batched-tokens", "block-size", "num-kv-blocks", "min-token-bucket"):
        models.add_argument(f"--{name}", type=int, default=None,
                            help="engine option (default: EngineConfig's)")
    models.add_argument("--kv-cache-memory-bytes", type=int, default=None,
                        help="KV pool size as a memory budget (instead of --num-kv-blocks)")
    add_tensor_parallel_argument(models)
    models.add_argument("--elastic-memory", action="store_true",
                        help="run every policy twice, without and with elastic memory "
                             "(Nightjar §5: the draft offloaded to grow the KV pool under "
                             "load), labelled 'NAME +elastic'")
    models.add_argument("--elastic-low-watermark", type=float, default=None,
                        metavar="FRACTION", help="τ_low of the elastic runs (default: 0.1)")
    models.add_argument("--elastic-persist-steps", type=int, default=None, metavar="STEPS",
                        help="T_persist of the elastic runs (default: 8)")
    models.add_argument("--elastic-pool-layout", choices=("auto", "segments", "preallocated"),
                        default=None, help="where the elastic runs keep the KV extension "
                        "(default: auto = preallocated on CPU, segments on GPU/TPU)")
    models.add_argument("--prefix-caching", choices=("on", "off", "both"), default="on",
                        help="automatic prefix caching in every engine (on, the engine's "
                             "default; off), or both: every policy runs twice, with caching "
                             f"and without, the latter labelled 'NAME{NO_CACHE_SUFFIX}', and "
                             "the table is followed by the with / without ratios "
                             "(default: %(default)s)")

    models.add_argument("--deterministic", choices=("on", "off", "both"), default="on",
                        help="batch-invariant target numerics in every engine (on, the "
                             "engine's default; off), or both: every policy runs twice, the "
                             f"second time without them, labelled 'NAME{NO_DETERMINISTIC_SUFFIX}' "
                             "(default: %(default)s)")
    models.add_argument("--async-scheduling", choices=("on", "off", "both"), default="on",
                        help="asynchronous scheduling in every engine (on, the engine's "
                             "default: a γ = 0 step is committed while the next one runs; "
                             f"off), or both: every policy runs twice, the second time "
                             f"without it, labelled 'NAME{NO_ASYNC_SUFFIX}' "
                             "(default: %(default)s)")

    syn = p.add_argument_group("cost-realistic synthetic mode (jspec/synthetic.py)")
    syn.add_argument("--synthetic", metavar="SHAPE", default=None,
                     help="random-weight target and draft of this real shape (qwen2.5-0.5b, "
                          "qwen2.5-7b with a 0.5b draft; tiny: a smoke-test stand-in) "
                          "with synthetic acceptance; results are labelled SYNTHETIC")
    syn.add_argument("--synthetic-acceptance", metavar="SPEC", default=None,
                     help="acceptance model: a rate (0.8), per-position rates (0.9,0.8,...), "
                          "a `jspec bench pair --json` file, or default-pair (the shipped "
                          "pair's recorded acceptance; the default with --synthetic)")
    pol = p.add_argument_group("policies")
    pol.add_argument("--policy", nargs="+", default=["static"], metavar="NAME[:K=V,...]",
                     help="policies to run one after another on the same requests, e.g. "
                          "off static:gamma=2 nightjar; drafter=ngram drafts by prompt lookup "
                          "instead of the draft model (static:gamma=4,drafter=ngram) "
                          "(default: static)")
    pol.add_argument("--rounds", type=int, default=1, metavar="N",
                     help="run the policy list N times, every other round in reverse order "
                          "(A B C C B A ...), and compare the policies on their means over "
                          "the rounds: on a machine whose speed drifts, a single run per "
                          "policy does not separate them (default: %(default)s)")
    pol.add_argument("--policy-option", action="append", default=[],
                     metavar="[NAME.]KEY=VALUE",
                     help="policy option for every policy but off, or for NAME only; "
                          "repeatable")

    work = p.add_argument_group("workload")
    work.add_argument("--workload", choices=wl.WORKLOADS, default="code",
                      help="prompt source (default: %(default)s); code-continuation: held-out "
                           "functions cut part way through their body; mixed: spec-bench, "
                           "sharegpt, code and code-continuation together; multiturn: "
                           "conversations, each user turn sent when the previous one's answer "
                           "has streamed back, its prompt the whole conversation so far (see "
                           "--turns)")
    work.add_argument("--category", metavar="NAME[,NAME...]", default=None,
                      help="only the workload's prompts of these categories (Spec-Bench: "
                           "summarization and rag are input-grounded; translation, qa, "
                           "math_reasoning and the MT-Bench ten are not; mixed: those, "
                           "sharegpt, code and code-continuation)")
    work.add_argument("--workload-file", metavar="PATH",
                      help="the workload's data file (default: the shared data directory's)")
    work.add_argument("--max-tokens", type=int, default=128,
                      help="output tokens per request; caps a trace's GeneratedTokens "
                           "(default: %(default)s)")
    work.add_argument("--max-prompt-tokens", type=int, default=None,
                      help="cap on prompt tokens (default: only the context limit); multiturn: "
                           "on each user message's tokens (the wrapper excluded)")
    work.add_argument("--context-scale", type=float, default=1.0,
                      help="multiply a trace's ContextTokens by this (default: %(default)s)")
    work.add_argument("--turns", type=int, default=None, metavar="K",
                      help="multiturn: user turns per conversation (default: "
                           f"{wl.DEFAULT_TURNS}): single-turn entries (the shipped ShareGPT "
                           "file's) are grouped K at a time into one conversation, a "
                           "multi-turn entry keeps its first K human turns")
    work.add_argument("--think-time", type=float, default=None, metavar="SECONDS",
                      help="multiturn: the pause between an answer's last token and the "
                           "user's next message (default: 0)")
    work.add_argument("--temperature", type=float, default=0.0)
    work.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                      help="generate every budgeted token (default: on, so output lengths are "
                           "the workload's)")
    work.add_argument("--warmup-requests", type=int, default=0, metavar="N",
                      help="before its measured run, each adaptive policy (not off / static) "
                           "serves the first N requests of the same schedule unmeasured, so it "
                           "is measured in the state a long-running server reaches, not while "
                           "it learns from nothing (multiturn: the first N conversations)")
    work.add_argument("--seed", type=int, default=0,
                      help="seeds prompt sampling, arrivals and per-request sampling")

    load = p.add_argument_group("arrivals")
    load.add_argument("--arrivals", choices=ARRIVALS, default=None,
                      help="the arrival schedule (default: trace when --trace is given, step "
                           "when --steps is, else poisson)")
    defaults = SCHEDULE_DEFAULTS
    load.add_argument("--rate", type=float, default=defaults["poisson"]["rate"],
                      help="requests/s (poisson)")
    load.add_argument("--process", choices=arr.PROCESSES, default="poisson",
                      help="poisson/step/burst: random (poisson) or evenly spaced (regular)")
    load.add_argument("--steps", default=None, metavar="T:RATE,...",
                      help="step pattern: rate RATE from second T, e.g. 0:1,30:4,60:1")
    load.add_argument("--burst-period", type=float, default=defaults["burst"]["burst_period"])
    load.add_argument("--burst-size", type=int, default=defaults["burst"]["burst_size"])
    load.add_argument("--burst-base-rate", type=float,
                      default=defaults["burst"]["burst_base_rate"])
    load.add_argument("--trace", default=None, metavar="NAME|PATH",
                      help=f"replay a shipped Azure trace ({', '.join(sorted(arr.TRACE_FILES))}: "
                           "the shared data copy) or the path of any CSV in the Azure trace "
                           "format (TIMESTAMP, ContextTokens, GeneratedTokens); implies "
                           f"--arrivals trace (which alone replays {DEFAULT_TRACE})")
    load.add_argument("--time-scale", type=float, default=defaults["trace"]["time_scale"],
                      help="trace: multiply arrival times (2 = half the rate)")
    load.add_argument("--rate-scale", type=float, default=defaults["trace"]["rate_scale"],
                      help="trace: thin (<1) or replicate (>1) requests")
    load.add_argument("--window-start", type=float, default=defaults["trace"]["window_start"],
                      help="trace: start of the replayed window, trace seconds")
    load.add_argument("--duration", type=float, default=None,
                      help="seconds of arrivals (a trace: of replay, i.e. after time scaling)")
    load.add_argument("--num-requests", type=int, default=None,
                      help=f"at most this many requests (default {DEFAULT_NUM_REQUESTS} when "
                           f"no --duration is given, except for a trace); multiturn: "
                           f"conversations, each arrival starting one")

    out = p.add_argument_group("metrics and output")
    out.add_argument("--tpot-slo-ms", type=float, default=100.0,
                     help="TPOT SLO for attainment and goodput (default: %(default)s ms)")
    out.add_argument("--ttft-slo-ms", type=float, default=None,
                     help="optional TTFT SLO, also required for goodput")
    out.add_argument("--bin-seconds", type=float, default=None,
                     help="time-series bin (default: about 1/60 of the arrival span)")
    out.add_argument("--out", metavar="JSON", help="write all results to this file")
    out.add_argument("--plot", metavar="DIR", help="also draw the plots into DIR")
    out.add_argument("--no-requests", action="store_true",
                     help="leave per-request and per-step records out of the JSON")
    out.add_argument("--no-progress", action="store_true")


# ----------------------------------------------------------------------------- policies
def parse_policies(specs: list[str], options: list[str], max_gamma: int) -> list[dict]:
    """[{"label", "name", "options"}] from --policy items and --policy-option entries; every
    policy is built once here so a bad name or option fails before any model loads."""
    from jspec.cli_common import parse_option_value
    from jspec.policies import POLICIES, make_policy

    common: dict[str, Any] = {}
    targeted: dict[str, dict[str, Any]] = {}
    for item in options:
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ValueError(f"--policy-option expects [NAME.]KEY=VALUE, got {item!r}")
        name, dot, bare = key.partition(".")
        if dot:
            if name not in POLICIES:
                raise ValueError(f"--policy-option {item!r}: unknown policy {name!r}")
            targeted.setdefault(name, {})[bare.replace("-", "_")] = parse_option_value(value)
        else:
            common[key.replace("-", "_")] = parse_option_value(value)
    runs, labels = [], {}
    for spec in specs:
        name, _, inline = spec.partition(":")
        opts = {} if name == "off" else dict(common)
        opts.update(targeted.get(name, {}))
        for kv in filter(None, inline.split(",")):
            key, sep, value = kv.partition("=")
            if not sep or not key.strip():
                raise ValueError(f"--policy {spec!r}: options are KEY=VALUE pairs after ':'")
            opts[key.strip().replace("-", "_")] = parse_option_value(value)
        # drafter=ngram: the run's engine drafts by prompt lookup (no draft model)
        drafter = opts.pop("drafter", "draft_model")
        try:
            parse_methods(drafter)
        except ValueError as e:
            raise ValueError(f"--policy {spec!r}: drafter: {e}") from None
        engine = {} if drafter == "draft_model" else {"speculative_method": drafter}
        make_policy(name, max_gamma, **opts)  # name and options, before anything loads
        label = name + ("" if not opts else " " + " ".join(
            f"{'γ' if k == 'gamma' else k}={os.path.basename(str(v))}" for k, v in
            sorted(opts.items()))) + (f" {drafter}" if engine else "")
        labels[label] = labels.get(label, 0) + 1
        if labels[label] > 1:
            label = f"{label} #{labels[label]}"
        runs.append({"label": label, "name": name, "options": opts, "engine": engine})
    return runs


NO_CACHE_SUFFIX = " -prefix-cache"  # the label of a policy's run without prefix caching
NO_ASYNC_SUFFIX = " -async"  # ... and of its run without asynchronous scheduling
NO_DETERMINISTIC_SUFFIX = " -deterministic"  # ... and without batch-invariant numerics


def with_variant_runs(policies: list[dict], suffix: str, engine: dict) -> list[dict]:
    """Each policy followed by the same policy on an engine with the options ``engine`` added
    to its own, labelled with ``suffix``."""
    out = []
    for p in policies:
        out += [p, {**p, "label": p["label"] + suffix,
                    "engine": {**p.get("engine", {}), **engine}}]
    return out


def with_prefix_cache_runs(policies: list[dict]) -> list[dict]:
    """Each policy (run with prefix caching, the engine's default) followed by the same policy
    on an engine without it (``--prefix-caching both``)."""
    return with_variant_runs(policies, NO_CACHE_SUFFIX, {"enable_prefix_caching": False})


def with_elastic_runs(policies: list[dict], args: argparse.Namespace) -> list[dict]:
    """Each policy followed by the same policy on an engine with elastic memory."""
    elastic = {"elastic_memory": True}
    for name in ("elastic_low_watermark", "elastic_persist_steps", "elastic_pool_layout"):
        if getattr(args, name) is not None:
            elastic[name] = getattr(args, name)
    return with_variant_runs(policies, " +elastic", elastic)


# ----------------------------------------------------------------------------- arrivals
def arrival_schedule(args: argparse.Namespace) -> str:
    """The arrival schedule the command line asks for: ``--arrivals``, or, when it is not given,
    the one whose options were (``--trace PATH`` alone replays that trace). An option of another
    schedule is an error, not silently ignored."""
    given = {kind: [name for name, default in opts.items()
                    if getattr(args, name) != default]
             for kind, opts in SCHEDULE_DEFAULTS.items()}
    kind = args.arrivals
    if kind is None:
        implied = [k for k, names in given.items() if names and k != "poisson"]
        if len(implied) > 1:
            raise ValueError(f"options of the {' and '.join(implied)} arrival schedules were "
                             "given: choose one with --arrivals")
        kind = implied[0] if implied else "poisson"
    for other, names in given.items():
        if other != kind and names:
            flags = ", ".join("--" + n.replace("_", "-") for n in names)
            raise ValueError(f"{flags} shape{'s' if len(names) == 1 else ''} --arrivals "
                             f"{other}, not --arrivals {kind}")
    return kind


def build_arrivals(args: argparse.Namespace) -> arr.Arrivals:
    num, duration = args.num_requests, args.duration
    kind = arrival_schedule(args)
    if kind != "trace" and num is None and duration is None:
        num = DEFAULT_NUM_REQUESTS
    if kind == "poisson":
        return arr.poisson(args.rate, duration=duration, num_requests=num, seed=args.seed,
                           process=args.process)
    if kind == "batch":
        if duration is not None:
            raise ValueError("--arrivals batch sends everything at t = 0: give --num-requests, "
                             "not --duration")
        return arr.batch(num)
    if kind == "step":
        if not args.steps:
            raise ValueError("--arrivals step needs --steps T:RATE,... (e.g. 0:1,30:4,60:1)")
        return arr.step(arr.parse_segments(args.steps), duration=duration, num_requests=num,
                        seed=args.seed, process=args.process)
    if kind == "burst":
        return arr.burst(args.burst_period, args.burst_size, duration=duration,
                         num_requests=num, background=arr.Background(
                             args.burst_base_rate, args.process, args.seed))
    trace = arr.read_azure_trace(arr.trace_path(args.trace or DEFAULT_TRACE))
    if not args.time_scale > 0:
        raise ValueError(f"--time-scale must be > 0, got {args.time_scale}")
    window = None if duration is None else duration / args.time_scale
    return arr.trace_arrivals(trace, time_scale=args.time_scale, rate_scale=args.rate_scale,
                              window_start=args.window_start, window_duration=window,
                              max_requests=num)


def nice_bin(span: float) -> float:
    """A 1-2-5 bin width giving about 60 bins over ``span`` seconds (1 s when span is 0)."""
    if not span > 0:
        return 1.0
    raw = span / 60
    base = 10 ** math.floor(math.log10(raw))
    for m in (1, 2, 5, 10):
        if raw <= m * base:
            return m * base
    return 10 * base


# ----------------------------------------------------------------------------- the driver
class StepRecorder:
    """Records every engine step from the engine's per-step record (``StepRecord``, delivered
    on the engine thread to a step listener); ``with`` subscribes and unsubscribes."""

    def __init__(self, engine):
        self.engine = engine
        self.steps = StepRecords()
        self.t0: float | None = None

    def __enter__(self) -> "StepRecorder":
        self.engine.add_step_listener(self._on_step)
        return self

    def __exit__(self, *exc) -> None:
        self.engine.remove_step_listener(self._on_step)

    def _on_step(self, o) -> None:
        if self.t0 is None:  # before the clock starts (warm-up requests)
            return
        self.steps.append(
            time=time.perf_counter() - self.t0, step_time=o.step_time,
            draft_time=o.draft_time, catch_up_time=o.catch_up_time,
            batch_size=o.batch_size, num_decode=o.num_decode,
            gamma_sum=int(o.gammas.sum()), gamma_max=int(o.gammas.max(initial=0)),
            num_verified=int(o.num_verified.sum()), num_accepted=int(o.num_accepted.sum()),
            num_emitted=int(o.num_emitted.sum()), num_prefill_tokens=o.num_prefill_tokens,
            num_tokens=o.num_tokens, num_padded_tokens=o.num_padded_tokens,
            num_running=o.num_running, num_waiting=o.num_waiting)


class _Progress:
    """The drivers' progress bar: requests done, output tokens/s so far."""

    def __init__(self, total: int, desc: str, enabled: bool, t0: float):
        from tqdm.auto import tqdm

        self.bar = tqdm(total=total, desc=desc, unit="req", disable=not enabled,
                        file=sys.stderr)
        self.t0, self.tokens = t0, 0

    def done(self, rec: RequestRecord) -> None:
        self.tokens += rec.num_output_tokens
        self.bar.update(1)
        self.bar.set_postfix(
            tok_s=f"{self.tokens / max(time.perf_counter() - self.t0, 1e-9):.1f}")

    def drop(self, n: int) -> None:
        """``n`` requests counted in the total will not be sent (a conversation ended)."""
        if n > 0:
            self.bar.total -= n
            self.bar.refresh()

    def close(self) -> None:
        self.bar.close()


def new_record(req: wl.BenchRequest) -> RequestRecord:
    return RequestRecord(request_id=req.request_id, arrival=req.arrival,
                         prompt_tokens=len(req.prompt_token_ids), max_tokens=req.max_tokens,
                         category=req.category, conversation_id=req.conversation_id,
                         turn=req.turn)


async def send_request(aengine, req: wl.BenchRequest, rec: RequestRecord, sampling,
                       t0: float) -> list[int] | None:
    """Send ``req`` now, consume its stream and record its timeline in ``rec`` (times on the
    benchmark clock, zero at ``t0``); returns its output token ids, None when it failed (the
    error is recorded and counted, the run goes on). Both drivers send every request through
    here."""
    rec.submit = time.perf_counter() - t0
    output = None
    try:
        async for out in aengine.generate(req.prompt_token_ids, sampling(req), req.request_id):
            now = time.perf_counter() - t0
            n = len(out.delta_token_ids)
            if n or out.finished:
                rec.chunk_times.append(now)
                rec.chunk_tokens.append(n)
            if out.finished:
                rec.finish, rec.finish_reason = now, out.finish_reason
                s = out.spec
                rec.num_drafted, rec.num_accepted = s.num_drafted, s.num_accepted
                rec.num_spec_steps, rec.num_steps = s.num_spec_steps, s.num_steps
                output = list(out.token_ids)
    except Exception as e:  # recorded and counted as failed, the run goes on
        rec.error = f"{type(e).__name__}: {e}"
        output = None
    return output


async def drive(aengine, requests: list[wl.BenchRequest], sampling, recorder: StepRecorder,
                progress: bool = True, desc: str = "serving") -> list[RequestRecord]:
    """Send each request at its arrival time, consume its stream, and record the timeline.
    ``sampling(request) -> SamplingParams``."""
    records = [new_record(r) for r in requests]
    t0 = time.perf_counter()
    recorder.t0 = t0
    bar = _Progress(len(requests), desc, progress, t0)

    async def one(req: wl.BenchRequest, rec: RequestRecord) -> None:
        delay = t0 + req.arrival - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        await send_request(aengine, req, rec, sampling, t0)
        bar.done(rec)

    try:
        await asyncio.gather(*(one(r, rec) for r, rec in zip(requests, records)))
    finally:
        bar.close()
    return records


@dataclasses.dataclass
class ConversationRun:
    """What one conversation did in a run: every sent turn's prompt ids and output ids."""

    conversation_id: int
    turns_planned: int
    prompts: list[list[int]] = dataclasses.field(default_factory=list)
    outputs: list[list[int]] = dataclasses.field(default_factory=list)  # [] for a failed turn
    # ended early because its next prompt + output budget would exceed the context limit
    truncated: bool = False
    failed: bool = False  # ended early because a turn failed (an error or an abort)

    @property
    def turns_sent(self) -> int:
        return len(self.prompts)

    def as_dict(self) -> dict:
        return {"conversation_id": self.conversation_id, "turns_planned": self.turns_planned,
                "turns_sent": self.turns_sent, "truncated": self.truncated,
                "failed": self.failed, "prompt_tokens": [len(p) for p in self.prompts],
                "output_tokens": [len(o) for o in self.outputs]}


def conversation_summary(runs: list[ConversationRun]) -> dict:
    return {"num_conversations": len(runs),
            "num_truncated": sum(r.truncated for r in runs),
            "num_failed": sum(r.failed for r in runs),
            "turns_planned": sum(r.turns_planned for r in runs),
            "turns_sent": sum(r.turns_sent for r in runs),
            "turns_sent_per_conversation": summarize(r.turns_sent for r in runs)}


@dataclasses.dataclass(frozen=True)
class ClosedLoop:
    """How conversations are driven: the longest a conversation may grow (``context_limit``),
    the pause between a turn's answer and the next turn (``think_time``, seconds), and the
    progress bar (``progress``, ``desc``)."""

    context_limit: int
    think_time: float = 0.0
    progress: bool = True
    desc: str = "serving"


async def drive_conversations(aengine, conversations: list[wl.BenchConversation], sampling,
                              recorder: StepRecorder, loop: ClosedLoop
                              ) -> tuple[list[RequestRecord], list[ConversationRun]]:
    """Closed loop per conversation: its first turn is sent at its arrival time, and each next
    turn ``think_time`` seconds after the previous turn's last chunk arrived (its arrival, on
    the benchmark clock, that moment); turn k's prompt = turn k−1's prompt + its output ids +
    turn k's message (``wl.build_conversations``). A conversation ends early when the next
    prompt + output budget would exceed ``context_limit`` (truncated) or a turn fails. Request
    ids are ``conv-{conversation}-turn-{turn}`` (turns from 1). Returns the records, by
    conversation then turn, and each conversation's ``ConversationRun``."""
    t0 = time.perf_counter()
    recorder.t0 = t0
    bar = _Progress(sum(len(c.turns) for c in conversations), loop.desc, loop.progress, t0)
    runs = [ConversationRun(c.conversation_id, len(c.turns)) for c in conversations]
    records: list[list[RequestRecord]] = [[] for _ in conversations]

    async def one(conv: wl.BenchConversation, run: ConversationRun,
                  recs: list[RequestRecord]) -> None:
        due, context = conv.arrival, []
        for turn, added in enumerate(conv.turns, 1):
            ids = context + added
            if len(ids) + conv.max_tokens > loop.context_limit:
                run.truncated = True
                bar.drop(len(conv.turns) - turn + 1)
                return
            delay = t0 + due - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            req = wl.BenchRequest(
                request_id=f"conv-{conv.conversation_id}-turn-{turn}", arrival=due,
                prompt_token_ids=ids, max_tokens=conv.max_tokens, category=conv.category,
                prompt_index=conv.conversation_index, conversation_id=conv.conversation_id,
                turn=turn)
            rec = new_record(req)
            recs.append(rec)
            run.prompts.append(ids)
            output = await send_request(aengine, req, rec, sampling, t0)
            bar.done(rec)
            run.outputs.append(output or [])
            if output is None or not rec.ok or rec.finish_reason == "abort":
                run.failed = True
                bar.drop(len(conv.turns) - turn)
                return
            context = ids + output
            due = rec.finish + loop.think_time

    try:
        await asyncio.gather(*(one(c, run, recs)
                               for c, run, recs in zip(conversations, runs, records)))
    finally:
        bar.close()
    return [r for recs in records for r in recs], runs


def make_engine(args: argparse.Namespace, policy: dict, engine_kwargs: dict):
    """A fresh engine (not warmed up) for ``policy``: over the given (or built-in) checkpoints,
    or, with ``--synthetic``, over random-weight models of that shape with the built-in pair's
    tokenizer (any tokenizer does: the text is meaningless); with ``--synthetic-acceptance``,
    its acceptance drawn from that model (``jspec.synthetic.install``)."""
    from jspec.llm import build_engine

    target, draft, tokenizer = args.target, args.draft, None
    if args.synthetic is not None:
        from jspec.config import resolve_dtype
        from jspec.default_models import default_pair
        from jspec.synthetic import synthetic_models

        target, draft = synthetic_models(args.synthetic, resolve_dtype(engine_kwargs["dtype"]))
        tokenizer = default_pair()[0]
    options = {**engine_kwargs, **policy.get("engine", {})}
    if not drafts_with_model(options.get("speculative_method", "draft_model")):
        draft = None  # lookups draft: the target alone
    engine = build_engine(target, draft, tokenizer=tokenizer, policy=policy["name"],
                          policy_options=policy["options"], warmup=False, **options)
    acceptance = getattr(args, "synthetic_acceptance", None)
    if acceptance is not None:
        from jspec.synthetic import install

        install(engine, acceptance, seed=engine.config.seed)
    return engine


PREFIX_CACHE_KEYS = ("prefix_cache_queries", "prefix_cache_hits", "prefix_cache_hit_rate")


def request_seed(seed: int, req: wl.BenchRequest) -> int:
    """The request's sampling seed: from its number (``req-N``), or, for a conversation's turn,
    from its id (``conv-C-turn-T``), so every policy samples a request alike."""
    if req.conversation_id is None:
        key = int(req.request_id[4:])
    else:
        key = zlib.crc32(req.request_id.encode())
    return (seed * 1_000_003 + key) % 2**31


def run_policy(policy: dict, args: argparse.Namespace, engine_kwargs: dict, requests,
               engine=None) -> dict:
    """Run one policy over the requests (``BenchRequest``s, or ``BenchConversation``s for the
    multiturn workload) on a fresh engine (or ``engine``, already built and warmed up for this
    policy); returns the run's results."""
    engine, compile_s = _prepared_engine(policy, args, engine_kwargs, engine)
    # the conversations' limit: the first engine's (run()), the same for every policy
    context_limit = getattr(args, "context_limit_resolved", None) or engine.limits.context_limit
    _check_requests(engine, requests)
    measured = _drive_policy(policy, args, engine, requests, context_limit)
    em = engine.metrics.as_dict()
    result = {
        "label": policy["label"], "policy": policy["name"],
        "engine_options": dict(policy.get("engine", {})),
        "prefix_caching": engine.config.enable_prefix_caching,
        "policy_options": {k: str(v) if not isinstance(v, (int, float, bool)) else v
                           for k, v in policy["options"].items()},
        "compile_s": compile_s, "wall_s": measured.wall_s,
        "warmup_requests": measured.num_warmup, "warmup_s": measured.warmup_s,
        "metrics": _run_metrics(args, engine, em, measured),
        "submit_lag_s": summarize(r.submit - r.arrival for r in measured.records
                                  if r.submit is not None),
        "gamma_by_batch": gamma_by_batch(em["gamma_histogram_by_batch"]),
        "engine_metrics": {k: v for k, v in em.items() if k != "gamma_histogram_by_batch"},
        "time_series": time_series(measured.records, measured.steps, args.bin_seconds_resolved),
    }
    if not args.no_requests:
        result["steps"] = measured.steps.as_dict()
        if measured.warmup_steps is not None:  # what the policy learned from before the run
            result["warmup_steps"] = measured.warmup_steps.as_dict()
        result["policy_state"] = engine.policy.state_dict()  # what it knows at the end
        result["requests"] = [r.as_dict() for r in measured.records]
        if measured.conversations is not None:
            result["conversations"] = [c.as_dict() for c in measured.conversations]
    return result


def _is_multiturn(requests) -> bool:
    return bool(requests) and isinstance(requests[0], wl.BenchConversation)


def _prepared_engine(policy: dict, args: argparse.Namespace, engine_kwargs: dict,
                     engine) -> tuple[Any, float]:
    """The policy's engine (``engine``, or a fresh one, compiled now) with its step profile
    measured, and the seconds compiling took (0 for a given engine)."""
    compile_s = 0.0
    if engine is None:
        engine = make_engine(args, policy, engine_kwargs)
        t = time.perf_counter()
        engine.warmup()
        compile_s = time.perf_counter() - t
    engine.ensure_profile()  # a cost-model policy's step profile, measured before any timing
    return engine, compile_s


def _check_requests(engine, requests) -> None:
    """The engine accepts every request: cheap, and a failure here is a harness bug, not a
    benchmark result (a conversation's later prompts are built as it runs, within the context
    limit, so its first turn stands for it)."""
    from jspec.sampling_params import SamplingParams

    multiturn = _is_multiturn(requests)
    for r in requests:
        engine.validate_request(r.turns[0] if multiturn else r.prompt_token_ids,
                                SamplingParams(max_tokens=r.max_tokens))


class _Driver:
    """Sends requests, or conversations, to one engine with the run's sampling settings."""

    def __init__(self, aengine, args: argparse.Namespace, multiturn: bool, context_limit: int):
        self.aengine, self.args = aengine, args
        self.multiturn, self.context_limit = multiturn, context_limit

    def sampling(self, req: wl.BenchRequest):
        from jspec.sampling_params import SamplingParams

        return SamplingParams(max_tokens=req.max_tokens, temperature=self.args.temperature,
                              ignore_eos=self.args.ignore_eos,
                              seed=request_seed(self.args.seed, req))

    def run(self, reqs, recorder: StepRecorder, progress: bool, desc: str = "serving"
            ) -> tuple[list[RequestRecord], list[ConversationRun] | None]:
        """The records of sending ``reqs`` on a clock that starts now, and the conversations'
        runs (None for single requests)."""
        if not self.multiturn:
            return asyncio.run(drive(self.aengine, reqs, self.sampling, recorder,
                                     progress=progress, desc=desc)), None
        return asyncio.run(drive_conversations(
            self.aengine, reqs, self.sampling, recorder,
            ClosedLoop(self.context_limit, self.args.think_time or 0.0, progress, desc)))


@dataclasses.dataclass
class _Measured:
    """What serving one policy's requests recorded."""

    records: list[RequestRecord]
    conversations: list[ConversationRun] | None  # multiturn: each conversation's run
    steps: StepRecords
    warmup_steps: StepRecords | None  # the unmeasured warm-up requests' steps, if any ran
    num_warmup: int
    warmup_s: float
    wall_s: float


def _drive_policy(policy: dict, args: argparse.Namespace, engine, requests,
                  context_limit: int) -> _Measured:
    """Serve the requests on ``engine``; an adaptive policy (not off / static) first serves the
    first --warmup-requests of them, unmeasured."""
    from jspec.async_engine import AsyncLLMEngine

    multiturn = _is_multiturn(requests)
    aengine = AsyncLLMEngine(engine)
    driver = _Driver(aengine, args, multiturn, context_limit)
    warm = requests[:args.warmup_requests] if policy["name"] not in ("off", "static") else []
    warm_recorder, warmup_s = None, 0.0
    start = time.perf_counter()
    try:
        if warm:
            # the same requests at the same times, under other ids; then the engine's counters
            # start again from zero while the policy keeps what it learned
            warm = [dataclasses.replace(r, conversation_id=10_000_000 + i) if multiturn else
                    dataclasses.replace(r, request_id=f"req-{10_000_000 + i}")
                    for i, r in enumerate(warm)]
            with StepRecorder(engine) as warm_recorder:
                driver.run(warm, warm_recorder, progress=False)
            engine.reset_metrics()
            # the measured requests must not find the warm-up's prefixes, nor (greedy, the
            # same prompts) their own outputs as suffix decoding's drafts
            engine.reset_prefix_cache()
            engine.reset_suffix_cache()
            warmup_s = time.perf_counter() - start
            start = time.perf_counter()
        with StepRecorder(engine) as recorder:
            records, conversations = driver.run(requests, recorder, not args.no_progress,
                                                policy["label"])
    finally:
        aengine.shutdown()
    wall = time.perf_counter() - start
    if aengine.error is not None:
        raise RuntimeError(f"the engine failed under policy {policy['label']!r}") \
            from aengine.error
    return _Measured(records, conversations, recorder.steps,
                     warm_recorder.steps if warm_recorder is not None else None, len(warm),
                     warmup_s, wall)


def _run_metrics(args: argparse.Namespace, engine, em: dict, measured: _Measured) -> dict:
    """The run's request metrics (``serving_metrics``) with the engine's counters ``em``."""
    tpot_slo = args.tpot_slo_ms / 1e3 if args.tpot_slo_ms is not None else None
    ttft_slo = args.ttft_slo_ms / 1e3 if args.ttft_slo_ms is not None else None
    metrics = compute_metrics(measured.records, tpot_slo=tpot_slo, ttft_slo=ttft_slo)
    hist = em["gamma_histogram"]
    seq_steps = sum(hist)
    metrics["mean_gamma"] = sum(g * c for g, c in enumerate(hist)) / seq_steps \
        if seq_steps else 0.0
    metrics["num_engine_steps"] = em["num_steps"]
    metrics["num_preemptions"] = em["num_preemptions"]
    metrics["num_async_steps"] = em["num_async_steps"]
    metrics["num_pool_expansions"] = em["num_pool_expansions"]
    metrics["num_pool_contractions"] = em["num_pool_contractions"]
    metrics["policy_time_per_step_s"] = em["policy_time_per_step"]
    for key in PREFIX_CACHE_KEYS:
        metrics[key] = em[key]
    metrics["prefix_cache_blocks"] = engine.stats().kv_blocks_cached  # cached at the end
    if len({r.category for r in measured.records}) > 1:
        metrics["by_category"] = category_metrics(measured.records)
    if measured.conversations is not None:
        metrics["by_turn"] = turn_metrics(measured.records)
        metrics["conversations"] = conversation_summary(measured.conversations)
    return metrics


# ----------------------------------------------------------------------------- reporting
def _mean_tree(trees: list):
    """The element-wise mean of equally shaped metric dicts (numbers averaged over the values
    that are not None, None where all are; non-numeric leaves from the first)."""
    first = trees[0]
    if isinstance(first, dict):
        # (a round may lack a key the first has: a conversation turn it never reached)
        return {k: _mean_tree([t.get(k) if isinstance(t, dict) else None for t in trees])
                for k in first}
    if isinstance(first, (int, float)) and not isinstance(first, bool) or first is None:
        vals = [t for t in trees if isinstance(t, (int, float)) and not isinstance(t, bool)]
        return sum(vals) / len(vals) if vals else None
    return first


def summarize_rounds(runs: list[dict]) -> list[dict]:
    """One row per policy over its rounds (``--rounds``): metrics averaged, and the per-round
    throughput and p90 TPOT kept, in the order the policies were first run."""
    groups: dict[str, list[dict]] = {}
    for r in runs:
        groups.setdefault(r.get("policy_label", r["label"]), []).append(r)
    return [{"label": label, "policy": rs[0]["policy"], "rounds": len(rs),
             "metrics": _mean_tree([r["metrics"] for r in rs]),
             "output_tokens_per_s_by_round": [r["metrics"]["output_tokens_per_s"] for r in rs],
             "tpot_p90_s_by_round": [r["metrics"]["tpot_s"]["p90"] for r in rs]}
            for label, rs in groups.items()]


def policy_rows(results: dict) -> list[dict]:
    """A results file's one row per policy: the means over rounds when it has several, else
    its runs."""
    return results.get("summary") or results["runs"]


def ttft_p50(metrics: dict, turns: str | None = None) -> float | None:
    """TTFT p50 over all requests, or over a conversation's ``first`` or ``later`` turns
    (None without per-turn metrics)."""
    if turns is None:
        return metrics["ttft_s"]["p50"]
    return ((metrics.get("by_turn") or {}).get(turns) or {}).get("ttft_s", {}).get("p50")


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def comparison(runs: list[dict]) -> list[dict]:
    """Per run: throughput relative to the first run and to the best fixed choice (off /
    static) of the same invocation, p90 TPOT relative to that best fixed run's; for
    conversations, TTFT p50 of the later turns (turn ≥ 2) relative to the first run's."""
    fixed = [r for r in runs if r["policy"] in ("off", "static")]
    best = max(fixed, key=lambda r: r["metrics"]["output_tokens_per_s"]) if fixed else None
    first = runs[0]["metrics"]["output_tokens_per_s"] if runs else 0.0
    first_later = ttft_p50(runs[0]["metrics"], "later") if runs else None
    rows = []
    for r in runs:
        m = r["metrics"]
        tps = m["output_tokens_per_s"]
        row = {"label": r["label"], "output_tokens_per_s": tps,
               "vs_first": tps / first if first else None,
               "ttft_later_p50_vs_first": _ratio(ttft_p50(m, "later"), first_later),
               "best_fixed": best["label"] if best else None,
               "vs_best_fixed": None, "tpot_p90_vs_best_fixed": None}
        if best is not None:
            b = best["metrics"]
            if b["output_tokens_per_s"]:
                row["vs_best_fixed"] = tps / b["output_tokens_per_s"]
            if m["tpot_s"]["p90"] is not None and b["tpot_s"]["p90"]:
                row["tpot_p90_vs_best_fixed"] = m["tpot_s"]["p90"] / b["tpot_s"]["p90"]
        rows.append(row)
    return rows


def prefix_cache_comparison(runs: list[dict]) -> list[dict]:
    """Per policy run both with and without prefix caching (``--prefix-caching both``: the
    latter labelled NAME + NO_CACHE_SUFFIX), the with / without ratios: throughput (> 1: caching
    is faster) and TTFT p50 overall, of first turns and of later turns (< 1: caching answers
    sooner)."""
    by_label = {r["label"]: r for r in runs}
    out = []
    for off in runs:
        if not off["label"].endswith(NO_CACHE_SUFFIX):
            continue
        on = by_label.get(off["label"][:-len(NO_CACHE_SUFFIX)])
        if on is None:
            continue
        a, b = on["metrics"], off["metrics"]
        out.append({
            "on": on["label"], "off": off["label"],
            "output_tokens_per_s_ratio": _ratio(a["output_tokens_per_s"],
                                                b["output_tokens_per_s"]),
            "ttft_p50_ratio": _ratio(ttft_p50(a), ttft_p50(b)),
            "ttft_p50_first_turn_ratio": _ratio(ttft_p50(a, "first"), ttft_p50(b, "first")),
            "ttft_p50_later_turns_ratio": _ratio(ttft_p50(a, "later"), ttft_p50(b, "later")),
            "prefix_cache_hit_rate": a.get("prefix_cache_hit_rate")})
    return out


def format_prefix_cache_comparison(rows: list[dict]) -> str:
    lines = ["prefix caching on / off (tok/s > 1 and TTFT < 1: caching helps):"]
    for c in rows:
        lines.append(
            f"  {c['on']}: tok/s ×{_fmt(c['output_tokens_per_s_ratio'], '.3f')}, TTFT p50 "
            f"×{_fmt(c['ttft_p50_ratio'], '.3f')} (first turn "
            f"×{_fmt(c['ttft_p50_first_turn_ratio'], '.3f')}, later turns "
            f"×{_fmt(c['ttft_p50_later_turns_ratio'], '.3f')}), hit rate with caching "
            f"{_fmt(c['prefix_cache_hit_rate'], '.3f')}")
    return "\n".join(lines)


def _fmt(x, spec: str, scale: float = 1.0) -> str:
    return "-" if x is None else format(x * scale, spec)


def format_table(runs: list[dict], rows: list[dict]) -> str:
    """The comparison table; conversations (the multiturn workload) add TTFT p50 of first and
    later turns and the later turns' ratio to the first run, and a prefix-cache hit rate adds
    its column."""
    turns = any(r["metrics"].get("by_turn") for r in runs)
    hits = any(r["metrics"].get("prefix_cache_hit_rate") is not None for r in runs)
    w = max([22] + [len(r["label"]) for r in runs])
    head = (f"{'policy':<{w}} {'tok/s':>8} {'×first':>7} {'×bestfix':>8} {'goodput':>8} "
            f"{'SLO%':>5} {'TTFT p50':>9} {'p90':>8} {'TPOT p50':>9} {'p90':>8} {'ITL p90':>8} "
            f"{'accept':>6} {'acc.len':>7} {'mean γ':>6} {'preempt':>7}")
    if turns:
        head += f" {'TTFT1 p50':>9} {'TTFT2+ p50':>10} {'×first':>7}"
    if hits:
        head += f" {'hit%':>5}"
    lines = [head, "-" * len(head)]
    for r, c in zip(runs, rows):
        m = r["metrics"]
        extra = ""
        if turns:
            extra += (f" {_fmt(ttft_p50(m, 'first'), '.1f', 1e3):>9} "
                      f"{_fmt(ttft_p50(m, 'later'), '.1f', 1e3):>10} "
                      f"{_fmt(c.get('ttft_later_p50_vs_first'), '.3f'):>7}")
        if hits:
            extra += f" {_fmt(m.get('prefix_cache_hit_rate'), '.1f', 100):>5}"
        lines.append(
            f"{r['label']:<{w}} {m['output_tokens_per_s']:>8.1f} "
            f"{_fmt(c['vs_first'], '.3f'):>7} {_fmt(c['vs_best_fixed'], '.3f'):>8} "
            f"{m['goodput_requests_per_s']:>8.3f} {100 * m['slo_attainment']:>5.1f} "
            f"{_fmt(m['ttft_s']['p50'], '.1f', 1e3):>9} {_fmt(m['ttft_s']['p90'], '.1f', 1e3):>8} "
            f"{_fmt(m['tpot_s']['p50'], '.2f', 1e3):>9} {_fmt(m['tpot_s']['p90'], '.2f', 1e3):>8} "
            f"{_fmt(m['itl_s']['p90'], '.2f', 1e3):>8} {m['acceptance_rate']:>6.3f} "
            f"{m['mean_accepted_length']:>7.2f} {m['mean_gamma']:>6.2f} "
            f"{_fmt(m.get('num_preemptions'), '.0f'):>7}" + extra)
    lines.append("(latencies in ms; goodput = requests/s meeting the SLO; ×bestfix = "
                 "throughput / best of off and static in this run"
                 + ("; TTFT1 / TTFT2+ = first turn / later turns of a conversation, their "
                    "×first = TTFT2+ / the first row's" if turns else "")
                 + ("; hit% = prompt tokens found in the prefix cache" if hits else "") + ")")
    return "\n".join(lines)


def synthetic_banner(args: argparse.Namespace, synthetic) -> str:
    models = (f"random-weight {args.synthetic}-shaped target and draft" if args.synthetic
              else "real models")
    return (f"SYNTHETIC: {models}, acceptance drawn from {synthetic.source} (not measured on "
            "this text)")


def _model_label(args: argparse.Namespace, role: str) -> str:
    if args.synthetic:
        return f"synthetic {args.synthetic} {role} (random weights)"
    return getattr(args, role) or "default pair"


def _device() -> dict:
    import jax

    d = jax.devices()[0]
    return {"platform": d.platform, "kind": getattr(d, "device_kind", str(d)),
            "count": jax.device_count()}


def engine_options(args: argparse.Namespace) -> dict:
    """The engine options every policy's engine shares, from the command line."""
    # no benchmark request asks for logprobs: none compiled (max_logprobs=0)
    engine_kwargs = {"num_speculative_tokens": args.num_speculative_tokens, "dtype": args.dtype,
                     "max_num_seqs": args.max_num_seqs, "max_logprobs": 0}
    for name in ("max_model_len", "max_num_batched_tokens", "block_size", "num_kv_blocks",
                 "min_token_bucket", "kv_cache_memory_bytes", "tensor_parallel_size"):
        if getattr(args, name) is not None:
            engine_kwargs[name] = getattr(args, name)
    # (--prefix-caching both: the runs without it override this in their "engine" options)
    engine_kwargs["enable_prefix_caching"] = args.prefix_caching != "off"
    engine_kwargs["async_scheduling"] = args.async_scheduling != "off"  # (likewise)
    engine_kwargs["deterministic"] = args.deterministic != "off"  # (likewise)
    return engine_kwargs


def run(args: argparse.Namespace) -> int:
    plan = plan_benchmark(args)  # everything checkable without models, before loading any
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    announce(args, plan)
    # the first engine's tokenizer and context limit shape the requests every policy gets;
    # run_rounds takes it out of the list to run the first policy on it
    first = [make_engine(args, plan.policies[0], plan.engine_kwargs)]
    built = build_bench_requests(args, plan, first[0])
    runs = run_rounds(args, plan, built.requests, first)
    report = BenchReport.of(runs, args.rounds)
    print_report(args, plan, report)
    write_outputs(args, results_document(args, plan, built, report))
    return 0


@dataclasses.dataclass
class BenchPlan:
    """What one invocation runs, known before any model loads."""

    synthetic: Any  # the synthetic acceptance (jspec.synthetic), or None
    policies: list[dict]  # one per run in a round, variants included
    arrivals: arr.Arrivals
    prompts: list  # the workload's pool (multiturn: the conversations' messages)
    multiturn: bool
    turns: int  # multiturn: the most user turns per conversation
    engine_kwargs: dict  # the options every policy's engine shares


def check_arguments(args: argparse.Namespace):
    """Refuse bad options; returns the synthetic acceptance (``--synthetic-acceptance``, which
    ``--synthetic`` defaults to the built-in pair's), or None."""
    if (args.target is None) != (args.draft is None):
        raise ValueError("give both --target and --draft, or neither for the built-in pair")
    if args.synthetic is not None:
        from jspec.synthetic import check_shape

        check_shape(args.synthetic, args.target)
        if args.synthetic_acceptance is None:
            args.synthetic_acceptance = "default-pair"
    synthetic = None
    if args.synthetic_acceptance is not None:
        from jspec.synthetic import parse_acceptance

        synthetic = parse_acceptance(args.synthetic_acceptance, seed=args.seed)
    for name, low in (("num_speculative_tokens", 0), ("max_tokens", 1), ("warmup_requests", 0),
                      ("rounds", 1)):
        if getattr(args, name) < low:
            raise ValueError(f"--{name.replace('_', '-')} must be >= {low}, got "
                             f"{getattr(args, name)}")
    if args.max_prompt_tokens is not None and args.max_prompt_tokens < 1:
        raise ValueError(f"--max-prompt-tokens must be >= 1, got {args.max_prompt_tokens}")
    for name in ("tpot_slo_ms", "ttft_slo_ms", "bin_seconds"):
        value = getattr(args, name)
        if value is not None and not value > 0:
            raise ValueError(f"--{name.replace('_', '-')} must be > 0, got {value}")
    if args.workload != "multiturn" and (args.turns is not None or args.think_time is not None):
        raise ValueError("--turns and --think-time are options of --workload multiturn")
    if args.turns is not None and args.turns < 1:
        raise ValueError(f"--turns must be >= 1, got {args.turns}")
    if args.think_time is not None and not args.think_time >= 0:
        raise ValueError(f"--think-time must be >= 0, got {args.think_time}")
    from jspec.sampling_params import SamplingParams

    SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)  # checks them
    return synthetic


def policy_runs(args: argparse.Namespace) -> list[dict]:
    """The policies given, each followed by its variants (elastic memory, and without prefix
    caching, asynchronous scheduling or batch-invariant numerics for ``both``)."""
    policies = parse_policies(args.policy, args.policy_option, args.num_speculative_tokens)
    if args.elastic_memory:
        policies = with_elastic_runs(policies, args)
    if args.prefix_caching == "both":
        policies = with_prefix_cache_runs(policies)
    if args.async_scheduling == "both":
        policies = with_variant_runs(policies, NO_ASYNC_SUFFIX, {"async_scheduling": False})
    if args.deterministic == "both":
        policies = with_variant_runs(policies, NO_DETERMINISTIC_SUFFIX, {"deterministic": False})
    return policies


def plan_benchmark(args: argparse.Namespace) -> BenchPlan:
    """Check the options, and build the policy runs, the arrival schedule and the prompt pool;
    sets ``args.bin_seconds_resolved``."""
    synthetic = check_arguments(args)
    policies = policy_runs(args)
    arrivals = build_arrivals(args)
    if args.workload_file and args.workload in wl.NO_FILE:
        raise ValueError(f"--workload {args.workload} {wl.NO_FILE[args.workload]}; "
                         f"--workload-file is for {', '.join(wl.FILE_WORKLOADS)}")
    multiturn = args.workload == "multiturn"
    turns = args.turns or wl.DEFAULT_TURNS
    prompts = (wl.load_conversations(args.workload_file, turns) if multiturn
               else wl.load_workload(args.workload, args.workload_file))
    if args.category:
        if multiturn:
            raise ValueError("--category picks prompts of a workload's categories; the "
                             "multiturn workload has none")
        prompts = wl.of_categories(prompts, args.category.split(","))
    if args.plot:
        from jspec.bench.plots import require_matplotlib

        require_matplotlib()
    span = float(arrivals.times[-1]) if len(arrivals) else 0.0
    # (conversations: the arrivals are their starts; their turns run on about `turns` times
    # as long)
    args.bin_seconds_resolved = args.bin_seconds or nice_bin(span * (turns if multiturn else 1))
    return BenchPlan(synthetic, policies, arrivals, prompts, multiturn, turns,
                     engine_options(args))


def announce(args: argparse.Namespace, plan: BenchPlan) -> None:
    """The notes on stderr before the first model loads: what is synthetic or built in, and
    what of the arrival trace a multiturn workload ignores."""
    if plan.multiturn and plan.arrivals.context_tokens is not None:
        print("note: --workload multiturn takes only the trace's times (conversation starts), "
              "not its token counts", file=sys.stderr)
    if plan.synthetic is not None:
        print(f"{synthetic_banner(args, plan.synthetic)}; conditional acceptance per position "
              f"{', '.join(f'{r:.3f}' for r in plan.synthetic.rates)}", file=sys.stderr)
    elif args.target is None:
        from jspec.default_models import describe_default_pair

        print(f"using {describe_default_pair()}", file=sys.stderr)


@dataclasses.dataclass
class BenchRequests:
    """The requests every policy gets, built with the first engine's tokenizer and limits."""

    requests: list  # BenchRequest, or BenchConversation for multiturn
    prompt_lens: list[int]  # multiturn: the first turns'
    output_lens: list[int]  # the output budgets (multiturn: of every turn)
    turn_lens: list[int]  # multiturn: every user turn's tokens; else empty
    max_model_len: int
    context_limit: int  # what a sequence (a conversation) may grow to, prompt + output
    model_info: dict  # the models' signatures and the KV cache's dtype


def build_bench_requests(args: argparse.Namespace, plan: BenchPlan, first) -> BenchRequests:
    """The requests from the prompt pool and the arrival times, tokenized and fitted to the
    ``first`` engine's limits (the same for every policy's engine); says what they are."""
    from jspec.policies.profile import model_signature

    # what a conversation may grow to (prompt + output): the same for every policy's engine
    context_limit = args.context_limit_resolved = first.limits.context_limit
    model_info = {"target_model": model_signature(first.target.cfg),
                  "draft_model": model_signature(first.draft.cfg) if first.draft else None,
                  "kv_dtype": first.limits.kv_dtype}
    labels = ", ".join(p["label"] for p in plan.policies)
    fit = wl.FitOptions(context_limit, args.max_tokens, args.max_prompt_tokens, args.seed)
    if plan.multiturn:
        tok = first.tokenizer
        # the wrapped messages' pieces without special tokens; the first piece of a
        # conversation with them (a BOS, where the tokenizer adds one, starts it once)
        requests = wl.build_conversations(
            plan.prompts, lambda text: tok.encode(text, add_special_tokens=False),
            plan.arrivals.times, fit, encode_first=tok.encode)
        prompt_lens = [len(c.turns[0]) for c in requests]  # first turns
        turn_lens = [len(t) for c in requests for t in c.turns]
        output_lens = [c.max_tokens for c in requests for _ in c.turns]
        print(f"{len(requests)} conversations ({plan.arrivals.label} starts, {len(turn_lens)} "
              f"user turns, up to {plan.turns} each, {args.think_time or 0:g} s think time), "
              f"{sum(turn_lens)} user-turn tokens, {sum(output_lens)} output tokens budgeted "
              f"(context limit {context_limit}); policies: {labels}", file=sys.stderr)
    else:
        # fitted to what one sequence may hold (the KV pool may hold less than max_model_len):
        # the engine refuses a request whose prompt + max_tokens does not fit
        arrivals = plan.arrivals
        requests = wl.build_requests(
            plan.prompts, first.tokenizer.encode, arrivals.times, fit,
            wl.TraceLengths(arrivals.context_tokens, arrivals.generated_tokens,
                            args.context_scale))
        prompt_lens = [len(r.prompt_token_ids) for r in requests]
        output_lens = [r.max_tokens for r in requests]
        turn_lens = []
        print(f"{len(requests)} requests ({arrivals.label}, {args.workload} prompts), "
              f"{sum(prompt_lens)} prompt tokens, {sum(output_lens)} output tokens budgeted; "
              f"policies: {labels}", file=sys.stderr)
    return BenchRequests(requests, prompt_lens, output_lens, turn_lens,
                         first.rc.max_model_len, context_limit, model_info)


def run_rounds(args: argparse.Namespace, plan: BenchPlan, requests, first: list) -> list[dict]:
    """Every policy run in every round, on identical requests. ``first`` holds the first
    policy's engine, built but not compiled; it is taken out of the list, so that nothing
    keeps it (and its device memory) once its run is over: every later run builds its own."""
    runs = []
    # palindromic rounds: a drift of the machine's speed that is linear in time cancels in the
    # means over rounds 1 and 2
    order = [(rnd, policy) for rnd in range(1, args.rounds + 1)
             for policy in (plan.policies if rnd % 2 else plan.policies[::-1])]
    for i, (rnd, policy) in enumerate(order):
        engine = compile_s = None
        if i == 0:
            engine = first.pop()
            t = time.perf_counter()
            engine.warmup()
            compile_s = time.perf_counter() - t
        result = run_policy(policy, args, plan.engine_kwargs, requests, engine=engine)
        if compile_s is not None:
            result["compile_s"] = compile_s
        result["round"] = rnd
        if args.rounds > 1:
            result["label"] = f"{policy['label']} r{rnd}"
            result["policy_label"] = policy["label"]
        runs.append(result)
        print_run(result, plan.multiturn)
    return runs


def print_run(result: dict, multiturn: bool) -> None:
    """One run's line on stderr, and a warning when the driver sent requests late."""
    m = result["metrics"]
    print(f"{result['label']}: {m['output_tokens_per_s']:.1f} tok/s, "
          f"TPOT p90 {_fmt(m['tpot_s']['p90'], '.2f', 1e3)} ms, "
          f"acceptance {m['acceptance_rate']:.3f}, {m['num_preemptions']} preemptions"
          + (f", {m['num_pool_expansions']} expansions / {m['num_pool_contractions']} "
             f"contractions" if result["engine_options"].get("elastic_memory") else "")
          + (f", TTFT p50 first turn {_fmt(ttft_p50(m, 'first'), '.1f', 1e3)} ms / later "
             f"turns {_fmt(ttft_p50(m, 'later'), '.1f', 1e3)} ms, "
             f"{m['conversations']['num_truncated']} conversations truncated"
             if multiturn else "")
          + (f", prefix-cache hit rate {m['prefix_cache_hit_rate']:.3f}"
             if m.get("prefix_cache_hit_rate") is not None else "")
          + f" (compiled in {result['compile_s']:.1f} s, "
          f"ran {result['wall_s']:.1f} s, send lag p99 "
          f"{_fmt(result['submit_lag_s']['p99'], '.1f', 1e3)} ms)", file=sys.stderr)
    # the driver shares the interpreter with the engine thread; a late send is charged to
    # the request's latency (arrival = scheduled time), so say when that was material
    lag = result["submit_lag_s"]["p99"]
    if lag is not None and lag > 0.05:
        print(f"warning: under {result.get('policy_label', result['label'])} the driver sent "
              f"requests late (p99 {lag * 1e3:.0f} ms after their arrival time; counted in "
              f"their latency)", file=sys.stderr)


@dataclasses.dataclass
class BenchReport:
    """The runs and the tables comparing them."""

    runs: list[dict]
    summary: list[dict] | None  # --rounds > 1: one row per policy over its rounds
    rows: list[dict]  # the comparison of the summary's rows, else of the runs
    cache_rows: list[dict]  # with / without prefix caching (--prefix-caching both)

    @classmethod
    def of(cls, runs: list[dict], rounds: int) -> "BenchReport":
        summary = summarize_rounds(runs) if rounds > 1 else None
        return cls(runs, summary, comparison(summary or runs),
                   prefix_cache_comparison(summary or runs))


def print_report(args: argparse.Namespace, plan: BenchPlan, report: BenchReport) -> None:
    """The comparison tables on stdout (with several rounds: every run's, then the means)."""
    if plan.synthetic is not None:
        print(synthetic_banner(args, plan.synthetic))
    if report.summary is None:
        print(format_table(report.runs, report.rows))
    else:
        print(format_table(report.runs, comparison(report.runs)))
        print(f"\nmeans over {args.rounds} rounds (policy order reversed every other round):")
        print(format_table(report.summary, report.rows))
        for row in report.summary:
            print(f"  {row['label']}: tok/s by round "
                  + ", ".join(f"{x:.1f}" for x in row["output_tokens_per_s_by_round"]))
    if report.cache_rows:
        print(format_prefix_cache_comparison(report.cache_rows))


def results_document(args: argparse.Namespace, plan: BenchPlan, built: BenchRequests,
                     report: BenchReport) -> dict:
    """The JSON results (``FORMAT``): configuration, workload, arrivals and every run."""
    synthetic = plan.synthetic
    results = {
        "format": FORMAT,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": ["jspec", "bench", "serving", *sys.argv[3:]] if sys.argv[1:3] == [
            "bench", "serving"] else None,
        "synthetic": None if synthetic is None else {
            "label": synthetic_banner(args, synthetic), "shape": args.synthetic,
            **synthetic.describe()},
        "config": {"target": _model_label(args, "target"), "draft": _model_label(args, "draft"),
                   **built.model_info, **plan.engine_kwargs,
                   "max_model_len": built.max_model_len, "context_limit": built.context_limit,
                   "prefix_caching": args.prefix_caching,
                   "temperature": args.temperature, "ignore_eos": args.ignore_eos,
                   "seed": args.seed, "device": _device()},
        "workload": workload_description(args, plan, built),
        "arrivals": plan.arrivals.describe(),
        "slo": {"tpot_s": args.tpot_slo_ms / 1e3,
                "ttft_s": args.ttft_slo_ms / 1e3 if args.ttft_slo_ms is not None else None},
        "bin_seconds": args.bin_seconds_resolved,
        "rounds": args.rounds,
        "runs": report.runs,
        "comparison": report.rows,
    }
    if args.prefix_caching == "both":
        results["prefix_cache_comparison"] = report.cache_rows
    if report.summary is not None:
        results["summary"] = report.summary
    return results


def workload_description(args: argparse.Namespace, plan: BenchPlan,
                         built: BenchRequests) -> dict:
    """The results' ``workload``: where the prompts came from and the requests' sizes."""
    requests = built.requests
    return {"name": args.workload,
            "path": _workload_path(args),
            "categories": args.category.split(",") if args.category else None,
            "pool_size": len(plan.prompts), "max_tokens": args.max_tokens,
            "max_prompt_tokens": args.max_prompt_tokens,
            "context_scale": args.context_scale,
            "prompt_tokens": summarize(built.prompt_lens),  # multiturn: first turns
            "output_tokens_budget": summarize(built.output_lens),
            **({"turns": plan.turns, "think_time_s": args.think_time or 0.0,
                "num_conversations": len(requests),
                "turns_per_conversation": summarize(len(c.turns) for c in requests),
                "user_turn_tokens": summarize(built.turn_lens),
                "conversation_pool_index": [c.conversation_index for c in requests]}
               if plan.multiturn else {})}


def _workload_path(args: argparse.Namespace) -> str | list[str] | None:
    """The file the prompts came from: None for the held-out code workloads, the list of the
    sources' files for mixed."""
    if args.workload_file:
        return str(args.workload_file)
    if args.workload == "mixed":
        return [str(wl.default_path(s)) for s in wl.MIXED_SOURCES if s in wl.DATA_FILES]
    return None if args.workload in wl.NO_FILE else str(wl.default_path(args.workload))


def write_outputs(args: argparse.Namespace, results: dict) -> None:
    """The JSON file (``--out``) and the figures (``--plot DIR``)."""
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(results, f, indent=None, separators=(",", ":"), default=_json_default)
        print(f"wrote {args.out}", file=sys.stderr)
    if args.plot:
        from jspec.bench.plots import plot_results

        for path in plot_results([results], args.plot, names=[
                os.path.splitext(os.path.basename(args.out))[0] if args.out else "serving"]):
            print(f"wrote {path}", file=sys.stderr)


def _json_default(o):
    import numpy as np

    if isinstance(o, np.generic):
        return o.item()
    if isinstance(o, np.ndarray):
        return o.tolist()
    raise TypeError(f"{type(o).__name__} is not JSON serializable")
