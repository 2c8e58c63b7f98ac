"""`jspec validate-gpu`: one command that checks a GPU machine on which JAX with CUDA is installed
and nothing can be downloaded:

    python3 -m pip install --no-deps --no-build-isolation -e . && python3 -m jspec validate-gpu --out gpu-report

(without ``--no-build-isolation`` pip tries to download setuptools to build the project, and
fails offline; ``python3 -m`` because on such an image the ``pip`` and ``jspec`` on PATH may
belong to another Python than the one that has JAX).

Stages, in this order, each in a process of its own (``jspec.validate_stages``, which says why);
a stage that fails, errs or runs out of time does not stop the later ones:

1. ``kernel-tests``: tests/test_kernels.py with the kernels compiled for the GPU
   (``JSPEC_KERNEL_TESTS=compiled``, tests/kernel_mode.py).
2. ``kernel-bench``: `jspec bench kernels` at the points its bandwidth goals are set at: every
   kernel against the reference, achieved bandwidth against the device's copy bandwidth.
3. ``greedy``: the built-in pair's greedy output with ``--kernel-backend pallas`` against the
   reference backend's, float32 and bfloat16.
4. ``serving``: the synthetic serving sweep at Qwen2.5-7B target / 0.5B draft shapes, plain
   decoding against a fixed γ at rising concurrency: where speculation stops paying on this GPU
   (``jspec.bench.spec_sweep``).

Time: a device probe first (at most ``PROBE_TIMEOUT_S``), then ``--budget-s`` shared by the
stages in the proportions of ``STAGES``; a stage may run until its share of the budget, counted
from the start, is spent, so the time a stage leaves unused passes to the next. A stage still
running then is killed (with everything it started) and reported as timed out, with whatever it
had written.

Output in ``--out``: ``validate-gpu.json`` (device, settings, every stage's status, checks,
numbers and errors), ``validate-gpu.md`` (the same, readable) and ``logs/STAGE.log`` (each
stage's own output). The run passes when every stage passed, is incomplete when one was skipped
(a missing test dependency, no budget left) and fails otherwise; exit code 0 when it passed, 1
otherwise. Without a GPU the command refuses (exit code 2) unless ``--allow-cpu``, which runs
every stage on the CPU at tiny sizes with the kernels interpreted: a check of the harness, not
of a GPU.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import shlex
import signal
import subprocess
import sys
import time

# (name, title, share of the budget)
STAGES = (
    ("kernel-tests", "kernel tests (tests/test_kernels.py)", 0.24),
    ("kernel-bench", "jspec bench kernels", 0.06),
    ("greedy", "greedy output, Pallas vs reference", 0.41),
    ("serving", "synthetic serving sweep", 0.29),
)
# shares from the stage times on an H100 and an H200 with jax 0.11.2, compiling included: kernel
# tests ~175 s, the bench 42 s, five greedy engines ~60 s each, three sweep levels ~70 s each
DEFAULT_BUDGET_S = 720.0
PROBE_TIMEOUT_S = 120.0
MIN_STAGE_S = 15.0  # a stage left less than this is skipped rather than started
FORMAT = "jspec-validate-gpu-v1"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True, metavar="DIR",
                   help="directory for validate-gpu.json, validate-gpu.md and the stages' logs")
    shares = ", ".join(f"{name} {share * 100:.0f}%%" for name, _, share in STAGES)
    p.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S, metavar="SECONDS",
                   help=f"wall-clock time for all stages together, after a device probe of at "
                        f"most {PROBE_TIMEOUT_S:.0f} s; shares: {shares} (default: "
                        "%(default)s)")
    p.add_argument("--stages", default=",".join(n for n, _, _ in STAGES), metavar="A,B",
                   help="comma-separated subset of the stages, run in the usual order "
                        "(default: all)")
    p.add_argument("--serving-levels", nargs="+", type=int, default=None, metavar="B",
                   help="concurrency levels of the serving sweep (default: 1 8 32 on a GPU)")
    p.add_argument("--allow-cpu", action="store_true",
                   help="on a machine without a GPU, run every stage on the CPU at tiny sizes "
                        "with the kernels interpreted (checks this command, not a GPU)")


def selected_stages(spec: str) -> list[tuple[str, str, float]]:
    names = [s.strip() for s in spec.split(",") if s.strip()]
    known = [n for n, _, _ in STAGES]
    for name in names:
        if name not in known:
            raise ValueError(f"unknown stage {name!r} in --stages; the stages are "
                             f"{', '.join(known)}")
    if not names:
        raise ValueError("--stages names no stage")
    return [s for s in STAGES if s[0] in names]


def run(args: argparse.Namespace) -> int:
    from jspec.validate_stages import PRESETS

    stages = selected_stages(args.stages)
    if not args.budget_s > 0:
        raise ValueError(f"--budget-s must be > 0, got {args.budget_s}")
    if args.serving_levels is not None:
        from jspec.bench.spec_sweep import check_levels

        check_levels(args.serving_levels)
    out = os.path.abspath(args.out)
    os.makedirs(os.path.join(out, "logs"), exist_ok=True)
    os.makedirs(os.path.join(out, "stages"), exist_ok=True)
    started = time.time()
    env = dict(os.environ)
    probe = run_stage("device", {}, out, PROBE_TIMEOUT_S, env)
    if probe["status"] != "pass":
        raise ValueError(f"the device probe failed ({probe['summary']}); its output: "
                         f"{probe['log']}")
    device = probe["numbers"]
    if device["platform"] != "gpu" and not args.allow_cpu:
        raise ValueError(f"jspec validate-gpu checks a GPU, and JAX runs on "
                         f"{device['platform'].upper()} here ({device['device_kind']}, jax "
                         f"{device['jax']}; what JAX said while looking for one: "
                         f"{os.path.join(out, probe['log'])}): install JAX with CUDA "
                         "(jax[cuda12]) or pass --allow-cpu to run every stage on the CPU at "
                         "tiny sizes (a check of this command, not of a GPU)")
    mode = "gpu" if device["platform"] == "gpu" else "cpu"
    if mode == "cpu":
        env["JAX_PLATFORMS"] = "cpu"  # whatever else JAX found (a TPU), the stages use the CPU
    settings = {**copy.deepcopy(PRESETS[mode]), "platform": device["platform"],
                "work_dir": os.path.join(out, "stages")}
    if args.serving_levels is not None:
        settings["serving"]["levels"] = list(args.serving_levels)
    print(f"validate-gpu: {device['device_count']} x {device['device_kind']} "
          f"({device['platform']}), {mode} settings, budget {args.budget_s:.0f} s; reports in "
          f"{out}", file=sys.stderr)
    total_share = sum(share for _, _, share in stages)
    clock, spent_share, results = time.time(), 0.0, []
    for i, (name, title, share) in enumerate(stages):
        spent_share += share
        timeout = clock + args.budget_s * spent_share / total_share - time.time()
        print(f"== {i + 1}/{len(stages)} {name}: {title} (until {timeout:.0f} s from now)",
              file=sys.stderr)
        if timeout < MIN_STAGE_S:
            result = {"status": "skipped", "checks": [], "numbers": {}, "errors": [],
                      "summary": f"{timeout:.0f} s of the budget were left, under the "
                                 f"{MIN_STAGE_S:.0f} s a stage needs at least",
                      "seconds": 0.0, "budget_s": max(timeout, 0.0), "log": None}
        else:
            result = run_stage(name, settings, out, timeout, env)
        result["title"] = title
        print(f"   {result['status']} in {result['seconds']:.0f} s: {result['summary']}",
              file=sys.stderr)
        results.append(result)
    status = overall_status([r["status"] for r in results])
    report = {
        "format": FORMAT, "status": status, "mode": mode,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": "jspec validate-gpu " + " ".join(shlex.quote(a) for a in sys.argv[2:])
        if sys.argv[1:2] == ["validate-gpu"] else f"jspec validate-gpu --out {args.out}",
        "device": device, "budget_s": args.budget_s, "seconds": time.time() - started,
        "settings": settings, "stages": results,
    }
    write_reports(report, out)
    return 0 if status == "pass" else 1


def overall_status(statuses: list[str]) -> str:
    """fail when a stage failed, erred or ran out of time; incomplete when one was skipped
    (a missing test dependency, no budget left); pass when every stage passed."""
    if any(s not in ("pass", "skipped") for s in statuses):
        return "fail"
    return "incomplete" if "skipped" in statuses else "pass"


def write_reports(report: dict, out: str) -> None:
    from jspec.validate_report import render

    with open(os.path.join(out, "validate-gpu.json"), "w") as f:
        json.dump(report, f, indent=1, default=str)
    markdown = render(report)
    with open(os.path.join(out, "validate-gpu.md"), "w") as f:
        f.write(markdown)
    print(markdown)
    print(f"wrote {os.path.join(out, 'validate-gpu.json')} and validate-gpu.md", file=sys.stderr)


def run_stage(name: str, settings: dict, out: str, timeout: float, env: dict) -> dict:
    """Run one stage in a process (group) of its own, killed after ``timeout`` seconds; its
    result, with ``seconds``, ``budget_s`` and ``log`` added."""
    work = os.path.join(out, "stages")
    settings_path = os.path.join(work, "settings.json")
    result_path = os.path.join(work, f"{name}.json")
    log_path = os.path.join(out, "logs", f"{name}.log")
    with open(settings_path, "w") as f:
        json.dump(settings, f, indent=1)
    if os.path.exists(result_path):
        os.remove(result_path)  # a result left by an earlier run must not pass for this one's
    start = time.time()
    cmd = [sys.executable, "-m", "jspec.validate_stages", name, "--settings", settings_path,
           "--result", result_path, "--deadline", repr(start + timeout)]
    timed_out = False
    with open(log_path, "w") as log:
        # its own session: at the deadline the stage goes together with what it started (pytest)
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            code = proc.wait()
            timed_out = True
    seconds = time.time() - start
    result = None
    if os.path.exists(result_path):
        with open(result_path) as f:
            result = json.load(f)
    if timed_out:
        partial = f"; it had got this far: {result['summary']}" if result else ""
        result = {"checks": [], "numbers": {}, "errors": [], **(result or {}),
                  "status": "timeout",
                  "summary": f"killed at the end of its {timeout:.0f} s budget{partial}"}
    elif result is None:
        result = {"status": "error", "checks": [], "numbers": {},
                  "summary": f"the stage exited with code {code} and wrote no result",
                  "errors": [_tail(log_path)]}
    result.update(name=name, seconds=seconds, budget_s=timeout,
                  log=os.path.relpath(log_path, out))
    return result


def _tail(path: str, limit: int = 3000) -> str:
    with open(path, errors="replace") as f:
        return f.read()[-limit:]
