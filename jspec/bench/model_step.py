"""`jspec bench model-step`: time of one jitted paged forward over batch size x tokens per sequence.

The model is Qwen2.5-0.5B-shaped with random weights (no download), plus a draft shape about ten
times cheaper, so the numbers say what a speculative step costs on this machine: decode at
batch 1 should be bound by reading the weights (time nearly flat in tokens per sequence, which is
what makes verifying several draft tokens cheap), and large batches by compute (time near-linear
in batch x tokens). The machine's memory bandwidth is measured in the same run, so the B=1 rows
can be read as a fraction of it.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time

# Qwen2.5-0.5B and the draft shape, and their random weights, shared with the synthetic
# serving mode
from jspec.synthetic import QWEN25_05B as TARGET_SHAPE
from jspec.synthetic import QWEN25_05B_DRAFT as DRAFT_SHAPE
from jspec.synthetic import random_params

# --small: seconds-long smoke run with the same code path.
SMALL_TARGET = dict(TARGET_SHAPE, vocab_size=512, hidden_size=64, num_layers=2, num_heads=4,
                    num_kv_heads=2, head_dim=16, intermediate_size=128)
SMALL_DRAFT = dict(SMALL_TARGET, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1)

DTYPES = {"bf16": "bfloat16", "fp32": "float32"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dtypes", nargs="+", choices=sorted(DTYPES), default=["bf16", "fp32"],
                        help="parameter and KV dtypes to time (default: both)")
    parser.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 4, 16, 64],
                        metavar="B", help="sequences per step")
    parser.add_argument("--query-lens", nargs="+", type=int, default=[1, 2, 4, 8], metavar="Q",
                        help="new tokens per sequence (1 = decode, >1 = verification window)")
    parser.add_argument("--context", type=int, default=256,
                        help="tokens already in each sequence's KV cache")
    parser.add_argument("--block-size", type=int, default=16, help="KV block size")
    parser.add_argument("--repeats", type=int, default=5, help="timed calls per point (best)")
    parser.add_argument("--models", nargs="+", choices=["target", "draft"],
                        default=["target", "draft"], help="which shapes to time")
    parser.add_argument("--bandwidth-mib", type=int, default=1024,
                        help="array size for the memory-bandwidth measurement")
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, metavar="N",
                        help="split the target over N devices as the engine does "
                             "(models/sharding.py; the draft is replicated) and report the "
                             "bytes each device holds (on CPU: N host devices)")
    parser.add_argument("--batch-invariant", action="store_true",
                        help="also time the target in batch-invariant numerics (the engine's "
                             "deterministic mode) at every point, right after the default "
                             "numerics, and print the ratio: what the mode costs")
    parser.add_argument("--small", action="store_true",
                        help="tiny shapes and grid: a quick smoke run of the same code path")


def _best_seconds(fn, repeats: int) -> float:
    """Fastest of ``repeats`` calls: on a small shared machine other processes only ever add
    time, so the minimum is the least noisy estimate of what the step itself costs."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def measure_bandwidth(num_bytes: int, repeats: int) -> float:
    """Read bandwidth in bytes/s: a jitted sum over a float32 array, the same access pattern as
    streaming weights (read once, nothing written back)."""
    import jax
    import jax.numpy as jnp

    n = max(1, num_bytes // 4)
    x = jax.jit(lambda: jnp.ones((n,), jnp.float32))()  # materialized, pages touched
    reduce = jax.jit(lambda a: jnp.sum(a))
    reduce(x).block_until_ready()
    seconds = _best_seconds(lambda: reduce(x).block_until_ready(), max(3, repeats))
    del x
    return 4 * n / seconds


def weight_bytes_per_step(params: dict) -> int:
    """Bytes of weights a step must read: everything except the embedding table, of which only
    the looked-up rows are touched (a tied model keeps a separate [hidden, vocab] head copy)."""
    from jspec.models.params import params_nbytes

    embed = params["embed"]
    return params_nbytes(params) - embed.size * embed.dtype.itemsize


def make_batch(batch: int, query_len: int, context: int, block_size: int):
    """B sequences of ``context`` cached tokens, each bringing ``query_len`` new ones; logits at
    every new token. Rows are padded to >= 2: XLA's one-row bf16 matmul on CPU is several times
    slower than a two-row one, so the runtime never issues one."""
    import jax.numpy as jnp
    import numpy as np

    from jspec.models.transformer import ModelInput
    from jspec.kernels.ragged_paged_attention import AttentionMetadata

    tokens = batch * query_len
    padded = max(2, tokens)
    pages = -(-(context + query_len) // block_size)
    page_table = 1 + np.arange(batch * pages, dtype=np.int32).reshape(batch, pages)
    positions = np.zeros(padded, np.int32)
    positions[:tokens] = np.tile(np.arange(context, context + query_len), batch)
    md = AttentionMetadata(
        positions=jnp.asarray(positions),
        cu_q_lens=jnp.asarray(np.arange(batch + 1, dtype=np.int32) * query_len),
        kv_lens=jnp.full((batch,), context + query_len, jnp.int32),
        page_table=jnp.asarray(page_table),
    )
    rng = np.random.default_rng(0)
    input_ids = jnp.asarray(rng.integers(0, 100, padded), jnp.int32)
    logits_indices = jnp.arange(padded, dtype=jnp.int32)
    return ModelInput(input_ids, md, logits_indices), 1 + batch * pages


@dataclasses.dataclass(frozen=True)
class ForwardOptions:
    """How ``ForwardTimer`` runs its forward, beyond the model and the shapes."""

    # a tensor-parallel mesh (jspec.models.sharding.make_mesh); the model is split over it
    # (``shard``, the target's case) or replicated on it (a draft's)
    mesh: object = None
    shard: bool = True
    # the engine's deterministic numerics (with the jnp attention)
    batch_invariant: bool = False
    # the bound on new tokens per sequence that the engine gives a decode-only step's attention
    max_q_len: int | None = None


class ForwardTimer:
    """Times one model's jitted paged forward on ``make_batch`` shapes: a fresh KV pool per
    shape, a warm-up call (compilation excluded), then the fastest of ``repeats`` calls. Shared
    by this benchmark, `jspec bench pair` and `jspec profile`."""

    def __init__(self, cfg, params, kv_dtype, block_size: int, repeats: int,
                 options: ForwardOptions = ForwardOptions()):
        import functools

        import jax

        from jspec.models import sharding
        from jspec.models.transformer import forward
        from jspec.kernels.ragged_paged_attention import ragged_paged_attention_tiled

        mesh, shard = options.mesh, options.shard
        if mesh is not None:
            params = (sharding.shard_params(params, cfg, mesh) if shard
                      else sharding.replicate(params, mesh))
        self.cfg, self.params, self.kv_dtype = cfg, params, kv_dtype
        self.block_size, self.repeats = block_size, repeats
        self.mesh = mesh
        self.kv_spec = sharding.KV_SPEC if shard else sharding.REPLICATED
        extra, attention = {}, {}
        if options.batch_invariant:
            extra["batch_invariant"] = attention["batch_invariant"] = True
        if options.max_q_len is not None:
            attention["max_q_len"] = options.max_q_len
        if attention:
            extra["attention_fn"] = functools.partial(ragged_paged_attention_tiled, **attention)
        self.step = jax.jit(functools.partial(forward, cfg=cfg,
                                              mesh=mesh if shard else None, **extra),
                            donate_argnames=("kv",))
        self.kv_bytes_per_device = 0

    def __call__(self, batch_size: int, query_len: int, context: int) -> float:
        from jax.sharding import NamedSharding

        from jspec.models import sharding
        from jspec.models.transformer import KVCache

        batch, num_blocks = make_batch(batch_size, query_len, context, self.block_size)
        where = None if self.mesh is None else NamedSharding(self.mesh, self.kv_spec)
        kv = KVCache.create(self.cfg, num_blocks, self.block_size, self.kv_dtype, where)
        if self.mesh is not None:
            batch = sharding.replicate(batch, self.mesh)
        self.kv_bytes_per_device = max(self.kv_bytes_per_device, sharding.bytes_per_device(kv))
        state = {"kv": kv}

        def call():
            logits, state["kv"] = self.step(self.params, state["kv"], batch)
            logits.block_until_ready()

        call()  # compile and warm up
        return _best_seconds(call, self.repeats)


def time_grid(cfg, params, dtype, args, mesh=None, shard: bool = True):
    """Fastest seconds per step for every (B, q) of the grid, and the timer (its params, on
    the mesh if one is given, and the largest KV pool it made)."""
    timer = ForwardTimer(cfg, params, dtype, args.block_size, args.repeats,
                         ForwardOptions(mesh=mesh, shard=shard))
    return {(b, q): timer(b, q, args.context)
            for b in args.batch_sizes for q in args.query_lens}, timer


def time_invariance_cost(cfg, params, dtype, args, mesh=None) -> dict:
    """(batch-invariant / default) forward time for every (B, q), each pair timed back to
    back so the machine's drift cancels; both attend as the engine's decode-only steps do,
    told that no sequence brings more than q tokens."""
    ratios = {}
    for q in args.query_lens:
        plain, invariant = (ForwardTimer(cfg, params, dtype, args.block_size, args.repeats,
                                         ForwardOptions(mesh=mesh, batch_invariant=inv,
                                                        max_q_len=q))
                            for inv in (False, True))
        for b in args.batch_sizes:
            ratios[b, q] = invariant(b, q, args.context) / plain(b, q, args.context)
    return ratios


def _format_table(results, args, unit: str = "ms") -> list[str]:
    """A (B, q) grid of seconds (shown in ms) or of ratios (``unit`` "x")."""
    scale = 1e3 if unit == "ms" else 1.0
    lines = ["  B \\ q " + "".join(f"{q:>11d}" for q in args.query_lens)]
    for b in args.batch_sizes:
        lines.append(f"  {b:>6d}" + "".join(f"{results[b, q] * scale:>11.2f}"
                                           for q in args.query_lens))
    return lines


def run(args: argparse.Namespace) -> int:
    measure(args)
    return 0


def measure(args: argparse.Namespace) -> dict:
    """Time the grid of ``args`` for every dtype and model, print the tables, and return what
    was measured: ``{"bandwidth_start", "bandwidth_end"}`` (bytes/s) and ``"runs"``, one per
    (dtype, model): ``{"dtype", "model", "config", "weight_bytes", "seconds": {(B, q): s}}``."""
    configs = _model_configs(args)

    import jax

    from jspec.models import sharding

    mesh = sharding.make_mesh(args.tensor_parallel_size)
    if mesh is not None:
        sharding.check_shardable(configs["target"], mesh.size)
    _print_setup(args, configs)
    bandwidth = measure_bandwidth(args.bandwidth_mib << 20, args.repeats)
    print(f"memory read bandwidth (jnp.sum over {args.bandwidth_mib} MiB float32): "
          f"{bandwidth / 1e9:.1f} GB/s")
    print(f"context {args.context} tokens/sequence, KV block {args.block_size}, logits at every "
          f"new token, best of {args.repeats}; times in ms per step")
    print(f"load average at start: {_load()}")

    measured: dict[tuple[str, str], dict] = {}
    runs = []
    for dtype_name in args.dtypes:
        for model in args.models:
            run = _time_model(args, configs[model], (dtype_name, model), mesh, bandwidth)
            measured[dtype_name, model] = run["seconds"]
            runs.append(run)
    _print_draft_ratios(measured, args)
    # A shared VM's bandwidth drifts with its neighbours: measure again and show both.
    bandwidth_end = measure_bandwidth(args.bandwidth_mib << 20, args.repeats)
    print(f"memory read bandwidth at end: {bandwidth_end / 1e9:.1f} GB/s (start: "
          f"{bandwidth / 1e9:.1f} GB/s; the shares above use the start value)")
    print(f"load average at end: {_load()} (other processes on the machine skew the numbers)")
    return {"bandwidth_start": bandwidth, "bandwidth_end": bandwidth_end, "runs": runs}


def _model_configs(args: argparse.Namespace) -> dict:
    """The target's and the draft's configs (``--small``: tiny shapes, and a tiny grid in
    place of the default one in ``args``); ValueError on a grid that cannot run."""
    from jspec.models.config import ModelConfig

    if args.small:
        target_shape, draft_shape = SMALL_TARGET, SMALL_DRAFT
        if args.batch_sizes == [1, 4, 16, 64]:
            args.batch_sizes = [1, 2]
        if args.query_lens == [1, 2, 4, 8]:
            args.query_lens = [1, 2]
        args.context, args.repeats, args.bandwidth_mib = min(args.context, 16), 1, 8
    else:
        target_shape, draft_shape = TARGET_SHAPE, DRAFT_SHAPE
    for name in ("batch_sizes", "query_lens"):
        if any(v < 1 for v in getattr(args, name)):
            raise ValueError(f"--{name.replace('_', '-')} must be positive integers")
    if args.context < 0 or args.block_size < 1 or args.repeats < 1:
        raise ValueError("--context must be >= 0, --block-size and --repeats >= 1")
    return {"target": ModelConfig(**target_shape), "draft": ModelConfig(**draft_shape)}


def _print_setup(args: argparse.Namespace, configs: dict) -> None:
    import jax

    print(f"jspec bench model-step: backend {jax.default_backend()}, {jax.device_count()} "
          f"device(s), tensor parallel size {args.tensor_parallel_size}, jax {jax.__version__}, "
          f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}")
    t, d = configs["target"], configs["draft"]
    flops_ratio = t.num_params() / d.num_params()
    print(f"target: Qwen2.5-0.5B shape, {t.num_params() / 1e6:.1f}M params "
          f"(L={t.num_layers} h={t.hidden_size} heads={t.num_heads}/{t.num_kv_heads} "
          f"ffn={t.intermediate_size} vocab={t.vocab_size}, tied)")
    print(f"draft:  {d.num_params() / 1e6:.1f}M params (L={d.num_layers} h={d.hidden_size} "
          f"heads={d.num_heads}/{d.num_kv_heads} ffn={d.intermediate_size}, same vocab); "
          f"cost ratio target/draft = {flops_ratio:.1f}x in params (FLOPs and bytes per token)")


def _laid_out(cfg, params, mesh, model: str):
    """``params`` (laid out "in_out", stacked) and ``cfg`` in the weight layout and layer buffers
    an engine would run ``model`` ("target" or "draft") in on this machine
    (jspec/engine_setup.py ``lay_out_weights``: a draft model's layers stay stacked)."""
    from jspec.weight_layout import choose, laid_out

    tp = 1 if mesh is None else mesh.size
    return laid_out(cfg, params, choose(cfg, params, tp), tp, drafts=model != "target")


def _time_model(args: argparse.Namespace, cfg, which: tuple[str, str], mesh,
                bandwidth: float) -> dict:
    """Time one (dtype, model) over the grid with random weights, print its table and
    observations (``bandwidth``: the machine's, measured at the start) and return its run."""
    import jax.numpy as jnp

    dtype_name, model = which
    dtype = jnp.dtype(DTYPES[dtype_name])
    base_cfg = cfg
    params, cfg = _laid_out(cfg, random_params(cfg, dtype), mesh, model)
    weight_bytes = weight_bytes_per_step(params)
    results, timer = time_grid(cfg, params, dtype, args, mesh, shard=model == "target")
    run = {"dtype": dtype_name, "model": model, "config": cfg,
           "weight_bytes": weight_bytes, "seconds": results}
    print()
    print(f"[{dtype_name}] {model}: {weight_bytes / 1e6:.1f} MB of weights read per step")
    if mesh is not None:
        weight_bytes = _per_device(run, timer, params, mesh)
    del params, timer
    for line in _format_table(results, args):
        print(line)
    _print_observations(results, args, weight_bytes, bandwidth)
    if args.batch_invariant and model == "target":
        from jspec.models.params import lay_out

        params, laid_cfg = lay_out(random_params(base_cfg, dtype), base_cfg, cfg.weight_layout,
                                   cfg.layer_buffers)
        ratios = time_invariance_cost(laid_cfg, params, dtype, args, mesh)
        run["batch_invariant_ratio"] = ratios
        print("  batch-invariant numerics: time / default time")
        for line in _format_table(ratios, args, "x"):
            print(line)
    return run


def _per_device(run: dict, timer: ForwardTimer, params, mesh) -> int:
    """What each device of ``mesh`` holds and reads per step, recorded in ``run`` and printed;
    returns the weight bytes each device reads (its own share: the bandwidth figures use it)."""
    from jspec.models import sharding
    from jspec.models.params import params_nbytes

    split = run["model"] == "target"
    run["params_bytes_per_device"] = sharding.bytes_per_device(timer.params)
    run["kv_bytes_per_device"] = timer.kv_bytes_per_device
    weight_bytes = run["weight_bytes"] // mesh.size if split else run["weight_bytes"]
    run["weight_bytes_per_device"] = weight_bytes
    print(f"  on each of {mesh.size} devices ({'split' if split else 'replicated'}): "
          f"{run['params_bytes_per_device'] / 1e6:.1f} MB of params "
          f"(of {params_nbytes(params) / 1e6:.1f} MB), "
          f"{weight_bytes / 1e6:.1f} MB read per step, largest KV pool "
          f"{timer.kv_bytes_per_device / 1e6:.2f} MB")
    return weight_bytes


def _load() -> str:
    try:
        return " ".join(f"{v:.2f}" for v in os.getloadavg())
    except OSError:
        return "n/a"


def _print_observations(results, args, weight_bytes: int, bandwidth: float) -> None:
    qs, bs = args.query_lens, args.batch_sizes
    if 1 in bs:
        row = ", ".join(f"q={q}: {weight_bytes / results[1, q] / 1e9:.1f} GB/s "
                        f"({100 * weight_bytes / results[1, q] / bandwidth:.0f}%)" for q in qs)
        print(f"  B=1 weight-read bandwidth (share of measured): {row}")
        print(f"  B=1 flatness: t(q={qs[-1]}) / t(q={qs[0]}) = "
              f"{results[1, qs[-1]] / results[1, qs[0]]:.2f}")
    big = max(bs)
    base = results[big, qs[0]] / (big * qs[0])
    row = ", ".join(f"q={q}: {results[big, q] / (big * q) / base:.2f}" for q in qs)
    print(f"  B={big} time per token relative to q={qs[0]} (1.00 = linear in B*q): {row}")


def _print_draft_ratios(measured, args) -> None:
    for dtype_name in args.dtypes:
        if (dtype_name, "target") in measured and (dtype_name, "draft") in measured:
            t, d = measured[dtype_name, "target"], measured[dtype_name, "draft"]
            q = 1 if 1 in args.query_lens else min(args.query_lens)  # decode, when timed
            row = ", ".join(f"B={b}: {t[b, q] / d[b, q]:.1f}x" for b in args.batch_sizes)
            print(f"[{dtype_name}] measured target/draft step-time ratio at q={q}: {row}")
