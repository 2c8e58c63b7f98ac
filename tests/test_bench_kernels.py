"""Smoke test of `jspec bench kernels --small --interpret`: the harness on tiny shapes."""

from __future__ import annotations

import argparse
import json

import pytest

from jspec.bench import kernels


def _parse(argv):
    parser = argparse.ArgumentParser()
    kernels.add_arguments(parser)
    return parser.parse_args(argv)


def test_small_run_times_reference_and_interpreted_kernel(capsys, tmp_path):
    out_json = tmp_path / "k.json"
    assert kernels.run(_parse(["--small", "--interpret", "--json", str(out_json)])) == 0
    out = capsys.readouterr().out
    assert "kernel backend auto -> reference" in out and "device copy bandwidth" in out
    data = json.loads(out_json.read_text())
    assert data["backend"] == "reference" and data["copy_bandwidth_gbps"] > 0
    row = data["attention"][0]
    assert row["kv_bytes"] == 2 * 1 * 64 * 2 * 64 * 2  # B x ctx x kv heads x D x K,V x bf16
    assert row["reference"]["ms"] > 0 and row["interpret"]["gbps"] > 0
    assert data["migration"][0]["blocks"] == 4 and "interpret" in data["migration"][0]


def test_bad_grid_is_rejected():
    with pytest.raises(ValueError, match="--query-lens"):
        kernels.run(_parse(["--query-lens", "16", "--contexts", "8"]))
    with pytest.raises(ValueError, match="positive"):
        kernels.run(_parse(["--batch-sizes", "0"]))
