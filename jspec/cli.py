"""The `jspec` command line. Each subcommand lives in its own module and is imported lazily, so
`jspec --help` stays fast and a broken optional dependency only breaks its own command.

Subcommands of the packages above the engine (`jspec serve`, in serve/cli.py) are found through
the ``jspec.commands`` entry-point group that pyproject.toml declares, so the engine package
imports nothing of them: the server depends on the engine, never the other way round."""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import sys

from jspec.layout import checkout_entry_points

# name -> (module, help). Each module defines `add_arguments(parser)` and `run(args) -> int`.
COMMANDS = {
    "generate": ("jspec.cli_generate", "generate text with speculative decoding"),
    "train": ("jspec.cli_train", "train the target model (and tokenizer) on the stdlib corpus"),
    "distill": ("jspec.cli_train", "distil a draft model from a trained target"),
    "train-eagle": ("jspec.cli_train", "train an EAGLE-3 draft head for a target (stdlib "
                    "corpus, and the target's own completions with --self-generated)"),
    "profile": ("jspec.cli_profile", "measure a model pair's step times for cost-aware policies"),
    "validate-gpu": ("jspec.validate_gpu", "check a GPU machine: compiled kernel tests, kernel "
                     "benchmark, greedy output Pallas vs reference, serving sweep; JSON and "
                     "markdown report"),
}

# the entry-point group of subcommands defined outside the engine package: name -> module, each
# module defining HELP besides `add_arguments(parser)` and `run(args) -> int`
COMMAND_GROUP = "jspec.commands"

# `jspec bench NAME`: each module defines `add_arguments(parser)` and `run(args) -> int`.
BENCHMARKS = {
    "model-step": ("jspec.bench.model_step", "forward step time over batch x tokens per sequence"),
    "overhead": ("jspec.bench.overhead", "host-side overhead per engine step"),
    "step": ("jspec.bench.step", "engine step vs the bare target forward and draft loop, per "
             "stage, decode and prefill"),
    "drafters": ("jspec.bench.drafters", "every drafter of a target side by side on held-out "
                 "code: acceptance, draft cost, throughput at B = 1 and 32"),
    "oracle": ("jspec.bench.oracle", "policies one request at a time, taking turns per prompt, "
               "against the best fixed choice and the per-request oracle over the fixed ones"),
    "pair": ("jspec.bench.pair", "acceptance and cost of a target/draft pair on held-out code"),
    "kernels": ("jspec.bench.kernels", "Pallas kernels vs references vs the bandwidth roofline"),
    "serving": ("jspec.bench.serving", "online serving: policies side by side on a workload "
                "and arrival schedule (Poisson, step, burst, Azure trace)"),
    "headline": ("jspec.bench.headline", "the headline experiment: every policy x low / medium "
                 "/ high Poisson load and a scaled Azure trace, with a markdown report"),
    "simulate": ("jspec.bench.simulate", "policies against the best fixed γ in seeded simulated "
                 "environments (saturation, low load, load steps, prefill bursts)"),
    "plot": ("jspec.bench.plots", "figures of `jspec bench serving` results (matplotlib)"),
}


def extra_commands() -> dict[str, str]:
    """name -> module of the subcommands in the ``jspec.commands`` entry-point group: those the
    installed distributions register, and those a source checkout's own pyproject.toml declares
    (which win, as the checkout's own folders do; jspec.layout)."""
    found = {ep.name: ep.value for ep in importlib.metadata.entry_points(group=COMMAND_GROUP)}
    found.update(checkout_entry_points(COMMAND_GROUP))
    return {name: module for name, module in found.items() if name not in COMMANDS}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jspec", description=__doc__.split(". ")[0] + ".")
    sub = parser.add_subparsers(dest="command", required=True)
    commands = [(name, module, help_text) for name, (module, help_text) in COMMANDS.items()]
    commands += [(name, module, None) for name, module in extra_commands().items()]
    for name, module, help_text in commands:
        loaded = importlib.import_module(module)
        p = sub.add_parser(name, help=help_text or loaded.HELP)
        loaded.add_arguments(p)
        p.set_defaults(_module=module)
    bench = sub.add_parser("bench", help="benchmarks (see `jspec bench -h`)")
    bench_sub = bench.add_subparsers(dest="benchmark", required=True)
    for name, (module, help_text) in BENCHMARKS.items():
        p = bench_sub.add_parser(name, help=help_text)
        importlib.import_module(module).add_arguments(p)
        p.set_defaults(_module=module)
    return parser


def main(argv: list[str] | None = None) -> int:
    from jspec.platform import configure_cpu_bf16, configure_cpu_devices

    configure_cpu_bf16()  # before anything starts JAX's backend
    args = build_parser().parse_args(argv)
    tp = getattr(args, "tensor_parallel_size", None)
    if tp and tp > 1:
        # several processes (jspec/distributed.py) each bring their share of the mesh
        configure_cpu_devices(max(1, tp // (getattr(args, "num_processes", None) or 1)))
    try:
        return int(importlib.import_module(args._module).run(args) or 0)
    except ValueError as e:  # user mistakes surface as one line, not a traceback
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
