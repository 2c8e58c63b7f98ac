"""StepProfile lookups (interpolation, extrapolation, memoisation), files, and `jspec profile`."""

from __future__ import annotations

import json

import numpy as np
import pytest

from jspec.policies.profile import StepProfile, interpolate, load_profile
from policy_helpers import synthetic_profile


def _profile():
    # target_time = 1 + B + 2q + L/100 (linear: interpolation and extrapolation are exact)
    B, Q, L = [1, 4], [1, 3], [100, 300]
    t = np.array([[[1 + b + 2 * q + l / 100 for l in L] for q in Q] for b in B])
    d = np.array([[0.5 + 0.1 * b + l / 1000 for l in L] for b in B])
    c = np.array([[0.01 * n * b for b in B] for n in [2, 10]])
    return StepProfile("t", "d", "cpu", "float32", B, Q, L, [2, 10], t, d, c)


def test_lookups_interpolate_and_extrapolate_linearly():
    p = _profile()
    assert p.target_step(1, 1, 100) == pytest.approx(1 + 1 + 2 + 1)
    assert p.target_step(2, 2, 200) == pytest.approx(1 + 2 + 4 + 2)  # inside the grid
    assert p.target_step(16, 9, 1000) == pytest.approx(1 + 16 + 18 + 10)  # past every axis
    assert p.draft_step(8, 100) == pytest.approx(0.5 + 0.8 + 0.1)
    assert p.step_time(2, 0, 200) == pytest.approx(p.target_step(2, 1, 200))
    assert p.step_time(2, 3, 200) == pytest.approx(p.target_step(2, 4, 200)
                                                   + 3 * p.draft_step(2, 200))
    assert p.c_prefill(0, 4) == 0.0
    assert p.c_prefill(6, 4) == pytest.approx(0.01 * 6 * 4)
    assert p.c_prefill(50, 8) == pytest.approx(0.01 * 50 * 8)  # extrapolated
    # never below the floor, even when extrapolating a falling curve far enough
    assert interpolate(([1, 2],), np.array([2.0, 1.0]), (10,)) > 0


def test_vectorised_step_times_equal_the_scalar_lookups():
    for p in (_profile(), synthetic_profile()):
        for batch, ctx in ((1, 100), (3, 250), (40, 5000), (0.5, 10)):
            gammas = np.arange(9)
            expect = [p.step_time(batch, int(g), ctx) for g in gammas]
            assert p.step_times(batch, gammas, ctx) == pytest.approx(expect, rel=1e-9)


def test_memoised_lookups_round_only_the_context():
    p = _profile()
    first = p.target_step(2, 2, 203)
    assert p.target_step(2, 2, 203) == first
    assert p.target_step(2, 2, 203) == pytest.approx(p.target_step(2, 2, 200), abs=0.1)


def test_save_load_round_trip_and_errors(tmp_path):
    p = _profile()
    path = tmp_path / "p.json"
    p.save(path)
    q = StepProfile.load(path)
    assert q.target_step(3, 2, 250) == p.target_step(3, 2, 250)
    assert load_profile("dsd", str(path)).c_prefill(4, 2) == p.c_prefill(4, 2)
    with pytest.raises(ValueError, match="dsd option profile must be a path"):
        load_profile("dsd", 3)
    with pytest.raises(ValueError, match="cannot read step profile.*jspec profile"):
        StepProfile.load(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text(json.dumps({"format": "other"}))
    with pytest.raises(ValueError, match="not a jspec step profile"):
        StepProfile.load(tmp_path / "bad.json")
    with pytest.raises(ValueError, match="re-run `jspec profile`"):
        p.check_models("other", "d")
    with pytest.raises(ValueError, match="strictly increasing"):
        StepProfile("t", "d", "x", "f", [4, 1], [1], [1], [1], np.zeros((2, 1, 1)),
                    np.zeros((2, 1)), np.zeros((1, 2)))
    with pytest.raises(ValueError, match="shape"):
        StepProfile("t", "d", "x", "f", [1], [1], [1], [1], np.zeros((2, 1, 1)),
                    np.zeros((1, 1)), np.zeros((1, 1)))


def test_synthetic_profile_grows_with_load():
    p = synthetic_profile()
    assert p.step_time(64, 4, 1024) > p.step_time(1, 4, 1024) > p.step_time(1, 0, 1024)


def test_jspec_profile_command_on_the_tiny_pair(tiny_pair, tmp_path, capsys):
    from jspec.cli import main
    from jspec.policies.profile import model_signature
    from jspec.models.config import ModelConfig

    out = tmp_path / "profile.json"
    code = main(["profile", "--target", tiny_pair[0], "--draft", tiny_pair[1], "--out", str(out),
                 "--dtype", "float32", "--batch-sizes", "1", "2", "--query-lens", "1", "3",
                 "--contexts", "16", "--catch-up-lens", "2", "--catch-up-context", "8",
                 "--repeats", "1", "--no-progress"])
    assert code == 0
    p = StepProfile.load(out)
    assert p.target == model_signature(ModelConfig.from_json_file(f"{tiny_pair[0]}/config.json"))
    assert p.target_time.shape == (2, 2, 1) and np.all(p.target_time > 0)
    assert p.catch_up_time.shape == (1, 2) and np.all(p.draft_time > 0)
    assert "step time (ms)" in capsys.readouterr().out
    assert main(["profile", "--out", str(out), "--batch-sizes", "0"]) == 2
