"""Tensor parallelism (models/sharding.py) on 4 CPU devices: the same greedy tokens as one
device, with and without speculation, params and KV pools really sharded, nothing compiled after
warm-up. The engines run in a subprocess (tests/tp_worker.py) whose XLA_FLAGS split the CPU into
4 devices: XLA reads the flag once per process and this one already runs on one device."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from conftest import TEST_XLA_FLAGS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COLUMN, ROW = str(P(None, None, "tp")), str(P(None, "tp", None))


@pytest.fixture(scope="module")
def report():  # about a minute: every test that reads it is marked slow
    env = dict(os.environ, XLA_FLAGS=f"{TEST_XLA_FLAGS} --xla_force_host_platform_device_count=4",
               JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "tp_worker.py")],
                          env=env, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout)


def runs(report, family):
    return {(r["tp"], r["speculate"]): r for r in report["runs"] if r["family"] == family}


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_greedy_tokens_equal_one_device(report, family):
    assert report["devices"] == 4
    by = runs(report, family)
    reference = by[(1, True)]["tokens"]
    assert len(reference) == 3 and all(len(t) == 20 for t in reference.values())
    for key, run in by.items():
        assert run["tokens"] == reference, f"{family} tp={key[0]} speculate={key[1]}"
        assert run["compiles_after_warmup"] == 0, f"{family} tp={key[0]} speculate={key[1]}"
        if key[1]:
            assert run["accepted"] > 0  # speculation really ran


@pytest.mark.slow
def test_target_sharded_megatron_style_and_draft_replicated(report):
    for (tp, speculate), run in runs(report, "qwen2").items():
        specs = run["specs"]
        if tp == 1:
            assert specs["target_kv"] == "single-device"
            continue
        assert run["kv_devices"] == tp
        assert specs["wqkv"] == COLUMN and specs["w_gate_up"] == COLUMN
        assert specs["wo"] == ROW and specs["w_down"] == ROW
        assert specs["embed"] == str(P("tp", None))
        assert specs["lm_head"] == str(P(None, "tp"))
        assert specs["target_kv"] == str(P(None, None, None, "tp", None))
        if speculate:
            assert specs["draft_params"] == specs["draft_kv"] == str(P())


@pytest.mark.slow
def test_each_device_holds_its_share(report):
    by = runs(report, "qwen2")
    one, four = by[(1, True)]["device_bytes"], by[(4, True)]["device_bytes"]
    assert four["target_kv"] * 4 == one["target_kv"]
    # norms stay whole on every device, everything else is split
    assert one["target_params"] / 4 < four["target_params"] < one["target_params"] / 3
    assert four["draft_params"] == one["draft_params"]  # replicated
    assert four["draft_kv"] == one["draft_kv"]


@pytest.mark.slow
def test_a_draft_whose_heads_do_not_divide_runs_replicated(report):
    reference = runs(report, "qwen2")[(1, True)]["tokens"]["0"]
    assert report["small_draft_tp4_tokens"] == reference


@pytest.mark.slow
def test_pallas_kernel_runs_per_device_under_shard_map(report):
    assert report["pallas_max_abs_diff"] < 1e-4
    assert report["odd_vocab_max_abs_diff"] < 1e-4  # vocabulary 258 on 4 devices: replicated


@pytest.mark.slow
def test_model_step_bench_reports_bytes_per_device(report):
    rows = {r["model"]: r for r in report["model_step"]}
    target, draft = rows["target"], rows["draft"]
    assert target["weight_bytes_per_device"] == target["weight_bytes"] // 2
    assert 0 < target["params_bytes_per_device"] < target["weight_bytes"]
    assert draft["weight_bytes_per_device"] == draft["weight_bytes"]  # replicated
    assert target["kv_bytes_per_device"] > 0


# ----------------------------------------------------------------------------- bad input
def test_errors_name_the_problem(engine_models):
    from jspec.config import EngineConfig
    from jspec.engine import LLMEngine
    from jspec.models.sharding import make_mesh

    target, _, small = engine_models
    with pytest.raises(ValueError, match="tensor_parallel_size must be a positive integer"):
        EngineConfig(tensor_parallel_size=0)
    with pytest.raises(ValueError, match="elastic_memory does not support tensor_parallel"):
        EngineConfig(tensor_parallel_size=2, elastic_memory=True)
    with pytest.raises(ValueError, match=r"does not divide the target's num_kv_heads \(1\)"):
        LLMEngine(small, None, EngineConfig(tensor_parallel_size=2, max_num_seqs=2))
    with pytest.raises(ValueError, match="needs 2 devices; JAX sees 1 .*"
                                         "xla_force_host_platform_device_count=2"):
        make_mesh(2)


def test_shard_major_gives_each_device_its_own_heads(engine_models):
    from jspec.models.sharding import shard_major

    cfg, params = engine_models[0].cfg, engine_models[0].params
    layers = {k: np.asarray(v) for k, v in params["layers"].items()}
    moved = shard_major({"layers": layers}, cfg, 2)["layers"]
    q, kv, inter = cfg.q_size, cfg.kv_size, cfg.intermediate_size
    width = (q + 2 * kv) // 2
    for s in range(2):  # device s: its q heads, then its k heads, then its v heads
        mine = moved["wqkv"][:, :, s * width:(s + 1) * width]
        wqkv = layers["wqkv"]
        np.testing.assert_array_equal(mine[:, :, :q // 2], wqkv[:, :, s * q // 2:(s + 1) * q // 2])
        k0, v0 = q + s * kv // 2, q + kv + s * kv // 2
        np.testing.assert_array_equal(mine[:, :, q // 2:q // 2 + kv // 2],
                                      wqkv[:, :, k0:k0 + kv // 2])
        np.testing.assert_array_equal(mine[:, :, q // 2 + kv // 2:], wqkv[:, :, v0:v0 + kv // 2])
        gate_up = moved["w_gate_up"][:, :, s * inter:(s + 1) * inter]  # its gate, then its up
        half = inter // 2
        np.testing.assert_array_equal(gate_up[:, :, :half],
                                      layers["w_gate_up"][:, :, s * half:(s + 1) * half])
        np.testing.assert_array_equal(gate_up[:, :, half:],
                                      layers["w_gate_up"][:, :, inter + s * half:
                                                          inter + (s + 1) * half])


# ----------------------------------------------------------------------------- several hosts
def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_processes_generate_what_one_does(tiny_pair, tiny_llm, tmp_path):
    """`jspec generate` as two local processes joined by jax.distributed (one CPU device each,
    tensor parallel over both): process 0 prints the same greedy text as one process."""
    from jspec.sampling_params import SamplingParams

    target, draft = tiny_pair
    prompts = ["def fibonacci(n):", "Hello, world!"]
    port = _free_port()
    env = dict(os.environ, XLA_FLAGS=TEST_XLA_FLAGS, JSPEC_CACHE=str(tmp_path))
    procs = []
    for rank in range(2):
        argv = ["generate", "--target", str(target), "--draft", str(draft),
                "--prompt", prompts[0], "--prompt", prompts[1], "--max-tokens", "10",
                "--ignore-eos", "--dtype", "float32", "--max-num-seqs", "2",
                "--max-model-len", "64", "--max-num-batched-tokens", "16",
                "--num-speculative-tokens", "2", "--no-progress",
                "--tensor-parallel-size", "2", "--coordinator-address", f"127.0.0.1:{port}",
                "--num-processes", "2", "--process-id", str(rank)]
        code = f"import sys\nfrom jspec.cli import main\nsys.exit(main({argv!r}))\n"
        procs.append(subprocess.Popen([sys.executable, "-c", code], env=env, cwd=ROOT,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    leader, follower = outs[0][0], outs[1][0]
    assert "### prompt" not in follower  # the leader reports; the follower only ran the steps
    expected = tiny_llm.generate(prompts, SamplingParams(max_tokens=10, temperature=0,
                                                         ignore_eos=True), use_tqdm=False)
    for i, (prompt, exp) in enumerate(zip(prompts, expected)):
        assert f"### prompt {i} (length, 10 tokens): {prompt}\n{exp.text}\n" in leader


def test_multi_process_flags_are_checked_before_anything_starts():
    import argparse

    from jspec import distributed

    def args(**kw):
        base = dict(coordinator_address=None, num_processes=None, process_id=None,
                    tensor_parallel_size=None)
        return argparse.Namespace(**{**base, **kw})

    assert distributed.check_arguments(args()) is False
    with pytest.raises(ValueError, match="go together"):
        distributed.check_arguments(args(coordinator_address="h:1"))
    with pytest.raises(ValueError, match=r"--process-id must be in \[0, 2\), got 2"):
        distributed.check_arguments(args(coordinator_address="h:1", num_processes=2,
                                         process_id=2, tensor_parallel_size=2))
    with pytest.raises(ValueError, match="must be a multiple of --num-processes"):
        distributed.check_arguments(args(coordinator_address="h:1", num_processes=2,
                                         process_id=0, tensor_parallel_size=3))
