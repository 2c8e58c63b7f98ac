"""`jspec serve`: an OpenAI-compatible HTTP server (this package) over one model pair.

The jspec command finds this subcommand through the ``jspec.commands`` entry-point group
(pyproject.toml), so the engine package imports nothing of the server.

Without --target/--draft it serves the built-in default pair. The port is bound at once and
GET /health answers 503 until the models are loaded and every shape bucket is compiled, then 200.
SIGTERM (or Ctrl-C) stops accepting, gives requests in flight --grace-period seconds, aborts the
rest and exits 0; a second signal aborts at once. If the engine fails (an exception in a step),
the traceback is logged, the requests in flight get an error, /health answers 503
{"status": "failed"} and the process exits 1 for its supervisor to restart it (with
--keep-alive-on-engine-failure it answers 503 until stopped, then exits 1).

Every check that can fail on user input (policy, options, server settings) runs before the
models load.
"""

from __future__ import annotations

import argparse
import os
import sys

from jspec import distributed
from jspec.cli_common import (add_engine_arguments, add_model_arguments,
                              add_speculation_arguments, check_model_arguments,
                              describe_models, engine_kwargs, join_processes)
from jspec.warmup import warmup

HELP = "OpenAI-compatible HTTP server (needs the serve extra)"
DEFAULT_MODEL_NAME = "jspec-default"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    add_speculation_arguments(parser)
    add_engine_arguments(parser, max_num_seqs_help="sequences per step, the most requests that "
                                                   "run at once (default: 16)")
    server = parser.add_argument_group("server")
    server.add_argument("--host", default="127.0.0.1",
                        help="address to listen on (default: %(default)s; 0.0.0.0 for all)")
    server.add_argument("--port", type=int, default=8000,
                        help="TCP port; 0 picks a free one (default: %(default)s)")
    server.add_argument("--served-model-name", metavar="NAME",
                        help="the model name clients send and /v1/models lists (default: the "
                             f"target directory's name, or {DEFAULT_MODEL_NAME!r} for the "
                             "built-in pair)")
    server.add_argument("--api-key", default=os.environ.get("JSPEC_API_KEY"), metavar="KEY",
                        help="require 'Authorization: Bearer KEY' on /v1/* (default: "
                             "$JSPEC_API_KEY if set, else no key)")
    server.add_argument("--max-queue", type=int, default=256, metavar="N",
                        help="requests that may wait beyond the --max-num-seqs running ones; "
                             "more get 503 with Retry-After (default: %(default)s)")
    server.add_argument("--grace-period", type=float, default=30.0, metavar="SECONDS",
                        help="on SIGTERM, how long requests in flight get to finish before "
                             "they are aborted (default: %(default)s)")
    server.add_argument("--keep-alive-on-engine-failure", action="store_true",
                        help="after the engine fails, keep answering (503, /health 'failed') "
                             "until stopped instead of exiting 1 at once; for debugging")
    distributed.add_arguments(parser)


def _require_server_dependencies() -> None:
    missing = []
    for module in ("aiohttp", "prometheus_client"):
        try:
            __import__(module)
        except ImportError:
            missing.append(module)
    if missing:
        raise ValueError(f"jspec serve needs {' and '.join(missing)}, which "
                         f"{'is' if len(missing) == 1 else 'are'} not installed: "
                         f"pip install 'jspec[serve]'")


def _log_to_stderr() -> None:
    """The server's and the engine's own log lines on stderr, without touching the root logger
    (so libraries' INFO chatter stays hidden); once per process, however often `run` is
    called."""
    import logging

    class StderrHandler(logging.StreamHandler):
        """Writes to sys.stderr as it is when a line is logged, like logging.lastResort: whoever
        replaced sys.stderr since (a test's capture) may have closed the old one."""

        @property
        def stream(self):
            return sys.stderr

        @stream.setter
        def stream(self, value):
            pass

    for name in ("jspec.serve", "jspec.engine"):
        log = logging.getLogger(name)
        if not any(getattr(h, "_jspec_serve", False) for h in log.handlers):
            handler = StderrHandler()
            handler.setFormatter(logging.Formatter("jspec serve: %(message)s"))
            handler._jspec_serve = True
            log.addHandler(handler)
        log.setLevel(logging.INFO)


def served_model_name(args: argparse.Namespace) -> str:
    if args.served_model_name is not None:
        return args.served_model_name
    if args.target is None:
        return DEFAULT_MODEL_NAME
    return os.path.basename(os.path.normpath(args.target)) or DEFAULT_MODEL_NAME


def run(args: argparse.Namespace) -> int:
    # -- everything checkable without models, before loading anything
    _require_server_dependencies()
    policy_options = check_model_arguments(args)
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in [0, 65535], got {args.port}")
    import asyncio

    from jspec.serve.app import ServerOptions
    from jspec.serve.server import Server

    options = ServerOptions(model_name=served_model_name(args), api_key=args.api_key,
                            max_queue=args.max_queue, grace_period=args.grace_period,
                            keep_alive_on_engine_failure=args.keep_alive_on_engine_failure)

    # transformers' advisory warnings (about torch-only features) are noise to jspec's users
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    _log_to_stderr()
    describe_models(args)
    progress = not args.no_progress

    sync = join_processes(args, policy_options)

    def build(should_stop=None):
        from jspec.llm import build_engine

        engine = build_engine(args.target, args.draft, tokenizer=args.tokenizer,
                              policy=args.policy,
                              num_speculative_tokens=args.num_speculative_tokens,
                              dtype=args.dtype, policy_options=policy_options, warmup=False,
                              **engine_kwargs(args))
        if args.policy_state and os.path.exists(args.policy_state):
            engine.load_policy_state(args.policy_state)
        if sync is not None:
            engine.set_step_sync(sync)
        if not args.no_warmup:
            warmup(engine, progress and (sync is None or sync.leader), should_stop=should_stop)
        return engine

    if sync is not None and not sync.leader:
        # a follower serves nothing: it runs the leader's steps on its devices until it stops
        steps = distributed.follow(build())
        print(f"process {args.process_id}: the leader stopped after {steps} steps",
              file=sys.stderr)
        return 0

    def load_engine(cancelled):
        from jspec.async_engine import AsyncLLMEngine

        return AsyncLLMEngine(build(cancelled.is_set))

    server = Server(options, load_engine, host=args.host, port=args.port)
    try:
        engine = asyncio.run(server.run(handle_signals=True))
    finally:
        if sync is not None:
            sync.stop()
    if server.failure is not None:
        if args.policy_state:  # a failed step may have left the policy half updated
            print(f"not saving the policy state to {args.policy_state}: the engine failed",
                  file=sys.stderr)
    elif engine is not None and args.policy_state:
        engine.save_policy_state(args.policy_state)
    return server.exit_code
