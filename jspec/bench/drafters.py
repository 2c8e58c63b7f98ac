"""`jspec bench drafters`: every drafter of one target side by side on held-out code: the draft
model, the EAGLE-3 head and the lookups, at a fixed γ, one request at a time (B = 1) and as a
full batch (B = 32).

For each batch size, an engine per drafter (and one decoding plainly, the baseline), each first
run on two other prompts (an engine's first steps). Then every engine generates greedy
completions of the held-out split's function prompts (``heldout_function_prompts``: modules the
built-in models never trained on) as it serves, once per round, every other round in reverse
order (``--rounds``: on a machine whose speed drifts, engines run one after another are not
compared like with like); each pass starts from empty prefix and suffix caches, so no pass
drafts from or reuses an earlier one's outputs. Throughput and acceptance sum over the rounds.
Each round then runs a second pass per engine, in the same order, with the stages of every step
timed apart (synced), for the stage times, which also sum over the rounds, so a slow spell of
the machine falls on every engine's stage times alike. The report gives the acceptance rate
(accepted / drafted), the mean accepted length per
drafting step, the drafter's own time per drafting step (its forwards and catch-up; nothing for
a lookup's host work, which counts in the step) and that time over the draft model's, the
whole step's time, and the throughput over plain decoding's. All in one process, so the ratios
compare like with like.
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
    parser.add_argument("--rounds", type=int, default=2,
                        help="measured passes per engine, every other round in reverse order "
                             "(default: %(default)s)")
    parser.add_argument("--json", metavar="FILE", help="write the results as JSON")


class _Engine:
    """One drafter's engine (``off``: plain decoding) and what its measured passes added up."""

    def __init__(self, target, draft, method: str, batch: int, gamma: int, warm_prompts, sp):
        from jspec.llm import LLM

        spec = {} if method == "off" else {"speculative_method": method}
        self.method, self.batch, self.sp = method, batch, sp
        self.llm = LLM(target=target, draft=draft, policy="off" if method == "off" else "static",
                       num_speculative_tokens=gamma, max_num_seqs=batch, use_tqdm=False,
                       **spec)
        self.records = []
        self.llm.engine.add_step_listener(self.records.append)
        # the first steps of a fresh engine (its shapes compiled at start-up) on other prompts
        self.llm.generate(warm_prompts, sp, use_tqdm=False)
        self.tokens = self.seconds = self.drafted = self.accepted = self.rows = 0
        # the synced passes' drafter seconds (forwards and catch-up) and drafting steps, and
        # their decode-only steps' seconds and count
        self.draft_seconds = self.drafting_steps = self.decode_seconds = self.decode_steps = 0

    def _fresh_pass(self, prompts):
        """Generate ``prompts`` from empty caches: suffix decoding drafts from the outputs of
        finished requests and the prefix cache holds the prompts' blocks, and a server would
        see neither from an earlier pass over the same prompts."""
        engine = self.llm.engine
        engine.reset_suffix_cache()
        engine.reset_prefix_cache()
        self.records.clear()
        return self.llm.generate(prompts, self.sp, use_tqdm=False)

    def measure(self, prompts) -> None:
        """One pass as the engine serves, never waiting between stages (a sync after each
        one costs a drafting step more than a plain one: a round trip per stage on a GPU)."""
        start = time.perf_counter()
        outs = self._fresh_pass(prompts)
        self.seconds += time.perf_counter() - start
        self.tokens += sum(len(o.token_ids) for o in outs)
        self.drafted += sum(int(r.num_drafted.sum()) for r in self.records)
        self.accepted += sum(int(r.num_accepted.sum()) for r in self.records)
        self.rows += sum(int((r.num_drafted > 0).sum()) for r in self.records)

    def time_stages(self, prompts) -> None:
        """One pass with every stage synced, so the drafter's time is its own (a sync after
        each stage costs a drafting step more than a plain one, hence apart from ``measure``)."""
        engine = self.llm.engine
        engine.time_stages = True
        try:
            self._fresh_pass(prompts)
        finally:
            engine.time_stages = False
        drafting = [r for r in self.records if r.gamma_bucket]
        decode = [r for r in self.records if not r.num_prefill_tokens]
        self.draft_seconds += sum(r.draft_time + r.catch_up_time for r in drafting)
        self.drafting_steps += len(drafting)
        self.decode_seconds += sum(r.step_time for r in decode)
        self.decode_steps += len(decode)

    def result(self, rounds: int) -> dict:
        """What the measured passes and the synced ones added up."""
        drafted, accepted, rows = self.drafted, self.accepted, self.rows
        return {
            "drafter": self.method, "batch": self.batch, "rounds": rounds,
            "tokens": self.tokens, "seconds": self.seconds,
            "tok_per_s": self.tokens / self.seconds,
            "acceptance_rate": accepted / drafted if drafted else 0.0,
            "mean_accepted_length": (accepted + rows) / rows if rows else 1.0,
            "draft_ms_per_step": 1e3 * self.draft_seconds / max(self.drafting_steps, 1),
            "step_ms": 1e3 * self.decode_seconds / max(self.decode_steps, 1),
        }


def _compare(target, models: dict, methods: list[str], batch: int, args, prompts, warm, sp
             ) -> list[dict]:
    """One batch size: every method's engine, the measured rounds, then each one's result (the
    engines are dropped on return, before the next batch size's are built)."""
    engines = [_Engine(target, models.get(m), m, batch, args.gamma, warm, sp) for m in methods]
    for rnd in range(args.rounds):
        order = engines if rnd % 2 == 0 else engines[::-1]
        for e in order:
            e.measure(prompts)
        for e in order:
            e.time_stages(prompts)
    results, base = [], None
    for e in engines:
        r = e.result(args.rounds)
        base = base or r["tok_per_s"]
        r["vs_off"] = r["tok_per_s"] / base
        results.append(r)
    # each drafter's time per drafting step over the draft model's, where it ran (a head's
    # goal: at most half of it)
    model = next((r for r in results if r["drafter"] == "draft_model"), None)
    for r in results:
        r["vs_draft_model_time"] = (r["draft_ms_per_step"] / model["draft_ms_per_step"]
                                    if model and model["draft_ms_per_step"] > 0
                                    and r["drafter"] != "off" else None)
    for r in results:
        print(f"B={batch:<3} {r['drafter']:<12} {r['tok_per_s']:8.1f} tok/s ({r['vs_off']:.2f}x "
              f"off)  acceptance {r['acceptance_rate']:.3f}  accepted length "
              f"{r['mean_accepted_length']:.2f}  drafter {r['draft_ms_per_step']:.2f} "
              f"ms/step ({_ratio(r['vs_draft_model_time'])} the draft model's)  step "
              f"{r['step_ms']:.2f} ms", file=sys.stderr)
    return results


def run(args: argparse.Namespace) -> int:
    import os

    from jspec.default_models import default_head, default_pair
    from jspec.models.corpus import heldout_function_prompts
    from jspec.sampling_params import SamplingParams

    drafters = [d.strip() for d in args.drafters.split(",") if d.strip()]
    bad = [d for d in drafters if d not in _DRAFTERS]
    if bad:
        raise ValueError(f"--drafters names {bad}; each must be one of {', '.join(_DRAFTERS)}")
    try:
        batches = [int(b) for b in args.batch_sizes.split(",")]
    except ValueError:
        raise ValueError(f"--batch-sizes takes comma-separated integers, got "
                         f"{args.batch_sizes!r}") from None
    if (args.gamma < 1 or args.num_prompts < 1 or args.max_tokens < 1 or args.rounds < 1
            or min(batches) < 1):
        raise ValueError("--gamma, --num-prompts, --max-tokens, --rounds and batch sizes must "
                         "be >= 1")
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
    sp = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    results = []
    for batch in batches:
        n = len(prompts) if batch > 1 else max(2, len(prompts) // 4)
        results += _compare(target, models, ["off"] + drafters, batch, args, prompts[:n],
                            warm, sp)
    print(f"\n| B | drafter | tok/s | x off | acceptance | accepted length / step | "
          f"drafter ms / step | x draft model's | step ms |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['batch']} | {r['drafter']} | {r['tok_per_s']:.1f} | {r['vs_off']:.2f} | "
              f"{r['acceptance_rate']:.3f} | {r['mean_accepted_length']:.2f} | "
              f"{r['draft_ms_per_step']:.2f} | {_ratio(r['vs_draft_model_time'])} | "
              f"{r['step_ms']:.2f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gamma": args.gamma, "results": results}, f, indent=1)
    return 0


def _ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"
