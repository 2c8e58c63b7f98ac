"""Cost-realistic synthetic mode (jspec/synthetic.py): the acceptance model, the host-side
replacement of verification results, the engine under it, and `jspec bench serving`'s wiring."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import (llm_cli_args, make_engine, parse_serving_args, run_to_completion,
                      tiny_serving_args)

from jspec.sampler import VerifyResult
from jspec import synthetic
from jspec.synthetic import (SHAPES, SyntheticAcceptance, conditional_from_unconditional,
                             parse_acceptance)


def test_conditional_from_unconditional():
    assert conditional_from_unconditional([0.8, 0.48, 0.24]) == pytest.approx((0.8, 0.6, 0.5))
    assert conditional_from_unconditional([0.5, 0.0, 0.0]) == (0.5, 0.0, 0.0)
    with pytest.raises(ValueError, match="non-increasing"):
        conditional_from_unconditional([0.5, 0.7])
    with pytest.raises(ValueError, match="empty"):
        conditional_from_unconditional([])


def test_draw_matches_the_accepted_length_distribution():
    acc = SyntheticAcceptance((0.9, 0.5), seed=3)
    n = acc.draw(np.full(200_000, 2))
    freq = np.bincount(n, minlength=3) / len(n)
    # P(0) = 0.1, P(1) = 0.9 * 0.5, P(2) = 0.9 * 0.5; 5 sigma of a 200k-sample frequency < 0.006
    assert freq == pytest.approx([0.1, 0.45, 0.45], abs=0.006)
    # the last rate repeats past the list; draws never exceed what was drafted
    n4 = acc.draw(np.full(100_000, 4))
    assert np.mean(n4 == 4) == pytest.approx(0.9 * 0.5 ** 3, abs=0.006)
    mixed = acc.draw(np.array([0, 1, 3, 0, 2] * 1000))
    assert np.all(mixed <= np.array([0, 1, 3, 0, 2] * 1000))
    assert acc.expected_accepted(2) == pytest.approx(0.9 + 0.45)
    # seeded: the same seed gives the same draws
    assert np.array_equal(SyntheticAcceptance((0.7,), seed=5).draw(np.full(50, 4)),
                          SyntheticAcceptance((0.7,), seed=5).draw(np.full(50, 4)))


def test_apply_replaces_accepted_tokens_by_the_drafts():
    # rows: decode γ=3 (real: 0 accepted, emitted 90), decode γ=3 (real: 3 accepted + bonus 93),
    # a prefill row (γ 0), a padding row
    tokens = np.array([[90, 0, 0, 0], [11, 12, 13, 93], [70, 0, 0, 0], [0, 0, 0, 0]], np.int32)
    drafts = np.array([[1, 2, 3], [11, 12, 13], [0, 0, 0], [0, 0, 0]], np.int32)
    result = VerifyResult(tokens, np.array([0, 3, 0, 0], np.int32))

    class Fixed(SyntheticAcceptance):
        def draw(self, drafted):
            return np.array([2, 1])

    out = Fixed((0.5,)).apply(result, drafts, drafted=np.array([3, 3, 0, 0]),
                              gammas=np.array([3, 3, 0, 0]))
    assert out.num_accepted.tolist() == [2, 1, 0, 0]
    # row 0: drafts 1, 2 accepted, then the target's own emitted token 90
    assert out.tokens[0, :3].tolist() == [1, 2, 90]
    # row 1: draft 11 accepted, then the target's emitted token (its bonus, 93)
    assert out.tokens[1, :2].tolist() == [11, 93]
    assert out.tokens[2:].tolist() == tokens[2:].tolist()
    assert result.tokens[0, 0] == 90  # the input is not modified


@pytest.mark.parametrize("spec, match", [
    ("abc", "neither rates"), ("1.5", r"\[0, 1\]"), ("0.5,-0.1", r"\[0, 1\]"),
    ("missing.json", "cannot read")])
def test_bad_specs(spec, match):
    with pytest.raises(ValueError, match=match):
        parse_acceptance(spec)


def test_specs_from_files(tmp_path):
    pair = tmp_path / "pair.json"
    pair.write_text(json.dumps({"acceptance_by_position": [0.8, 0.4, 0.2, 0.1]}))
    assert parse_acceptance(str(pair)).rates == pytest.approx((0.8, 0.5, 0.5, 0.5))
    cond = tmp_path / "cond.json"
    cond.write_text(json.dumps({"conditional_acceptance": [0.9, 0.7]}))
    assert parse_acceptance(str(cond)).rates == (0.9, 0.7)
    other = tmp_path / "other.json"
    other.write_text("{}")
    with pytest.raises(ValueError, match="acceptance_by_position"):
        parse_acceptance(str(other))
    shipped = parse_acceptance("default-pair")
    assert len(shipped.rates) >= 4 and all(0 < r <= 1 for r in shipped.rates)
    assert parse_acceptance("0.9,0.8").rates == (0.9, 0.8)


@pytest.mark.parametrize("spec", ["1.0", "0.0", "0.6"])
def test_engine_under_synthetic_acceptance(engine_models, mixed_prompts, spec):
    """The unrelated small draft accepts ~nothing for real; with synthetic acceptance the
    engine's counts follow the model, and every request still gets all its tokens with the
    KV bookkeeping intact (run_to_completion checks the scheduler invariants every step)."""
    from jspec.sampling_params import SamplingParams

    target, _, small = engine_models
    engine = make_engine(target, small, num_speculative_tokens=4, policy_options=(("gamma", 4),))
    synthetic.install(engine, spec)
    done = run_to_completion(engine, mixed_prompts[:8], SamplingParams(max_tokens=24,
                                                                       ignore_eos=True))
    assert all(len(o.token_ids) == 24 for o in done.values())
    m = engine.metrics
    rate = m.spec_decode_num_accepted_tokens / m.spec_decode_num_draft_tokens
    expected = {"1.0": 1.0, "0.0": 0.0}.get(spec)
    if expected is not None:
        assert rate == expected
    else:
        # E[accepted]/γ for p=0.6 at γ=4 is 0.6(1-0.6^4)/(1-0.6)/4 = 0.3276; drafts near the end
        # of a request are shorter, which raises it a little
        assert 0.25 < rate < 0.45
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks - 1


def test_shapes_are_real_shapes():
    target, draft = SHAPES["qwen2.5-0.5b"]
    assert 0.45e9 < target.num_params() < 0.55e9
    assert draft.vocab_size == target.vocab_size and draft.num_params() < target.num_params() / 8
    # Qwen2.5-7B (7.62B parameters) drafted by Qwen2.5-0.5B's shape on the 7B's vocabulary
    target, draft = SHAPES["qwen2.5-7b"]
    assert 7.5e9 < target.num_params() < 7.7e9 and (target.num_heads, target.num_kv_heads,
                                                    target.head_dim) == (28, 4, 128)
    assert draft.vocab_size == target.vocab_size and 0.45e9 < draft.num_params() < 0.55e9


def test_serving_bench_labels_synthetic_runs(tiny_pair, tmp_path, capsys):
    from jspec.bench import serving

    out = tmp_path / "syn.json"
    args = tiny_serving_args(
        tiny_pair, "--synthetic-acceptance", "1.0", "--policy", "static:gamma=3",
        "--arrivals", "batch", "--num-requests", "4", "--max-tokens", "9", "--out", str(out),
        "--no-progress", "--no-requests")
    assert serving.run(args) == 0
    assert "SYNTHETIC" in capsys.readouterr().out
    res = json.loads(out.read_text())
    assert res["synthetic"]["conditional_acceptance"] == [1.0]
    assert "SYNTHETIC" in res["synthetic"]["label"]
    m = res["runs"][0]["metrics"]
    assert m["acceptance_rate"] == 1.0 and m["total_output_tokens"] == 4 * 9


def test_serving_bench_synthetic_errors(capsys):
    from jspec.cli import main

    assert main(["bench", "serving", "--synthetic", "gpt-9"]) == 2
    assert "unknown --synthetic shape" in capsys.readouterr().err
    assert main(["bench", "serving", "--synthetic", "qwen2.5-0.5b", "--target", "a",
                 "--draft", "b"]) == 2
    assert "drop --target" in capsys.readouterr().err
    assert main(["bench", "serving", "--synthetic-acceptance", "2"]) == 2
    assert "[0, 1]" in capsys.readouterr().err


def test_serving_bench_synthetic_shape(monkeypatch, tmp_path):
    """--synthetic SHAPE builds random-weight models of that shape (here a tiny stand-in for
    the 0.5B one, which is too slow for the suite) and labels the results."""
    from jspec import synthetic
    from jspec.bench import serving
    from jspec.models.tiny import DRAFT_OVERRIDES, tiny_config

    shape = (tiny_config("llama", vocab_size=4096), tiny_config("llama", vocab_size=4096,
                                                                **DRAFT_OVERRIDES))
    monkeypatch.setitem(synthetic.SHAPES, "test-tiny", shape)
    out = tmp_path / "shape.json"
    args = parse_serving_args(
        "--synthetic", "test-tiny", "--synthetic-acceptance", "0.0,1.0", *llm_cli_args(),
        "--policy", "static:gamma=2", "--arrivals", "batch", "--num-requests", "3",
        "--max-tokens", "7", "--out", str(out), "--no-progress", "--no-requests")
    assert serving.run(args) == 0
    res = json.loads(out.read_text())
    assert res["config"]["target"] == "synthetic test-tiny target (random weights)"
    assert res["config"]["target_model"].endswith("v4096")
    assert res["synthetic"]["shape"] == "test-tiny"
    m = res["runs"][0]["metrics"]
    # position 1 is always rejected, so nothing is ever accepted
    assert m["acceptance_rate"] == 0.0 and m["total_output_tokens"] == 3 * 7


def test_build_engine_takes_loaded_models_with_a_tokenizer(engine_models):
    from jspec.llm import build_engine

    target, _, _ = engine_models
    with pytest.raises(ValueError, match="needs a tokenizer directory"):
        build_engine(target, None)
