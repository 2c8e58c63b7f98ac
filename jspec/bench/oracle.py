"""`jspec bench oracle`: what choosing a drafter per request could gain, and what each policy
gains, one request at a time.

Every policy (``--policy``, spelled as for ``jspec bench serving``: ``static:gamma=4,drafter=
suffix``, ``auto:drafter=draft_model+ngram+suffix``) gets its own engine in one process. Each
prompt runs alone (B = 1) on every engine in turn, the engines taking turns in palindromic order
(A B C for one prompt, C B A for the next), so a slow spell of the machine falls on all of them
alike. Per prompt, the fastest of the fixed policies (``off`` and ``static``) is what an oracle
that knew each request's best drafter beforehand would have run: its total is the most that
choosing per request among those fixed choices can gain over the best single one. An adaptive
policy may gain more only by choosing per step (or choices the fixed set lacks).

The report: each policy's seconds, steps and seconds per step, the host time of its steps'
plan stage per step (the schedule's rows, the policy's decision, the device inputs: host work
while the device waits, which an adaptive policy's decisions add to), its speed against the best
fixed policy (time of that policy / own time), the oracle's, and the seconds per prompt
category.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

FIXED = ("off", "static")  # the policies whose choice is fixed for the whole run


def add_arguments(parser: argparse.ArgumentParser) -> None:
    models = parser.add_argument_group("models and engine")
    models.add_argument("--target", metavar="DIR", help="default: the built-in target")
    models.add_argument("--draft", metavar="DIR", help="draft model (default: the built-in one)")
    models.add_argument("--dtype", choices=["auto", "bfloat16", "float32"], default="auto")
    models.add_argument("--max-num-seqs", type=int, default=16,
                        help="the engines' batch limit (their compiled shapes; prompts still run "
                             "one at a time) (default: %(default)s)")
    for name in ("max-model-len", "max-num-batched-tokens", "block-size", "min-token-bucket"):
        models.add_argument(f"--{name}", type=int, default=None,
                            help="engine option (default: EngineConfig's)")
    parser.add_argument("--policy", nargs="+", required=True, metavar="SPEC",
                        help="policies as `jspec bench serving` spells them, at least one of "
                             "them fixed (off, static)")
    parser.add_argument("--num-speculative-tokens", type=int, default=4,
                        help="Γmax of every engine (a static policy's gamma= may ask fewer)")
    parser.add_argument("--workload", default="mixed",
                        help="prompt source, as for `jspec bench serving` (default: mixed)")
    parser.add_argument("--workload-file", metavar="FILE",
                        help="the workload's data file (default: under JSPEC_DATA_DIR)")
    parser.add_argument("--num-prompts", type=int, default=36, help="measured prompts")
    parser.add_argument("--warmup-prompts", type=int, default=4,
                        help="prompts each engine runs first, unmeasured")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="above 0: every request samples (seeded by its prompt) to "
                             "--max-tokens, ignoring EOS, so every engine emits as many tokens")
    parser.add_argument("--max-prompt-tokens", type=int, default=800,
                        help="prompts longer than this are skipped")
    parser.add_argument("--seed", type=int, default=0, help="which prompts, in which order")
    parser.add_argument("--json", metavar="FILE", help="write the results as JSON")


def _check(args: argparse.Namespace) -> None:
    if not any(spec.partition(":")[0] in FIXED for spec in args.policy):
        raise ValueError(f"--policy needs at least one fixed policy ({', '.join(FIXED)}) for "
                         f"the oracle to choose from, got {args.policy}")
    for name in ("num_prompts", "max_tokens", "max_prompt_tokens", "max_num_seqs"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got "
                             f"{getattr(args, name)}")
    if args.warmup_prompts < 0 or args.num_speculative_tokens < 0:
        raise ValueError("--warmup-prompts and --num-speculative-tokens must be >= 0")
    if not args.temperature >= 0:
        raise ValueError(f"--temperature must be >= 0, got {args.temperature}")


def _engines(args: argparse.Namespace, runs: list[dict]) -> list:
    from jspec.config import drafts_with_model
    from jspec.llm import LLM

    # no request asks for logprobs: none compiled
    options = {"dtype": args.dtype, "max_num_seqs": args.max_num_seqs, "max_logprobs": 0,
               "num_speculative_tokens": args.num_speculative_tokens}
    for name in ("max_model_len", "max_num_batched_tokens", "block_size", "min_token_bucket"):
        if getattr(args, name) is not None:
            options[name] = getattr(args, name)
    llms = []
    for run in runs:
        # lookups alone draft from the target: no draft model
        method = run["engine"].get("speculative_method", "draft_model")
        draft = args.draft if drafts_with_model(method) else None
        llm = LLM(target=args.target, draft=draft, policy=run["name"],
                  policy_options=run["options"], use_tqdm=False, **options, **run["engine"])
        llms.append((llm, _Counts(llm.engine)))
    return llms


class _Counts:
    """An engine's steps and their plan stages' seconds, from its per-step records."""

    def __init__(self, engine):
        self.steps, self.plan = 0, 0.0
        engine.add_step_listener(self._observe)

    def _observe(self, record) -> None:
        self.steps += 1
        self.plan += record.stage_times.get("plan", 0.0)


def _prompts(args: argparse.Namespace, tokenizer) -> list:
    from jspec.bench import workloads as wl

    pool = wl.load_workload(args.workload, args.workload_file)
    wanted = args.warmup_prompts + args.num_prompts
    chosen = []
    for i in wl.sample_order(len(pool), len(pool), args.seed):  # each prompt once, seeded
        if len(tokenizer.encode(pool[int(i)].text)) <= args.max_prompt_tokens:
            chosen.append(pool[int(i)])
            if len(chosen) == wanted:
                break
    if len(chosen) < wanted:
        raise ValueError(f"the {args.workload} workload has {len(chosen)} prompts of at most "
                         f"{args.max_prompt_tokens} tokens; {wanted} are needed "
                         f"(--warmup-prompts + --num-prompts)")
    return chosen


def compare(seconds: np.ndarray, steps: np.ndarray, labels: list[str], fixed: list[bool],
            categories: list[str], plan: np.ndarray | None = None) -> dict:
    """The report's numbers from per-(policy, prompt) ``seconds``, ``steps`` and ``plan``
    (the steps' plan stages' seconds; zeros where not given)."""
    totals = seconds.sum(axis=1)
    plan = np.zeros_like(seconds) if plan is None else plan
    fixed_idx = [i for i, f in enumerate(fixed) if f]
    best = min(fixed_idx, key=lambda i: totals[i])
    oracle = seconds[fixed_idx].min(axis=0)
    picks = [labels[fixed_idx[i]] for i in seconds[fixed_idx].argmin(axis=0)]
    return {
        "policies": [{"label": label, "fixed": f, "seconds": float(t),
                      "steps": int(n), "ms_per_step": 1e3 * float(t) / max(int(n), 1),
                      "plan_ms_per_step": 1e3 * float(h) / max(int(n), 1),
                      "x_best_fixed": float(totals[best] / t)}
                     for label, f, t, n, h in zip(labels, fixed, totals, steps.sum(axis=1),
                                                  plan.sum(axis=1))],
        "best_fixed": labels[best],
        "oracle": {"seconds": float(oracle.sum()),
                   "x_best_fixed": float(totals[best] / oracle.sum()),
                   "picks": {label: picks.count(label) for label in dict.fromkeys(picks)}},
        "categories": {c: {label: float(seconds[i, [k for k, x in enumerate(categories)
                                                     if x == c]].sum())
                           for i, label in enumerate(labels)}
                       for c in sorted(set(categories))},
    }


def run(args: argparse.Namespace) -> int:
    from jspec.bench.serving import parse_policies
    from jspec.sampling_params import SamplingParams

    _check(args)
    runs = parse_policies(args.policy, [], args.num_speculative_tokens)
    labels = [r["label"] for r in runs]
    fixed = [r["name"] in FIXED for r in runs]
    llms = _engines(args, runs)
    prompts = _prompts(args, llms[0][0].tokenizer)
    def params(k: int) -> SamplingParams:
        return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                              seed=k, ignore_eos=args.temperature > 0)

    for llm, steps in llms:
        for k, p in enumerate(prompts[:args.warmup_prompts]):
            llm.generate([p.text], params(k), use_tqdm=False)
    measured = prompts[args.warmup_prompts:]
    seconds = np.zeros((len(llms), len(measured)))
    steps = np.zeros_like(seconds)
    plan = np.zeros_like(seconds)
    for k, p in enumerate(measured):
        turn = range(len(llms)) if k % 2 == 0 else range(len(llms) - 1, -1, -1)
        for j in turn:
            llm, counts = llms[j]
            before, planned, start = counts.steps, counts.plan, time.perf_counter()
            llm.generate([p.text], params(args.warmup_prompts + k), use_tqdm=False)
            seconds[j, k] = time.perf_counter() - start
            steps[j, k] = counts.steps - before
            plan[j, k] = counts.plan - planned
        print(f"prompt {k + 1}/{len(measured)} ({p.category}): "
              + " ".join(f"{s:.3f}" for s in seconds[:, k]), file=sys.stderr)
    report = compare(seconds, steps, labels, fixed, [p.category for p in measured], plan)
    sampled = f", temperature {args.temperature:g}" if args.temperature > 0 else ""
    print(f"\n{len(measured)} {args.workload} prompts, one at a time, {args.max_tokens} tokens "
          f"at most{sampled}, Γmax = {args.num_speculative_tokens}; best fixed: "
          f"{report['best_fixed']}\n")
    print("| policy | seconds | steps | ms / step | plan ms / step | × best fixed |")
    print("|---|---|---|---|---|---|")
    for r in report["policies"]:
        print(f"| {r['label']} | {r['seconds']:.2f} | {r['steps']} | {r['ms_per_step']:.2f} | "
              f"{r['plan_ms_per_step']:.3f} | {r['x_best_fixed']:.3f} |")
    o = report["oracle"]
    print(f"| oracle: the fastest fixed policy per prompt | {o['seconds']:.2f} | | | | "
          f"{o['x_best_fixed']:.3f} |")
    print("\noracle's picks: " + ", ".join(f"{k} {v}" for k, v in o["picks"].items()))
    print("\n| category | " + " | ".join(labels) + " |")
    print("|---|" + "---|" * len(labels))
    for c, row in report["categories"].items():
        print(f"| {c} | " + " | ".join(f"{row[label]:.2f}" for label in labels) + " |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": {k: v for k, v in vars(args).items() if not k.startswith("_")},
                       **report}, f, indent=1)
    return 0
