"""Which layout the models' projection weights take on this machine, chosen by measurement.

A projection can be stored ``[in, out]`` and multiplied as ``x @ W`` or stored ``[out, in]`` (the
checkpoint's layout) and multiplied as ``x @ W.T`` (models/params.py, ``with_weight_layout``).
The values are the same and so are the products' bits where it was checked (XLA:CPU's matmul
library packs either into the same kernel); the speed is not, and which layout is faster
depends on the CPU. On a 2-vCPU AMD Zen 3 (AVX2, no bf16 instructions) XLA:CPU multiplies
Qwen2.5-0.5B-shaped bf16 weights ``[out, in]`` 1.2-2.5x faster at 2-64 rows, and that model's
forward at B = 1 takes 0.6-0.7x the time; on the built-in pair's small weights the two are
within 15% (docs/benchmarks.md, "Weight layout"). So an engine on a CPU backend times the
target's first layer's projections and its output head (``probe_weights``) both ways at 1, 4 and
16 rows and keeps ``[out, in]`` only where it is at least 5% faster, caching the answer per
CPU, core count, jax version, dtype and shapes beside the step-time profiles
(``JSPEC_PROFILE_CACHE=off``: measure afresh, write nothing).

``JSPEC_WEIGHT_LAYOUT`` = ``in_out`` / ``out_in`` forces a layout (``auto``, the default,
measures). Accelerators and tensor parallelism keep ``in_out``: that is what the sharding rules
name, and nothing has measured the other on a GPU or TPU.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time

from jspec.models.config import WEIGHT_LAYOUTS, ModelConfig

ENV = "JSPEC_WEIGHT_LAYOUT"
PROBE_ROWS = (1, 4, 16)
PROJECTIONS = ("wqkv", "wo", "w_gate_up", "w_down")
HEAD_COLUMNS = 32768
ROUNDS = 7  # interleaved timed calls per (layout, rows); the fastest of each counts
MARGIN = 0.95  # "out_in" must take at most this share of "in_out"'s time to be chosen


def requested() -> str:
    """The layout ``JSPEC_WEIGHT_LAYOUT`` asks for: "auto" when unset."""
    value = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if value not in ("auto", *WEIGHT_LAYOUTS):
        raise ValueError(f"{ENV}={value!r}: expected one of auto, "
                         f"{', '.join(WEIGHT_LAYOUTS)}")
    return value


def choose(cfg: ModelConfig, params: dict, tensor_parallel_size: int = 1, log=None) -> str:
    """The layout for the model ``cfg`` and ``params`` describe (module docstring)."""
    import jax
    import numpy as np

    want = requested()
    if tensor_parallel_size > 1:
        if want == "out_in":
            raise ValueError(f"{ENV}=out_in: tensor parallelism shards weights laid out "
                             f"'in_out'; unset it or use tensor_parallel_size=1")
        return "in_out"
    if want != "auto":
        return want
    if cfg.weight_layout != "in_out":  # laid out already: the probe reads "in_out" weights
        return cfg.weight_layout
    if jax.default_backend() != "cpu":
        return "in_out"
    weights = probe_weights(params)
    dtype_name = str(np.dtype(weights["w_gate_up"].dtype))
    from jspec.autoprofile import cache_enabled, host_signature
    from jspec.default_models import cache_dir

    key = json.dumps({"host": host_signature(), "jax": jax.__version__, "dtype": dtype_name,
                      "shapes": {k: list(w.shape) for k, w in weights.items()},
                      "rows": PROBE_ROWS}, sort_keys=True)
    use_cache = cache_enabled()
    path = (cache_dir() / "weight_layout"
            / f"{hashlib.sha256(key.encode()).hexdigest()[:20]}.json")
    if use_cache and path.exists():
        try:
            layout = json.loads(path.read_text())["layout"]
            if layout in WEIGHT_LAYOUTS:
                return layout
        except (OSError, ValueError, KeyError, TypeError):
            pass  # a damaged entry: measure again and overwrite it
    times = measure(weights)
    layout = "out_in" if times["out_in"] <= MARGIN * times["in_out"] else "in_out"
    if use_cache:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps({"key": json.loads(key), "layout": layout,
                                       "seconds": times}))
            os.replace(tmp, path)
        except OSError:  # a read-only cache directory: measured again next time
            pass
    print(f"jspec: weight layout {layout!r} on this CPU (one layer's projections and the "
          f"output head, {dtype_name}, at {', '.join(map(str, PROBE_ROWS))} rows: in_out "
          f"{times['in_out'] * 1e3:.2f} ms, out_in {times['out_in'] * 1e3:.2f} ms; {ENV} "
          f"overrides)", file=log or sys.stderr, flush=True)
    return layout


def probe_weights(params: dict) -> dict:
    """What the probe multiplies, laid out "in_out": the first layer's projections and the
    output head (its first ``HEAD_COLUMNS`` vocabulary columns: a 150k-token head would cost
    a second copy of itself to probe, and a slice multiplies the same way)."""
    layers = params["layers"]
    weights = {name: layers[name][0] for name in PROJECTIONS}
    weights["lm_head"] = params["lm_head"][:, :HEAD_COLUMNS]
    return weights


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
    cases = []  # (layout, name, rows, x, w)
    key = jax.random.PRNGKey(0)
    for name, w in weights.items():
        laid = {"in_out": w, "out_in": jnp.swapaxes(w, 0, 1).copy()}
        for rows in PROBE_ROWS:
            x = jax.random.normal(jax.random.fold_in(key, rows), (rows, w.shape[0]),
                                  jnp.float32).astype(w.dtype)
            cases += [(layout, name, rows, x, laid[layout]) for layout in fns]
    for layout, _, _, x, w in cases:  # compile and warm up
        fns[layout](x, w).block_until_ready()
    best = [float("inf")] * len(cases)
    for _ in range(ROUNDS):
        for i, (layout, _, _, x, w) in enumerate(cases):
            t = time.perf_counter()
            fns[layout](x, w).block_until_ready()
            best[i] = min(best[i], time.perf_counter() - t)
    return {layout: sum(b for b, case in zip(best, cases) if case[0] == layout)
            for layout in fns}
