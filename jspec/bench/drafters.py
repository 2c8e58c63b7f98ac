"""`jspec bench drafters`: every drafter of one target side by side on held-out code: the draft
model, the EAGLE-3 head and the lookups, at a fixed γ, one request at a time (B = 1) and as a
full batch (B = 32).

For each batch size and drafter (and plain decoding as the baseline) an engine generates greedy
completions of the held-out split's function prompts (``heldout_function_prompts``: modules the
built-in models never trained on) twice, after two other prompts (an engine's first steps): once as
it serves, for the throughput and acceptance, and once with the stages of every step timed apart
(synced), for the stage times. The report gives the acceptance rate (accepted / drafted), the mean
accepted length per drafting step, the drafter's own time per drafting step (its forwards and
catch-up; nothing for a lookup's host work, which counts in the step), the whole step's time, and
the throughput over plain decoding's. All in one process, so the ratios compare like with like.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

# what each drafter needs: the draft model, the head, or nothing
_DRAFTERS = ("draft_model", "eagle3", "ngram", "suffix")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", metavar="DIR", help="default: the built-in target")
    parser.add_argument("--draft", metavar="DIR", help="draft model (default: the built-in one)")
    parser.add_argument("--head", metavar="DIR", help="EAGLE-3 head (default: the built-in one)")
    parser.add_argument("--drafters", default=",".join(_DRAFTERS),
                        help="comma-separated drafters to compare (default: %(default)s)")
    parser.add_argument("--batch-sizes", default="1,32",
                        help="comma-separated max_num_seqs values (default: %(default)s)")
    parser.add_argument("--gamma", type=int, default=4, help="draft tokens per step (static)")
    parser.add_argument("--num-prompts", type=int, default=64,
                        help="prompts per batch size (B = 1 runs a quarter of them)")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--json", metavar="FILE", help="write the results as JSON")


def _run_one(target, draft, method: str, batch: int, gamma: int, prompts, warm_prompts,
             max_tokens: int):
    from jspec.llm import LLM
    from jspec.sampling_params import SamplingParams

    spec = {} if method == "off" else {"speculative_method": method}
    llm = LLM(target=target, draft=draft, policy="off" if method == "off" else "static",
              num_speculative_tokens=gamma, max_num_seqs=batch, use_tqdm=False, **spec)
    engine = llm.engine
    records = []
    engine.add_step_listener(records.append)
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    # the first steps of a fresh engine (its shapes compiled at start-up) on other prompts:
    # suffix decoding drafts from the outputs of finished requests, and the measured prompts'
    # own would be drafts no server sees
    llm.generate(warm_prompts, sp, use_tqdm=False)
    # throughput and acceptance from a pass that never waits between stages: a sync after
    # each one costs a drafting step more than a plain one (a round trip per stage on a GPU)
    records.clear()
    start = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.token_ids) for o in outs)
    drafted = sum(int(r.num_drafted.sum()) for r in records)
    accepted = sum(int(r.num_accepted.sum()) for r in records)
    rows = sum(int((r.num_drafted > 0).sum()) for r in records)
    # the stages' times from a second pass over the same prompts, each stage synced so the
    # drafter's time is its own, with the first pass's outputs forgotten as drafts
    engine.time_stages = True
    engine.reset_suffix_cache()
    records.clear()
    llm.generate(prompts, sp, use_tqdm=False)
    drafting = [r for r in records if r.gamma_bucket]
    decode_steps = [r for r in records if not r.num_prefill_tokens]
    return {
        "drafter": method, "batch": batch, "tokens": tokens, "seconds": seconds,
        "tok_per_s": tokens / seconds,
        "acceptance_rate": accepted / drafted if drafted else 0.0,
        "mean_accepted_length": (accepted + rows) / rows if rows else 1.0,
        "draft_ms_per_step": 1e3 * sum(r.draft_time + r.catch_up_time for r in drafting)
        / max(len(drafting), 1),
        "step_ms": 1e3 * sum(r.step_time for r in decode_steps) / max(len(decode_steps), 1),
    }


def run(args: argparse.Namespace) -> int:
    import os

    from jspec.default_models import default_head, default_pair
    from jspec.models.corpus import heldout_function_prompts

    drafters = [d.strip() for d in args.drafters.split(",") if d.strip()]
    bad = [d for d in drafters if d not in _DRAFTERS]
    if bad:
        raise ValueError(f"--drafters names {bad}; each must be one of {', '.join(_DRAFTERS)}")
    try:
        batches = [int(b) for b in args.batch_sizes.split(",")]
    except ValueError:
        raise ValueError(f"--batch-sizes takes comma-separated integers, got "
                         f"{args.batch_sizes!r}") from None
    if args.gamma < 1 or args.num_prompts < 1 or args.max_tokens < 1 or min(batches) < 1:
        raise ValueError("--gamma, --num-prompts, --max-tokens and batch sizes must be >= 1")
    if args.target is not None and ("draft_model" in drafters and args.draft is None
                                    or "eagle3" in drafters and args.head is None):
        raise ValueError("with --target, give --draft and --head for the drafters that need "
                         "them (or leave them out of --drafters)")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    pair = default_pair() if args.target is None else (args.target, args.draft)
    target = pair[0]
    # only the models the compared drafters need (the built-in head is built or checked here)
    models = {}
    if "draft_model" in drafters:
        models["draft_model"] = args.draft or pair[1]
    if "eagle3" in drafters:
        models["eagle3"] = args.head or default_head()
    held = heldout_function_prompts()
    prompts = held[:args.num_prompts]
    # the warm-up's two prompts: others where the split has them, else two measured ones
    warm = held[args.num_prompts:args.num_prompts + 2]
    warm = warm if len(warm) == 2 else prompts[:2]
    results = []
    for batch in batches:
        n = len(prompts) if batch > 1 else max(2, len(prompts) // 4)
        base = None
        for method in ["off"] + drafters:
            r = _run_one(target, models.get(method), method, batch, args.gamma, prompts[:n],
                         warm, args.max_tokens)
            base = base or r["tok_per_s"]
            r["vs_off"] = r["tok_per_s"] / base
            results.append(r)
            print(f"B={batch:<3} {method:<12} {r['tok_per_s']:8.1f} tok/s ({r['vs_off']:.2f}x "
                  f"off)  acceptance {r['acceptance_rate']:.3f}  accepted length "
                  f"{r['mean_accepted_length']:.2f}  drafter {r['draft_ms_per_step']:.2f} "
                  f"ms/step  step {r['step_ms']:.2f} ms", file=sys.stderr)
    print(f"\n| B | drafter | tok/s | x off | acceptance | accepted length / step | "
          f"drafter ms / step | step ms |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['batch']} | {r['drafter']} | {r['tok_per_s']:.1f} | {r['vs_off']:.2f} | "
              f"{r['acceptance_rate']:.3f} | {r['mean_accepted_length']:.2f} | "
              f"{r['draft_ms_per_step']:.2f} | {r['step_ms']:.2f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gamma": args.gamma, "results": results}, f, indent=1)
    return 0
