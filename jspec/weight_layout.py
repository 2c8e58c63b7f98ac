"""Which layout the models' projection weights take on this machine, chosen by measurement.

A projection can be stored ``[in, out]`` and multiplied as ``x @ W`` or stored ``[out, in]`` (the
checkpoint's layout) and multiplied as ``x @ W.T`` (models/params.py, ``lay_out``).
The values are the same and so are the bf16 products' bits where it was checked (XLA:CPU's matmul
library packs either into the same kernel); the speed is not, and which layout is faster
depends on the CPU. On a 2-vCPU AMD Zen 3 (AVX2, no bf16 instructions) XLA:CPU multiplies
Qwen2.5-0.5B-shaped bf16 weights ``[out, in]`` 1.2-2.5x faster at 2-64 rows, and that model's
forward at B = 1 takes 0.6-0.7x the time; on the built-in pair's small weights the two are
within 15% (docs/benchmarks.md, "Weight layout"). So an engine on a CPU backend times the
target's first layer's projections and its output head (``probe_weights``) both ways at 1, 4 and
16 rows and keeps ``[out, in]`` only where it is at least 5% faster, caching the answer per
CPU, core count, jax version, dtype and shapes beside the step-time profiles
(``JSPEC_PROFILE_CACHE=off``: measure afresh, write nothing). For the target of an engine in
deterministic mode the faster layout is kept only where this backend's dots in it are
batch-invariant for the model's shapes (``jspec.kernels.batch_invariance.probe_shapes``), else
the other where its are: on a 2-vCPU Intel Xeon with AMX float32 dots of ``[in, out]`` weights
change their order at 51 rows, those of ``[out, in]`` ones do not.

The target's layer weights are held stacked (one ``[L, ...]`` array per weight, the forward a
scan over layers) or in a buffer per layer (the forward unrolled; models/params.py). XLA:CPU
copies each layer's slice out of a stacked array before multiplying it; when the layers do not
stay in the CPU's caches the copies are a third of the forward (Qwen2.5-0.5B shapes on a 2-vCPU
AMD Zen 3: 190-216 against 129-170 ms at B = 1), while per-layer buffers compile every layer
apart (about twice the first start of an engine, once per machine with the persistent
compilation cache). ``choose_buffers`` times a chain through the projections of the target's
first layers (as many as hold ``PROBE_BYTES``, so that they leave the caches as a larger model's
would) both ways at 2 and 16 rows and takes per-layer buffers where they take at most 0.9 of
the stacked time; cached like the layout. Draft models stay stacked (engine_setup.py). A model
deep enough that its per-layer executables would hold half of the process's memory maps
(``per_layer_fits``; jspec/memory_maps.py) stays stacked without measuring.

A product of one row (one sequence decoding, or drafting, alone) can take another path than
one of several rows: on a 2-vCPU Intel Xeon with AMX, XLA:CPU widens bf16 weights to float32
for a one-row product and multiplies a chain of [384, 1920] and [1920, 384] bf16 weights
2.2-2.7x faster with the row padded to two (float32 there: 1.0-1.9x slower padded).
``choose_min_rows`` times each model's first layer's projections and output head at one row, as
it is and padded to two, and pads (``ModelConfig.min_dot_rows`` = 2, models/transformer.py
``project``) where that takes at most ``MARGIN`` of the one-row time; cached like the layout.
The target's batch-invariant mode pads its products to four rows anyway
(``jspec.kernels.batch_invariance``), so this counts for the draft models' loop and for a
target run without it.

``JSPEC_WEIGHT_LAYOUT`` = ``in_out`` / ``out_in`` forces a layout, ``JSPEC_LAYER_BUFFERS`` =
``stacked`` / ``per_layer`` the target's layer buffers and ``JSPEC_DOT_ROWS`` = ``1`` / ``2``
the row floor (``auto``, the default, measures). Accelerators and tensor parallelism keep
``in_out`` and stacked layers: that is what the sharding rules name, and nothing has measured
the others on a GPU or TPU; accelerators multiply single rows as they are.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time

from jspec.models.config import LAYER_BUFFERS, WEIGHT_LAYOUTS, ModelConfig

ENV = "JSPEC_WEIGHT_LAYOUT"
BUFFERS_ENV = "JSPEC_LAYER_BUFFERS"
PROBE_ROWS = (1, 4, 16)
PROJECTIONS = ("wqkv", "wo", "w_gate_up", "w_down")
HEAD_COLUMNS = 32768
ROUNDS = 7  # interleaved timed calls per (layout, rows); the fastest of each counts
MARGIN = 0.95  # "out_in" must take at most this share of "in_out"'s time to be chosen
BUFFER_ROWS = (2, 16)
# "per_layer" must take at most this share of "stacked"'s time: it compiles every layer apart
BUFFER_MARGIN = 0.9
PROBE_BYTES = 128 << 20  # layer weights the buffer probe runs through, at most (probe_layers)
# Per-layer buffers cost memory maps: XLA:CPU loads each kernel of an executable as an object of
# three mappings, and an unrolled forward has each layer's own kernels. Counted on the 2-vCPU
# Intel Xeon: a 24-layer model's bucket holds ~150 mappings stacked and ~600 per layer, up to
# 1,066 for the widest (about 19 more per layer, up to 44). An engine compiles some tens of
# target forwards (the built-in pair under `auto` at 16 sequences: 33).
MAPS_PER_LAYER = 20
TARGET_EXECUTABLES = 40
ROWS_ENV = "JSPEC_DOT_ROWS"
DOT_ROWS = ("1", "2")  # the row floors choose_min_rows picks from


def requested(env: str = ENV, choices: tuple[str, ...] = WEIGHT_LAYOUTS) -> str:
    """What ``env`` asks for (``JSPEC_WEIGHT_LAYOUT`` by default): "auto" when unset."""
    value = os.environ.get(env, "auto").strip().lower() or "auto"
    if value not in ("auto", *choices):
        raise ValueError(f"{env}={value!r}: expected one of auto, {', '.join(choices)}")
    return value


def choose(cfg: ModelConfig, params: dict, tensor_parallel_size: int = 1, log=None,
           batch_invariant: bool = False) -> str:
    """The layout for the model ``cfg`` and ``params`` describe (module docstring). With
    ``batch_invariant`` (the target of an engine in deterministic mode) only a layout whose dots
    this backend computes batch-invariantly for the model's shapes is taken, where one is."""
    import jax
    import numpy as np

    from jspec.kernels.batch_invariance import probe_shapes
    from jspec.models.params import projection_shapes

    forced = _forced(requested(), ENV, "in_out", "weights laid out 'in_out'",
                     tensor_parallel_size)
    if forced:
        return forced
    if cfg.weight_layout != "in_out":  # laid out already: the probe reads "in_out" weights
        return cfg.weight_layout
    if jax.default_backend() != "cpu":
        return "in_out"
    weights = probe_weights(params, cfg)
    dtype_name = str(np.dtype(weights["w_gate_up"].dtype))
    key = {"dtype": dtype_name, "rows": PROBE_ROWS,
           "shapes": {k: list(w.shape) for k, w in weights.items()}}
    invariant = None
    if batch_invariant:
        key["batch_invariant"] = True
        shapes = projection_shapes(cfg)

        def invariant(layout):
            return probe_shapes(dtype_name, shapes, layout)
    layout, times = _cached("weight_layout", key, WEIGHT_LAYOUTS,
                            lambda: _decide_layout(weights, invariant))
    if times is not None:
        fastest = _faster_layout(times)
        why = "" if layout == fastest else \
            f"; {fastest!r} is faster but not batch-invariant here: {invariant(fastest)}"
        print(f"jspec: weight layout {layout!r} on this CPU (one layer's projections and the "
              f"output head, {dtype_name}, at {', '.join(map(str, PROBE_ROWS))} rows: in_out "
              f"{times['in_out'] * 1e3:.2f} ms, out_in {times['out_in'] * 1e3:.2f} ms{why}; "
              f"{ENV} overrides)", file=log or sys.stderr, flush=True)
    return layout


def _faster_layout(times: dict) -> str:
    return "out_in" if times["out_in"] <= MARGIN * times["in_out"] else "in_out"


def _decide_layout(weights: dict, invariant=None) -> tuple[str, dict]:
    """The faster layout, or the other where only that one's dots are batch-invariant
    (``invariant(layout)``: None, or what differs; None for no such condition)."""
    times = measure(weights)
    fastest = _faster_layout(times)
    if invariant is None or invariant(fastest) is None:
        return fastest, times
    other = "in_out" if fastest == "out_in" else "out_in"
    return (other if invariant(other) is None else fastest), times


def choose_buffers(cfg: ModelConfig, params: dict, layout: str, tensor_parallel_size: int = 1,
                   log=None) -> str:
    """How the layer weights of the model ``cfg`` and ``params`` describe are to be held once
    laid out as ``layout``: "per_layer" where a chain through the layers' projections
    (``measure_buffers``) at ``BUFFER_ROWS`` rows takes at most ``BUFFER_MARGIN`` of its time
    with the weights stacked, else "stacked"; "stacked" unmeasured for a model too deep for the
    process's memory maps (``per_layer_fits``; module docstring)."""
    import jax
    import numpy as np

    forced = _forced(requested(BUFFERS_ENV, LAYER_BUFFERS), BUFFERS_ENV, "stacked",
                     "stacked layer weights", tensor_parallel_size)
    if forced:
        return forced
    if cfg.layer_buffers != "stacked":  # held per layer already: kept
        return cfg.layer_buffers
    if jax.default_backend() != "cpu":
        return "stacked"
    from jspec.memory_maps import map_limit

    limit = map_limit()
    if not per_layer_fits(cfg.num_layers, limit):
        print(f"jspec: layer weights 'stacked': {cfg.num_layers} layers held per layer would "
              f"take about {per_layer_maps(cfg.num_layers):,} of the {limit:,} memory maps this "
              f"process may hold (vm.max_map_count; {BUFFERS_ENV} overrides)",
              file=log or sys.stderr, flush=True)
        return "stacked"
    stacked = {name: params["layers"][name] for name in PROJECTIONS}
    dtype_name = str(np.dtype(stacked["w_gate_up"].dtype))
    num_probed = probe_layer_count(params, cfg)
    key = {"dtype": dtype_name, "rows": BUFFER_ROWS, "layout": layout, "layers": num_probed,
           "shapes": {k: list(w.shape) for k, w in stacked.items()}}

    def decide():
        times = measure_buffers(probe_layers(params, cfg, layout), cfg, layout)
        per_layer = times["per_layer"] <= BUFFER_MARGIN * times["stacked"]
        return ("per_layer" if per_layer else "stacked"), times

    buffers, times = _cached("layer_buffers", key, LAYER_BUFFERS, decide)
    if times is not None:
        print(f"jspec: layer weights {buffers!r} on this CPU ({num_probed} of "
              f"{cfg.num_layers} layers' projections, {dtype_name}, at "
              f"{', '.join(map(str, BUFFER_ROWS))} rows: stacked {times['stacked'] * 1e3:.2f} ms, "
              f"per_layer {times['per_layer'] * 1e3:.2f} ms; {BUFFERS_ENV} overrides)",
              file=log or sys.stderr, flush=True)
    return buffers


def per_layer_maps(num_layers: int) -> int:
    """About how many more memory maps an engine's target executables hold with ``num_layers``
    layers in a buffer each than stacked."""
    return MAPS_PER_LAYER * num_layers * TARGET_EXECUTABLES


def per_layer_fits(num_layers: int, limit: int | None) -> bool:
    """Whether per-layer buffers leave room under the process's memory-map ``limit`` (None: no
    limit): their executables may take at most half of it, the rest being for the draft's, the
    libraries' and other engines' (jspec/memory_maps.py starts releasing at 7/8 of it)."""
    return limit is None or per_layer_maps(num_layers) <= limit // 2


def choose_min_rows(cfg: ModelConfig, params: dict, log=None) -> int:
    """The row floor of the model ``cfg`` and ``params`` describe (``ModelConfig.min_dot_rows``):
    2 where its first layer's projections and output head, laid out as ``cfg`` says, multiply
    one row padded to two in at most ``MARGIN`` of the one-row time, else 1 (module
    docstring)."""
    import jax
    import numpy as np

    want = requested(ROWS_ENV, DOT_ROWS)
    if want != "auto":
        return int(want)
    if cfg.min_dot_rows != 1:  # chosen already: kept
        return cfg.min_dot_rows
    if jax.default_backend() != "cpu":
        return 1
    weights = probe_weights(params, cfg)
    dtype_name = str(np.dtype(weights["w_gate_up"].dtype))
    key = {"dtype": dtype_name, "layout": cfg.weight_layout,
           "shapes": {k: list(w.shape) for k, w in weights.items()}}

    def decide():
        times = measure_rows(weights, cfg.weight_layout)
        return ("2" if times["2"] <= MARGIN * times["1"] else "1"), times

    rows, times = _cached("dot_rows", key, DOT_ROWS, decide)
    if times is not None:
        print(f"jspec: dot rows {rows} on this CPU (the first layer's projections and the "
              f"output head of a {cfg.hidden_size}-wide model, {dtype_name}, one row: as it is "
              f"{times['1'] * 1e3:.2f} ms, padded to two {times['2'] * 1e3:.2f} ms; {ROWS_ENV} "
              f"overrides)", file=log or sys.stderr, flush=True)
    return int(rows)


def measure_rows(weights: dict, layout: str) -> dict[str, float]:
    """Seconds of the model's own product (``models/transformer.project``) of one row by every
    weight of ``weights`` (laid out as ``layout`` says), summed, the fastest of ``ROUNDS``
    interleaved calls each: as it is ("1") and padded to two rows ("2")."""
    import functools

    import jax
    import jax.numpy as jnp

    from jspec.models.transformer import project

    fns = {rows: jax.jit(functools.partial(project, layout=layout, min_rows=int(rows)))
           for rows in DOT_ROWS}
    contract = 0 if layout == "in_out" else 1
    cases = []  # (rows, call)
    for i, w in enumerate(weights.values()):
        x = jax.random.normal(jax.random.PRNGKey(i), (1, w.shape[contract]),
                              jnp.float32).astype(w.dtype)
        cases += [(rows, functools.partial(fn, x, w)) for rows, fn in fns.items()]
    return _fastest(cases)


def laid_out(cfg: ModelConfig, params: dict, layout: str, tensor_parallel_size: int = 1,
             drafts: bool = False) -> tuple[dict, ModelConfig]:
    """``params`` and ``cfg`` laid out as ``layout`` with the layer buffers an engine holds the
    model in: measured for the target (``choose_buffers``), stacked for a draft model (its
    forward runs inside the draft loop's ``while_loop``, where per-layer buffers measured
    slower: docs/benchmarks.md, "Layer buffers"); and the row floor this machine multiplies
    the model's weights fastest with (``choose_min_rows``)."""
    import dataclasses

    from jspec.models.params import lay_out

    buffers = "stacked" if drafts else choose_buffers(cfg, params, layout, tensor_parallel_size)
    params, cfg = lay_out(params, cfg, layout, buffers)
    return params, dataclasses.replace(cfg, min_dot_rows=choose_min_rows(cfg, params))


def probe_layers(params: dict, cfg: ModelConfig, layout: str) -> dict:
    """The stacked projection weights the buffer probe runs through, laid out as ``layout``:
    the first layers, as many as hold ``PROBE_BYTES`` (all of a smaller model): enough that they
    do not stay in a CPU's caches when the model's layers do not, without a second copy of a
    large model."""
    import jax.numpy as jnp

    stacked = {name: params["layers"][name] for name in PROJECTIONS}
    n = probe_layer_count(params, cfg)
    swap = layout != cfg.weight_layout
    return {k: jnp.swapaxes(w[:n], -1, -2).copy() if swap else w[:n] for k, w in stacked.items()}


def probe_layer_count(params: dict, cfg: ModelConfig) -> int:
    """How many of the model's first layers hold ``PROBE_BYTES`` of projection weights (all of
    a smaller model)."""
    per_layer = sum(params["layers"][name].nbytes // cfg.num_layers for name in PROJECTIONS)
    return min(cfg.num_layers, max(1, -(-PROBE_BYTES // per_layer)))


def _forced(want: str, env: str, sharded: str, what: str, tensor_parallel_size: int
            ) -> str | None:
    """The choice made without measuring: what tensor parallelism shards (``sharded``, with
    ``what`` naming it; another one asked for by ``env`` is refused), or what ``env`` forces;
    None where the measurement decides."""
    if tensor_parallel_size > 1:
        if want not in ("auto", sharded):
            raise ValueError(f"{env}={want}: tensor parallelism shards {what}; unset it or use "
                             f"tensor_parallel_size=1")
        return sharded
    return None if want == "auto" else want


def _cached(kind: str, key: dict, choices: tuple[str, ...], decide):
    """(choice, seconds measured or None): the answer cached for this host, jax version and
    ``key`` under ``<cache>/<kind>/``, else ``decide() -> (choice, seconds)``, cached. Only an
    answer two measurements agree on is kept: on a busy machine one measurement can flip a
    choice near its margin (the layout probe of the built-in target on a 2-vCPU Intel Xeon
    answered ``out_in``, ``in_out``, ``out_in`` at three first starts), and the cache would keep
    the flip; where the two differ a third decides (there are two choices)."""
    import jax

    from jspec.autoprofile import cache_enabled, host_signature
    from jspec.default_models import cache_dir

    key = json.dumps({"host": host_signature(), "jax": jax.__version__, **key}, sort_keys=True)
    use_cache = cache_enabled()
    path = cache_dir() / kind / f"{hashlib.sha256(key.encode()).hexdigest()[:20]}.json"
    if use_cache and path.exists():
        try:
            choice = json.loads(path.read_text())["choice"]
            if choice in choices:
                return choice, None
        except (OSError, ValueError, KeyError, TypeError):
            pass  # a damaged entry: measure again and overwrite it
    choice, seconds = decide()
    again, seconds = decide()
    if again != choice:
        choice, seconds = decide()
    if use_cache:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps({"key": json.loads(key), "choice": choice,
                                       "seconds": seconds}))
            os.replace(tmp, path)
        except OSError:  # a read-only cache directory: measured again next time
            pass
    return choice, seconds


def probe_weights(params: dict, cfg: ModelConfig) -> dict:
    """What the probes multiply, laid out and held as ``cfg`` says: the first layer's
    projections and the output head (its first ``HEAD_COLUMNS`` vocabulary entries: a
    150k-token head would cost a second copy of itself to probe, and a slice multiplies the
    same way)."""
    layers = params["layers"]
    first = layers[0] if cfg.layer_buffers == "per_layer" else {
        name: layers[name][0] for name in PROJECTIONS}
    head = params["lm_head"]
    head = head[:, :HEAD_COLUMNS] if cfg.weight_layout == "in_out" else head[:HEAD_COLUMNS]
    return {**{name: first[name] for name in PROJECTIONS}, "lm_head": head}


def measure(weights: dict) -> dict[str, float]:
    """Seconds of the model's own product (``models/transformer.project``) for every weight of
    ``weights`` (laid out "in_out") at each of ``PROBE_ROWS`` rows, summed, the fastest of
    ``ROUNDS`` interleaved calls each, per layout."""
    import functools

    import jax
    import jax.numpy as jnp

    from jspec.models.transformer import project

    fns = {layout: jax.jit(functools.partial(project, layout=layout))
           for layout in WEIGHT_LAYOUTS}
    cases = []  # (layout, call)
    key = jax.random.PRNGKey(0)
    for w in weights.values():
        laid = {"in_out": w, "out_in": jnp.swapaxes(w, 0, 1).copy()}
        for rows in PROBE_ROWS:
            x = jax.random.normal(jax.random.fold_in(key, rows), (rows, w.shape[0]),
                                  jnp.float32).astype(w.dtype)
            cases += [(layout, functools.partial(fn, x, laid[layout]))
                      for layout, fn in fns.items()]
    return _fastest(cases)


def _fastest(cases: list) -> dict[str, float]:
    """Seconds per label of ``cases`` ((label, call) pairs; ``call()`` returns a jax array),
    each case the fastest of ``ROUNDS`` interleaved calls after a warm-up, summed per label."""
    for _, call in cases:  # compile and warm up
        call().block_until_ready()
    best = [float("inf")] * len(cases)
    for _ in range(ROUNDS):
        for i, (_, call) in enumerate(cases):
            t = time.perf_counter()
            call().block_until_ready()
            best[i] = min(best[i], time.perf_counter() - t)
    totals: dict[str, float] = {}
    for (label, _), b in zip(cases, best):
        totals[label] = totals.get(label, 0.0) + b
    return totals


def measure_buffers(layers: dict, cfg: ModelConfig, layout: str) -> dict[str, float]:
    """Seconds of a chain through the layers' projections (``layers``: the stacked projection
    weights of some of ``cfg``'s layers, laid out as ``layout`` says) at each of
    ``BUFFER_ROWS`` rows, summed, the fastest of ``ROUNDS`` interleaved calls each, with the
    weights stacked and in a buffer per layer, run by the forward's own layer loop
    (``models/transformer.over_layers``). Each projection's input is scaled by the running sum
    of the outputs before it, so the layers run one after another."""
    import dataclasses
    import functools

    import jax
    import jax.numpy as jnp

    from jspec.models.params import lay_out
    from jspec.models.transformer import over_layers, project

    stacked_cfg = dataclasses.replace(cfg, num_layers=layers["wqkv"].shape[0],
                                      weight_layout=layout, layer_buffers="stacked")
    contract = 1 if layout == "in_out" else 2

    def layer(carry, xs):
        s, inputs = carry
        for name in PROJECTIONS:
            y = project(inputs[name] * s.astype(inputs[name].dtype), xs[0][name], layout)
            s = s + 1e-3 * jnp.mean(y)
        return (s, inputs), None

    def chain(weights, inputs, cfg):
        return over_layers(layer, (jnp.float32(1), inputs), weights, cfg)[0][0]

    fns = {}
    for buffers in LAYER_BUFFERS:
        weights, laid_cfg = lay_out({"layers": layers, "lm_head": None}, stacked_cfg,
                                    buffers=buffers)
        fns[buffers] = (jax.jit(functools.partial(chain, cfg=laid_cfg)), weights["layers"])
    key = jax.random.PRNGKey(0)
    cases = []  # (buffers, call)
    for rows in BUFFER_ROWS:
        inputs = {k: jax.random.normal(jax.random.fold_in(key, rows), (rows, w.shape[contract]),
                                       jnp.float32).astype(w.dtype) for k, w in layers.items()}
        cases += [(buffers, functools.partial(fn, weights, inputs))
                  for buffers, (fn, weights) in fns.items()]
    return _fastest(cases)
