"""The stages of `jspec validate-gpu` (``jspec.validate_gpu``), each run in a process of its own:

    python -m jspec.validate_stages STAGE --settings FILE --result FILE --deadline UNIX_TIME

A stage writes its result to ``--result`` as JSON: ``status`` (pass, fail, error, skipped, or
timeout where it saw its own deadline pass), ``summary`` (one line), ``checks`` (each ``{name,
ok, required, detail}``: a stage fails when a required check fails; the rest, such as the
kernels' bandwidth goals, are reported, not judged), ``numbers`` and ``errors``. Stages made of
several steps (the greedy runs, the serving sweep's levels) write what they have after each, so
a stage killed at its budget, or failing half way, still leaves its numbers.

Why a process per stage: a stage that hangs or runs out of GPU memory is killed at its budget and
the later stages still run, each with the GPU to itself (JAX reserves most of a GPU's memory for
the process that first uses it).

``PRESETS`` holds what each stage runs: ``gpu`` sized to finish in minutes on one H100-class
GPU, ``cpu`` tiny (``--allow-cpu``: a check of the harness, not of a GPU).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform as host_platform
import subprocess
import sys
import time
import traceback
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Callable

import jspec

REPO_ROOT = Path(jspec.__file__).resolve().parent.parent
KERNEL_TESTS = REPO_ROOT / "tests" / "test_kernels.py"
# the kernel tests' imports beyond jspec's own dependencies (pyproject.toml's test extra)
KERNEL_TEST_MODULES = ("pytest", "hypothesis")
# seconds a stage keeps back from its budget to write its result
RESULT_MARGIN_S = 10.0

GREEDY_PROMPTS = ("def fibonacci(n):", "import os\n\n\ndef ", "class Stack:\n    def ",
                  "for i in range(")

PRESETS = {
    "gpu": {
        "kernel_tests": {"mode": "compiled", "select": []},
        # the points the bandwidth goals are set at: decode (q = 1) and γ + 1 = 5 verification at B = 1 and 32
        # over 4k contexts, a 512-token prefill chunk, a 512-block migration of 24 layers
        "kernel_bench": ["--batch-sizes", "1", "32", "--query-lens", "1", "5", "--contexts",
                         "4096", "--prefill", "512", "--migrate-blocks", "512", "--layers", "24",
                         "--repeats", "5"],
        "greedy": {"kernel_backend": "pallas", "prompts": 4, "max_tokens": 48,
                   "dtypes": ["float32", "bfloat16"],
                   "drafters": ["draft_model+ngram+suffix", "eagle3+ngram+suffix"]},
        "serving": {"shape": "qwen2.5-7b", "levels": [1, 8, 32], "policies": ["off",
                    "static:gamma=3"], "max_tokens": 64, "prompt_tokens": 32,
                    "acceptance": "default-pair"},
    },
    "cpu": {
        # two interpreted kernel tests (the whole file takes about a minute on 2 cores)
        "kernel_tests": {"mode": "interpret", "select": [
            "test_attention_kernel_decode_verify_and_prefill_in_one_launch",
            "test_migration_in_bf16_is_exact"]},
        "kernel_bench": ["--small", "--interpret"],
        "greedy": {"kernel_backend": "interpret", "prompts": 1, "max_tokens": 8,
                   "dtypes": ["float32", "bfloat16"],
                   "drafters": ["draft_model+ngram+suffix", "eagle3+ngram+suffix"]},
        "serving": {"shape": "tiny", "levels": [1, 4], "policies": ["off", "static:gamma=2"],
                    "max_tokens": 8, "prompt_tokens": 16, "acceptance": "default-pair"},
    },
}


# ----------------------------------------------------------------------------- results
def check(name: str, ok: bool, detail: str = "", required: bool = True) -> dict:
    return {"name": name, "ok": bool(ok), "required": required, "detail": detail}


def judged(summary: str, checks: list[dict], numbers: dict, errors: list[str] = ()) -> dict:
    """A stage's result: fail when a required check failed (or none was made), else pass."""
    required = [c for c in checks if c["required"]]
    ok = bool(required) and all(c["ok"] for c in required)
    return {"status": "pass" if ok else "fail", "summary": summary, "checks": checks,
            "numbers": numbers, "errors": list(errors)}


def skipped(reason: str) -> dict:
    return {"status": "skipped", "summary": reason, "checks": [], "numbers": {}, "errors": []}


def _seconds_left(deadline: float) -> float:
    return deadline - time.time() - RESULT_MARGIN_S


# ----------------------------------------------------------------------------- device
def device(settings: dict, deadline: float, save: Callable[[dict], None]) -> dict:
    """What JAX runs on here: the platform the other stages' presets are chosen by."""
    import jax
    import jaxlib

    devices = jax.devices()
    numbers = {"platform": jax.default_backend(),
               "device_kind": getattr(devices[0], "device_kind", str(devices[0])),
               "device_count": len(devices), "jax": jax.__version__,
               "jaxlib": jaxlib.__version__, "python": host_platform.python_version()}
    return {"status": "pass", "summary": f"{numbers['device_count']} x {numbers['device_kind']} "
            f"({numbers['platform']}), jax {numbers['jax']}", "checks": [], "numbers": numbers,
            "errors": []}


# ----------------------------------------------------------------------------- kernel tests
def kernel_tests(settings: dict, deadline: float, save: Callable[[dict], None]) -> dict:
    """tests/test_kernels.py under pytest, with ``JSPEC_KERNEL_TESTS`` set to the preset's mode
    (compiled on a GPU: tests/kernel_mode.py)."""
    cfg = settings["kernel_tests"]
    if not KERNEL_TESTS.exists():
        return skipped(f"{KERNEL_TESTS} is missing: jspec is installed without its tests "
                       "directory; install it from a source checkout (`pip install --no-deps -e "
                       ".` in the repository) to run the kernel tests")
    missing = [m for m in KERNEL_TEST_MODULES if importlib.util.find_spec(m) is None]
    if missing:
        return skipped(f"the kernel tests import {', '.join(missing)}, which is not installed "
                       f"here (pip install {' '.join(missing)}, or the repository's test extra); "
                       "the kernel benchmark and the greedy check still compare the kernels "
                       "with the reference")
    junit = Path(settings["work_dir"]) / "kernel-tests.xml"
    if junit.exists():
        junit.unlink()  # a report left by an earlier run must not pass for this one's
    targets = ([f"{KERNEL_TESTS}::{name}" for name in cfg["select"]] if cfg["select"]
               else [str(KERNEL_TESTS)])
    # one process on the one accelerator, and without pytest-xdist, which the project's test
    # options ask for (pyproject.toml) but an accelerator's image may not have
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=-ra",
           "--junitxml", str(junit), *targets]
    env = dict(os.environ, JSPEC_KERNEL_TESTS=cfg["mode"])
    print("$ JSPEC_KERNEL_TESTS=" + cfg["mode"] + " " + " ".join(cmd), flush=True)
    try:
        # pytest writes into this stage's log as it goes
        code = subprocess.run(cmd, cwd=REPO_ROOT, env=env,
                              timeout=max(1.0, _seconds_left(deadline))).returncode
    except subprocess.TimeoutExpired:
        return {"status": "timeout", "summary": "pytest ran out of the stage's budget (its "
                "output so far is in the stage's log)", "checks": [],
                "numbers": {"mode": cfg["mode"]}, "errors": []}
    numbers = {"mode": cfg["mode"], "pytest_exit_code": code,
               **(_junit_summary(junit) if junit.exists() else {})}
    ran = numbers.get("passed", 0) + numbers.get("failed", 0) + numbers.get("errors", 0)
    checks = [
        check("kernel tests ran", ran > 0,
              f"{ran} ran, {numbers.get('skipped', 0)} skipped"
              + ("" if junit.exists() else "; pytest wrote no report (its output is in the "
                 "stage's log)")),
        check("every kernel test passed", code == 0 and ran > 0,
              f"{numbers.get('passed', 0)} passed, {numbers.get('failed', 0)} failed, "
              f"{numbers.get('errors', 0)} errors (pytest exit code {code})"),
    ]
    failing = numbers.get("failures", [])
    summary = (f"{cfg['mode']}: {numbers.get('passed', 0)} passed, {numbers.get('failed', 0)} "
               f"failed, {numbers.get('errors', 0)} errors, {numbers.get('skipped', 0)} skipped"
               + (f" (first failure: {failing[0]['test']})" if failing else ""))
    return judged(summary, checks, numbers)


def _junit_summary(path: Path) -> dict:
    """Counts and the failing tests (name, first line of the message) of a pytest JUnit XML."""
    root = ET.parse(path).getroot()
    counts = {"tests": 0, "failed": 0, "errors": 0, "skipped": 0, "seconds": 0.0}
    failures = []
    for case in root.iter("testcase"):
        counts["tests"] += 1
        counts["seconds"] += float(case.get("time") or 0.0)
        for tag, key in (("failure", "failed"), ("error", "errors"), ("skipped", "skipped")):
            element = case.find(tag)
            if element is None:
                continue
            counts[key] += 1
            if tag != "skipped":
                message = (element.get("message") or element.text or "").strip()
                failures.append({"test": f"{case.get('classname')}::{case.get('name')}",
                                 "kind": tag, "message": message.splitlines()[0][:300]
                                 if message else ""})
            break
    counts["passed"] = counts["tests"] - counts["failed"] - counts["errors"] - counts["skipped"]
    counts["seconds"] = round(counts["seconds"], 2)
    return {**counts, "failures": failures}


# ----------------------------------------------------------------------------- kernel bench
# attention's error against the per-token oracle that passes, whatever the reference's own error
# (the kernel tests' tolerances)
ATTENTION_TOL = {"bfloat16": 2e-2, "float32": 1e-5}
ATTENTION_GOAL = 0.60  # of the copy bandwidth, decode at B = 1 and 32 over 4k contexts
MIGRATION_GOAL = 0.70
GOAL_CONTEXT = 4096


def kernel_bench(settings: dict, deadline: float, save: Callable[[dict], None]) -> dict:
    """`jspec bench kernels` (its ``measure``) at the preset's points, judged: every timed kernel
    equal to the reference (attention within the larger of the reference's own error and the
    kernel tests' tolerance, migration bit for bit), the compiled kernels in use on a GPU, and
    the bandwidth goals (ATTENTION_GOAL, MIGRATION_GOAL) reported."""
    from jspec.bench import kernels

    parser = argparse.ArgumentParser(prog="jspec bench kernels")
    kernels.add_arguments(parser)
    args = parser.parse_args(settings["kernel_bench"])
    res = kernels.measure(args)
    kernel = "pallas" if settings["platform"] == "gpu" else "interpret"
    tol = ATTENTION_TOL[res["dtype"]]
    checks, goals = [], []
    if settings["platform"] == "gpu":
        checks.append(check("the compiled Pallas kernels run", all(
            kernel in row for row in res["attention"] + res["migration"]),
            f"backend chosen by auto: {res['backend']}"))
    bad_attention, worst = [], 0.0
    for row in res["attention"]:
        ref_err = row["reference"]["max_abs_err"]
        for name in ("reference", kernel):
            if name not in row:
                continue
            err = row[name]["max_abs_err"]
            worst = max(worst, err) if name == kernel else worst
            if not err <= max(ref_err, tol):
                bad_attention.append(f"{name} B={row['batch']} q={row['q_len']} "
                                     f"ctx={row['context']}: {err:.2e}")
    checks.append(check("attention equals the per-token reference", not bad_attention,
                        "; ".join(bad_attention) or f"largest {kernel} error {worst:.2e} "
                        f"(tolerance: the reference's own error or {tol:g})"))
    bad_migration = [f"{name} {row['blocks']} blocks" for row in res["migration"]
                     for name in ("reference", kernel) if name in row and not row[name]["exact"]]
    checks.append(check("migration copies blocks bit for bit", not bad_migration,
                        "; ".join(bad_migration) or "every timed migration exact"))
    if kernel == "pallas":
        for row in res["attention"]:
            if row["q_len"] == 1 and row["context"] == GOAL_CONTEXT and "pallas" in row:
                frac = row["pallas"]["roofline"]
                goals.append(check(f"attention decode B={row['batch']}, {GOAL_CONTEXT} context "
                                   f">= {ATTENTION_GOAL:.0%} of copy bandwidth",
                                   frac >= ATTENTION_GOAL, f"{frac:.0%} "
                                   f"({row['pallas']['gbps']:.0f} GB/s)", required=False))
        for row in res["migration"]:
            if "pallas" in row:
                frac = row["pallas"]["roofline"]
                goals.append(check(f"migration of {row['blocks']} blocks >= {MIGRATION_GOAL:.0%} "
                                   "of copy bandwidth", frac >= MIGRATION_GOAL,
                                   f"{frac:.0%} ({row['pallas']['gbps']:.0f} GB/s)",
                                   required=False))
    met = sum(g["ok"] for g in goals)
    summary = (f"backend {res['backend']}, copy bandwidth {res['copy_bandwidth_gbps']:.0f} GB/s"
               + (f"; bandwidth goals met {met} of {len(goals)}" if goals else
                  "; bandwidth goals not judged (no compiled kernel here)"))
    return judged(summary, checks + goals, {"bench_kernels": res})


# ----------------------------------------------------------------------------- greedy output
def greedy(settings: dict, deadline: float, save: Callable[[dict], None]) -> dict:
    """The built-in pair's greedy output with the kernels (``pallas`` on a GPU, ``interpret``
    on CPU) against the reference backend, per dtype. float32 must be equal token for token (as
    tests/test_kernels.py's engine test asks); in bfloat16 the two kernels round differently,
    so a flipped near-tie may change the text: the agreement is reported, and what must hold
    there is bfloat16's own lossless claim, speculative output equal to plain decoding's on the
    same kernel (README, "What lossless guarantees"). In float32 the preset's drafters (the
    draft model, then the EAGLE head, each beside both lookups, chosen per row by `auto`) must
    give the reference's tokens too: their one-hot and mixed verification run on the kernel."""
    cfg = settings["greedy"]
    kernel = cfg["kernel_backend"]
    prompts = list(GREEDY_PROMPTS[:cfg["prompts"]])
    checks, numbers = [], {"prompts": prompts, "max_tokens": cfg["max_tokens"], "runs": {}}

    def run(name: str, dtype: str, backend: str, policy: str,
            method: str = "draft_model") -> dict:
        numbers["runs"][name] = _greedy_run(dtype, backend, policy, prompts, cfg["max_tokens"],
                                            method)
        save(judged("(running)", checks, numbers))  # kept if a later engine fails
        return numbers["runs"][name]

    for dtype in cfg["dtypes"]:
        ref = run(f"{dtype} reference", dtype, "reference", "static")
        got = run(f"{dtype} {kernel}", dtype, kernel, "static")
        same, detail = _compare(ref, got)
        checks.append(check(f"{dtype}: {kernel} equals reference token for token", same, detail,
                            required=dtype == "float32"))
        save(judged("(running)", checks, numbers))  # a verdict survives a later timeout
        for drafters in cfg.get("drafters", []) if dtype == "float32" else []:
            # the drafters in one engine, chosen per row by `auto`: the one-hot and mixed
            # verification paths (and the EAGLE head's hidden states) on the kernel, lossless
            # against the reference's tokens
            mixed = run(f"{dtype} {kernel} {drafters}", dtype, kernel, "auto", drafters)
            same, detail = _compare(ref, mixed)
            checks.append(check(f"{dtype}: {drafters} (auto) on {kernel} equals reference",
                                same, detail))
            save(judged("(running)", checks, numbers))
        if dtype == "bfloat16":
            plain = run(f"{dtype} {kernel} plain", dtype, kernel, "off")
            same, detail = _compare(plain, got)
            checks.append(check(f"{dtype}: speculative equals plain decoding on {kernel}", same,
                                detail))
    summary = "; ".join(f"{c['name']}: {'yes' if c['ok'] else 'NO'}" for c in checks)
    return judged(summary, checks, numbers)


def _greedy_run(dtype: str, kernel_backend: str, policy: str, prompts: list[str],
                max_tokens: int, method: str = "draft_model") -> dict:
    """Token ids, each step's top-2 log-probabilities, the acceptance and the drafts per drafter
    of one engine."""
    import gc

    from jspec.llm import LLM
    from jspec.sampling_params import SamplingParams

    start = time.perf_counter()
    llm = LLM(dtype=dtype, kernel_backend=kernel_backend, policy=policy,
              num_speculative_tokens=4, max_num_seqs=len(prompts), max_model_len=256,
              speculative_method=method, warmup=False, use_tqdm=False)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                            logprobs=2)
    outs = llm.generate(prompts, params, use_tqdm=False)
    run = {"kernel_backend": llm.engine.limits.kernel_backend, "policy": policy,
           "tokens": [list(o.token_ids) for o in outs],
           "top2_logprobs": [[sorted((p.logprob for p in step.values()), reverse=True)[:2]
                              for step in o.logprobs] for o in outs],
           "acceptance_rate": llm.metrics["acceptance_rate"],
           "drafts_by_drafter": {name: stats["num_drafts"] for name, stats
                                 in llm.metrics["drafter_stats"].items()},
           "seconds": time.perf_counter() - start}
    print(f"{dtype} {run['kernel_backend']} {method} {policy}: {len(prompts)} x {max_tokens} "
          f"tokens in {run['seconds']:.1f} s, acceptance {run['acceptance_rate']:.3f}",
          flush=True)
    del llm, outs
    gc.collect()
    return run


def _compare(ref: dict, got: dict) -> tuple[bool, str]:
    """Whether two runs' tokens are equal, and where the first difference of each differing
    prompt is with the reference's top-2 log-probability gap there (a gap near 0 is a near-tie
    that rounding may flip; a large one is a wrong result)."""
    diffs = []
    for i, (a, b) in enumerate(zip(ref["tokens"], got["tokens"])):
        if a == b:
            continue
        at = next((t for t, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        top2 = ref["top2_logprobs"][i][at] if at < len(ref["top2_logprobs"][i]) else []
        gap = f", the reference's top-2 gap there {top2[0] - top2[1]:.2e}" if len(top2) == 2 \
            else ""
        diffs.append(f"prompt {i} differs from token {at}{gap}")
    total = len(ref["tokens"])
    if not diffs:
        return True, f"{total} of {total} prompts equal"
    return False, f"{total - len(diffs)} of {total} prompts equal; " + "; ".join(diffs)


# ----------------------------------------------------------------------------- serving sweep
def serving(settings: dict, deadline: float, save: Callable[[dict], None]) -> dict:
    """The synthetic serving sweep (``jspec.bench.spec_sweep``): where speculation stops
    paying on this device."""
    from jspec.bench import spec_sweep

    cfg = settings["serving"]
    sweep = spec_sweep.Sweep(shape=cfg["shape"], levels=tuple(cfg["levels"]),
                             policies=tuple(cfg["policies"]), max_tokens=cfg["max_tokens"],
                             prompt_tokens=cfg["prompt_tokens"], acceptance=cfg["acceptance"])

    def partial(numbers: dict) -> None:
        save(_serving_result(numbers, finished=False))

    numbers = spec_sweep.run(sweep, deadline=deadline - RESULT_MARGIN_S, on_level=partial)
    return _serving_result(numbers, finished=True)


def _serving_result(numbers: dict, finished: bool) -> dict:
    levels = numbers["levels"]
    done = [lv for lv in levels if lv.get("runs")]
    checks = [check("every level ran", finished and len(done) == len(numbers["requested"]),
                    f"{len(done)} of {len(numbers['requested'])} levels: "
                    + ", ".join(str(lv["concurrency"]) for lv in done)
                    + ("" if not numbers.get("stopped") else f" ({numbers['stopped']})"))]
    return judged(numbers["verdict"], checks, numbers)


STAGES = {"device": device, "kernel-tests": kernel_tests, "kernel-bench": kernel_bench,
          "greedy": greedy, "serving": serving}


def _write(path: str, result: dict) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(result, f, indent=1, default=str)
    os.replace(tmp, path)  # a stage killed mid-write leaves the previous result whole


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m jspec.validate_stages")
    p.add_argument("stage", choices=list(STAGES))
    p.add_argument("--settings", required=True)
    p.add_argument("--result", required=True)
    p.add_argument("--deadline", type=float, required=True, help="UNIX time the stage must end")
    args = p.parse_args(argv)
    with open(args.settings) as f:
        settings = json.load(f)
    try:
        result = STAGES[args.stage](settings, args.deadline,
                                    lambda partial: _write(args.result, partial))
    except Exception as e:  # noqa: BLE001 - any failure is this stage's result, not the run's
        traceback.print_exc()
        previous = {}
        if os.path.exists(args.result):
            with open(args.result) as f:
                previous = json.load(f)
        result = {**previous, "status": "error",
                  "summary": f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300]}"
                  if str(e).strip() else type(e).__name__,
                  "errors": previous.get("errors", []) + [traceback.format_exc()[-3000:]]}
        result.setdefault("checks", [])
        result.setdefault("numbers", {})
    _write(args.result, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
