"""Process-level settings for the machine we run on, applied by the command-line entry points.

bf16 on XLA's CPU backend: XLA's ``float-normalization-bf16`` pass treats bf16 slicing, gathers
and scatters as unsupported on CPU and widens their operands to f32. Inside the layer scan that
converts the whole stacked weight tensor and the KV pool every step, which made bf16 serving 3x
slower than fp32 on our CPU; with the pass disabled bf16 is ~1.5x faster than fp32
(docs/benchmarks.md). The flag is process-wide and must be set before JAX starts its backend,
and with it a bf16 x bf16 -> bf16 dot fails to compile on CPU (ours all accumulate in f32), so
only our own entry points set it, and only when no accelerator plugin is installed. Library
users can opt in by exporting the same XLA_FLAGS themselves.
"""

from __future__ import annotations

import importlib.metadata
import os
import sys

CPU_BF16_FLAG = "--xla_disable_hlo_passes=float-normalization-bf16"
_ACCELERATOR_DISTRIBUTIONS = ("jax-cuda", "jax_cuda", "libtpu", "jax-rocm", "jax_rocm")


def accelerator_plugin_installed() -> bool:
    for dist in importlib.metadata.distributions():
        name = (dist.metadata["Name"] or "").lower()
        if name.startswith(_ACCELERATOR_DISTRIBUTIONS):
            return True
    return False


def configure_cpu_bf16() -> bool:
    """Set the CPU bf16 flag if it is still possible and safe; return whether it is active.

    Skipped when JAX is already imported (its backend may be up), when an accelerator plugin is
    installed, or when JSPEC_CPU_BF16=off.
    """
    if cpu_bf16_flag_set():
        return True
    if os.environ.get("JSPEC_CPU_BF16", "on").lower() in ("0", "off", "false"):
        return False
    if "jax" in sys.modules or accelerator_plugin_installed():
        return False
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + CPU_BF16_FLAG).strip()
    return True


def cpu_bf16_flag_set() -> bool:
    return CPU_BF16_FLAG in os.environ.get("XLA_FLAGS", "")
