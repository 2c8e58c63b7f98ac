"""`jspec bench model-step --small`: the same code path on tiny shapes, checked against the grid
asked for and against the weight bytes a step must read, counted here from the shape."""

from __future__ import annotations

import argparse
import math

import pytest

from jspec.bench import model_step


def _parse(argv):
    parser = argparse.ArgumentParser()
    model_step.add_arguments(parser)
    return parser.parse_args(argv)


def _weight_bytes_read_per_step(shape: dict, itemsize: int) -> int:
    """Every layer's matrices, biases and norms, the final norm and the [hidden, vocab] head
    (its own copy when tied); not the embedding table, of which a step reads a few rows."""
    h, ffn, vocab = shape["hidden_size"], shape["intermediate_size"], shape["vocab_size"]
    q = shape["num_heads"] * shape["head_dim"]
    kv = shape["num_kv_heads"] * shape["head_dim"]
    layer = h * q + 2 * h * kv + q * h + 3 * h * ffn + 2 * h
    layer += (q + 2 * kv) * bool(shape.get("qkv_bias")) + h * bool(shape.get("o_bias"))
    return (shape["num_layers"] * layer + h + h * vocab) * itemsize


def test_small_run_times_the_requested_grid(capsys):
    argv = ["--small", "--dtypes", "bf16", "--batch-sizes", "1", "3", "--query-lens", "2"]
    results = model_step.measure(_parse(argv))
    out = capsys.readouterr().out
    assert results["bandwidth_start"] > 0 and results["bandwidth_end"] > 0
    runs = {(r["dtype"], r["model"]): r for r in results["runs"]}
    assert sorted(runs) == [("bf16", "draft"), ("bf16", "target")]
    shapes = {"target": model_step.SMALL_TARGET, "draft": model_step.SMALL_DRAFT}
    for (dtype, model), r in runs.items():
        assert r["config"].hidden_size == shapes[model]["hidden_size"]  # the --small shapes
        expected = _weight_bytes_read_per_step(shapes[model], 2)  # bf16
        assert r["weight_bytes"] == expected, (dtype, model)
        assert f"[{dtype}] {model}: {expected / 1e6:.1f} MB of weights read per step" in out
        assert set(r["seconds"]) == {(1, 2), (3, 2)}  # B x q, nothing else
        assert all(math.isfinite(t) and t > 0 for t in r["seconds"].values())
    # q=1 was not asked for: the target/draft ratio is given at the smallest q timed
    assert "[bf16] measured target/draft step-time ratio at q=2: B=1: " in out


def test_defaults_cover_the_documented_grid():
    args = _parse([])
    assert args.dtypes == ["bf16", "fp32"]
    assert args.batch_sizes == [1, 4, 16, 64] and args.query_lens == [1, 2, 4, 8]


def test_bad_grid_is_refused():
    with pytest.raises(ValueError, match="--batch-sizes"):
        model_step.run(_parse(["--small", "--batch-sizes", "0"]))
