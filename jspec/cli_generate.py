"""`jspec generate`: generate text for one or more prompts with speculative decoding.

Prints each prompt's generated text and one summary line (tokens/s, acceptance rate, mean
accepted length). Without --target/--draft it runs the built-in default model pair.

Every check that can fail on user input (sampling parameters, policy name and options, prompts,
prompt lengths) runs before the compile warm-up, so a mistake costs seconds, not minutes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from jspec import distributed
from jspec.cli_common import (add_engine_arguments, add_model_arguments,
                              add_speculation_arguments, check_model_arguments,
                              describe_models, engine_kwargs, join_processes)
from jspec.warmup import warmup


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    add_speculation_arguments(parser)

    prompts = parser.add_argument_group("prompts")
    source = prompts.add_mutually_exclusive_group()
    source.add_argument("--prompt", action="append", metavar="TEXT",
                        help="a prompt (repeatable; default: a short code prompt)")
    source.add_argument("--prompts-file", metavar="FILE",
                        help="prompts, one per line; a .jsonl file holds one JSON string or "
                             "{\"prompt\": ...} object per line (for prompts with newlines)")

    sampling = parser.add_argument_group("sampling")
    sampling.add_argument("--max-tokens", type=int, default=64,
                          help="tokens to generate per prompt (default: %(default)s)")
    sampling.add_argument("--temperature", type=float, default=0.0,
                          help="0 is greedy (default: %(default)s)")
    sampling.add_argument("--top-p", type=float, default=1.0)
    sampling.add_argument("--top-k", type=int, default=0, help="0 disables (default)")
    sampling.add_argument("--seed", type=int, default=None,
                          help="per-request sampling seed (reproducible whatever the batch)")
    sampling.add_argument("--stop", action="append", default=[], metavar="TEXT",
                          help="stop string, repeatable")
    sampling.add_argument("--ignore-eos", action="store_true",
                          help="keep generating past the end-of-sequence token")

    add_engine_arguments(parser, max_num_seqs_help=(
        "sequences per step; more prompts wait for a slot (default: 16, as in jspec serve, so "
        "both load the same compiled shape buckets)"))
    distributed.add_arguments(parser)


def read_prompts(args: argparse.Namespace) -> list[str]:
    if args.prompts_file is None:
        return list(args.prompt) if args.prompt else ["def fibonacci(n):"]
    try:
        with open(args.prompts_file, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError as e:
        raise ValueError(f"cannot read --prompts-file {args.prompts_file!r}: "
                         f"{e.strerror or e}") from None
    prompts = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue  # blank lines separate prompts, they are not prompts
        if args.prompts_file.endswith(".jsonl"):
            try:
                item = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{args.prompts_file}:{number}: not JSON ({e.msg})") from None
            if isinstance(item, dict):
                item = item.get("prompt")
            if not isinstance(item, str):
                raise ValueError(f"{args.prompts_file}:{number}: expected a JSON string or an "
                                 f"object with a string \"prompt\"")
            line = item
        prompts.append(line)
    if not prompts:
        raise ValueError(f"--prompts-file {args.prompts_file!r} holds no prompts")
    return prompts


def summary_line(outputs, seconds: float, num_steps: int) -> str:
    """One line: throughput and speculation statistics over all outputs (rates are 0 when
    nothing was drafted, as in the engine's metrics)."""
    tokens = sum(len(o.token_ids) for o in outputs)
    drafted = sum(o.spec.num_drafted for o in outputs)
    accepted = sum(o.spec.num_accepted for o in outputs)
    spec_steps = sum(o.spec.num_spec_steps for o in outputs)
    acceptance = accepted / drafted if drafted else 0.0
    mean_len = (accepted + spec_steps) / spec_steps if spec_steps else 0.0
    return (f"summary: {len(outputs)} prompt{'s' if len(outputs) != 1 else ''}, "
            f"{tokens} tokens in {seconds:.2f} s ({tokens / max(seconds, 1e-9):.1f} tokens/s), "
            f"acceptance rate {acceptance:.2f}, mean accepted length {mean_len:.2f}, "
            f"{drafted} drafted / {accepted} accepted, {num_steps} engine steps")


def run(args: argparse.Namespace) -> int:
    from jspec.sampling_params import SamplingParams

    # -- everything checkable without models, before loading anything
    policy_options = check_model_arguments(args)
    sampling_params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
        top_k=args.top_k, seed=args.seed, stop=tuple(args.stop), ignore_eos=args.ignore_eos)
    prompts = read_prompts(args)
    sync = join_processes(args, policy_options)

    # transformers' advisory warnings (about torch-only features) are noise to jspec's users
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    from jspec.llm import LLM

    progress = not args.no_progress
    describe_models(args)
    # The engine's shapes come from its options alone, never from the prompts, so a run with
    # any number of prompts loads the executables an earlier run of the same models and options
    # compiled (XLA's persistent compilation cache); the warm-up compiles only those that as many
    # sequences as there are prompts reach (one sample each). Its requests never ask for
    # logprobs: compile nothing for them unless told.
    options = {"max_logprobs": 0, **engine_kwargs(args)}
    llm = LLM(target=args.target, draft=args.draft, tokenizer=args.tokenizer, policy=args.policy,
              num_speculative_tokens=args.num_speculative_tokens, dtype=args.dtype,
              policy_options=policy_options, warmup=False, **options)
    for prompt in prompts:  # lengths against the context, before the warm-up
        llm.engine.validate_request(prompt, sampling_params)
    if args.policy_state and os.path.exists(args.policy_state):
        llm.engine.load_policy_state(args.policy_state)
    if sync is not None:
        llm.engine.set_step_sync(sync)
    if not args.no_warmup:
        warmup(llm.engine, progress and (sync is None or sync.leader), max_rows=len(prompts))
    if sync is not None and not sync.leader:
        distributed.follow(llm.engine)  # process 0 prints the results
        return 0

    steps_before = llm.engine.metrics.num_steps
    start = time.perf_counter()
    try:
        outputs = llm.generate(prompts, sampling_params, use_tqdm=progress)
    finally:
        if sync is not None:
            sync.stop()
    seconds = time.perf_counter() - start
    for i, (prompt, out) in enumerate(zip(prompts, outputs)):
        print(f"### prompt {i} ({out.finish_reason}, {len(out.token_ids)} tokens): {prompt}")
        print(out.text)
    print(summary_line(outputs, seconds, llm.engine.metrics.num_steps - steps_before))
    m = llm.engine.metrics
    if m.policy_calls:
        per_step = m.policy_time / m.policy_calls
        print(f"policy {llm.engine.policy.name}: {per_step * 1e6:.0f} µs of decisions per step "
              f"({m.policy_time / max(m.step_time, 1e-9):.2%} of step time)", file=sys.stderr)
    if args.policy_state:
        llm.engine.save_policy_state(args.policy_state)
    sys.stdout.flush()
    return 0
