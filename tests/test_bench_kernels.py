"""`jspec bench kernels --small --interpret` on tiny shapes: the rows cover the requested grid,
the byte counts follow the KV layout, every timed implementation matches the per-token oracle
(and a broken one is caught), the migration is bit-exact."""

from __future__ import annotations

import argparse
import json
import math

import pytest

from jspec.bench import kernels

# --small: batch sizes 1 2, query lengths 1 4, context 64, a 32-token prefill per context,
# one 4-block migration over 2 layers; Qwen2.5-0.5B attention: 2 kv heads of 64, block 16
SMALL_POINTS = [(b, q, 64) for b in (1, 2) for q in (1, 4)] + [(1, 32, 64)]
KV_HEADS, HEAD_DIM, BLOCK, LAYERS, BF16 = 2, 64, 16, 2, 2


def _parse(argv):
    parser = argparse.ArgumentParser()
    kernels.add_arguments(parser)
    return parser.parse_args(argv)


def _timing_is_sane(cell, nbytes):
    assert math.isfinite(cell["ms"]) and cell["ms"] > 0
    assert cell["gbps"] == pytest.approx(nbytes / (cell["ms"] / 1e3) / 1e9)


def test_small_run_checks_every_kernel_on_the_requested_grid(capsys, tmp_path):
    from jspec.kernels import backend as kb

    out_json = tmp_path / "k.json"
    assert kernels.run(_parse(["--small", "--interpret", "--json", str(out_json)])) == 0
    out = capsys.readouterr().out
    data = json.loads(out_json.read_text())
    chosen = kb.select()
    impls = {kernel: {"reference", "interpret"} | ({"pallas"} if backend == "pallas" else set())
             for kernel, backend in (("attention", chosen.attention),
                                     ("migration", chosen.migration))}
    assert data["backend"] == str(chosen) and f"kernel backend auto -> {data['backend']}" in out
    assert data["dtype"] == "bfloat16" and data["copy_bandwidth_gbps"] > 0

    rows = data["attention"]
    assert sorted((r["batch"], r["q_len"], r["context"]) for r in rows) == sorted(SMALL_POINTS)
    for r in rows:
        b, c = r["batch"], r["context"]
        assert r["kv_bytes"] == b * c * KV_HEADS * HEAD_DIM * 2 * BF16  # K and V, bf16
        assert set(r) - {"batch", "q_len", "context", "kv_bytes"} == impls["attention"]
        for name in impls["attention"]:
            _timing_is_sane(r[name], r["kv_bytes"])
            # outputs are bf16 of magnitude < 2: a few units in the last place at most
            assert 0 <= r[name]["max_abs_err"] < 2e-2, (name, r)

    (mig,) = data["migration"]
    assert mig["blocks"] == 4
    assert mig["bytes_moved"] == 2 * 2 * LAYERS * 4 * BLOCK * KV_HEADS * HEAD_DIM * BF16
    assert set(mig) - {"blocks", "bytes_moved"} == impls["migration"]
    for name in impls["migration"]:
        _timing_is_sane(mig[name], mig["bytes_moved"])
        assert mig[name]["exact"] is True, name


def test_a_wrong_kernel_is_reported(monkeypatch, capsys):
    """The checks above can fail: an attention returning ones and a migration that moves
    nothing, posing as the reference."""
    import jax.numpy as jnp

    from jspec.kernels import backend as kb

    monkeypatch.setattr(kb, "attention_fn", lambda backend: (
        lambda q, k, v, layer, md, sm_scale, max_q_len: jnp.ones_like(q)))
    monkeypatch.setattr(kb, "migration_fn", lambda backend: (lambda k, v, pairs: (k, v)))
    results = kernels.measure(_parse(["--small"]))
    assert all(r["reference"]["max_abs_err"] > 0.25 for r in results["attention"])
    assert results["migration"][0]["reference"]["exact"] is False
    assert "|  NO" in capsys.readouterr().out


def test_bad_grid_is_rejected():
    with pytest.raises(ValueError, match="--query-lens"):
        kernels.run(_parse(["--query-lens", "16", "--contexts", "8"]))
    with pytest.raises(ValueError, match="positive"):
        kernels.run(_parse(["--batch-sizes", "0"]))


# ----------------------------------------------------------------------------- --tune
def test_tune_needs_a_gpu(capsys):
    with pytest.raises(ValueError, match="--tune needs a GPU: .* JAX runs on CPU here"):
        kernels.run(_parse(["--tune"]))
    from jspec.cli import main

    assert main(["bench", "kernels", "--tune"]) == 2
    assert "error: --tune needs a GPU" in capsys.readouterr().err


def test_pick_scores_settings_against_the_defaults_and_reports_failures():
    seconds = {1: [2.0, 2.0], 2: [1.0, 3.0], 3: [1.5, 1.5], 4: None}

    def measure(values):
        if seconds[values["a"]] is None:
            raise ValueError("max |error| 3e-01 against the oracle\nsecond line")
        return seconds[values["a"]]

    best, rows = kernels.pick([{"a": a} for a in (1, 2, 3, 4)], measure)
    assert best == {"a": 3}  # 0.75 of the defaults' time, where {"a": 2} is sqrt(0.5 * 1.5)
    assert [r.get("score") for r in rows] == pytest.approx([1, math.sqrt(0.75), 0.75, None])
    assert rows[3]["error"] == "ValueError: max |error| 3e-01 against the oracle"
    seconds[1] = None
    with pytest.raises(RuntimeError, match="the default settings .* fail"):
        kernels.pick([{"a": a} for a in (1, 2)], measure)


def test_candidates_start_with_the_defaults():
    from jspec.kernels import gpu_lowering

    got = kernels.candidates("migration", {"num_warps": (4, 8), "num_stages": (2,)})
    assert got == [gpu_lowering.DEFAULTS["migration"], {"num_warps": 8, "num_stages": 2}]
    assert len(kernels.candidates("attention")) == 1 + 2 * 2 * 3 * 3 - 1  # defaults in grid


def test_tune_records_each_kernels_best_settings_for_the_gpu_model(tmp_path, monkeypatch,
                                                                   capsys):
    """The whole --tune path with the kernels interpreted (timings meaningless) under a
    made-up GPU model: every setting checked and timed, the best recorded, then read back as
    that GPU model's settings."""
    from jspec.kernels import gpu_lowering

    path = tmp_path / "tuning.json"
    args = _parse(["--tune", "--small", "--tuning-file", str(path)])
    grid = {"attention": {"pages_per_iter": (1,), "programs": (4,)},
            "migration": {"num_warps": (8,)}}
    results = kernels.tune(args, device="NVIDIA Fake", interpret=True, grid=grid)
    out = capsys.readouterr().out
    data = json.loads(path.read_text())
    assert list(data) == ["NVIDIA Fake"] and set(data["NVIDIA Fake"]) == {"attention",
                                                                          "migration"}
    for kernel, n in (("attention", 2), ("migration", 2)):
        rows = results[kernel]["rows"]
        assert len(rows) == n and all(r["error"] is None for r in rows), rows
        entry = data["NVIDIA Fake"][kernel]
        assert entry["settings"] == results[kernel]["best"]
        assert entry["settings"] in [r["settings"] for r in rows]
        assert len(entry["seconds"]) == len(results[kernel]["points"])
        assert f"recorded in {path}" in out
    assert results["attention"]["points"] == ["B=1 q=1 ctx=64", "B=2 q=4 ctx=64"]
    monkeypatch.setenv(gpu_lowering.TUNING_ENV, str(path))
    monkeypatch.setattr(gpu_lowering, "device_name", lambda: "NVIDIA Fake")
    gpu_lowering.settings.cache_clear()
    try:
        assert gpu_lowering.settings("attention") == results["attention"]["best"]
        assert gpu_lowering.settings("migration") == results["migration"]["best"]
    finally:
        gpu_lowering.settings.cache_clear()


def test_tune_refuses_a_setting_that_computes_the_wrong_attention(tmp_path, monkeypatch):
    """A setting whose result is off is reported and never recorded."""
    from jspec.kernels import gpu_lowering

    real = gpu_lowering.attention

    def broken_when_programs_is_4(values=None):
        kernel = real(values)
        if values["programs"] != 4:
            return kernel
        return lambda *a, **kw: kernel(*a, **kw) * 1.5

    monkeypatch.setattr(gpu_lowering, "attention", broken_when_programs_is_4)
    path = tmp_path / "tuning.json"
    args = _parse(["--tune", "--small", "--tuning-file", str(path)])
    results = kernels.tune(args, device="NVIDIA Fake", interpret=True,
                           grid={"attention": {"programs": (4,)}, "migration": {}})
    rows = results["attention"]["rows"]
    assert rows[0]["error"] is None and "against the oracle" in rows[1]["error"]
    assert results["attention"]["best"] == gpu_lowering.DEFAULTS["attention"]
    assert json.loads(path.read_text())["NVIDIA Fake"]["attention"]["settings"] == \
        gpu_lowering.DEFAULTS["attention"]
