"""The compile warm-up with progress: every shape bucket of an engine compiled, or loaded from
XLA's persistent compilation cache, before the first request; a tqdm bar on stderr while it
runs and one line at the end saying how many buckets were compiled and how many loaded.

Used by the command-line entry points (`jspec generate`, `jspec serve`) and by ``LLM``. The
buckets come from the engine's configuration alone (``ModelRunner.bucket_plan``), never from the
requests it will serve, so a second run of the same models and options loads every one of them.
"""

from __future__ import annotations

import sys
import time
from typing import Callable


class WarmupCancelled(Exception):
    """Raised between two shape buckets when a warm-up is asked to stop (a server told to shut
    down while it compiles: one XLA compilation cannot be interrupted, but the next need not
    start)."""


def warmup(engine, progress: bool, should_stop: Callable[[], bool] | None = None,
           max_rows: int | None = None) -> None:
    """Compile every shape bucket of an LLMEngine (with ``max_rows``, those that steps of at
    most that many sequences reach: ``LLMEngine.warmup``), with a progress bar and a closing line
    on stderr when ``progress``; then give a cost-model policy its step-time profile
    (``LLMEngine.ensure_profile``)."""
    from tqdm.auto import tqdm

    from jspec.runner import cache_loads, compile_events

    start = time.perf_counter()
    compiled, loaded = compile_events(), cache_loads()
    bar = tqdm(desc="compile", unit="bucket", disable=not progress, leave=False)

    def step(done: int, total: int) -> None:
        bar.total = total
        bar.update(done - bar.n)
        if should_stop is not None and done < total and should_stop():
            raise WarmupCancelled(f"warm-up stopped after {done} of {total} shape buckets")

    try:
        n = engine.warmup(step, max_rows)
    finally:
        bar.close()
    if progress:
        loaded = cache_loads() - loaded
        compiled = compile_events() - compiled - loaded  # JAX counts a load as a compile event
        # the rest were compiled already in this process, by an engine of the same shapes
        held = max(0, n - compiled - loaded)
        print(f"{n} shape buckets ready in {time.perf_counter() - start:.1f} s: {compiled} "
              f"compiled, {loaded} loaded from the compilation cache"
              + (f", {held} compiled before in this process" if held else ""), file=sys.stderr)
    engine.ensure_profile()  # a cost-model policy's profile, timed on compiled steps
