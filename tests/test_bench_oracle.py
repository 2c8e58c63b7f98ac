"""`jspec bench oracle`: the report's arithmetic on hand-made times, its argument checks, and
one tiny run on the tiny pair. No timing assertions."""

from __future__ import annotations

import argparse
import json

import numpy as np
import pytest

from conftest import LLM_KW
from jspec.bench import oracle


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    oracle.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_the_oracle_takes_the_fastest_fixed_policy_of_each_prompt():
    seconds = np.array([[4.0, 1.0, 2.0, 3.0],    # off
                        [1.0, 3.0, 1.0, 2.0],    # static
                        [2.0, 2.0, 1.5, 2.0]])   # auto (adaptive: not the oracle's to pick)
    steps = np.array([[40, 10, 20, 30], [5, 15, 5, 10], [8, 8, 6, 8]])
    plan = np.array([[0.0] * 4, [0.01] * 4, [0.02, 0.02, 0.01, 0.03]])
    report = oracle.compare(seconds, steps, ["off", "static", "auto"], [True, True, False],
                            ["code", "qa", "code", "qa"], plan)
    assert report["best_fixed"] == "static"  # 7 s against off's 10
    assert report["oracle"]["seconds"] == pytest.approx(1 + 1 + 1 + 2)
    assert report["oracle"]["x_best_fixed"] == pytest.approx(7 / 5)
    assert report["oracle"]["picks"] == {"static": 3, "off": 1}
    by_label = {p["label"]: p for p in report["policies"]}
    assert by_label["auto"]["x_best_fixed"] == pytest.approx(7 / 7.5)
    assert by_label["off"]["ms_per_step"] == pytest.approx(1e3 * 10 / 100)
    # the plan stages' host time per step: 0.08 s over auto's 30 steps
    assert by_label["auto"]["plan_ms_per_step"] == pytest.approx(1e3 * 0.08 / 30)
    assert by_label["off"]["plan_ms_per_step"] == 0.0
    assert report["categories"]["code"] == {"off": 6.0, "static": 2.0, "auto": 3.5}


def test_it_needs_a_fixed_policy_to_choose_from():
    with pytest.raises(ValueError, match="at least one fixed policy"):
        oracle.run(_parse("--policy", "auto"))
    with pytest.raises(ValueError, match="--num-prompts must be >= 1"):
        oracle.run(_parse("--policy", "off", "--num-prompts", "0"))
    with pytest.raises(ValueError, match="--temperature must be >= 0"):
        oracle.run(_parse("--policy", "off", "--temperature", "-1"))


def test_a_tiny_run_reports_every_policy(tiny_pair, tmp_path, capsys):
    target, draft = tiny_pair
    shapes = [f"--{k.replace('_', '-')}={v}" for k, v in LLM_KW.items()
              if k not in ("num_speculative_tokens",)]
    out = tmp_path / "oracle.json"
    assert oracle.run(_parse("--target", str(target), "--draft", str(draft), *shapes,
                             "--num-speculative-tokens", "7", "--workload", "code",
                             "--policy", "off", "static:gamma=2,drafter=ngram",
                             "--num-prompts", "2", "--warmup-prompts", "1", "--max-tokens",
                             "4", "--max-prompt-tokens", "60", "--temperature", "1.0",
                             "--json", str(out))) == 0
    report = json.loads(out.read_text())
    assert [p["label"] for p in report["policies"]] == ["off", "static γ=2 ngram"]
    # two prompts, 4 sampled tokens each (EOS ignored when sampling)
    assert all(p["steps"] >= 2 for p in report["policies"])
    assert all(p["plan_ms_per_step"] > 0 for p in report["policies"])  # every step plans
    assert sum(report["oracle"]["picks"].values()) == 2
    assert "oracle: the fastest fixed policy per prompt" in capsys.readouterr().out
