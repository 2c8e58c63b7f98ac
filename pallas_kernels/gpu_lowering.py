"""The Pallas kernels as a GPU runs them, and the check that judges a model's shapes against
their GPU lowering before the engine compiles anything.

JAX 0.10 lowers a ``pallas_call`` for CUDA through Triton only when the call carries Triton's
``CompilerParams``; without them it picks Mosaic GPU, which wants kernels written against its
own warpgroup/TMA model (ours fail there: shared memory overflows, copies not a multiple of a
warpgroup). So every kernel's GPU form passes ``compiler_params(kernel)``.

Lowering (jaxpr -> Triton IR inside an XLA custom call) runs on any machine:
``jax.jit(f).trace(*abstract args).lower(lowering_platforms=("cuda",))``. ``problem`` uses it to
refuse shapes a kernel cannot take (the Triton lowering wants every array's size a power of two)
with the reason, and on a GPU also compiles and runs the kernel once at those shapes;
``tests/test_kernel_lowering.py`` lowers every configuration the engine compiles.

Tuning: each kernel's warps and pipeline stages (and attention's pages per loop iteration and
the grid size its context split aims at) have defaults here (``DEFAULTS``); `jspec bench
kernels --tune` times a small grid of them on a GPU and records the fastest per GPU model name
in a JSON file (``tuning_path``: ``$JSPEC_KERNEL_TUNING``, else
``~/.cache/jspec/kernel_tuning.json``). ``settings`` reads the record for this process's GPU
model where there is one and the defaults otherwise.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jspec.kernels import kv_migration
from jspec.kernels import ragged_paged_attention as rpa

KERNELS = ("attention", "migration")
log = logging.getLogger(__name__)
# XLA's custom-call target for a Pallas Triton kernel (JAX 0.10; later jaxlibs compile the
# kernel ahead and call "triton_kernel_call_ffi")
TRITON_CALL_TARGETS = ("__gpu$xla.gpu.triton", "triton_kernel_call_ffi")
# Defaults, what runs on a GPU model --tune has not recorded: JAX's default warp count; two
# stages let a loop's next load (K/V pages, a chunk of a migrated row) start while the current
# one is used. Attention also tunes the pages one loop iteration reads and the grid size its
# context split aims at (ragged_paged_attention).
NUM_WARPS = 4
NUM_STAGES = 2
DEFAULTS = {
    "attention": {"num_warps": NUM_WARPS, "num_stages": NUM_STAGES,
                  "pages_per_iter": rpa.PAGES_PER_ITER, "programs": rpa.PROGRAMS},
    "migration": {"num_warps": NUM_WARPS, "num_stages": NUM_STAGES},
}
TUNING_ENV = "JSPEC_KERNEL_TUNING"
_POW2 = ("num_warps", "pages_per_iter")  # Triton's warps and our arrays' pages: powers of two


def _check_kernel(kernel: str) -> None:
    if kernel not in KERNELS:
        raise ValueError(f"unknown kernel {kernel!r}; the kernels are {', '.join(KERNELS)}")


def tuning_path() -> Path:
    """Where tuned settings are recorded and read: ``$JSPEC_KERNEL_TUNING``, else
    ``~/.cache/jspec/kernel_tuning.json``."""
    env = os.environ.get(TUNING_ENV, "").strip()
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "jspec" / "kernel_tuning.json"


def device_name() -> str | None:
    """The GPU model this process runs on (JAX's ``device_kind``, e.g. "NVIDIA H100 80GB
    HBM3"), or None off a GPU."""
    if jax.default_backend() != "gpu":
        return None
    return jax.devices()[0].device_kind


def validate_settings(kernel: str, values: dict) -> dict:
    """``values`` checked against ``kernel``'s tunable settings: every key known, every value
    a positive integer (a power of two for warps and pages); the defaults fill the rest."""
    _check_kernel(kernel)
    unknown = sorted(set(values) - set(DEFAULTS[kernel]))
    if unknown:
        raise ValueError(f"{kernel} has no setting {', '.join(unknown)}; its settings are "
                         f"{', '.join(DEFAULTS[kernel])}")
    for key, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{kernel} setting {key} must be a positive integer, not {value!r}")
        if key in _POW2 and not _is_pow2(value):
            raise ValueError(f"{kernel} setting {key} must be a power of two, not {value}")
    return {**DEFAULTS[kernel], **values}


def read_tuning(path: Path | None = None) -> dict:
    """The whole tuning file, ``{gpu model: {kernel: {"settings": {...}, ...}}}``; empty when
    there is none. A file that is not such JSON is a ValueError naming it."""
    path = Path(path) if path is not None else tuning_path()
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"kernel tuning file {path} cannot be read: {e}") from e
    if not isinstance(data, dict) or not all(isinstance(v, dict) for v in data.values()):
        raise ValueError(f"kernel tuning file {path} is not a mapping of GPU model to kernels")
    return data


def recorded(kernel: str, device: str | None, path: Path | None = None) -> dict | None:
    """The settings recorded for ``kernel`` on GPU model ``device`` (validated, defaults
    filled in), or None when there are none."""
    _check_kernel(kernel)
    if device is None:
        return None
    entry = read_tuning(path).get(device, {}).get(kernel)
    if entry is None:
        return None
    if not isinstance(entry, dict) or not isinstance(entry.get("settings"), dict):
        raise ValueError(f"the {kernel} entry for {device!r} in {path or tuning_path()} has no "
                         "settings mapping")
    return validate_settings(kernel, entry["settings"])


def record(device: str, kernel: str, values: dict, path: Path | None = None,
           **details) -> Path:
    """Record ``values`` as ``kernel``'s settings on GPU model ``device`` (with ``details``:
    timings, versions), keeping every other entry of the file; returns the file."""
    values = validate_settings(kernel, values)
    path = Path(path) if path is not None else tuning_path()
    data = read_tuning(path)
    data.setdefault(device, {})[kernel] = {"settings": values, **details}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    tmp.replace(path)
    return path


@functools.lru_cache(maxsize=None)
def settings(kernel: str) -> dict:
    """``kernel``'s settings in this process: those recorded for this GPU model, else the
    defaults. A tuning file that cannot be used is a warning, and the defaults run."""
    _check_kernel(kernel)
    try:
        tuned = recorded(kernel, device_name())
    except ValueError as e:
        log.warning("ignoring the recorded %s kernel settings: %s", kernel, e)
        tuned = None
    return tuned if tuned is not None else dict(DEFAULTS[kernel])


def compiler_params(kernel: str, values: dict | None = None):
    """The Triton compiler parameters ``kernel`` ("attention" or "migration") runs with (from
    ``values``, default ``settings(kernel)``)."""
    from jax.experimental.pallas import triton as pltriton

    _check_kernel(kernel)
    values = settings(kernel) if values is None else validate_settings(kernel, values)
    return pltriton.CompilerParams(num_warps=values["num_warps"],
                                   num_stages=values["num_stages"])


def attention(values: dict | None = None):
    """The attention kernel compiled for a GPU (the reference's signature), with ``values``
    (default ``settings("attention")``)."""
    values = settings("attention") if values is None else validate_settings("attention", values)
    return functools.partial(rpa.ragged_paged_attention,
                             compiler_params=compiler_params("attention", values),
                             pages_per_iter=values["pages_per_iter"],
                             programs=values["programs"])


def migration(values: dict | None = None):
    """``f(k_pool, v_pool, pairs) -> (k_pool, v_pool)``, compiled for a GPU, pools donated,
    with ``values`` (default ``settings("migration")``)."""
    return jax.jit(functools.partial(kv_migration.migrate_blocks_kernel,
                                     compiler_params=compiler_params("migration", values)),
                   donate_argnums=(0, 1))


@dataclasses.dataclass(frozen=True)
class KernelShape:
    """What a model's kernels are compiled for: its attention heads and its KV pool's geometry.
    ``segments`` is 2 for a target pool that elastic memory extends by a second array."""

    num_heads: int
    kv_heads: int
    head_dim: int
    block_size: int
    num_layers: int
    dtype: str
    sliding_window: int | None = None
    segments: int = 1

    @classmethod
    def of_model(cls, cfg, block_size: int, dtype, segments: int = 1) -> "KernelShape":
        """From a ``jspec.models.config.ModelConfig`` and its pool's block size and dtype."""
        return cls(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, block_size, cfg.num_layers,
                   np.dtype(dtype).name, cfg.sliding_window, segments)

    def __str__(self) -> str:
        window = f", sliding window {self.sliding_window}" if self.sliding_window else ""
        pool = ", two-segment pool" if self.segments == 2 else ""
        return (f"{self.num_heads} heads / {self.kv_heads} kv heads, head_dim {self.head_dim}, "
                f"block_size {self.block_size}, {self.dtype}{window}{pool}")


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _shape_rule(kernel: str, shape: KernelShape) -> str | None:
    """Known limits, stated in the model's terms (the lowering's own error names an array)."""
    if shape.segments > 2:
        return f"a pool of {shape.segments} segments (the kernels read one or two)"
    if kernel == "attention":
        # a K/V page is a [block_size, head_dim] array inside the kernel
        for name in ("head_dim", "block_size"):
            value = getattr(shape, name)
            if not _is_pow2(value):
                return (f"{name} {value} is not a power of two, which every array in a Triton "
                        "kernel must be")
    return None


def _pool(shape: KernelShape, num_blocks: int, layers: int):
    """A zero K or V pool of ``shape``'s geometry: one array, or (two segments) two halves."""
    dims = (shape.block_size, shape.kv_heads, shape.head_dim)
    if shape.segments == 1:
        return np.zeros((layers, num_blocks) + dims, shape.dtype)
    half = num_blocks // 2
    return tuple(np.zeros((layers, n) + dims, shape.dtype) for n in (half, num_blocks - half))


def _attention_case(shape: KernelShape):
    """One layer over two 4-token sequences, one page each, in blocks from both segments."""
    fn = functools.partial(attention(), sm_scale=shape.head_dim ** -0.5,
                           sliding_window=shape.sliding_window)
    i32 = lambda *v: np.array(v, np.int32)  # noqa: E731
    md = rpa.AttentionMetadata(positions=i32(0, 1, 2, 3, 0, 1, 2, 3), cu_q_lens=i32(0, 4, 8),
                               kv_lens=i32(4, 4), page_table=i32([1, 0], [6, 0]))
    q = np.zeros((8, shape.num_heads, shape.head_dim), shape.dtype)
    pool = _pool(shape, 8, 1)
    return fn, (q, pool, pool, np.int32(0), md)


def _migration_case(shape: KernelShape):
    """Two pairs (one across the segments when there are two) and two padding pairs."""
    layers = min(shape.num_layers, 2)  # more layers only widen the grid
    pairs = np.array([[6, 1], [2, 3], [0, 0], [0, 0]], np.int32)
    return migration(), (_pool(shape, 8, layers), _pool(shape, 8, layers), pairs)


_CASES = {"attention": _attention_case, "migration": _migration_case}


def lower_for_cuda(kernel: str, shape: KernelShape) -> str:
    """The StableHLO text of ``kernel``'s GPU form lowered for CUDA at ``shape`` (no GPU needed);
    raises what the lowering raises."""
    fn, args = _CASES[kernel](shape)
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), args)
    return jax.jit(fn).trace(*abstract).lower(lowering_platforms=("cuda",)).as_text()


def _run_on_gpu(kernel: str, shape: KernelShape) -> None:
    """Compile and run ``kernel`` once at ``shape`` on this process's GPU."""
    fn, args = _CASES[kernel](shape)
    jax.block_until_ready(jax.jit(fn)(*jax.tree.map(jnp.asarray, args)))


def _first_line(e: Exception, limit: int = 300) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:limit] if text else ''}"


@functools.lru_cache(maxsize=None)
def problem(kernel: str, shape: KernelShape, run: bool = False) -> str | None:
    """Why ``kernel`` cannot run at ``shape`` on a CUDA GPU, or None: the known limits, then its
    lowering through Triton, then (``run``, on a GPU) one compile and run."""
    why = _shape_rule(kernel, shape)
    if why is not None:
        return why
    try:
        text = lower_for_cuda(kernel, shape)
    except Exception as e:  # noqa: BLE001 - any lowering failure is the reason to refuse
        return f"its Triton lowering fails: {_first_line(e)}"
    if not any(f"@{target}(" in text for target in TRITON_CALL_TARGETS):
        return "it did not lower to a Triton call"
    if run:
        try:
            _run_on_gpu(kernel, shape)
        except Exception as e:  # noqa: BLE001 - a compile or launch failure means "not here"
            return f"it does not compile and run on this GPU: {_first_line(e)}"
    return None
