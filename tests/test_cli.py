"""`jspec generate` through ``jspec.cli.main`` in-process (tiny pair, shared LLM_KW shapes)."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from conftest import TEST_XLA_FLAGS, llm_cli_args
from jspec.cli import main
from jspec.sampling_params import SamplingParams

SUMMARY = re.compile(
    r"^summary: (\d+) prompts?, (\d+) tokens in [\d.]+ s \([\d.]+ tokens/s\), "
    r"acceptance rate ([\d.]+), mean accepted length ([\d.]+), (\d+) drafted / (\d+) accepted, "
    r"(\d+) engine steps$")


def run_cli(capsys, *argv):
    code = main(["generate", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def summaries(stdout: str) -> list[re.Match]:
    return [m for m in map(SUMMARY.match, stdout.splitlines()) if m]


def test_generate_prints_texts_and_one_summary(capsys, tiny_pair, tiny_llm):
    target, draft = tiny_pair
    prompts = ["def fibonacci(n):", "Hello, world!"]
    code, out, err = run_cli(capsys, "--target", target, "--draft", draft, *llm_cli_args(),
                             "--prompt", prompts[0], "--prompt", prompts[1],
                             "--max-tokens", "12", "--ignore-eos", "--no-progress")
    assert code == 0, err
    (summary,) = summaries(out)
    assert out.rstrip("\n").splitlines()[-1] == summary.group(0)  # the last line
    num_prompts, tokens, acceptance, mean_len, drafted, accepted, steps = (
        float(g) for g in summary.groups())
    assert num_prompts == 2 and tokens == 24 and steps >= 1
    assert drafted > 0 and 0 <= accepted <= drafted and 0 <= acceptance <= 1 and mean_len >= 1
    # greedy by default: the same text as the API gives
    expected = tiny_llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0,
                                                         ignore_eos=True), use_tqdm=False)
    for i, (prompt, exp) in enumerate(zip(prompts, expected)):
        assert f"### prompt {i} (length, 12 tokens): {prompt}\n{exp.text}\n" in out


def test_engine_shapes_do_not_depend_on_the_prompt_count(capsys, monkeypatch, tiny_pair):
    """`jspec generate` builds the same engine, so the same shape buckets, for 1, 3 and 8
    prompts: a later run with another count loads the first run's executables from the
    compilation cache. Stopped where generation would start, so nothing compiles here."""
    from jspec.llm import LLM

    class Stop(Exception):
        pass

    plans = []

    def record(llm, prompts, *args, **kwargs):
        plans.append((llm.engine.rc, llm.engine.runner.bucket_plan(), llm.engine.policy.name))
        raise Stop

    monkeypatch.setattr(LLM, "generate", record)
    target, draft = tiny_pair
    shapes = llm_cli_args()
    at = shapes.index("--max-num-seqs")
    del shapes[at:at + 2]  # the engine's default
    for n in (1, 3, 8):
        prompts = [arg for i in range(n) for arg in ("--prompt", f"def f{i}(x):")]
        with pytest.raises(Stop):
            run_cli(capsys, "--target", target, "--draft", draft, *shapes, *prompts,
                    "--no-warmup", "--no-progress")
    assert plans[0] == plans[1] == plans[2]
    assert plans[0][0].engine.max_num_seqs == 16  # the engine's default, as in jspec serve
    assert plans[0][2] == "auto"  # the default policy, as in jspec serve and LLM


def test_the_default_policy_is_auto_everywhere():
    import inspect

    from jspec.cli import build_parser
    from jspec.config import EngineConfig
    from jspec.llm import LLM

    parser = build_parser()
    for command in ("generate", "serve"):
        assert parser.parse_args([command]).policy == "auto", command
    assert inspect.signature(LLM).parameters["policy"].default == "auto"
    assert EngineConfig().policy == "auto"


def test_prompts_file(capsys, tiny_pair, tmp_path):
    target, draft = tiny_pair
    path = tmp_path / "prompts.txt"
    path.write_text("def fibonacci(n):\n\nHello, world!\nThe engine serves\n")
    code, out, err = run_cli(capsys, "--target", target, "--draft", draft, *llm_cli_args(),
                             "--prompts-file", str(path), "--max-tokens", "4", "--no-progress",
                             "--policy", "static", "--policy-option", "gamma=7", "--seed", "5",
                             "--temperature", "0.8")
    assert code == 0, err
    headers = [line for line in out.splitlines() if line.startswith("### prompt")]
    prompts = ["def fibonacci(n):", "Hello, world!", "The engine serves"]  # blank line skipped
    assert len(headers) == 3
    for i, (header, prompt) in enumerate(zip(headers, prompts)):
        assert header.startswith(f"### prompt {i} (") and header.endswith(f": {prompt}")
    (summary,) = summaries(out)
    assert summary.group(1) == "3"


def test_jsonl_prompts_file_and_progress_bars(capsys, tiny_pair, tmp_path):
    target, draft = tiny_pair
    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps("def f(x):\n    return") + "\n" +
                    json.dumps({"prompt": "Hello"}) + "\n")
    code, out, err = run_cli(capsys, "--target", target, "--draft", draft, *llm_cli_args(),
                             "--prompts-file", str(path), "--max-tokens", "3")
    assert code == 0, err
    assert "### prompt 0 " in out and "def f(x):\n    return\n" in out
    assert "### prompt 1 " in out
    assert summaries(out)[0].group(1) == "2"
    assert "compiled" in err and "generate" in err  # warm-up note and progress bar on stderr


def test_default_pair_and_default_prompt(capsys, monkeypatch, tmp_path):
    """No --target/--draft: the shipped default pair (models/default_pair), nothing built."""
    monkeypatch.setenv("JSPEC_CACHE", str(tmp_path / "cache"))
    # no warm-up: what is checked is which pair ran, not its compiled shapes
    code, out, err = run_cli(capsys, *llm_cli_args(), "--max-tokens", "4", "--no-progress",
                             "--no-warmup")
    assert code == 0, err
    assert "built-in default pair (models/default_pair" in err
    assert "### prompt 0 " in out and "def fibonacci(n):" in out
    assert len(summaries(out)) == 1
    assert not (tmp_path / "cache" / "tiny-random-pair-v1").exists()


def test_tiny_random_fallback_when_the_pair_is_missing(monkeypatch, tmp_path):
    from jspec import default_models

    monkeypatch.setenv("JSPEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(default_models, "SHIPPED_DIR", tmp_path / "nowhere")
    target, draft = default_models.default_pair()
    assert target.startswith(str(tmp_path / "cache" / "tiny-random-pair-v1"))
    assert "fallback" in default_models.describe_default_pair()


def test_target_without_draft_is_plain_decoding(capsys, tiny_pair):
    code, out, err = run_cli(capsys, "--target", tiny_pair[0], *llm_cli_args(),
                             "--prompt", "Hello", "--max-tokens", "5", "--ignore-eos",
                             "--no-progress")
    assert code == 0, err
    assert "plain autoregressive decoding" in err
    (summary,) = summaries(out)
    assert summary.group(5) == "0"  # nothing drafted


def test_ngram_drafts_without_a_draft_model(capsys, tiny_pair):
    prompt = "one two three one two three one two"
    code, out, err = run_cli(capsys, "--target", tiny_pair[0], *llm_cli_args(),
                             "--speculative-method", "ngram", "--prompt-lookup-min", "1",
                             "--prompt", prompt, "--max-tokens", "12", "--ignore-eos",
                             "--no-progress")
    assert code == 0, err
    assert "the target, drafting by n-gram lookup (no draft model)" in err
    (summary,) = summaries(out)
    assert int(summary.group(5)) > 0  # drafted by lookup
    code, _, err = run_cli(capsys, "--target", tiny_pair[0], "--draft", tiny_pair[1],
                           "--speculative-method", "ngram", "--no-progress")
    assert code == 2 and "error: --speculative-method ngram drafts by lookup and takes no " \
                         "--draft" in err
    code, _, err = run_cli(capsys, "--target", tiny_pair[0], "--speculative-method",
                           "ngram+sufix", "--no-progress")
    assert code == 2 and "speculative_method names 'sufix'; each drafter must be one of" in err


@pytest.mark.parametrize("extra, message", [
    (["--temperature", "-1"], "temperature must be a finite number >= 0, got -1.0"),
    (["--max-tokens", "0"], "max_tokens must be an integer >= 1, got 0"),
    (["--top-p", "1.5"], "top_p must be in (0, 1], got 1.5"),
    (["--policy", "nope"], "unknown policy 'nope'; known policies: adaedl, adaspec, auto, dsd, "
                             "dsde, heuristic, nightjar, off, specrouter, static, ucb"),
    (["--policy-option", "gamma"], "--policy-option expects KEY=VALUE, got 'gamma'"),
    (["--policy", "static", "--policy-option", "gamma=99"],
     "gamma must be in [0, max_gamma=7], got 99"),
    (["--policy", "static", "--policy-option", "gama=2"],
     "unknown option 'gama' for policy 'static'; did you mean 'gamma'? (its options are gamma, "
     "chain)"),
    (["--prompt", "Hello", "--max-tokens", "500"], "max_tokens=500 is too large: the prompt has "),
    (["--prompt", ""], "prompt is empty"),
    (["--prompt", "word " * 200], "max_model_len is 128"),
    (["--prompts-file", "/nonexistent/prompts.txt"], "cannot read --prompts-file"),
    (["--num-speculative-tokens", "-1"], "--num-speculative-tokens must be >= 0, got -1"),
])
def test_bad_input_is_one_line_and_exit_code_2(capsys, tiny_pair, extra, message):
    target, draft = tiny_pair
    code, out, err = run_cli(capsys, "--target", target, "--draft", draft, *llm_cli_args(),
                             "--no-progress", *extra)
    assert code == 2
    assert "Traceback" not in err and "summary:" not in out
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and message in errors[0], err


def test_bad_model_arguments(capsys, tiny_pair, tmp_path):
    from jspec.models.tiny import DRAFT_OVERRIDES, write_tiny_checkpoint

    target, draft = tiny_pair
    code, _, err = run_cli(capsys, "--draft", draft, "--no-progress")
    assert code == 2 and err.strip() == ("error: --draft needs --target (give both, or neither "
                                         "for the default pair)")
    other = write_tiny_checkpoint(tmp_path / "draft-520", "llama", seed=3, vocab_size=520,
                                  **DRAFT_OVERRIDES)
    code, _, err = run_cli(capsys, "--target", target, "--draft", other, *llm_cli_args(),
                           "--no-progress")
    assert code == 2
    assert "error: draft vocabulary (520 tokens) differs from the target's (512)" in err
    code, _, err = run_cli(capsys, "--target", str(tmp_path / "missing"), "--no-progress")
    assert code == 2 and "does not exist" in err
    code, _, err = run_cli(capsys, "--target", f"{target}/config.json", "--no-progress")
    assert code == 2 and (f"error: expected a checkpoint directory, but '{target}/config.json' "
                          f"is a file; pass its directory '{target}'") in err


def test_argparse_errors_exit_2(capsys):
    with pytest.raises(SystemExit) as info:
        main(["generate", "--max-tokens", "many"])
    assert info.value.code == 2
    with pytest.raises(SystemExit) as info:
        main(["generate", "--prompt", "a", "--prompts-file", "b"])
    assert info.value.code == 2
    capsys.readouterr()


def test_help_is_fast_and_light():
    """Building the parser (what `jspec --help` does) must not import JAX."""
    code = ("import sys\n"
            "from jspec.cli import build_parser\n"
            "build_parser().parse_args(['generate', '--prompt', 'x'])\n"
            "assert 'jax' not in sys.modules, 'the CLI parser imported jax'\n")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_python_dash_m_jspec_is_the_command():
    """`python3 -m jspec` runs the CLI with that interpreter (the GPU check's spelling, where the
    `jspec` script on PATH may belong to another Python)."""
    proc = subprocess.run([sys.executable, "-m", "jspec", "validate-gpu", "--help"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "--budget-s" in proc.stdout
    proc = subprocess.run([sys.executable, "-m", "jspec", "no-such-command"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "invalid choice" in proc.stderr


def test_generate_in_a_fresh_process_runs_bf16_with_the_cpu_flag(tiny_pair, tmp_path):
    """The real entry point: a new process, where `jspec` sets the CPU bf16 flag before JAX starts
    and dtype 'auto' resolves to bfloat16 (in-process tests cannot cover this: JAX is up)."""
    import os

    target, draft = tiny_pair
    code = (
        "import sys\n"
        "from jspec.cli import main\n"
        f"rc = main(['generate', '--target', {str(target)!r}, '--draft', {str(draft)!r},\n"
        "            '--prompt', 'def f(x):', '--max-tokens', '8', '--max-num-seqs', '2',\n"
        "            '--max-model-len', '64', '--max-num-batched-tokens', '16',\n"
        "            '--num-speculative-tokens', '2', '--no-progress', '--no-warmup'])\n"
        "from jspec.config import resolve_dtype\n"
        "from jspec.platform import cpu_bf16_flag_set\n"
        "assert cpu_bf16_flag_set() and resolve_dtype('auto') == 'bfloat16'\n"
        "sys.exit(rc)\n")
    env = dict(os.environ, XLA_FLAGS=TEST_XLA_FLAGS, JSPEC_CACHE=str(tmp_path))
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "summary: 1 prompt, 8 tokens" in proc.stdout


def test_policy_option_and_state_file(capsys, tiny_pair, tmp_path):
    """--policy with options, the decision-overhead line, and --policy-state saved then loaded."""
    target, draft = tiny_pair
    state = tmp_path / "nightjar.json"
    args = ["--target", target, "--draft", draft, *llm_cli_args(), "--policy", "nightjar",
            "--policy-option", "seed=1", "--policy-state", str(state), "--prompt", "def f(x):",
            "--max-tokens", "6", "--ignore-eos", "--no-progress"]
    code, out, err = run_cli(capsys, *args)
    assert code == 0, err
    assert "policy nightjar:" in err and "of step time" in err
    saved = json.loads(state.read_text())
    assert saved["policy"] == "nightjar" and saved["state"]["contexts"]
    code, out, err = run_cli(capsys, *args)  # loads the state it saved
    assert code == 0, err
    steps_before = sum(sum(c["counts"]) for c in saved["state"]["contexts"].values())
    saved2 = json.loads(state.read_text())
    assert sum(sum(c["counts"]) for c in saved2["state"]["contexts"].values()) > steps_before
