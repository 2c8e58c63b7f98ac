"""`jspec bench drafters`: its argument checks, its schedule of measured passes (every engine
once per round, every other round in reverse order) and its ratios. No timing assertions."""

from __future__ import annotations

import argparse

import pytest

from jspec.bench import drafters


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    drafters.add_arguments(parser)
    return parser.parse_args(list(argv))


@pytest.mark.parametrize("argv, match", [
    (("--rounds", "0"), "--rounds"),
    (("--drafters", "draft_model,medusa"), "medusa"),
    (("--batch-sizes", "1,x"), "comma-separated integers"),
])
def test_bad_arguments_are_refused_before_any_engine_is_built(argv, match):
    with pytest.raises(ValueError, match=match):
        drafters.run(_parse(*argv))


def test_every_engine_is_measured_and_timed_once_per_round_in_palindromic_order(monkeypatch):
    passes = []

    class Recording:
        """Stands in for an engine: records its measured and synced passes and reports their
        counts."""

        def __init__(self, target, draft, method, batch, gamma, warm, sp):
            self.method, self.batch, self.count, self.timed = method, batch, 0, 0

        def measure(self, prompts):
            passes.append(self.method)
            self.count += 1

        def time_stages(self, prompts):
            passes.append(self.method + " synced")
            self.timed += 1

        def result(self, rounds):
            return {"drafter": self.method, "batch": self.batch, "rounds": rounds,
                    "tok_per_s": 10.0 * self.count, "acceptance_rate": 0.0,
                    "mean_accepted_length": 1.0, "step_ms": 1.0 * self.timed,
                    "draft_ms_per_step": {"off": 0.0, "draft_model": 4.0, "eagle3": 1.0}[
                        self.method]}

    monkeypatch.setattr(drafters, "_Engine", Recording)
    args = _parse("--rounds", "3")
    results = drafters._compare("t", {}, ["off", "draft_model", "eagle3"], 1, args, ["p"],
                                ["w"], None)
    forward, backward = ["off", "draft_model", "eagle3"], ["eagle3", "draft_model", "off"]
    synced = lambda order: [m + " synced" for m in order]  # noqa: E731
    assert passes == (forward + synced(forward) + backward + synced(backward)
                      + forward + synced(forward))
    assert [r["drafter"] for r in results] == ["off", "draft_model", "eagle3"]
    assert all(r["rounds"] == 3 and r["vs_off"] == 1.0 and r["step_ms"] == 3.0
               for r in results)
    # each drafter's time per drafting step against the draft model's
    assert [r["vs_draft_model_time"] for r in results] == [None, 1.0, 0.25]
