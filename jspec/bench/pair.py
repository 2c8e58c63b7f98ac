"""`jspec bench pair`: how well a draft serves its target, on held-out code prompts.

Prompts are the signatures + docstrings of the functions in the held-out split of the stdlib
corpus (``jspec.models.corpus.heldout_function_prompts``: modules the default pair never trained on).
The pair generates greedy completions with a fixed γ (static policy, default 4) through the real
engine; the report gives the acceptance rate (accepted / drafted), the mean accepted length per
speculative step (accepted + 1), acceptance by draft position, and the share of completions
that parse as Python once cut at the end of the function body.

Cost: the draft's and the target's forward step are timed on the same shapes (decode, B = 1 and
B = 8 at context 256, and a 512-token prefill chunk) and their ratio printed next to the ratio
of forward FLOPs per token.
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
import time


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", metavar="DIR", help="default: the built-in pair's target")
    parser.add_argument("--draft", metavar="DIR", help="default: the built-in pair's draft")
    parser.add_argument("--gamma", type=int, default=4, help="draft tokens per step (static)")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--show", type=int, default=3, help="completions to print")
    parser.add_argument("--no-cost", action="store_true", help="skip the step-time comparison")
    parser.add_argument("--json", metavar="FILE", help="write the results as JSON")


def function_body_parses(prompt: str, completion: str, slack: int = 3) -> bool:
    """Does prompt + completion parse as Python once the completion is cut where the function
    ends (the first non-blank line indented no deeper than the ``def``)? When the token budget
    ends inside the body, the unfinished last line and up to ``slack`` more trailing lines (a
    statement cut in half) may be dropped. A body with no statement does not count."""
    lines = completion.split("\n")
    if not completion.endswith("\n"):
        lines = lines[:-1]  # the unfinished last line
    body = []
    for line in lines:
        if line.strip() and not line[:1].isspace():
            break
        body.append(line)
    for cut in range(len(body), max(len(body) - slack, 0) - 1, -1):
        if not any(line.strip() for line in body[:cut]):
            return False
        try:
            ast.parse(prompt + "\n".join(body[:cut]) + "\n")
            return True
        except SyntaxError:
            continue
    return False


def measure_cost(llm, repeats: int = 5) -> list[dict]:
    """Forward step time of target and draft on identical shapes (fastest of ``repeats``)."""
    from jspec.bench.model_step import ForwardTimer

    import jax.numpy as jnp

    engine = llm.engine
    kv_dtype = jnp.dtype(engine.limits.kv_dtype)
    timers = {name: ForwardTimer(m.cfg, m.params, kv_dtype, 16, repeats)
              for name, m in (("target", engine.target), ("draft", engine.draft))}
    rows = []
    for label, batch_size, query_len, context in (("decode B=1", 1, 1, 256),
                                                  ("decode B=8", 8, 1, 256),
                                                  ("prefill 512", 1, 512, 0)):
        row = {"shape": label}
        for name, timer in timers.items():
            row[name] = timer(batch_size, query_len, context)
        row["ratio"] = row["draft"] / row["target"]
        rows.append(row)
    return rows


def run(args: argparse.Namespace) -> int:
    import os

    from jspec.sampling_params import SamplingParams
    from jspec.models.corpus import heldout_function_prompts
    from jspec.models.train import forward_flops_per_token

    if args.gamma < 1 or args.num_prompts < 1 or args.max_tokens < 1:
        raise ValueError("--gamma, --num-prompts and --max-tokens must be >= 1")
    if (args.target is None) != (args.draft is None):
        raise ValueError("give both --target and --draft, or neither for the built-in pair")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    from jspec.llm import LLM

    prompts = heldout_function_prompts(args.num_prompts)
    llm = LLM(target=args.target, draft=args.draft, policy="static",
              num_speculative_tokens=args.gamma, max_num_seqs=args.max_num_seqs,
              use_tqdm=sys.stderr.isatty())
    engine = llm.engine
    t_cfg, d_cfg = engine.target.cfg, engine.draft.cfg
    print(f"target {t_cfg.num_params() / 1e6:.2f}M params, draft {d_cfg.num_params() / 1e6:.2f}M; "
          f"forward FLOPs/token draft/target = "
          f"{forward_flops_per_token(d_cfg) / forward_flops_per_token(t_cfg):.3f} "
          f"(context 256)")
    sp = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    start = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=sys.stderr.isatty())
    seconds = time.perf_counter() - start
    drafted = sum(o.spec.num_drafted for o in outs)
    accepted = sum(o.spec.num_accepted for o in outs)
    spec_steps = sum(o.spec.num_spec_steps for o in outs)
    tokens = sum(len(o.token_ids) for o in outs)
    per_pos = engine.metrics.accepted_per_position[:args.gamma] / max(
        engine.metrics.spec_decode_num_drafts, 1)
    parses = sum(function_body_parses(p, o.text) for p, o in zip(prompts, outs))
    result = {
        "num_prompts": len(prompts), "gamma": args.gamma, "tokens": tokens,
        "seconds": seconds, "acceptance_rate": accepted / drafted if drafted else 0.0,
        "mean_accepted_length": (accepted + spec_steps) / spec_steps if spec_steps else 0.0,
        "acceptance_by_position": [float(x) for x in per_pos],
        "parse_rate": parses / len(prompts),
    }
    print(f"{len(prompts)} held-out prompts, greedy, γ = {args.gamma}: {tokens} tokens in "
          f"{seconds:.1f} s; acceptance {result['acceptance_rate']:.3f} "
          f"({accepted}/{drafted}), mean accepted length {result['mean_accepted_length']:.2f} "
          f"tokens/step")
    print("accepted at draft position 1..γ: "
          + " ".join(f"{x:.2f}" for x in result["acceptance_by_position"]))
    print(f"completions whose function parses as Python: {parses}/{len(prompts)}")
    for p, o in list(zip(prompts, outs))[:args.show]:
        print("-" * 72)
        print(p + o.text)
    if not args.no_cost:
        result["cost"] = measure_cost(llm)
        print("-" * 72)
        print("forward step time (ms)   target    draft   draft/target")
        for row in result["cost"]:
            print(f"  {row['shape']:<20} {row['target'] * 1e3:>8.2f} {row['draft'] * 1e3:>8.2f}"
                  f"   {row['ratio']:.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0
