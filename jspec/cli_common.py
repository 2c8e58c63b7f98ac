"""Command-line pieces shared by the commands that build an engine (`jspec generate`, `jspec
serve`): the model, speculation and engine argument groups, their checks, and the compile
warm-up with a progress bar (``jspec.warmup``). Nothing here imports JAX at module import, so
`jspec --help` stays fast."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from jspec.config import drafts_with_model, parse_methods

# EngineConfig fields that map one-to-one onto `--flag` options; unset flags keep the config's
# default.
ENGINE_OPTION_FIELDS = ("max_num_seqs", "max_model_len", "max_num_batched_tokens", "block_size",
                        "num_kv_blocks", "min_token_bucket", "kernel_backend", "elastic_memory",
                        "elastic_low_watermark", "elastic_persist_steps", "elastic_pool_layout",
                        "tensor_parallel_size", "max_logprobs", "enable_prefix_caching",
                        "async_scheduling", "deterministic", "speculative_method",
                        "prompt_lookup_min", "prompt_lookup_max")


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    models = parser.add_argument_group("models")
    models.add_argument("--target", metavar="DIR",
                        help="target HF checkpoint directory (llama / qwen2 / mistral); "
                             "default: the built-in default pair")
    models.add_argument("--draft", metavar="DIR", action="append",
                        help="draft checkpoint directory sharing the target's vocabulary; "
                             "repeat it for a pool of drafts (SpecRouter's chains, "
                             "--policy specrouter); with --target but no --draft, decoding is "
                             "plain (no speculation)")
    models.add_argument("--tokenizer", metavar="DIR",
                        help="tokenizer directory (default: the target's)")
    models.add_argument("--dtype", choices=["auto", "bfloat16", "float32"], default="auto",
                        help="parameter and KV-cache dtype; auto = bfloat16, except float32 on "
                             "a CPU backend without the bf16 flag jspec sets (JSPEC_CPU_BF16=off "
                             "or an accelerator plugin installed; see jspec/platform.py) "
                             "(default: %(default)s)")


def add_speculation_arguments(parser: argparse.ArgumentParser) -> None:
    spec = parser.add_argument_group("speculation")
    spec.add_argument("--policy", default="auto",
                      help="speculation policy: auto (adapts to load), static (fixed γ), off, "
                           "nightjar, dsde, adaspec, dsd, ucb, adaedl, heuristic "
                           "(default: %(default)s)")
    spec.add_argument("--speculative-method", default=None, metavar="METHOD",
                      help="what drafts: draft_model (the draft checkpoint; the built-in "
                           "pair's without --target), eagle3 (an EAGLE-3 head given as "
                           "--draft; the built-in target's head without --target), ngram (prompt lookup in each "
                           "sequence's own tokens) or suffix (suffix decoding over the "
                           "request's and earlier requests' tokens); the last two run no draft "
                           "model. Several joined by '+' (e.g. draft_model+ngram+suffix): "
                           "the policy picks one per sequence each step (auto does) "
                           "(default: draft_model)")
    spec.add_argument("--prompt-lookup-min", type=int, default=None, metavar="N",
                      help="ngram: shortest suffix matched (default: 2)")
    spec.add_argument("--prompt-lookup-max", type=int, default=None, metavar="N",
                      help="ngram: longest suffix matched (default: 4)")
    spec.add_argument("--num-speculative-tokens", type=int, default=4, metavar="N",
                      help="largest number of draft tokens per step, Γmax (default: %(default)s)")
    spec.add_argument("--policy-option", action="append", default=[], metavar="KEY=VALUE",
                      help="policy option, repeatable (e.g. gamma=2 for static, "
                           "profile=PROFILE.json for adaspec/dsd)")
    spec.add_argument("--policy-state", metavar="FILE",
                      help="load the policy's learned state from FILE if it exists, and save "
                           "it there at the end")


def add_engine_arguments(parser: argparse.ArgumentParser, max_num_seqs_help: str
                         ) -> argparse._ArgumentGroup:
    engine = parser.add_argument_group("engine")
    engine.add_argument("--max-num-seqs", type=int, default=None, help=max_num_seqs_help)
    engine.add_argument("--max-model-len", type=int, default=None,
                        help="context limit (default: the target's, at most 4096)")
    engine.add_argument("--max-num-batched-tokens", type=int, default=None,
                        help="target tokens per step (default: derived)")
    engine.add_argument("--block-size", type=int, default=None,
                        help="KV block size in tokens (default: 16)")
    engine.add_argument("--num-kv-blocks", type=int, default=None,
                        help="KV pool size in blocks (default: max-num-seqs full sequences)")
    engine.add_argument("--min-token-bucket", type=int, default=None,
                        help="smallest token-count shape bucket (default: 8)")
    engine.add_argument("--max-logprobs", type=int, default=None, metavar="K",
                        help="the most top log-probabilities a request may ask for (default 20; "
                             "0 compiles nothing for them and refuses such requests)")
    engine.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                        default=None,
                        help="keep finished requests' full KV blocks and reuse them for prompts "
                             "that start with the same tokens (vLLM's automatic prefix "
                             "caching; default: on)")
    engine.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction,
                        default=None,
                        help="commit each decoding step in which nothing drafts while the "
                             "next one runs on its tokens (vLLM's name; default: on)")
    engine.add_argument("--deterministic", action=argparse.BooleanOptionalAction, default=None,
                        help="batch-invariant numerics: a token's logits do not depend on its "
                             "batch, so greedy speculative output equals plain greedy output "
                             "in bfloat16 too (default: on)")
    engine.add_argument("--kernel-backend", choices=["auto", "pallas", "interpret", "reference"],
                        default=None,
                        help="attention / KV-migration kernels: auto = Pallas on a GPU where they "
                             "compile, else the jnp reference (default: auto)")
    add_tensor_parallel_argument(engine)
    add_elastic_arguments(engine)
    engine.add_argument("--no-warmup", action="store_true",
                        help="skip compiling every shape bucket up front (first steps then "
                             "compile as they go)")
    engine.add_argument("--no-progress", action="store_true",
                        help="no progress bars on stderr")
    return engine


def add_tensor_parallel_argument(group) -> None:
    group.add_argument("--tensor-parallel-size", "-tp", type=int, default=None, metavar="N",
                       help="split the target over N devices (Megatron tensor parallelism over "
                            "a JAX mesh, models/sharding.py; on a machine without accelerators "
                            "the CPU is split into N devices) (default: 1)")


def add_elastic_arguments(group) -> None:
    """Nightjar's elastic memory (jspec/elastic.py), on generate, serve and bench serving."""
    group.add_argument("--elastic-memory", action="store_const", const=True, default=None,
                       help="offload the draft and give its memory to the KV cache while "
                            "speculation is off and blocks run short; reload it when load "
                            "falls (Nightjar §5)")
    group.add_argument("--elastic-low-watermark", type=float, default=None, metavar="FRACTION",
                       help="τ_low: expand below this share of free blocks (default: 0.1)")
    group.add_argument("--elastic-persist-steps", type=int, default=None, metavar="STEPS",
                       help="T_persist: steps the expansion conditions must hold (default: 8)")
    group.add_argument("--elastic-pool-layout", choices=("auto", "segments", "preallocated"),
                       default=None, help="the KV extension as a second array allocated from "
                       "the draft's freed memory (segments), or one array sized for both from "
                       "the start (preallocated); auto: segments on GPU/TPU, preallocated on "
                       "CPU")


def parse_option_value(text: str) -> Any:
    """``2`` -> int, ``0.5`` -> float, ``true``/``false`` -> bool, ``none`` -> None, else str."""
    lowered = text.strip().lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered in ("none", "null"):
        return None
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def parse_policy_options(items: list[str]) -> dict[str, Any]:
    options: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ValueError(f"--policy-option expects KEY=VALUE, got {item!r}")
        options[key.replace("-", "_")] = parse_option_value(value)
    return options


def _lookup_only(args: argparse.Namespace) -> bool:
    """Whether --speculative-method names only drafters without a model."""
    return args.speculative_method is not None and \
        not drafts_with_model(args.speculative_method)


def check_model_arguments(args: argparse.Namespace) -> dict[str, Any]:
    """Everything about the models and the policy that is checkable without loading anything.
    Returns the parsed policy options."""
    from jspec.policies import make_policy

    if args.draft is not None and args.target is None:
        raise ValueError("--draft needs --target (give both, or neither for the default pair)")
    if args.speculative_method is not None:
        parse_methods(args.speculative_method)  # a clear error for a misspelt drafter
    if _lookup_only(args) and args.draft is not None:
        raise ValueError(f"--speculative-method {args.speculative_method} drafts by lookup and "
                         f"takes no --draft")
    policy_options = parse_policy_options(args.policy_option)
    if args.num_speculative_tokens < 0:
        raise ValueError(f"--num-speculative-tokens must be >= 0, got "
                         f"{args.num_speculative_tokens}")
    make_policy(args.policy, args.num_speculative_tokens, **policy_options)  # name and options
    return policy_options


def join_processes(args: argparse.Namespace, policy_options: dict[str, Any]):
    """A multi-process run (--coordinator-address ...): join the processes before anything
    starts JAX's backend (jspec/distributed.py) and return this process's StepSync; None for
    a single process."""
    from jspec import distributed
    from jspec.policies import make_policy

    if not distributed.check_arguments(args):
        return None
    policy = make_policy(args.policy, args.num_speculative_tokens, **policy_options)
    if policy.needs_profile and policy.profile is None:
        raise ValueError(f"policy {args.policy!r} measures a step-time profile when the engine "
                         "starts, which a multi-process run cannot do yet (each process would "
                         "time steps of its own); pass --policy-option profile=FILE from "
                         "`jspec profile`")
    return distributed.initialize(args)


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The engine options given on the command line (unset ones: EngineConfig's default)."""
    return {name: getattr(args, name) for name in ENGINE_OPTION_FIELDS
            if getattr(args, name) is not None}


def describe_models(args: argparse.Namespace) -> None:
    """One stderr note on which models run when that is not obvious from the flags."""
    if _lookup_only(args):
        which = "the built-in target" if args.target is None else "the target"
        how = " and ".join({"ngram": "n-gram lookup", "suffix": "suffix decoding"}[m]
                           for m in parse_methods(args.speculative_method))
        print(f"{which}, drafting by {how} (no draft model)", file=sys.stderr)
    elif args.target is None:
        from jspec.default_models import describe_default_pair
        from jspec.policies import POLICIES

        pool = getattr(POLICIES.get(args.policy), "wants_pool", False)
        extra = " and the pool's middle model (models/default_pair/mid)" if pool else ""
        print(f"using {describe_default_pair()}{extra}", file=sys.stderr)
    elif args.draft is None:
        print("no --draft: plain autoregressive decoding", file=sys.stderr)
