"""Where speculation stops paying on this device: plain decoding (``off``) against fixed γ
(``static``) at rising concurrency, in the cost-realistic synthetic mode (``jspec.synthetic``:
random weights of a real pair's shapes, acceptance replayed from a recorded pair), on the
machinery of `jspec bench serving`.

Each concurrency level B is a batch of B requests sent at once (``--arrivals batch``), so the
engine runs about B sequences per step until they finish. Every policy serves the same requests
at a level, each on its own engine, kept for the whole sweep. At each level an engine first
compiles every shape a step of at most that many sequences can take (a full warm-up would compile
every bucket up to the widest level, most of which the sweep never uses; one unmeasured pass
alone misses the shapes that only another draw of acceptances reaches), serves the requests once
unmeasured, then measured.
Speculation pays at a level when the best fixed γ's output throughput beats plain decoding's;
the verdict names the level from which on it no longer does.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from typing import Callable


@dataclasses.dataclass(frozen=True)
class Sweep:
    shape: str  # a ``jspec.synthetic.SHAPES`` name
    levels: tuple[int, ...]  # concurrent requests, rising
    policies: tuple[str, ...]  # `jspec bench serving --policy` specs: off and fixed γs
    max_tokens: int  # output tokens per request
    prompt_tokens: int  # prompt tokens per request, at most
    acceptance: str = "default-pair"  # ``jspec.synthetic.parse_acceptance`` spec
    seed: int = 0

    def __post_init__(self):
        check_levels(self.levels)
        names = [p.partition(":")[0] for p in self.policies]
        if "off" not in names or "static" not in names:
            raise ValueError(f"a sweep compares off with static policies, got {self.policies}")


def check_levels(levels) -> None:
    if not levels or any(b < 1 for b in levels):
        raise ValueError(f"sweep levels must be positive request counts, got {list(levels)}")
    if list(levels) != sorted(set(levels)):
        raise ValueError(f"sweep levels must rise, got {list(levels)}")


def serving_args(sweep: Sweep) -> argparse.Namespace:
    """`jspec bench serving`'s arguments for the sweep's engines (one batch of the widest
    level; each level's requests are built by ``level_requests``)."""
    from jspec.bench import serving

    parser = argparse.ArgumentParser(prog="jspec bench serving")
    serving.add_arguments(parser)
    widest = max(sweep.levels)
    args = parser.parse_args([
        "--synthetic", sweep.shape, "--synthetic-acceptance", sweep.acceptance,
        "--policy", *sweep.policies, "--arrivals", "batch", "--num-requests", str(widest),
        "--max-tokens", str(sweep.max_tokens), "--max-prompt-tokens", str(sweep.prompt_tokens),
        "--max-num-seqs", str(widest),
        # room for the prompt, the output and a draft's lookahead, in whole 16-token blocks
        "--max-model-len", str(16 * -(-(sweep.prompt_tokens + sweep.max_tokens + 16) // 16)),
        # the same prompts come back at every level: nothing may be served from a cache
        "--prefix-caching", "off", "--seed", str(sweep.seed), "--no-progress",
        "--no-requests"])
    args.bin_seconds_resolved = 1.0
    return args


def level_requests(args: argparse.Namespace, prompts, tokenizer, context_limit: int,
                   level: int):
    """``level`` requests sent at once, drawn from ``prompts`` as `jspec bench serving` draws."""
    from jspec.bench import arrivals, workloads

    return workloads.build_requests(
        prompts, tokenizer.encode, arrivals.batch(level).times,
        workloads.FitOptions(context_limit, args.max_tokens, args.max_prompt_tokens, args.seed))


def run(sweep: Sweep, deadline: float | None = None,
        on_level: Callable[[dict], None] | None = None) -> dict:
    """Run the sweep level by level (stopping before a level once ``deadline``, a UNIX time,
    has passed); ``on_level`` gets the numbers so far after each level. Returns them."""
    import jax

    from jspec.bench import serving, workloads
    from jspec.policies.profile import model_signature
    from jspec.synthetic import parse_acceptance

    args = serving_args(sweep)
    policies = serving.parse_policies(args.policy, args.policy_option,
                                      args.num_speculative_tokens)
    options = serving.engine_options(args)
    acceptance = parse_acceptance(sweep.acceptance, seed=sweep.seed)
    prompts = workloads.load_workload("code")  # their text does not matter, only their length
    numbers = {"shape": sweep.shape, "requested": list(sweep.levels),
               "policies": [p["label"] for p in policies], "max_tokens": sweep.max_tokens,
               "prompt_tokens": sweep.prompt_tokens, "acceptance": acceptance.describe(),
               "device": jax.devices()[0].device_kind, "levels": [], "stopped": None}
    engines = {}
    for level in sweep.levels:
        if deadline is not None and time.time() >= deadline:
            numbers["stopped"] = f"the budget ran out before {level} concurrent requests"
            break
        row = {"concurrency": level, "runs": []}
        for policy in policies:
            if policy["label"] not in engines:
                engines[policy["label"]] = serving.make_engine(args, policy, options)
            engine = engines[policy["label"]]
            if "target_model" not in numbers:
                numbers["target_model"] = model_signature(engine.target.cfg)
                numbers["draft_model"] = model_signature(engine.draft.cfg)
                numbers["kernel_backend"] = engine.limits.kernel_backend
            args.context_limit_resolved = engine.limits.context_limit
            requests = level_requests(args, prompts, engine.tokenizer,
                                      args.context_limit_resolved, level)
            start = time.perf_counter()
            engine.warmup(max_rows=level)
            serving.run_policy(policy, args, options, requests, engine=engine)
            compile_pass = time.perf_counter() - start
            engine.reset_metrics()
            result = serving.run_policy(policy, args, options, requests, engine=engine)
            m = result["metrics"]
            row["runs"].append({
                "label": policy["label"], "policy": policy["name"],
                "output_tokens_per_s": m["output_tokens_per_s"],
                "tpot_p50_s": m["tpot_s"]["p50"], "tpot_p90_s": m["tpot_s"]["p90"],
                "acceptance_rate": m["acceptance_rate"], "mean_gamma": m["mean_gamma"],
                "engine_steps": m["num_engine_steps"], "wall_s": result["wall_s"],
                "compile_pass_s": compile_pass})
            print(f"B={level} {policy['label']}: {m['output_tokens_per_s']:.1f} tok/s, TPOT p50 "
                  f"{(m['tpot_s']['p50'] or 0) * 1e3:.2f} ms, acceptance "
                  f"{m['acceptance_rate']:.3f} (compiling pass {compile_pass:.1f} s)",
                  file=sys.stderr, flush=True)
        row.update(compare(row["runs"]))
        numbers["levels"].append(row)
        numbers["verdict"] = verdict(numbers["levels"])
        if on_level is not None:
            on_level(numbers)
    numbers["verdict"] = verdict(numbers["levels"])
    return numbers


def compare(runs: list[dict]) -> dict:
    """The best fixed γ at one level and its throughput over plain decoding's."""
    off = next(r for r in runs if r["policy"] == "off")
    best = max((r for r in runs if r["policy"] == "static"),
               key=lambda r: r["output_tokens_per_s"])
    return {"best_static": best["label"],
            "speedup": best["output_tokens_per_s"] / off["output_tokens_per_s"]}


def verdict(levels: list[dict]) -> str:
    """One line: from which level on the best fixed γ no longer beats plain decoding."""
    if not levels:
        return "no level ran"
    ratios = ", ".join(f"B={lv['concurrency']}: {lv['speedup']:.2f}x" for lv in levels)
    pays = [lv["speedup"] >= 1.0 for lv in levels]
    if all(pays):
        return f"speculation pays at every level measured (best fixed γ / off: {ratios})"
    if not any(pays):
        return f"speculation pays at no level measured (best fixed γ / off: {ratios})"
    last = max(i for i, p in enumerate(pays) if p)
    if last == len(levels) - 1:
        return (f"speculation pays at the highest level measured but not at every lower one "
                f"(best fixed γ / off: {ratios})")
    return (f"speculation stops paying at {levels[last + 1]['concurrency']} concurrent requests "
            f"(best fixed γ / off: {ratios})")
