"""Smoke test of `jspec bench model-step --small`: the same code path on tiny shapes."""

from __future__ import annotations

import argparse

import pytest

from jspec.bench import model_step


def _parse(argv):
    parser = argparse.ArgumentParser()
    model_step.add_arguments(parser)
    return parser.parse_args(argv)


def test_small_run_prints_tables(capsys):
    argv = ["--small", "--dtypes", "bf16", "--batch-sizes", "1", "--query-lens", "1", "2"]
    assert model_step.run(_parse(argv)) == 0
    out = capsys.readouterr().out
    assert "cost ratio target/draft" in out and "memory read bandwidth" in out
    assert "[bf16] target" in out and "[bf16] draft" in out
    assert "B=1 weight-read bandwidth" in out and "measured target/draft step-time ratio" in out


def test_defaults_cover_the_documented_grid():
    args = _parse([])
    assert args.dtypes == ["bf16", "fp32"]
    assert args.batch_sizes == [1, 4, 16, 64] and args.query_lens == [1, 2, 4, 8]


def test_bad_grid_is_refused():
    with pytest.raises(ValueError, match="--batch-sizes"):
        model_step.run(_parse(["--small", "--batch-sizes", "0"]))
