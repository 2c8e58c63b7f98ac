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
        lambda q, k, v, layer, md, sm_scale: jnp.ones_like(q)))
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
