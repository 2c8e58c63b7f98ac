"""The kernel's limit on a process's memory maps, and keeping compiled executables under it.

XLA:CPU loads every kernel of an executable as its own object with three mappings (code,
read-only data, data): one engine bucket holds ~180 mappings with stacked layers and ~250 with
per-layer ones on the built-in pair. Linux caps a process at ``vm.max_map_count`` mappings
(65530 by default); the compilation that crosses it does not fail cleanly: XLA crashes the
process (a segmentation fault or abort while serializing the executable for the persistent
cache). A process that builds many engines (a notebook, a benchmark comparing policies, the
test suite) gets there. So before each compilation the runner calls ``make_room``: near the
limit it drops what nobody uses (executables of dropped engines, JAX's own jit caches), and if
the engines still alive hold too many it raises an error that says so.
"""

from __future__ import annotations

import gc
import sys
from typing import Callable

import jax

LIMIT_FILE = "/proc/sys/vm/max_map_count"
MAPS_FILE = "/proc/self/maps"


class MemoryMapLimitError(RuntimeError):
    """The executables alive in this process hold nearly all the memory maps Linux allows."""


def map_limit() -> int | None:
    """``vm.max_map_count``, or None where the system has no such limit to read."""
    try:
        with open(LIMIT_FILE) as f:
            return int(f.read())
    except (OSError, ValueError):
        return None


def map_count() -> int:
    """The memory mappings this process holds now."""
    with open(MAPS_FILE, "rb") as f:
        return sum(1 for _ in f)


def thresholds(limit: int) -> tuple[int, int]:
    """(relieve, refuse): above the first, free what nobody uses before compiling; above the
    second after that, refuse to compile. The margin below ``refuse`` is room for the
    compilation itself (one large bucket of a per-layer model adds a few thousand)."""
    return limit - max(limit // 8, 4096), limit - max(limit // 16, 2048)


# The mappings held right after the last release: until they grow by a share of the limit
# again, engines that stay alive hold them and another release would free nothing.
_after_release = [0]


def make_room(drop_unused: Callable[[], int]) -> None:
    """Before a compilation: near the limit, ``drop_unused()`` (the caller releases the
    executables it caches for engines that may be gone and returns how many), clear JAX's jit
    caches and collect garbage; raise ``MemoryMapLimitError`` if that left too little room."""
    limit = map_limit()
    if limit is None:
        return
    relieve, refuse = thresholds(limit)
    before = map_count()
    if before < relieve or (before < refuse and before < _after_release[0] + limit // 32):
        return
    dropped = drop_unused()
    jax.clear_caches()
    gc.collect()
    after = _after_release[0] = map_count()
    print(f"jspec: {before} memory maps of the {limit} this process may hold; released "
          f"{dropped} cached executables and JAX's jit caches: {after} now", file=sys.stderr)
    if after >= refuse:
        raise MemoryMapLimitError(
            f"this process holds {after} memory maps, near Linux's limit of {limit} "
            f"(vm.max_map_count), and each compiled executable adds hundreds: the engines alive "
            f"in it hold too many executables to compile another safely. Drop the engines you "
            f"no longer use (del llm; gc.collect()), run fewer engines per process, hold targets' "
            f"layers stacked (JSPEC_LAYER_BUFFERS=stacked: their mappings do not grow with the "
            f"layer count), or raise the limit (sysctl -w vm.max_map_count=262144).")
