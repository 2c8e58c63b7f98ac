"""`jspec bench headline`: the product's headline experiment, policies x loads, in one command.

For each load (three fixed Poisson rates and a scaled Azure conversation-trace replay) it runs
``jspec bench serving`` with every policy side by side (same requests, same arrival times, one
process, each policy on a fresh engine compiled before its clock starts), writes that load's
results JSON, and at the end a markdown report (``headline.md``: the policy x load table of
throughput, p90 TPOT and mean γ, and the goals of ``goal_checks`` checked one by one) and the
figures.

    jspec bench headline --out bench-results/real                 # the built-in pair
    jspec bench headline --synthetic qwen2.5-0.5b --out bench-results/synthetic

Loads are presets per mode (``PRESETS``), chosen for this repository's 2-core CPU so that "low"
keeps one or two sequences in flight, "high" saturates the engine (the batch reaches
``--max-num-seqs``) and "medium" sits in between. Three loads change during the run: "step" goes
from low to saturation and back (1 -> 16 -> 1 requests/s), "burst" sends a batch of requests at
once every few seconds over a light background, and the trace is a window of the Azure conv trace
whose request rate swings between those regimes. Every preset value can be overridden (``--rates``,
``--trace-*``, ``--num-requests``); the report prints the exact ``jspec bench serving`` command
of every load so any cell can be rerun alone. ``--report-only`` rebuilds the report from the JSON
files already in ``--out``.

Adaptive policies (not off / static) first serve the first N requests of the same schedule
unmeasured (``--warmup-requests``, part of each preset), so they are measured in the state a
long-running server reaches rather than while they learn from nothing; ``--extra
'--warmup-requests 0'`` measures them cold.

Every load runs its policy list three times (``--rounds``, palindromic order): the table gives
the means over the rounds and, for the adaptive policies, their worst round (lowest throughput,
highest p90 TPOT), and the goals are judged on the means and on the worst round, since a user
meets one run, not the average of three.

Throughput is output tokens over the run's span (first arrival to last finish): under an
open-loop load below capacity every policy delivers what arrives, so throughputs differ only by
the tail and the policies' speed shows in TPOT; at and above capacity throughput is capacity.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys

POLICIES = ("off", "static:gamma=1", "static:gamma=2", "static:gamma=3", "static:gamma=4",
            "static:gamma=5", "nightjar", "auto", "dsde", "adaspec", "dsd")
JUDGED = ("nightjar", "auto")  # the policies whose goals the report checks
SATURATED = ("high",)  # fixed loads at capacity: judged on throughput, the others on p90 TPOT
LOADS = ("low", "medium", "high", "step", "burst", "trace")
CHANGING = ("step", "burst", "trace")  # loads whose rate changes during the run

# mode -> load -> `jspec bench serving` arguments (calibrated on the 2-vCPU development machine;
# docs/benchmarks.md, "Headline", says which loads are arrival-bound there)
PRESETS: dict[str, dict[str, list[str]]] = {
    "real": {
        "common": ["--workload", "code", "--max-tokens", "128", "--max-num-seqs", "32",
                   "--num-speculative-tokens", "5", "--tpot-slo-ms", "40"],
        "low": ["--arrivals", "poisson", "--rate", "1", "--num-requests", "30",
                "--warmup-requests", "10"],
        "medium": ["--arrivals", "poisson", "--rate", "4", "--num-requests", "100",
                   "--warmup-requests", "40"],
        "high": ["--arrivals", "poisson", "--rate", "16", "--num-requests", "200",
                 "--warmup-requests", "100"],
        # 1 -> 16 -> 1 requests/s: light, saturated, light again (about 230 requests)
        "step": ["--arrivals", "step", "--steps", "0:1,20:16,32:1", "--duration", "52",
                 "--warmup-requests", "100"],
        # 24 requests at once every 10 s over a 1 request/s background (about 200 requests)
        "burst": ["--arrivals", "burst", "--burst-period", "10", "--burst-size", "24",
                  "--burst-base-rate", "1", "--duration", "60", "--warmup-requests", "100"],
        # the whole hour of the conv trace in 70 s at its own rate (3.2 to 8.5 requests/s by
        # trace minute), prompts at a tenth of its context lengths
        "trace": ["--arrivals", "trace", "--trace", "conv", "--time-scale", "0.02",
                  "--rate-scale", "0.02", "--context-scale", "0.1", "--warmup-requests", "200"],
    },
    "synthetic": {
        # the 494M target's decode step is ~65 ms at B = 1 and ~80 ms at B = 16 on this CPU, so
        # fewer, shorter requests; prompts cut to 32 tokens (their text does not matter here)
        "common": ["--workload", "code", "--max-tokens", "64", "--max-prompt-tokens", "32",
                   "--max-num-seqs", "16", "--max-model-len", "512",
                   "--num-speculative-tokens", "5", "--tpot-slo-ms", "150"],
        "low": ["--arrivals", "poisson", "--rate", "0.3", "--num-requests", "8"],
        "medium": ["--arrivals", "poisson", "--rate", "1", "--num-requests", "24"],
        "high": ["--arrivals", "poisson", "--rate", "6", "--num-requests", "48"],
        "step": ["--arrivals", "step", "--steps", "0:0.3,30:4,45:0.3", "--duration", "75"],
        "burst": ["--arrivals", "burst", "--burst-period", "15", "--burst-size", "8",
                  "--burst-base-rate", "0.2", "--duration", "60"],
        # the whole hour of the conv trace in 42 s at 0.23 x its rate (0.7 to 2.0 requests/s by
        # trace minute: from a few sequences in flight to saturating max_num_seqs for off)
        "trace": ["--arrivals", "trace", "--trace", "conv", "--time-scale", "0.012",
                  "--rate-scale", "0.0028", "--context-scale", "0.02"],
    },
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True, metavar="DIR",
                   help="directory for one JSON per load, headline.md and the figures")
    p.add_argument("--synthetic", metavar="SHAPE", default=None,
                   help="cost-realistic synthetic mode (e.g. qwen2.5-0.5b), acceptance replayed "
                        "from the shipped pair's record unless --synthetic-acceptance is given")
    p.add_argument("--synthetic-acceptance", metavar="SPEC", default=None)
    p.add_argument("--profile", metavar="PROFILE.json", default=None,
                   help="step-time profile for the policies that need one (adaspec, dsd); "
                        "default: the one each engine measures of itself at start-up "
                        "(jspec/autoprofile.py, cached)")
    p.add_argument("--loads", default=",".join(LOADS),
                   help=f"comma-separated subset of {', '.join(LOADS)}")
    p.add_argument("--policies", nargs="+", default=list(POLICIES), metavar="NAME[:K=V]")
    p.add_argument("--rounds", type=int, default=3, metavar="N",
                   help="run every load's policies N times in palindromic order (`jspec bench "
                        "serving --rounds`); the report gives each adaptive policy's worst "
                        "round beside the means, and judges the worst (default: 3)")
    p.add_argument("--extra", default="", metavar="ARGS",
                   help="more `jspec bench serving` arguments for every load (quoted), e.g. "
                        "'--seed 1 --max-tokens 96'")
    p.add_argument("--report-only", action="store_true",
                   help="only rebuild headline.md and the figures from the JSON files in --out")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--no-progress", action="store_true")


NEEDS_PROFILE = ("adaspec", "dsd")


def serving_args(mode: str, load: str, args: argparse.Namespace) -> list[str]:
    preset = PRESETS[mode]
    argv = [*preset["common"], *preset[load], "--policy", *args.policies]
    if getattr(args, "profile", None):
        for name in NEEDS_PROFILE:
            argv += ["--policy-option", f"{name}.profile={args.profile}"]
    if args.synthetic:
        argv += ["--synthetic", args.synthetic]
    if args.synthetic_acceptance:
        argv += ["--synthetic-acceptance", args.synthetic_acceptance]
    if getattr(args, "rounds", 1) > 1:
        argv += ["--rounds", str(args.rounds)]
    argv += shlex.split(args.extra)
    return argv


def run(args: argparse.Namespace) -> int:
    from jspec.bench import serving

    loads = [x.strip() for x in args.loads.split(",") if x.strip()]
    for load in loads:
        if load not in LOADS:
            raise ValueError(f"unknown load {load!r}; choose from {', '.join(LOADS)}")
    mode = "synthetic" if (args.synthetic or args.synthetic_acceptance) else "real"
    os.makedirs(args.out, exist_ok=True)
    commands = {}
    parser = argparse.ArgumentParser(prog="jspec bench serving")
    serving.add_arguments(parser)
    for load in loads:
        path = os.path.join(args.out, f"{load}.json")
        argv = serving_args(mode, load, args) + ["--out", path, "--no-requests"] + (
            ["--no-progress"] if args.no_progress else [])
        commands[load] = "jspec bench serving " + " ".join(shlex.quote(a) for a in argv)
        if args.report_only:
            continue
        ns = parser.parse_args(argv)  # argparse errors exit here, before any model loads
        print(f"== load {load}: {commands[load]}", file=sys.stderr)
        code = serving.run(ns)
        if code:
            return code
    from jspec.bench.plots import load_results

    results = {}
    for load in loads:
        path = os.path.join(args.out, f"{load}.json")
        if not os.path.exists(path):
            raise ValueError(f"no results for load {load!r} at {path!r}")
        results[load] = load_results(path)
    report = headline_report(results, commands)
    with open(os.path.join(args.out, "headline.md"), "w") as f:
        f.write(report)
    print(report)
    if not args.no_plots:
        from jspec.bench.plots import plot_results

        for path in plot_results(list(results.values()), args.out, names=list(results)):
            print(f"wrote {path}", file=sys.stderr)
    return 0


# ----------------------------------------------------------------------------- the report
def _runs(res: dict) -> dict[str, dict]:
    from jspec.bench.serving import policy_rows

    return {r["label"]: r for r in policy_rows(res)}


def _tps(run: dict) -> float:
    return run["metrics"]["output_tokens_per_s"]


def _tpot90(run: dict) -> float | None:
    return run["metrics"]["tpot_s"]["p90"]


def goal_checks(load: str, res: dict, policy: str = "nightjar") -> list[tuple[str, bool, str]]:
    """[(goal, met, numbers)] for one load: at a fixed load, ``policy``'s throughput >= 0.97 x
    the best fixed choice (off or static); under a changing load (step, burst, trace), >= 1.05 x
    every static and >= 1.10 x off; at every load its p90 TPOT <= the lowest p90 TPOT of the
    fixed choices."""
    runs = _runs(res)
    if policy not in runs:
        return []
    me = runs[policy]
    fixed = {k: v for k, v in runs.items() if v["policy"] in ("off", "static")}
    if not fixed:
        return []
    best_label = max(fixed, key=lambda k: _tps(fixed[k]))
    best = fixed[best_label]
    checks = []
    if load in CHANGING:
        statics = {k: v for k, v in fixed.items() if v["policy"] == "static"}
        if statics:
            best_static = max(statics, key=lambda k: _tps(statics[k]))
            ratio = _tps(me) / _tps(statics[best_static])
            checks.append((f"{policy} >= 1.05 x every static", ratio >= 1.05,
                           f"{ratio:.3f} x the best static ({best_static})"))
        if "off" in fixed:
            ratio = _tps(me) / _tps(fixed["off"])
            checks.append((f"{policy} >= 1.10 x off", ratio >= 1.10, f"{ratio:.3f} x off"))
    else:
        ratio = _tps(me) / _tps(best)
        checks.append((f"{policy} >= 0.97 x best fixed", ratio >= 0.97,
                       f"{ratio:.3f} x {best_label}"))
    timed = {k: v for k, v in fixed.items() if _tpot90(v) is not None}
    if _tpot90(me) is not None and timed:
        # against the fixed choice with the lowest p90 TPOT (below capacity every policy has the
        # same throughput, so "the best static" by throughput would be an arbitrary one); "no
        # worse" allows 2% of run-to-run timing noise, the numbers are printed
        low_label = min(timed, key=lambda k: _tpot90(timed[k]))
        low = _tpot90(timed[low_label])
        ratio = _tpot90(me) / low
        checks.append((f"{policy} p90 TPOT <= lowest fixed", ratio <= 1.02,
                       f"{_tpot90(me) * 1e3:.2f} vs {low * 1e3:.2f} ms ({low_label}), "
                       f"ratio {ratio:.3f}"))
    return checks


def headline_report(results: dict[str, dict], commands: dict[str, str]) -> str:
    loads = list(results)
    first = next(iter(results.values()))
    labels: list[str] = []
    for res in results.values():
        for label in _runs(res):
            if label not in labels:
                labels.append(label)
    lines = []
    syn = first.get("synthetic")
    if syn:
        lines += [f"**{syn['label']}**", ""]
    cfg = first["config"]
    lines += [f"Models: target {cfg['target']}, draft {cfg['draft']}; device "
              f"{cfg['device']['kind']} ({cfg['device']['platform']}); max_num_seqs "
              f"{cfg['max_num_seqs']}, Γmax {cfg['num_speculative_tokens']}.", ""]
    lines.append("| policy | " + " | ".join(
        f"{load}: tok/s (× best fixed), p90 TPOT ms, mean γ" for load in loads) + " |")
    lines.append("|---|" + "---|" * len(loads))
    for label in labels:
        cells = []
        for load in loads:
            res = results[load]
            run = _runs(res).get(label)
            if run is None:
                cells.append("-")
                continue
            comp = next((c for c in res["comparison"] if c["label"] == label), {})
            vs = comp.get("vs_best_fixed")
            t90 = _tpot90(run)
            cell = (f"{_tps(run):.1f} ({vs:.3f}), {t90 * 1e3 if t90 else float('nan'):.2f}"
                    f", {run['metrics']['mean_gamma']:.2f}" if vs is not None else
                    f"{_tps(run):.1f}")
            by_round = run.get("output_tokens_per_s_by_round")
            if by_round and run["policy"] not in ("off", "static"):
                tpots = [t for t in run["tpot_p90_s_by_round"] if t is not None]
                cell += (f"; worst of {len(by_round)}: {min(by_round):.1f}"
                         + (f", {max(tpots) * 1e3:.2f}" if tpots else ""))
            cells.append(cell)
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines += ["", "Loads:"]
    for load in loads:
        a = results[load]["arrivals"]
        lines.append(f"- {load}: {a['label']}, {a['num_requests']} requests; `{commands[load]}`")
    judged = [p for p in JUDGED if any(p in _runs(res) for res in results.values())]
    for policy in judged:
        lines += ["", f"Goals ({policy}, on the means over the rounds):"]
        for load in loads:
            for goal, met, numbers in goal_checks(load, results[load], policy):
                lines.append(f"- {load}: {goal}: {'met' if met else 'MISSED'} ({numbers})")
    worst = [(policy, load, check) for policy in judged for load in loads
             for check in worst_run_checks(load, results[load], policy)]
    if worst:
        lines += ["", "Worst round of each adaptive policy against the best fixed choice's mean, "
                  "and against the same round's best fixed choice (at saturation throughput "
                  "≥ 0.97×, below it p90 TPOT ≤ 1.05×):"]
        for policy, load, (goal, met, numbers) in worst:
            lines.append(f"- {load}: {goal}: {'met' if met else 'MISSED'} ({numbers})")
    return "\n".join(lines) + "\n"


def worst_run_checks(load: str, res: dict, policy: str) -> list[tuple[str, bool, str]]:
    """[(goal, met, numbers)]: ``policy``'s worst round (lowest throughput, highest p90 TPOT)
    against the best fixed choice's mean over the rounds, then its worst ratio to the best fixed
    choice of the same round. At saturation (``SATURATED``): throughput ≥ 0.97 × the best fixed;
    below it, where every policy delivers what arrives: p90 TPOT ≤ 1.05 × the lowest fixed.
    The machine's speed drifts between rounds (a fixed arm's rounds spread by ±8% on the 2-vCPU
    development machine), and a round's policies run side by side in palindromic order, so the
    same-round ratio is the one drift does not move. Loads that change are not judged here
    (their goals are on the means). Empty without rounds (``summary``)."""
    rows = {r["label"]: r for r in res.get("summary") or []}
    me = rows.get(policy)
    if me is None or load in CHANGING:
        return []
    fixed = {k: v for k, v in rows.items() if v["policy"] in ("off", "static")}
    if not fixed:
        return []
    n = me["rounds"]
    if load in SATURATED:
        best = max(fixed, key=lambda k: _tps(fixed[k]))
        ratio = min(me["output_tokens_per_s_by_round"]) / _tps(fixed[best])
        per_round = [x / max(f["output_tokens_per_s_by_round"][r] for f in fixed.values())
                     for r, x in enumerate(me["output_tokens_per_s_by_round"])]
        return [(f"{policy} worst of {n} rounds >= 0.97 x best fixed", ratio >= 0.97,
                 f"{ratio:.3f} x {best}'s mean; rounds " + ", ".join(
                     f"{x:.1f}" for x in me["output_tokens_per_s_by_round"]) + " tok/s"),
                (f"{policy} worst of {n} rounds >= 0.97 x the same round's best fixed",
                 min(per_round) >= 0.97, "rounds " + ", ".join(f"{x:.3f}" for x in per_round))]
    tpots = [t for t in me["tpot_p90_s_by_round"] if t is not None]
    timed = {k: v for k, v in fixed.items() if _tpot90(v) is not None}
    if not tpots or not timed:
        return []
    low = min(timed, key=lambda k: _tpot90(timed[k]))
    ratio = max(tpots) / _tpot90(timed[low])
    per_round = [t / min(f["tpot_p90_s_by_round"][r] for f in timed.values())
                 for r, t in enumerate(me["tpot_p90_s_by_round"]) if t is not None]
    return [(f"{policy} worst of {n} rounds p90 TPOT <= 1.05 x lowest fixed", ratio <= 1.05,
             f"{max(tpots) * 1e3:.2f} vs {_tpot90(timed[low]) * 1e3:.2f} ms ({low}'s mean), "
             f"ratio {ratio:.3f}; rounds " + ", ".join(f"{t * 1e3:.2f}" for t in tpots) + " ms"),
            (f"{policy} worst of {n} rounds p90 TPOT <= 1.05 x the same round's lowest fixed",
             max(per_round) <= 1.05, "rounds " + ", ".join(f"{x:.3f}" for x in per_round))]
