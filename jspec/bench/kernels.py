"""`jspec bench kernels`: the Pallas kernels against their references and the bandwidth roofline.

Attention: for every (batch B, new tokens per sequence q, context length L) point, one layer of
ragged paged attention (Qwen2.5-0.5B attention shape by default: 14 query heads, 2 kv heads, head
dim 64, block 16) is timed for each implementation, per call, in a jitted loop of calls over the
layers of a small pool as a forward makes them (``seconds_per_call``). The bytes one call must read
from the KV pool (B x L x kv_heads x head_dim x 2 (K and V) x itemsize) divided by its time give
an effective bandwidth, printed as a fraction of the machine's copy bandwidth measured in the
same run (``x + 1`` over a large array in a jitted loop: read + write bytes / time). Decode and
verification at long contexts should be bound by that read, so it is the roofline; the goal is
>= 60% of it (``jspec.validate_stages.ATTENTION_GOAL``).

Migration: one launch moving N blocks of every layer (K and V) against a plain device copy of
the same bytes (``pool[:, dst] = pool[:, src]`` via XLA gather/scatter is the reference; the
roofline is the copy bandwidth above; the goal is >= 70%).

Implementations timed: ``reference`` always; ``pallas`` for each kernel that the backend
choice (``auto``, judged at this benchmark's shapes) runs with Pallas (a GPU);
``interpret`` only with ``--interpret`` (the interpreter runs the kernel as ordinary XLA ops, so
its times say nothing about the kernel on a GPU: it is there to check the harness on CPU).

Every timed implementation is also checked on the point it is timed on: attention against the
per-token jnp oracle (``ragged_paged_attention_reference``; ``max_abs_err`` in the results), a
migration against the same copy done by numpy on the host (``exact``: must be bit-identical).
``measure`` returns the results that ``run`` prints and writes as JSON.

``--tune`` (a GPU only): for each kernel, times a small grid of its settings (Triton's warps
and pipeline stages; attention's pages per loop iteration and the grid size its context split
aims at: ``TUNE_GRID``) at a few engine-like points, checks every result (attention against
the oracle, migration bit for bit), and records the fastest for this GPU model
(``jspec.kernels.gpu_lowering.record``) in the file the engine's kernels read their settings
from. A setting's score is the geometric mean over the points of its time over the defaults'
time, so each point counts alike.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import math
from typing import NamedTuple

ATTN_SHAPE = dict(num_heads=14, kv_heads=2, head_dim=64)
# what --tune tries: each kernel's defaults first, then every combination of these
TUNE_GRID = {
    "attention": {"num_warps": (4, 8), "num_stages": (2, 3), "pages_per_iter": (4, 8, 16),
                  "programs": (128, 256, 512)},
    "migration": {"num_warps": (2, 4, 8), "num_stages": (1, 2, 3)},
}
# (batch, new tokens per sequence) of --tune's attention points, at the longest --contexts:
# a lone decode (where the context split matters), a batch of decodes, γ = 4 verifications
TUNE_POINTS = ((1, 1), (32, 1), (32, 5))
TUNE_TOL = {"bfloat16": 2e-2, "float32": 1e-4}  # attention's max |error| against the oracle
# Attention is timed as a forward runs it: LOOP_CALLS calls in one jitted loop over the layers
# of a LOOP_LAYERS-layer pool. Timed alone, one call on a GPU measures its dispatch (tens of
# microseconds, more than a decode layer's kernel takes).
LOOP_LAYERS, LOOP_CALLS = 4, 8


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 8, 32], metavar="B")
    parser.add_argument("--query-lens", nargs="+", type=int, default=[1, 4, 8], metavar="Q",
                        help="new tokens per sequence (1 decode, 2..8 verification)")
    parser.add_argument("--contexts", nargs="+", type=int, default=[512, 2048, 8192],
                        metavar="L", help="context lengths (tokens in the KV cache)")
    parser.add_argument("--prefill", type=int, default=512,
                        help="also time one prefill chunk of this many tokens per context "
                             "(0: skip)")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--migrate-blocks", nargs="+", type=int, default=[64, 512],
                        metavar="N", help="blocks per migration launch")
    parser.add_argument("--layers", type=int, default=24, help="layers in the migrated pool")
    parser.add_argument("--repeats", type=int, default=5, help="timed calls per point (best)")
    parser.add_argument("--interpret", action="store_true",
                        help="also time the kernels in Pallas interpret mode (harness check)")
    parser.add_argument("--small", action="store_true", help="tiny grid: a smoke run")
    parser.add_argument("--json", metavar="FILE", help="write the results as JSON")
    parser.add_argument("--tune", action="store_true",
                        help="on a GPU: time a small grid of each kernel's settings (Triton "
                             "warps and stages, attention's pages per iteration and split "
                             "target) and record the fastest for this GPU model in the tuning "
                             "file, which the engine's kernels then use")
    parser.add_argument("--tuning-file", metavar="FILE",
                        help="where --tune records (default: $JSPEC_KERNEL_TUNING, else "
                             "~/.cache/jspec/kernel_tuning.json, which is where the engine "
                             "reads; another file is read only through $JSPEC_KERNEL_TUNING)")


def _best(fn, repeats: int) -> float:
    """Fastest of ``repeats`` calls of ``fn`` (waited on) after a warm-up call."""
    import jax

    from jspec.bench.model_step import _best_seconds

    jax.block_until_ready(fn())  # compile, warm
    return _best_seconds(lambda: jax.block_until_ready(fn()), repeats)


def copy_bandwidth(num_bytes: int, repeats: int) -> float:
    """Device copy bandwidth (bytes read + written per second) of ``x + 1``, LOOP_CALLS times
    in one jitted loop."""
    import jax
    import jax.numpy as jnp

    n = max(1, num_bytes // 4)
    x = jax.jit(lambda: jnp.ones((n,), jnp.float32))()
    f = jax.jit(lambda a: jax.lax.fori_loop(0, LOOP_CALLS, lambda i, b: b + 1, a))
    return LOOP_CALLS * 2 * 4 * n / _best(lambda: f(x), repeats)


def seconds_per_call(call, qa, k, v, md, repeats: int) -> float:
    """Seconds of one ``call(q, k, v, layer, md)``, timed as LOOP_CALLS calls in one jitted
    loop over the layers of a LOOP_LAYERS-layer pool (a traced layer index, as in a forward)."""
    import jax
    import jax.numpy as jnp

    def run(qa, k, v, md):
        def body(i, acc):
            return acc + call(qa, k, v, i % LOOP_LAYERS, md).astype(jnp.float32)
        return jax.lax.fori_loop(0, LOOP_CALLS, body, jnp.zeros(qa.shape, jnp.float32))
    loop = jax.jit(run)
    return _best(lambda: loop(qa, k, v, md), repeats) / LOOP_CALLS


class AttentionPoint(NamedTuple):
    """One attention row of the benchmark: ``batch`` sequences each with ``context`` tokens of
    which the last ``q_len`` are new."""

    batch: int
    q_len: int
    context: int


def attention_case(point: AttentionPoint, block_size: int, dtype, seed: int = 0,
                   layers: int = LOOP_LAYERS):
    """Inputs for ``layers`` layers at ``point``: B sequences each with ``context`` tokens of
    which the last ``q_len`` are new (their K/V already in the pool), shuffled physical pages;
    ``kv_bytes`` is what one layer's attention reads."""
    import jax.numpy as jnp
    import numpy as np

    from jspec.kernels.ragged_paged_attention import AttentionMetadata

    batch, q_len, context = point
    rng = np.random.default_rng(seed)
    h, kvh, d = ATTN_SHAPE["num_heads"], ATTN_SHAPE["kv_heads"], ATTN_SHAPE["head_dim"]
    pages = -(-context // block_size)
    num_blocks = batch * pages + 1
    table = (1 + rng.permutation(batch * pages)).reshape(batch, pages).astype(np.int32)
    tokens = batch * q_len
    md = AttentionMetadata(
        positions=jnp.asarray(np.tile(np.arange(context - q_len, context), batch), jnp.int32),
        cu_q_lens=jnp.asarray(np.arange(batch + 1) * q_len, jnp.int32),
        kv_lens=jnp.full((batch,), context, jnp.int32),
        page_table=jnp.asarray(table))
    shape = (layers, num_blocks, block_size, kvh, d)
    q = jnp.asarray(rng.normal(size=(tokens, h, d)), dtype)
    k = jnp.asarray(rng.normal(size=shape), dtype)
    v = jnp.asarray(rng.normal(size=shape), dtype)
    kv_bytes = 2 * batch * context * kvh * d * jnp.dtype(dtype).itemsize
    return q, k, v, md, kv_bytes


def attention_points(args: argparse.Namespace) -> list[AttentionPoint]:
    """Every attention row: the grid, then one prefill per context."""
    points = [AttentionPoint(b, q, c) for c in args.contexts for b in args.batch_sizes
              for q in args.query_lens]
    if args.prefill:
        points += [AttentionPoint(1, min(args.prefill, c), c) for c in args.contexts]
    return points


def bounded_call(fn, sm_scale: float, max_q_len: int):
    """``fn(q, k, v, layer, md)`` bounded as the engine bounds a decode-only step's attention
    (one query tile per sequence: no sequence brings more than ``max_q_len`` tokens)."""
    def call(qa, k, v, layer, md):
        return fn(qa, k, v, layer, md, sm_scale=sm_scale, max_q_len=max_q_len)
    return call


def migration_case(layers: int, blocks: int, block_size: int, dtype, seed: int = 0):
    """Random K and V pools of ``2 * blocks + 1`` blocks and the plan moving blocks
    ``blocks+1 .. 2*blocks`` onto ``1 .. blocks`` (padded to its bucket)."""
    import jax
    import jax.numpy as jnp

    from jspec.kernels.kv_migration import pad_pairs, validate_pairs

    kvh, d = ATTN_SHAPE["kv_heads"], ATTN_SHAPE["head_dim"]
    num_blocks = 2 * blocks + 1
    shape = (layers, num_blocks, block_size, kvh, d)
    pairs = validate_pairs([(blocks + 1 + i, 1 + i) for i in range(blocks)], num_blocks)
    kk, kv = jax.random.split(jax.random.key(seed))
    k = jax.random.normal(kk, shape, jnp.float32).astype(dtype)
    v = jax.random.normal(kv, shape, jnp.float32).astype(dtype)
    return k, v, pairs, jnp.asarray(pad_pairs(pairs, blocks))


def _migration_is_exact(fn, k, v, pairs, padded) -> bool:
    """Whether ``fn`` moves the blocks exactly as numpy does (on copies: ``fn`` donates)."""
    import jax.numpy as jnp
    import numpy as np

    got_k, got_v = fn(jnp.array(k, copy=True), jnp.array(v, copy=True), padded)
    for pool, got in ((k, got_k), (v, got_v)):
        expected = np.array(pool)
        expected[:, pairs[:, 1]] = expected[:, pairs[:, 0]]
        if not np.array_equal(np.asarray(got), expected):
            return False
    return True


def run(args: argparse.Namespace) -> int:
    results = tune(args) if args.tune else measure(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
        print(f"wrote {args.json}")
    return 0


def measure(args: argparse.Namespace) -> dict:
    """Time (and check) every implementation over the grid of ``args``, print the tables and
    return the results (the JSON of ``--json``)."""
    import jax.numpy as jnp

    from jspec.kernels import backend as kb

    _check_grid(args)
    dtype = jnp.dtype(args.dtype)
    resolved, settings = _resolve_backend(args)
    copy_mib = 8 if args.small else 256
    peak = copy_bandwidth(copy_mib << 20, args.repeats)
    print(f"device copy bandwidth: {peak / 1e9:.1f} GB/s (read + write of a {copy_mib} MiB "
          "array)")
    results = {"platform": kb.platform(), "backend": str(resolved), "dtype": args.dtype,
               "settings": settings, "copy_bandwidth_gbps": peak / 1e9, "attention": [],
               "migration": []}
    impls = _implementations(kb.attention_fn, resolved.attention, args.interpret)
    results["attention"] = _measure_attention(args, impls, dtype, peak)
    _print_attention(results["attention"], list(impls))
    impls = _implementations(kb.migration_fn, resolved.migration, args.interpret)
    results["migration"] = _measure_migration(args, impls, dtype, peak)
    _print_migration(results["migration"], list(impls), args.layers)
    return results


def _check_grid(args: argparse.Namespace) -> None:
    """``--small``'s grid in place of the one asked for; ValueError on a grid that cannot run."""
    if args.small:
        args.batch_sizes, args.query_lens, args.contexts = [1, 2], [1, 4], [64]
        args.prefill, args.migrate_blocks, args.layers, args.repeats = 32, [4], 2, 1
    for name in ("batch_sizes", "query_lens", "contexts", "migrate_blocks"):
        if any(v < 1 for v in getattr(args, name)):
            raise ValueError(f"--{name.replace('_', '-')} must be positive integers")
    if any(q > c for q in args.query_lens for c in args.contexts):
        raise ValueError("every --query-lens value must be <= every --contexts value")


def _resolve_backend(args: argparse.Namespace):
    """The kernel backend ``auto`` picks at this benchmark's shapes and the settings its GPU
    kernels run with (tuned for this GPU model by --tune, or the defaults), both printed."""
    import jax

    from jspec.kernels import backend as kb
    from jspec.kernels import gpu_lowering
    from jspec.kernels.gpu_lowering import KernelShape

    resolved = kb.select("auto", [KernelShape(**ATTN_SHAPE, block_size=args.block_size,
                                              num_layers=args.layers, dtype=args.dtype)])
    print(f"jspec bench kernels: platform {kb.platform()}, kernel backend auto -> {resolved}, "
          f"jax {jax.__version__}, {args.dtype}")
    if resolved.attention != "pallas":
        print("  (no GPU kernel here: " + ("the reference and the interpreted kernel (not a "
                                            "performance number) are timed)" if args.interpret
                                            else "only the reference is timed)"))
    settings = {kernel: gpu_lowering.settings(kernel) for kernel in gpu_lowering.KERNELS
                if getattr(resolved, kernel) == "pallas"}
    for kernel, values in settings.items():
        print(f"  {kernel} settings: {json.dumps(values, sort_keys=True)}")
    return resolved, settings


def _implementations(make, resolved: str, interpret: bool) -> dict:
    """The implementations of one kernel to time (``make``: ``backend.attention_fn`` or
    ``backend.migration_fn``): the reference, the Pallas kernel where ``auto`` resolved to it,
    the interpreted kernel with --interpret."""
    impls = {"reference": make("reference")}
    if resolved == "pallas":
        impls["pallas"] = make("pallas")
    if interpret:
        impls["interpret"] = make("interpret")
    return impls


def _measure_attention(args: argparse.Namespace, impls: dict, dtype, peak: float) -> list[dict]:
    """A row per attention point: each implementation's time, bandwidth and share of ``peak``,
    and its max |error| against the per-token oracle."""
    import jax
    import numpy as np
    from tqdm.auto import tqdm

    from jspec.kernels.ragged_paged_attention import ragged_paged_attention_reference

    scale = ATTN_SHAPE["head_dim"] ** -0.5
    oracle = jax.jit(lambda qa, k, v, md: ragged_paged_attention_reference(qa, k, v, 0, md,
                                                                           sm_scale=scale))
    rows = []
    for point in tqdm(attention_points(args), desc="attention", leave=False):
        qa, k, v, md, kv_bytes = attention_case(point, args.block_size, dtype)
        expected = np.asarray(oracle(qa, k, v, md), np.float32)
        row = {"batch": point.batch, "q_len": point.q_len, "context": point.context,
               "kv_bytes": kv_bytes}
        for name, fn in impls.items():
            call = bounded_call(fn, scale, point.q_len)
            seconds = seconds_per_call(call, qa, k, v, md, args.repeats)
            err = np.abs(np.asarray(jax.jit(call)(qa, k, v, 0, md), np.float32)
                         - expected).max()
            row[name] = {"ms": seconds * 1e3, "gbps": kv_bytes / seconds / 1e9,
                         "roofline": kv_bytes / seconds / peak, "max_abs_err": float(err)}
        rows.append(row)
        del qa, k, v, expected
    return rows


def _print_attention(rows: list[dict], names: list[str]) -> None:
    print("\nattention, one layer (ms | GB/s of KV read | fraction of copy bandwidth | max "
          "|error| against the per-token oracle)")
    print(f"  {'B':>4} {'q':>4} {'ctx':>6}" + "".join(f" {n:>38}" for n in names))
    for row in rows:
        cells = "".join(f" {row[n]['ms']:>9.3f} |{row[n]['gbps']:>7.1f} |{row[n]['roofline']:>6.0%}"
                        f" |{row[n]['max_abs_err']:>8.1e}" for n in names)
        print(f"  {row['batch']:>4} {row['q_len']:>4} {row['context']:>6}{cells}")


def _measure_migration(args: argparse.Namespace, impls: dict, dtype, peak: float) -> list[dict]:
    """A row per --migrate-blocks: each implementation's time, bandwidth and share of
    ``peak``, and whether it moved the blocks exactly as numpy does."""
    import jax.numpy as jnp

    kvh, d = ATTN_SHAPE["kv_heads"], ATTN_SHAPE["head_dim"]
    rows = []
    for n in args.migrate_blocks:
        k0, v0, plan, pairs = migration_case(args.layers, n, args.block_size, dtype)
        shape = k0.shape
        moved = 2 * 2 * args.layers * n * args.block_size * kvh * d * dtype.itemsize  # r+w, K+V
        row = {"blocks": n, "bytes_moved": moved}
        for name, fn in impls.items():
            exact = _migration_is_exact(fn, k0, v0, plan, pairs)
            state = {"k": jnp.zeros(shape, dtype), "v": jnp.ones(shape, dtype)}

            def call(fn=fn, state=state):
                state["k"], state["v"] = fn(state["k"], state["v"], pairs)
                return state["k"]

            seconds = _best(call, args.repeats)
            row[name] = {"ms": seconds * 1e3, "gbps": moved / seconds / 1e9,
                         "roofline": moved / seconds / peak, "exact": exact}
        rows.append(row)
        del k0, v0
    return rows


def _print_migration(rows: list[dict], names: list[str], layers: int) -> None:
    print(f"\nKV migration, {layers} layers, K and V (ms | GB/s read+write | fraction of "
          "copy bandwidth | result bit-identical to a numpy copy)")
    print(f"  {'blocks':>6}" + "".join(f" {n:>34}" for n in names))
    for row in rows:
        cells = "".join(f" {row[n]['ms']:>9.3f} |{row[n]['gbps']:>7.1f} |{row[n]['roofline']:>6.0%}"
                        f" |{'yes' if row[n]['exact'] else 'NO':>4}" for n in names)
        print(f"  {row['blocks']:>6}{cells}")


# ----------------------------------------------------------------------------- --tune
def candidates(kernel: str, grid: dict | None = None) -> list[dict]:
    """``kernel``'s settings to try: its defaults, then every combination of ``grid`` (default
    ``TUNE_GRID[kernel]``) over them."""
    from jspec.kernels import gpu_lowering

    grid = TUNE_GRID[kernel] if grid is None else grid
    default = dict(gpu_lowering.DEFAULTS[kernel])
    out = [default]
    for combo in itertools.product(*grid.values()):
        values = {**default, **dict(zip(grid, combo))}
        if values not in out:
            out.append(values)
    return out


def pick(settings: list[dict], measure) -> tuple[dict, list[dict]]:
    """The fastest of ``settings`` (the first is the baseline) and a row per setting.

    ``measure(values)`` returns the seconds of each point, or raises when the setting does not
    compile, run or give the right result there (the row then says why). Score: the geometric
    mean over the points of the time over the baseline's; the baseline must succeed."""
    rows = []
    for values in settings:
        try:
            seconds = [float(t) for t in measure(values)]
            rows.append({"settings": values, "seconds": seconds, "error": None})
        except Exception as e:  # noqa: BLE001 - a setting that fails is reported, not fatal
            rows.append({"settings": values, "seconds": None,
                         "error": f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200]}"
                         if str(e).strip() else type(e).__name__})
    base = rows[0]["seconds"]
    if base is None:
        raise RuntimeError(f"the default settings {rows[0]['settings']} fail: {rows[0]['error']}")
    for row in rows:
        if row["seconds"] is not None:
            row["score"] = math.exp(sum(math.log(t / b) for t, b in zip(row["seconds"], base))
                                    / len(base))
    best = min((r for r in rows if r["seconds"] is not None), key=lambda r: r["score"])
    return best["settings"], rows


def _attention_measure(args, dtype, interpret: bool):
    """``measure`` for attention: each point timed and checked against the per-token oracle."""
    import jax
    import numpy as np

    from jspec.kernels import gpu_lowering
    from jspec.kernels.ragged_paged_attention import ragged_paged_attention_reference

    context = max(args.contexts)
    points = ([(1, 1), (2, 4)] if args.small else TUNE_POINTS)
    scale = ATTN_SHAPE["head_dim"] ** -0.5
    cases, expected = [], []
    for b, q in points:
        qa, k, v, md, _ = attention_case(AttentionPoint(b, min(q, context), context),
                                         args.block_size, dtype)
        cases.append((qa, k, v, md, min(q, context)))
        expected.append(np.asarray(ragged_paged_attention_reference(
            qa, k, v, 0, md, sm_scale=scale), np.float32))
    tol = TUNE_TOL[args.dtype]

    def measure(values):
        kernel = gpu_lowering.attention(values)
        seconds = []
        for (qa, k, v, md, q), ref in zip(cases, expected):
            call = bounded_call(functools.partial(kernel, interpret=interpret), scale, q)
            err = float(np.abs(np.asarray(jax.jit(call)(qa, k, v, 0, md), np.float32)
                               - ref).max())
            if not err <= tol:
                raise ValueError(f"max |error| {err:.2e} against the oracle (B={len(md.kv_lens)}"
                                 f", q={q}) exceeds {tol:.0e}")
            seconds.append(seconds_per_call(call, qa, k, v, md, args.repeats))
        return seconds

    return measure, [f"B={b} q={q} ctx={context}" for b, q in points]


def _migration_measure(args, dtype, interpret: bool):
    """``measure`` for migration: one launch of the largest --migrate-blocks, checked bit for
    bit against a numpy copy."""
    import jax
    import jax.numpy as jnp

    from jspec.kernels import gpu_lowering, kv_migration

    blocks = max(args.migrate_blocks)
    k0, v0, plan, pairs = migration_case(args.layers, blocks, args.block_size, dtype)

    def measure(values):
        if interpret:
            fn = jax.jit(functools.partial(
                kv_migration.migrate_blocks_kernel, interpret=True,
                compiler_params=gpu_lowering.compiler_params("migration", values)),
                donate_argnums=(0, 1))
        else:
            fn = gpu_lowering.migration(values)
        if not _migration_is_exact(fn, k0, v0, plan, pairs):
            raise ValueError("the moved blocks differ from a numpy copy")
        state = {"k": jnp.zeros(k0.shape, dtype), "v": jnp.ones(v0.shape, dtype)}

        def call():
            state["k"], state["v"] = fn(state["k"], state["v"], pairs)
            return state["k"]

        return [_best(call, args.repeats)]

    return measure, [f"{blocks} blocks x {args.layers} layers"]


def tune(args: argparse.Namespace, device: str | None = None, interpret: bool = False,
         grid: dict | None = None) -> dict:
    """``--tune``: pick and record each kernel's settings for this GPU model; returns what it
    measured. ``device``, ``interpret`` and ``grid`` (per kernel) are for checking this
    harness on CPU: the kernels interpreted, timings meaningless, the record under a made-up
    GPU model."""
    import jax
    import jax.numpy as jnp

    from jspec.kernels import backend as kb
    from jspec.kernels import gpu_lowering

    if not interpret:
        plat = kb.platform()
        if plat != "gpu":
            raise ValueError(f"--tune needs a GPU: it times the Pallas kernels as Triton compiles "
                             f"them for the GPU whose settings it records, and JAX runs on "
                             f"{plat.upper()} here")
        device = gpu_lowering.device_name()
    if device is None:
        raise ValueError("--tune: no GPU model to record the settings under")
    if args.small:
        args.contexts, args.migrate_blocks, args.layers, args.repeats = [64], [4], 2, 1
    dtype = jnp.dtype(args.dtype)
    path = gpu_lowering.tuning_path() if args.tuning_file is None else args.tuning_file
    results = {"device": device, "dtype": args.dtype, "jax": jax.__version__,
               "tuning_file": str(path)}
    makers = {"attention": _attention_measure, "migration": _migration_measure}
    print(f"jspec bench kernels --tune: {device}, jax {jax.__version__}, {args.dtype}")
    for kernel in gpu_lowering.KERNELS:
        measure, points = makers[kernel](args, dtype, interpret)
        settings = candidates(kernel, None if grid is None else grid[kernel])
        best, rows = pick(settings, measure)
        print(f"\n{kernel}: {len(settings)} settings at {'; '.join(points)} (ms per point, "
              "score: geometric mean of time over the defaults')")
        for row in sorted(rows, key=lambda r: r.get("score", math.inf)):
            cells = ("  ".join(f"{t * 1e3:8.3f}" for t in row["seconds"])
                     + f"  score {row['score']:.3f}" if row["seconds"] is not None
                     else f"failed: {row['error']}")
            print(f"  {json.dumps(row['settings'], sort_keys=True)}  {cells}")
        chosen = next(r for r in rows if r["settings"] == best)
        gpu_lowering.record(device, kernel, best, path, points=points,
                            seconds=chosen["seconds"], default_seconds=rows[0]["seconds"],
                            dtype=args.dtype, jax=jax.__version__)
        print(f"  best: {json.dumps(best, sort_keys=True)} ({chosen['score']:.3f} of the "
              f"defaults' time), recorded in {path}")
        results[kernel] = {"best": best, "points": points, "rows": rows}
    gpu_lowering.settings.cache_clear()  # this process now runs the recorded settings too
    return results
