"""Process-level settings for the machine we run on, applied when ``jspec`` is imported.

bf16 on XLA's CPU backend: XLA's ``float-normalization-bf16`` pass treats bf16 slicing, gathers
and scatters as unsupported on CPU and widens their operands to f32. Inside the layer scan that
converts the whole stacked weight tensor and the KV pool every step, which made bf16 serving 3x
slower than fp32 on our CPU; with the pass disabled bf16 is ~1.5x faster than fp32
(docs/benchmarks.md).

The flag (``CPU_BF16_FLAG`` in ``XLA_FLAGS``) is process-wide and XLA reads it once, when JAX
starts its backend (the first ``jax.devices()``, array or jitted call), not when ``jax`` is
imported. So ``configure_cpu_bf16`` sets it whenever that has not happened yet: ``import jspec``
calls it (jspec/__init__.py; library use, e.g. a notebook), and so does the ``jspec`` command.
It is skipped when JAX's backend is already running (too late: the flag would do nothing, and
``dtype="auto"`` then resolves to float32 on CPU, see ``jspec.config.resolve_dtype``), when an
accelerator plugin is installed (jax-cuda*, jax-rocm*, libtpu), and when the environment has
``JSPEC_CPU_BF16=off``. Exporting ``XLA_FLAGS=--xla_disable_hlo_passes=float-normalization-bf16``
before starting Python has the same effect as the automatic setting.

Its price: with the pass disabled, XLA's CPU dot emitter rejects a bf16 x bf16 -> bf16 dot at
compile time (a RET_CHECK in ``dot_op_emitter.cc``). Every matmul of jspec accumulates in f32
(``preferred_element_type``), but other JAX code in the same process that multiplies bf16
matrices on CPU without it fails to compile; set ``JSPEC_CPU_BF16=off`` before importing jspec
to keep XLA's default there (jspec's bf16 is then slow and ``dtype="auto"`` picks float32).

When a CPU backend runs without the flag and bf16 is forced anyway (``dtype="bfloat16"``),
``warn_if_slow_cpu_bf16`` warns once per process (called where jspec.llm builds engines).
"""

from __future__ import annotations

import os
import sys
import warnings

CPU_BF16_FLAG = "--xla_disable_hlo_passes=float-normalization-bf16"
# distribution names (normalized: lower case, "-" and "." -> "_") of JAX accelerator plugins
_ACCELERATOR_PREFIXES = ("jax_cuda", "jax_rocm", "libtpu")


class CPUBFloat16Warning(UserWarning):
    """bf16 was forced on a CPU backend that runs XLA's bf16 normalization (slow)."""


def accelerator_plugin_installed() -> bool:
    """Whether a JAX accelerator plugin distribution (jax-cuda*, jax-rocm*, libtpu*) is installed.

    Looks only at the names of the ``*.dist-info`` / ``*.egg-info`` entries of the directories on
    ``sys.path`` (where ``importlib.metadata`` finds distributions) instead of parsing every
    distribution's metadata: this runs on ``import jspec``, which must stay cheap."""
    for entry in sys.path:
        try:
            names = os.listdir(entry or ".")
        except OSError:  # missing, a file, a zip archive
            continue
        for name in names:
            if not name.endswith((".dist-info", ".egg-info")):
                continue
            normalized = name.lower().replace("-", "_").replace(".", "_")
            if normalized.startswith(_ACCELERATOR_PREFIXES):
                return True
    return False


def jax_backend_started() -> bool:
    """Whether JAX has started a backend in this process (from then on XLA_FLAGS is not read).

    False while ``jax`` is not imported; importing it starts nothing. Otherwise asks JAX's
    internals (``jax._src.xla_bridge``: ``backends_are_initialized()``, or the ``_backends``
    dict it reads; both exist in jax 0.4 to 0.10). Should a later JAX rename them, an imported
    JAX counts as started: the flag is then never set where it might come too late."""
    if "jax" not in sys.modules:
        return False
    try:
        from jax._src import xla_bridge

        probe = getattr(xla_bridge, "backends_are_initialized", None)
        if callable(probe):
            return bool(probe())
        backends = xla_bridge._backends
        if isinstance(backends, dict):
            return len(backends) > 0
    except Exception:  # noqa: BLE001 - any change of JAX's internals: assume started
        pass
    return True


def _opted_out() -> bool:
    return os.environ.get("JSPEC_CPU_BF16", "on").strip().lower() in ("0", "off", "false", "no")


def configure_cpu_bf16() -> bool:
    """Set the CPU bf16 flag if it is still possible and safe; return whether it is set.

    Skipped when JAX's backend already runs (see ``jax_backend_started``), when an accelerator
    plugin is installed, or when JSPEC_CPU_BF16=off. Cheap: imports nothing."""
    if cpu_bf16_flag_set():
        return True
    if _opted_out() or jax_backend_started() or accelerator_plugin_installed():
        return False
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + CPU_BF16_FLAG).strip()
    return True


CPU_DEVICES_FLAG = "--xla_force_host_platform_device_count"


def configure_cpu_devices(count: int) -> bool:
    """Split XLA's CPU backend into ``count`` devices (tensor parallelism on a machine without
    accelerators: ``jspec ... --tensor-parallel-size N`` calls it), if JAX has not started its
    backend and no accelerator plugin is installed (there the mesh is made of the accelerators).
    A device count already in XLA_FLAGS is left alone. Returns whether the flag is set."""
    flags = os.environ.get("XLA_FLAGS", "")
    if CPU_DEVICES_FLAG in flags:
        return True
    if jax_backend_started() or accelerator_plugin_installed():
        return False
    os.environ["XLA_FLAGS"] = f"{flags} {CPU_DEVICES_FLAG}={int(count)}".strip()
    return True


def cpu_bf16_flag_set() -> bool:
    return CPU_BF16_FLAG in os.environ.get("XLA_FLAGS", "")


_warned_slow_bf16 = False


def slow_cpu_bf16_message() -> str:
    if _opted_out():
        why = "JSPEC_CPU_BF16=off is set, so jspec did not disable it"
    else:
        why = ("JAX started its backend before jspec was imported, so jspec could not disable "
               "it (XLA reads XLA_FLAGS only then)")
    return (
        "dtype='bfloat16' on JAX's CPU backend is slow in this process (about 3x slower than "
        "float32): XLA's float-normalization-bf16 pass widens bf16 gathers, slices and scatters "
        "to f32, converting the whole weight stack and KV cache every step, and " + why + ". "
        "To fix it, import jspec before anything starts JAX (jax.devices(), creating an array, "
        f"a jitted call), or export XLA_FLAGS={CPU_BF16_FLAG} before starting Python; or use "
        "dtype='auto' (float32 here) or dtype='float32'.")


def warn_if_slow_cpu_bf16(dtype: str, stacklevel: int = 2) -> bool:
    """Warn, once per process, when ``dtype`` (as the user gave it) forces bfloat16 on a CPU
    backend running without the flag. Returns whether this call warned. Starts JAX's backend
    (call it where an engine is being built anyway)."""
    global _warned_slow_bf16
    if dtype != "bfloat16" or _warned_slow_bf16:
        return False
    import jax

    if jax.default_backend() != "cpu" or cpu_bf16_flag_set():
        return False
    _warned_slow_bf16 = True
    warnings.warn(slow_cpu_bf16_message(), CPUBFloat16Warning, stacklevel=stacklevel + 1)
    return True


def device_free_bytes(device=None) -> int | None:
    """Free memory of an accelerator (its allocator's limit minus what is in use), or None where
    the backend does not report one (XLA:CPU)."""
    import jax

    device = device or jax.local_devices()[0]
    try:
        stats = device.memory_stats()
    except Exception:  # noqa: BLE001 - a backend without allocator statistics
        return None
    if not stats or "bytes_limit" not in stats:
        return None
    return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
