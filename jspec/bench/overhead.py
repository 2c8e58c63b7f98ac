"""`jspec bench overhead`: host-side time per engine step, outside the compiled device calls.

Runs steady decoding (every sequence decoding, prompts already prefilled) of a tiny model at
several batch sizes, with speculation on and off, and prints the share of each step spent in
Python/numpy (scheduling, policy, batch assembly, commit) rather than in device work. Everything
compared runs in this one process.
"""

from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batch-sizes", default="1,32", help="comma-separated batch sizes")
    p.add_argument("--gamma", type=int, default=4, help="static γ of the speculative runs")
    p.add_argument("--steps", type=int, default=60, help="measured decode steps per run")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])


def run(args: argparse.Namespace) -> int:
    import numpy as np

    from jspec.config import EngineConfig
    from jspec.engine import LLMEngine
    from jspec.runner import LoadedModel
    from jspec.sampling_params import SamplingParams
    from jspec.models.params import init_params
    from jspec.models.tiny import DRAFT_OVERRIDES, tiny_config

    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    vocab = 512
    cfg = tiny_config("llama", vocab_size=vocab, max_position_embeddings=4096)
    draft_cfg = tiny_config("llama", vocab_size=vocab, max_position_embeddings=4096,
                            **DRAFT_OVERRIDES)
    target = LoadedModel(cfg, init_params(cfg, seed=0, std=0.2), "target")
    draft = LoadedModel(draft_cfg, init_params(draft_cfg, seed=1, std=0.2), "draft")
    max_tokens = args.steps * (args.gamma + 1) + 8
    print(f"tiny model: target {cfg.num_params():,} params, draft {draft_cfg.num_params():,}; "
          f"{args.steps} steady decode steps per run, dtype {args.dtype}")
    print(f"{'batch':>5} {'policy':>10} {'step ms':>9} {'host ms':>9} {'host %':>7} "
          f"{'device ms':>9}")
    rng = np.random.default_rng(0)
    for batch in batch_sizes:
        for policy, gamma in (("off", 0), ("static", args.gamma)):
            config = EngineConfig(
                dtype=args.dtype, max_num_seqs=max(batch, 2),
                max_model_len=args.prompt_len + max_tokens + 16, policy=policy,
                num_speculative_tokens=args.gamma, policy_options=(("gamma", gamma),)
                if policy == "static" else ())
            engine = LLMEngine(target, draft, config)
            sp = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
            for i in range(batch):
                engine.add_request(str(i), rng.integers(3, vocab, args.prompt_len).tolist(), sp)
            while engine.scheduler.num_waiting or any(
                    not s.is_decoding for s in engine.scheduler.running):
                engine.step()  # prefill; not measured
            for _ in range(3):
                engine.step()  # settle (draft catch-up after prefill)
            m = engine.metrics
            start = (m.step_time, m.host_time, m.num_steps)
            for _ in range(args.steps):
                engine.step()
            steps = m.num_steps - start[2]
            step_ms = (m.step_time - start[0]) / steps * 1e3
            host_ms = (m.host_time - start[1]) / steps * 1e3
            print(f"{batch:>5} {policy + (f' γ={gamma}' if gamma else ''):>10} {step_ms:9.3f} "
                  f"{host_ms:9.3f} {100 * host_ms / step_ms:6.1f}% {step_ms - host_ms:9.3f}")
    return 0
