"""`jspec validate-gpu` (jspec/validate_gpu.py) on this CPU: refused without --allow-cpu, and with
it every stage runs at tiny sizes and lands in the JSON and markdown reports; a stage that fails
or runs out of time is reported as such while the later stages still run. (What the stages find
on a GPU needs a GPU; the switch they run the kernel tests with is tests/kernel_mode.py.)"""

from __future__ import annotations

import json
import os

import pytest

from jspec.cli import main

STAGE_NAMES = ["kernel-tests", "kernel-bench", "greedy", "serving"]


def _report(out) -> tuple[dict, str]:
    return (json.loads((out / "validate-gpu.json").read_text()),
            (out / "validate-gpu.md").read_text())


def test_refused_without_a_gpu_unless_allowed(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_help:
        main(["validate-gpu", "--help"])
    assert exit_help.value.code == 0 and "--allow-cpu" in capsys.readouterr().out
    assert main(["validate-gpu", "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert "checks a GPU, and JAX runs on CPU here" in err and "--allow-cpu" in err
    assert not (tmp_path / "r" / "validate-gpu.json").exists()
    assert main(["validate-gpu", "--out", str(tmp_path), "--stages", "greedy,lint"]) == 2
    assert "unknown stage 'lint'" in capsys.readouterr().err
    assert main(["validate-gpu", "--out", str(tmp_path), "--serving-levels", "8", "2"]) == 2
    assert "levels must rise" in capsys.readouterr().err


@pytest.mark.slow  # four stages in subprocesses, each compiling its engines: 45-90 s here
def test_every_stage_runs_on_cpu_and_is_reported(tmp_path):
    out = tmp_path / "report"
    assert main(["validate-gpu", "--out", str(out), "--allow-cpu"]) == 0
    report, md = _report(out)
    assert report["format"] == "jspec-validate-gpu-v1" and report["status"] == "pass"
    assert report["mode"] == "cpu" and report["device"]["platform"] == "cpu"
    stages = {s["name"]: s for s in report["stages"]}
    assert [s["name"] for s in report["stages"]] == STAGE_NAMES
    for name, st in stages.items():
        assert st["status"] == "pass", (name, st["summary"], st["errors"])
        assert st["checks"] and all(c["ok"] for c in st["checks"] if c["required"])
        assert 0 < st["seconds"] <= st["budget_s"]
        assert (out / st["log"]).is_file()
        assert f"| {st['title']} | pass |" in md and f"## {st['title']}" in md
    # (a) the kernel tests ran through pytest, interpreted (no GPU), and all passed
    tests = stages["kernel-tests"]["numbers"]
    assert tests["mode"] == "interpret" and tests["passed"] == 2 and tests["failed"] == 0
    # (b) the benchmark checked the interpreted kernels against the reference
    bench = stages["kernel-bench"]["numbers"]["bench_kernels"]
    assert bench["attention"] and all("interpret" in row for row in bench["attention"])
    assert all(row["interpret"]["exact"] for row in bench["migration"])
    # (c) the kernels' greedy tokens equal the reference's, and plain decoding's in bf16
    runs = stages["greedy"]["numbers"]["runs"]
    mixed = ["float32 interpret draft_model+ngram+suffix",
             "float32 interpret eagle3+ngram+suffix"]
    assert set(runs) == {"float32 reference", "float32 interpret", *mixed, "bfloat16 reference",
                         "bfloat16 interpret", "bfloat16 interpret plain"}
    assert runs["float32 interpret"]["tokens"] == runs["float32 reference"]["tokens"]
    for name in mixed:  # the draft model's and the EAGLE head's, each beside the lookups
        assert runs[name]["tokens"] == runs["float32 reference"]["tokens"], name
        assert sum(runs[name]["drafts_by_drafter"].values()) > 0, name
    assert all(len(t) == 8 for run in runs.values() for t in run["tokens"])
    # (d) every level of the sweep ran both policies on the tiny synthetic shape
    sweep = stages["serving"]["numbers"]
    assert [lv["concurrency"] for lv in sweep["levels"]] == [1, 4]
    for lv in sweep["levels"]:
        assert [r["label"] for r in lv["runs"]] == ["off", "static γ=2"]
        assert lv["speedup"] > 0 and all(r["output_tokens_per_s"] > 0 for r in lv["runs"])
    assert sweep["verdict"].startswith("speculation ")
    assert md.startswith("# jspec validate-gpu: pass")
    assert "CPU run (`--allow-cpu`)" in md and f"Verdict: {sweep['verdict']}" in md


def test_a_failing_stage_does_not_stop_the_later_ones(tmp_path, monkeypatch):
    from jspec.validate_stages import PRESETS

    # the parent writes the settings its stages read: a kernel test that does not exist
    monkeypatch.setitem(PRESETS["cpu"], "kernel_tests",
                        {"mode": "interpret", "select": ["test_no_such_test"]})
    out = tmp_path / "report"
    assert main(["validate-gpu", "--out", str(out), "--allow-cpu",
                 "--stages", "kernel-bench,kernel-tests"]) == 1
    report, md = _report(out)
    assert report["status"] == "fail"
    assert [(s["name"], s["status"]) for s in report["stages"]] == [
        ("kernel-tests", "fail"), ("kernel-bench", "pass")]
    ran = report["stages"][0]["checks"][0]
    assert ran["name"] == "kernel tests ran" and not ran["ok"]
    assert "| kernel tests (tests/test_kernels.py) | FAIL |" in md


def test_a_stage_past_its_budget_is_killed_and_reported(tmp_path):
    from jspec.validate_gpu import run_stage
    from jspec.validate_stages import PRESETS

    (tmp_path / "logs").mkdir()
    (tmp_path / "stages").mkdir()
    settings = {**PRESETS["cpu"], "platform": "cpu", "work_dir": str(tmp_path / "stages")}
    result = run_stage("kernel-bench", settings, str(tmp_path), 3.0, dict(os.environ))
    assert result["status"] == "timeout"
    assert result["summary"].startswith("killed at the end of its 3 s budget")
    assert 3.0 <= result["seconds"] < 30 and (tmp_path / result["log"]).is_file()


@pytest.mark.parametrize("spec", ["lint", ""])
def test_stage_selection_is_checked(spec):
    from jspec.validate_gpu import selected_stages

    with pytest.raises(ValueError, match="unknown stage|names no stage"):
        selected_stages(spec)
    assert [s[0] for s in selected_stages("serving,greedy")] == ["greedy", "serving"]


def test_kernel_tests_stage_says_what_is_missing(tmp_path, monkeypatch):
    """On a GPU machine where nothing can be installed: without hypothesis (a test extra) or
    without the tests directory (a non-editable install) the stage is skipped, naming why."""
    from jspec import validate_stages

    settings = {"kernel_tests": {"mode": "compiled", "select": []}, "work_dir": str(tmp_path)}
    monkeypatch.setattr(validate_stages, "KERNEL_TEST_MODULES",
                        ("pytest", "jspec_no_such_module"))
    result = validate_stages.kernel_tests(settings, 0.0, lambda r: None)
    assert result["status"] == "skipped"
    assert "import jspec_no_such_module, which is not installed" in result["summary"]
    monkeypatch.setattr(validate_stages, "KERNEL_TESTS", tmp_path / "tests" / "test_kernels.py")
    result = validate_stages.kernel_tests(settings, 0.0, lambda r: None)
    assert result["status"] == "skipped"
    assert "installed without its tests directory" in result["summary"]


def test_overall_status():
    from jspec.validate_gpu import overall_status

    assert overall_status(["pass", "pass"]) == "pass"
    assert overall_status(["pass", "skipped"]) == "incomplete"
    for bad in ("fail", "error", "timeout"):
        assert overall_status(["skipped", bad, "pass"]) == "fail"


@pytest.mark.parametrize("speedups, verdict", [
    ([1.6, 1.2, 0.9, 0.8], "speculation stops paying at 16 concurrent requests"),
    ([1.6, 1.2, 1.1, 1.0], "speculation pays at every level measured"),
    ([0.9, 0.8, 0.7, 0.6], "speculation pays at no level measured"),
    ([1.2, 0.9, 1.1, 0.9], "speculation stops paying at 32 concurrent requests"),
    ([0.9, 1.1, 0.9, 1.05], "speculation pays at the highest level measured but not"),
])
def test_sweep_verdict(speedups, verdict):
    from jspec.bench.spec_sweep import compare, verdict as sweep_verdict

    levels = []
    for b, x in zip((1, 4, 16, 32), speedups):
        runs = [{"label": "off", "policy": "off", "output_tokens_per_s": 100.0},
                {"label": "static γ=2", "policy": "static", "output_tokens_per_s": 90.0},
                {"label": "static γ=4", "policy": "static", "output_tokens_per_s": 100.0 * x}]
        levels.append({"concurrency": b, **compare(runs)})
    assert levels[0]["best_static"] == ("static γ=4" if speedups[0] > 0.9 else "static γ=2")
    assert sweep_verdict(levels).startswith(verdict)
