"""Shared fixtures. Tiny model checkpoints are built once per session: building the tokenizer and
compiling forwards dominates the run time, so tests share them."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

import pytest

# Tests never read or write the user's cache: the default pair and XLA's persistent compilation
# cache live in a per-run temporary directory (so every run measures cold compiles, as CI does).
_CACHE = tempfile.mkdtemp(prefix="jspec-test-cache-")
os.environ["JSPEC_CACHE"] = _CACHE
atexit.register(shutil.rmtree, _CACHE, ignore_errors=True)

# XLA:CPU compiles at optimization level 0 in the test run (this process and the jspec
# subprocesses it starts): with tiny models, compiling the shape buckets is most of the suite's
# time, and level 0 compiles them 2-3x as fast (tests/test_engine_lossless.py: 219 s -> 106 s
# on the 2-core CI machine) though it runs each step 3-4x slower (docs/benchmarks.md,
# "Start-up": why jspec itself keeps XLA's default). Nothing a test checks depends on it
# (tokens, distributions, invariants, compile counts); benchmarks and users get the default.
# Subprocesses that set XLA_FLAGS themselves start from TEST_XLA_FLAGS.
TEST_XLA_FLAGS = "--xla_backend_optimization_level=0"
os.environ["XLA_FLAGS"] = " ".join(filter(None, (os.environ.get("XLA_FLAGS"), TEST_XLA_FLAGS)))

# An engine on a CPU picks its weight layout, layer buffers and row floor by timing both ways
# (jspec/weight_layout.py); timings at optimization level 0 would pick at random. The suite runs
# what is named here (JSPEC_WEIGHT_LAYOUT=out_in, JSPEC_LAYER_BUFFERS=per_layer or
# JSPEC_DOT_ROWS=2 pytest runs it the other way, but for the tensor-parallel tests, which
# refuse the first two);
# tests/test_weight_layout.py runs the other ones and the choice.
os.environ.setdefault("JSPEC_WEIGHT_LAYOUT", "in_out")
os.environ.setdefault("JSPEC_LAYER_BUFFERS", "stacked")
os.environ.setdefault("JSPEC_DOT_ROWS", "1")


@pytest.fixture(scope="session")
def tiny_tokenizer():
    from jspec.models.tiny import build_tiny_tokenizer

    return build_tiny_tokenizer()


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory, tiny_tokenizer):
    """Path of a tiny random llama checkpoint (fp32 weights, with tokenizer)."""
    from jspec.models.tiny import write_tiny_checkpoint

    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny_llama"), "llama", seed=0,
                                 tokenizer=tiny_tokenizer)


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory):
    """(target_path, draft_path): tiny llama target and smaller draft sharing a tokenizer."""
    from jspec.models.tiny import write_tiny_pair

    return write_tiny_pair(tmp_path_factory.mktemp("tiny_pair"), "llama", seed=0)


# ----------------------------------------------------------------------------- engine fixtures
# Every engine test uses the same shapes (ENGINE_KW), so the process-wide executable cache
# compiles each bucket once for the whole session. Their policy is static (γ = Γmax): the
# default, auto, compiles every γ bucket; the tests of an adaptive policy name it.
ENGINE_KW = dict(dtype="float32", max_num_seqs=8, max_model_len=128, max_num_batched_tokens=64,
                 num_speculative_tokens=7, block_size=16,
                 min_token_bucket=16, policy="static")
ENGINE_VOCAB = 256


@pytest.fixture(scope="session")
def engine_models():
    """(target, agreeing_draft, small_draft) LoadedModels in fp32.

    agreeing_draft is the target with small weight noise (acceptance around 0.6); small_draft is
    an unrelated, smaller random model (acceptance near 0)."""
    import jax
    import numpy as np

    from jspec.runner import LoadedModel
    from jspec.models.params import init_params
    from jspec.models.tiny import DRAFT_OVERRIDES, tiny_config

    cfg = tiny_config("llama", vocab_size=ENGINE_VOCAB)
    target = init_params(cfg, seed=0, std=0.2)
    rng = np.random.default_rng(1)
    noisy = jax.tree_util.tree_map(
        lambda a: a + 0.003 * rng.standard_normal(a.shape).astype(np.float32), target)
    small_cfg = tiny_config("llama", vocab_size=ENGINE_VOCAB, **DRAFT_OVERRIDES)
    small = init_params(small_cfg, seed=5, std=0.2)
    return (LoadedModel(cfg, target, "target"), LoadedModel(cfg, noisy, "draft"),
            LoadedModel(small_cfg, small, "small-draft"))


def make_engine(target, draft, policy=None, **overrides):
    from jspec.config import EngineConfig
    from jspec.engine import LLMEngine

    kw = dict(ENGINE_KW)
    kw.update(overrides)
    return LLMEngine(target, draft, EngineConfig(**kw), policy=policy)


def run_to_completion(engine, prompts, sampling_params, max_steps=10_000):
    """Add prompts as requests '0'..'n-1', step until done; returns {id: RequestOutput}."""
    for i, prompt in enumerate(prompts):
        sp = sampling_params[i] if isinstance(sampling_params, list) else sampling_params
        engine.add_request(str(i), prompt, sp)
    done = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        engine.scheduler.check_invariants()
    assert not engine.has_unfinished_requests(), "engine did not finish"
    return done


@pytest.fixture(scope="session")
def mixed_prompts():
    """16 token-id prompts of mixed lengths (1 to 100 tokens; the long ones need chunking)."""
    import numpy as np

    rng = np.random.default_rng(7)
    lengths = [1, 2, 5, 9, 16, 17, 31, 33, 48, 64, 65, 70, 80, 90, 99, 100]
    rng.shuffle(lengths)
    return [rng.integers(3, ENGINE_VOCAB, n).tolist() for n in lengths]


@pytest.fixture(scope="session")
def ten_prompts(mixed_prompts):
    return mixed_prompts[:10]


@pytest.fixture(scope="session")
def greedy_reference(engine_models, ten_prompts):
    """Target-only greedy outputs of ``ten_prompts`` (20 tokens each, EOS ignored): what every
    speculative configuration must reproduce token for token."""
    from jspec.sampling_params import SamplingParams

    target, _, _ = engine_models
    greedy = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    outs = run_to_completion(make_engine(target, None), ten_prompts, greedy)
    return [outs[str(i)].token_ids for i in range(len(ten_prompts))]


# ----------------------------------------------------------------------------- LLM-level fixtures
# The offline API, the CLI and the async engine build engines from checkpoint directories: the
# tiny pair (vocabulary 512) with the ENGINE_KW engine shapes, so all of them share one set of
# compilations.
LLM_KW = dict(ENGINE_KW)


def llm_cli_args() -> list[str]:
    """`jspec generate` flags that give the LLM_KW engine shapes (the policy left at the
    command's default)."""
    args = []
    for key, value in LLM_KW.items():
        if key != "policy":
            args += ["--" + key.replace("_", "-"), str(value)]
    return args


def parse_serving_args(*argv: str):
    """`jspec bench serving`'s command line, parsed."""
    import argparse

    from jspec.bench import serving

    parser = argparse.ArgumentParser()
    serving.add_arguments(parser)
    return parser.parse_args(list(argv))


def tiny_serving_args(tiny_pair, *argv: str):
    """`jspec bench serving` arguments for the tiny pair with the LLM_KW engine shapes."""
    target, draft = tiny_pair
    return parse_serving_args("--target", str(target), "--draft", str(draft), *llm_cli_args(),
                              *argv)


@pytest.fixture(scope="session")
def tiny_llm(tiny_pair):
    """One LLM over the tiny pair, shared by the API tests (it holds no state between calls)."""
    from jspec.llm import LLM

    target, draft = tiny_pair
    return LLM(target=target, draft=draft, **LLM_KW)
