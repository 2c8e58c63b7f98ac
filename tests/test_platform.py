"""dtype 'auto' and the CPU bf16 flag of the command-line entry points."""

from __future__ import annotations

from jspec import platform
from jspec.config import resolve_dtype


def test_auto_dtype_is_fp32_on_cpu_without_the_flag(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "")
    assert resolve_dtype("auto") == "float32"
    assert resolve_dtype("bfloat16") == "bfloat16"
    monkeypatch.setenv("XLA_FLAGS", platform.CPU_BF16_FLAG)
    assert resolve_dtype("auto") == "bfloat16"


def test_flag_is_never_set_once_jax_runs(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_foo=1")
    assert not platform.configure_cpu_bf16()  # jax is imported in this process
    assert platform.CPU_BF16_FLAG not in __import__("os").environ["XLA_FLAGS"]


def test_flag_respects_opt_out_and_accelerator_plugins(monkeypatch):
    import sys

    monkeypatch.setenv("XLA_FLAGS", "")
    monkeypatch.delitem(sys.modules, "jax")  # pretend a fresh process
    monkeypatch.setenv("JSPEC_CPU_BF16", "off")
    assert not platform.configure_cpu_bf16()
    monkeypatch.setenv("JSPEC_CPU_BF16", "on")
    monkeypatch.setattr(platform, "accelerator_plugin_installed", lambda: True)
    assert not platform.configure_cpu_bf16()
    monkeypatch.setattr(platform, "accelerator_plugin_installed", lambda: False)
    assert platform.configure_cpu_bf16()
    assert platform.CPU_BF16_FLAG in __import__("os").environ["XLA_FLAGS"]
