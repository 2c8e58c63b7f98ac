"""`jspec bench step`: what an engine step costs against the model work inside it.

For each batch size B and fixed draft length γ the engine decodes B sequences steadily (every
sequence past its prompt) and the benchmark prints, per step:

* ``step``: the engine's ``LLMEngine.step`` wall time (median), each measured step alternating
  with an unmeasured one and followed by its replays (with asynchronous scheduling a γ = 0 step
  returns while its successor runs, so a call waits for the device work of the step before it);
* ``fwd``: the bare target forward over the very ragged batch the engine verified (its
  compiled executable replayed on the same inputs right after the step);
* ``draft``: the bare draft loop on the same inputs, or with ``--speculative-method ngram``
  the host lookup over the same sequences (0 at γ = 0);
* ``step / (fwd + draft)``: the engine's own overhead as a ratio (1.00 = none);
* ``loop``: p10 / median / p90 of further steps called back to back, as a decoding loop calls
  them: nothing runs between two calls, so where host and device share the cores (a CPU) the
  host's commit of one step competes with the device work of the next, which the alternating
  pass hides; ``loop fwd``: p10 / median / p90 of those very steps' forwards, replayed after
  the loop (the contexts grow as the sequences decode, so the loop is compared with its own
  steps' model work, ``loop / (fwd + draft)``);
* the share of each stage (``jspec.policies.base.STAGES``) in a second pass whose device stages are
  synced (``LLMEngine.time_stages``, which also commits every step before the next), so the
  verify forward, sampling/acceptance and signals are told apart.

With ``--loop-seconds S`` each (B, γ) also decodes back to back for S seconds (a finished
sequence replaced by a new one) and reports the steps' p10 / median / p90 and the share of seconds
spent in slow spells: seconds whose median step is over ``SPELL_RATIO`` × the median of the
fastest tenth of seconds. On a shared 2-vCPU machine the same step sometimes runs at 2-2.5× its
time for seconds on end (docs/benchmarks.md, "Slow spells"), which 20 steps rarely catch.

Then prefill: one request per prompt length, the engine's time to its first token against the
bare forward over the same chunks. Everything runs in this one process; ``--trace DIR`` records
the measured decode steps with the JAX profiler (open it in Perfetto or TensorBoard).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from jspec.config import LOOKUP_METHODS, SPECULATIVE_METHODS


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default=None, help="target checkpoint (default: built-in pair)")
    p.add_argument("--draft", default=None, help="draft checkpoint")
    p.add_argument("--speculative-method", choices=SPECULATIVE_METHODS,
                   default="draft_model",
                   help="what drafts: the draft model, an EAGLE-3 head (--draft HEAD; the "
                        "built-in target's without --target), or n-gram lookup or suffix "
                        "decoding (no draft model; the lookup is the 'draft' column)")
    p.add_argument("--synthetic", metavar="SHAPE", default=None,
                   help="random-weight models of this shape instead (e.g. qwen2.5-0.5b)")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--gammas", type=int, nargs="+", default=[0, 1, 2, 4])
    p.add_argument("--context", type=int, default=128,
                   help="prompt tokens per sequence before decoding starts (default: %(default)s)")
    p.add_argument("--steps", type=int, default=20, help="measured steps per point")
    p.add_argument("--loop-seconds", type=float, default=0.0, metavar="S",
                   help="also decode each point back to back for S seconds and report the "
                        "share of seconds in slow spells (default 0: off)")
    p.add_argument("--prefill-lens", type=int, nargs="*", default=[256, 1024],
                   help="prompt lengths for the prefill rows (clipped to the context limit)")
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"])
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True,
                   help="commit each γ = 0 step while the next one runs (EngineConfig."
                        "async_scheduling; default: on)")
    p.add_argument("--json", metavar="FILE", help="write the rows as JSON")
    p.add_argument("--trace", metavar="DIR",
                   help="record the measured decode steps with jax.profiler into DIR")


def _median(fn, repeats: int = 9) -> float:
    """Median seconds of ``fn`` after one warm-up call: the same statistic as the engine's
    step time (run to run, single calls on this 2-core machine vary by tens of percent)."""
    import jax

    jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def bare_forward(engine, st) -> float:
    """Seconds of the target forward alone over the batch a step verified."""
    return _median(engine.probe.replays(st)[0])


def _timed(fn) -> float:
    import jax

    t = time.perf_counter()
    jax.block_until_ready(fn())
    return time.perf_counter() - t


def _replay(engine, st) -> tuple[float, float]:
    """Seconds of one bare target forward and one bare draft loop (0 without one) on ``st``."""
    forward, draft = engine.probe.replays(st)
    return _timed(forward), _timed(draft) if draft else 0.0


def _engine(args, gamma: int, max_num_seqs: int, max_model_len: int | None):
    from jspec.bench.serving import make_engine

    policy = {"name": "static", "options": {"gamma": gamma}}
    kwargs = {"num_speculative_tokens": max(args.gammas), "max_num_seqs": max_num_seqs,
              "dtype": args.dtype, "async_scheduling": args.async_scheduling,
              "speculative_method": args.speculative_method}
    if max_model_len is not None:
        kwargs["max_model_len"] = max_model_len
    return make_engine(args, policy, kwargs)


def measure_decode(engine, batch: int, context: int, steps: int, trace: str | None = None
                   ) -> dict:
    import numpy as np

    from jspec.sampling_params import SamplingParams

    rng = np.random.default_rng(batch)
    vocab = engine.target.cfg.vocab_size
    room = engine.limits.max_model_len - context - 1
    sp = SamplingParams(max_tokens=room, temperature=0.0, ignore_eos=True)
    ids = [f"b{batch}-{i}" for i in range(batch)]
    for rid in ids:
        engine.add_request(rid, rng.integers(10, vocab, context).tolist(), sp)
    while engine.scheduler.num_waiting or any(not s.is_decoding
                                              for s in engine.scheduler.running):
        engine.step()
    for _ in range(3):  # settle: draft catch-up after prefill, first compilations
        engine.step()
    # Each measured step follows an unmeasured one and is followed at once by one bare forward
    # and one draft loop on its inputs, so the three medians see the same machine (a 2-core VM
    # drifts by tens of percent in a minute). The unmeasured step refills the pipeline: with
    # asynchronous scheduling a γ = 0 step returns while its successor runs, so the measured
    # call waits for the device work of the one before, as it does in steady decoding.
    import jax

    times, replays = [], []
    if trace:
        jax.profiler.start_trace(trace)
    for _ in range(steps):
        engine.step()
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
        if not trace:
            engine.probe.sync_device()  # the step left in flight
            replays.append(_replay(engine, engine.last_step))
    if trace:
        jax.profiler.stop_trace()
        # the trace holds the steps alone; the last step is replayed after it
        replays = [_replay(engine, engine.last_step) for _ in range(9)]
    step_s = statistics.median(times)
    last = engine.last_step
    fwd = statistics.median(r[0] for r in replays)
    draft = statistics.median(r[1] for r in replays)
    loop, looped = [], []
    for _ in range(steps):
        t = time.perf_counter()
        engine.step()
        loop.append(time.perf_counter() - t)
        looped.append(engine.last_step)
    engine.probe.sync_device()
    # each replay rewrites the K/V its step wrote, with the same values: the state is kept
    loop_replays = [_replay(engine, st) for st in looped]
    # second pass, device stages synced: the share of each stage
    engine.time_stages = True
    stage = {}
    total = 0.0
    for _ in range(steps):
        engine.step()
        o = engine.last_outcome
        total += o.stage_total
        for k, v in o.stage_times.items():
            stage[k] = stage.get(k, 0.0) + v
    engine.time_stages = False
    engine.abort_request(ids)
    engine.step()  # deliver the aborts
    return {"batch": batch, "gamma": last.gamma, "tokens": int(last.batch.input_ids.shape[0]),
            "step_ms": step_s * 1e3, "target_forward_ms": fwd * 1e3, "draft_ms": draft * 1e3,
            "overhead": step_s / (fwd + draft),
            "loop_step_ms": percentiles_ms(loop),
            "loop_forward_ms": percentiles_ms([r[0] for r in loop_replays]),
            "loop_overhead": statistics.median(loop) / (
                statistics.median(r[0] for r in loop_replays)
                + statistics.median(r[1] for r in loop_replays)),
            "stage_share": {k: v / total for k, v in stage.items()}}


SPELL_RATIO = 1.6  # a second this much slower than the fastest seconds is in a slow spell


def measure_sustained(engine, batch: int, context: int, seconds: float) -> dict:
    """``batch`` sequences decoding back to back for ``seconds``, each replaced by a new one
    (random ``context``-token prompt) when it reaches the model's length: the steps'
    percentiles and the share of seconds in slow spells (module docstring)."""
    import numpy as np

    from jspec.sampling_params import SamplingParams

    rng = np.random.default_rng(batch)
    vocab = engine.target.cfg.vocab_size
    room = engine.limits.max_model_len - context - 1
    sp = SamplingParams(max_tokens=room, temperature=0.0, ignore_eos=True)
    added = 0

    def top_up():
        nonlocal added
        while engine.num_unfinished_requests < batch:
            engine.add_request(f"sustained-b{batch}-{added}",
                               rng.integers(10, vocab, context).tolist(), sp)
            added += 1

    top_up()
    for _ in range(5):  # admit the prompts before timing
        engine.step()
    starts, times = [], []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        top_up()
        t = time.perf_counter()
        engine.step()
        starts.append(t)
        times.append(time.perf_counter() - t)
    engine.abort_request([f"sustained-b{batch}-{i}" for i in range(added)])
    engine.step()  # deliver the aborts
    starts = np.asarray(starts) - starts[0]
    times = np.asarray(times)
    second = starts.astype(np.int64)
    medians = np.array([np.median(times[second == k]) for k in np.unique(second)])
    fast = np.median(np.sort(medians)[:max(1, len(medians) // 10)])
    return {"seconds": float(seconds), "steps": int(len(times)), "sequences": added,
            "step_ms": percentiles_ms(list(times)),
            "slow_share": float(np.mean(medians > SPELL_RATIO * fast))}


def percentiles_ms(seconds: list[float]) -> dict[str, float]:
    """p10, median and p90 of a list of durations, in milliseconds."""
    import numpy as np

    p10, p50, p90 = np.percentile(np.asarray(seconds) * 1e3, [10, 50, 90])
    return {"p10": float(p10), "p50": float(p50), "p90": float(p90)}


def measure_prefill(engine, length: int) -> dict:
    """The engine's time from adding a prompt of ``length`` tokens to its first token, against
    the bare forward replayed over the same chunks."""
    import numpy as np

    from jspec.sampling_params import SamplingParams

    rng = np.random.default_rng(length)
    sp = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)

    def run(rid):
        # a new prompt each time: the same one again would come from the prefix cache
        engine.add_request(rid, rng.integers(10, engine.target.cfg.vocab_size,
                                             length).tolist(), sp)
        states = []
        t = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
            states.append(engine.last_step)
        return time.perf_counter() - t, states

    run(f"prefill-warm-{length}")  # compile what it needs
    seconds, states = min((run(f"prefill-{length}-{i}") for i in range(3)), key=lambda r: r[0])
    fwd = sum(bare_forward(engine, st) for st in states)
    return {"prompt_tokens": length, "chunks": len(states), "engine_ms": seconds * 1e3,
            "target_forward_ms": fwd * 1e3, "engine_tok_s": length / seconds,
            "forward_tok_s": length / fwd, "overhead": seconds / fwd}


def run(args: argparse.Namespace) -> int:
    import jax

    if min(args.batch_sizes) < 1 or min(args.gammas) < 0 or args.steps < 1:
        raise ValueError("--batch-sizes must be >= 1, --gammas >= 0, --steps >= 1")
    if args.loop_seconds < 0:
        raise ValueError(f"--loop-seconds must be >= 0, got {args.loop_seconds}")
    if args.context < 1:
        raise ValueError(f"--context must be >= 1, got {args.context}")
    if args.speculative_method in LOOKUP_METHODS:
        if args.draft is not None:
            raise ValueError(f"--speculative-method {args.speculative_method} drafts by lookup "
                             f"and takes no --draft")
    elif (args.target is None) != (args.draft is None):
        raise ValueError("give both --target and --draft, or neither for the built-in pair")
    if args.synthetic is not None:
        from jspec.synthetic import check_shape

        check_shape(args.synthetic, args.target)
    max_seqs = max(args.batch_sizes)
    # settling, the alternating pass, the loop and the synced pass
    need = args.context + (args.steps * 4 + 3) * (max(args.gammas) + 1) + 16
    engines = {}
    print(f"jspec bench step: backend {jax.default_backend()}, jax {jax.__version__}, "
          f"models: {_describe(args)}", flush=True)
    rows = []
    header = (f"{'B':>3} {'γ':>2} {'tokens':>6} {'step ms':>8} {'fwd ms':>8} {'draft ms':>8} "
              f"{'step/(fwd+draft)':>16} {'loop ms p10/p50/p90':>21} "
              f"{'loop fwd p10/p50/p90':>21} {'loop/(fwd+draft)':>16}   stage shares (synced "
              f"pass)")
    print(header)
    for gamma in args.gammas:
        engine = _engine(args, gamma, max_seqs, None)
        if need > engine.limits.max_model_len:
            raise ValueError(f"--context {args.context} with {args.steps} steps needs "
                             f"{need} tokens, the model allows {engine.limits.max_model_len}")
        engines[gamma] = engine
        for batch in args.batch_sizes:
            trace = (f"{args.trace}/B{batch}-g{gamma}" if args.trace else None)
            row = measure_decode(engine, batch, args.context, args.steps, trace)
            row["gamma"] = gamma
            if args.loop_seconds > 0:
                row["sustained"] = measure_sustained(engine, batch, args.context,
                                                     args.loop_seconds)
            rows.append(row)
            shares = " ".join(f"{k} {100 * v:.0f}%" for k, v in row["stage_share"].items()
                              if v >= 0.005)
            print(f"{batch:>3} {gamma:>2} {row['tokens']:>6} {row['step_ms']:>8.2f} "
                  f"{row['target_forward_ms']:>8.2f} {row['draft_ms']:>8.2f} "
                  f"{row['overhead']:>16.2f} {_spread(row['loop_step_ms']):>21} "
                  f"{_spread(row['loop_forward_ms']):>21} {row['loop_overhead']:>16.2f}   "
                  f"{shares}", flush=True)
            if "sustained" in row:
                sus = row["sustained"]
                print(f"        sustained {sus['seconds']:.0f} s: {sus['steps']} steps, ms "
                      f"p10/p50/p90 {_spread(sus['step_ms'])}, "
                      f"{100 * sus['slow_share']:.0f}% of seconds in slow spells", flush=True)
    prefill = []
    if args.prefill_lens:
        engine = engines[args.gammas[0]]
        print(f"\nprefill (one request, chunks of at most {engine.limits.max_num_batched_tokens} "
              f"tokens)")
        print(f"{'prompt':>6} {'chunks':>6} {'engine ms':>9} {'fwd ms':>8} {'engine tok/s':>12} "
              f"{'fwd tok/s':>10} {'engine/fwd':>10}")
        for length in args.prefill_lens:
            length = min(length, engine.limits.max_model_len - 2)
            r = measure_prefill(engine, length)
            prefill.append(r)
            print(f"{length:>6} {r['chunks']:>6} {r['engine_ms']:>9.1f} "
                  f"{r['target_forward_ms']:>8.1f} {r['engine_tok_s']:>12.0f} "
                  f"{r['forward_tok_s']:>10.0f} {r['overhead']:>10.2f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"decode": rows, "prefill": prefill, "models": _describe(args),
                       "backend": jax.default_backend()}, f, indent=1)
    return 0


def _spread(p: dict[str, float]) -> str:
    return f"{p['p10']:.2f}/{p['p50']:.2f}/{p['p90']:.2f}"


def _describe(args) -> str:
    lookup = args.speculative_method in LOOKUP_METHODS
    if args.synthetic:
        return f"synthetic {args.synthetic} (random weights)" + (
            f", {args.speculative_method} lookup" if lookup else "")
    if lookup:
        return f"{args.target or 'the built-in target'}, drafting by {args.speculative_method}"
    if args.target:
        return f"{args.target} + {args.draft}"
    return "the built-in default pair"


if __name__ == "__main__":
    sys.exit(run(argparse.ArgumentParser().parse_args()))
