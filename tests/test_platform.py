"""dtype 'auto' and the CPU bf16 flag that `import jspec` and the `jspec` command set."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import textwrap

import pytest

from jspec import platform
from jspec.config import resolve_dtype

REPO = pathlib.Path(__file__).resolve().parents[1]


def test_auto_dtype_is_fp32_on_cpu_without_the_flag(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "")
    assert resolve_dtype("auto") == "float32"
    assert resolve_dtype("bfloat16") == "bfloat16"
    monkeypatch.setenv("XLA_FLAGS", platform.CPU_BF16_FLAG)
    assert resolve_dtype("auto") == "bfloat16"


def test_flag_is_never_set_once_jax_runs(monkeypatch):
    import jax

    jax.devices()  # this process's backend is up
    monkeypatch.setenv("XLA_FLAGS", "--xla_foo=1")
    monkeypatch.setattr(platform, "accelerator_plugin_installed", lambda: False)
    assert not platform.configure_cpu_bf16()
    assert platform.CPU_BF16_FLAG not in os.environ["XLA_FLAGS"]


def test_flag_respects_opt_out_and_accelerator_plugins(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "")
    monkeypatch.delitem(sys.modules, "jax")  # pretend a fresh process
    monkeypatch.setenv("JSPEC_CPU_BF16", "off")
    assert not platform.configure_cpu_bf16()
    monkeypatch.setenv("JSPEC_CPU_BF16", "on")
    monkeypatch.setattr(platform, "accelerator_plugin_installed", lambda: True)
    assert not platform.configure_cpu_bf16()
    monkeypatch.setattr(platform, "accelerator_plugin_installed", lambda: False)
    assert platform.configure_cpu_bf16()
    assert platform.CPU_BF16_FLAG in os.environ["XLA_FLAGS"]


# ----------------------------------------------------------------------------- import jspec
# Each check runs in a fresh interpreter (this one has JAX's backend up): the flag only matters
# before JAX starts its backend. The probe compiles one tiny bf16 gather and looks for the f32
# widening of XLA's float-normalization-bf16 pass in the optimized HLO, so the checks below see
# whether the backend really runs with the pass disabled, not only what os.environ says.

_PROBE = """
import os, jax, jax.numpy as jnp
hlo = jax.jit(lambda w, i: w[i] * 2).lower(jnp.ones((64, 128), jnp.bfloat16),
                                          jnp.arange(8)).compile().as_text()
print("FLAG", CPU_BF16_FLAG in os.environ.get("XLA_FLAGS", ""), "WIDENED", "f32[" in hlo)
"""

needs_cpu_only_jax = pytest.mark.skipif(
    platform.accelerator_plugin_installed(),
    reason="an accelerator plugin is installed: jspec leaves XLA_FLAGS alone")


def _fresh_python(code: str, tmp_path, **env_overrides) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JSPEC_CPU_BF16")}
    env.update(JSPEC_CACHE=str(tmp_path), JSPEC_COMPILATION_CACHE="off", JAX_PLATFORMS="cpu",
               **env_overrides)
    code = f"CPU_BF16_FLAG = {platform.CPU_BF16_FLAG!r}\n" + code
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=180, cwd=str(REPO))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


@needs_cpu_only_jax
def test_import_jspec_before_jax_sets_the_flag(tmp_path):
    out = _fresh_python("import jspec\nimport jax\njax.devices()\n" + _PROBE, tmp_path)
    assert "FLAG True WIDENED False" in out


@needs_cpu_only_jax
def test_import_jspec_after_jax_import_but_before_its_backend_sets_the_flag(tmp_path):
    code = """
        import jax
        from jax._src import xla_bridge
        assert not xla_bridge.backends_are_initialized()  # importing jax starts no backend
        import jspec
        from jspec.config import resolve_dtype
        assert resolve_dtype("auto") == "bfloat16", resolve_dtype("auto")
    """
    assert "FLAG True WIDENED False" in _fresh_python(textwrap.dedent(code) + _PROBE, tmp_path)


@needs_cpu_only_jax
def test_import_jspec_after_the_backend_started_leaves_it_and_forced_bf16_warns_once(tmp_path):
    code = """
        import warnings
        import jax
        jax.devices()  # the backend starts without the flag
        import jspec
        from jspec import platform
        from jspec.config import resolve_dtype
        from jspec.llm import build_engine
        from jspec.runner import LoadedModel
        assert not platform.cpu_bf16_flag_set()
        assert resolve_dtype("auto") == "float32"
        fake = LoadedModel(cfg=None, params={}, name="t")  # fails after the dtype check
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for dtype in ("auto", "float32"):
                platform.warn_if_slow_cpu_bf16(dtype)
            assert not caught, [str(w.message) for w in caught]
            for _ in range(2):  # the user-facing constructor, twice: one warning
                try:
                    jspec.LLM(target=fake, dtype="bfloat16")
                except Exception:
                    pass
            assert not platform.warn_if_slow_cpu_bf16("bfloat16")  # already warned
        assert len(caught) == 1, [str(w.message) for w in caught]
        assert caught[0].category is platform.CPUBFloat16Warning
        print("MESSAGE", caught[0].message)
    """
    out = _fresh_python(textwrap.dedent(code) + _PROBE, tmp_path)
    assert "FLAG False WIDENED True" in out
    message = out.split("MESSAGE", 1)[1]
    for part in ("float-normalization-bf16", "f32", "import jspec before",
                 "XLA_FLAGS=" + platform.CPU_BF16_FLAG, "dtype='auto'", "'float32'"):
        assert part in message, part


def test_opt_out_keeps_the_flag_off_on_import(tmp_path):
    out = _fresh_python("import jspec\nimport jax\njax.devices()\n" + _PROBE, tmp_path,
                        JSPEC_CPU_BF16="off")
    assert "FLAG False" in out


# ----------------------------------------------------------------------------- in this process

def test_backend_probe_reads_jax_internals_and_falls_back_to_started(monkeypatch):
    import jax
    from jax._src import xla_bridge

    jax.devices()
    assert platform.jax_backend_started()
    monkeypatch.delattr(xla_bridge, "backends_are_initialized")
    assert platform.jax_backend_started()  # via _backends
    monkeypatch.setattr(xla_bridge, "_backends", {})
    assert not platform.jax_backend_started()
    monkeypatch.delattr(xla_bridge, "_backends")  # a JAX with other internals: assume started
    assert platform.jax_backend_started()


def test_accelerator_plugins_are_found_by_distribution_name(monkeypatch, tmp_path):
    (tmp_path / "numpy-2.0.0.dist-info").mkdir()
    monkeypatch.setattr(sys, "path", [str(tmp_path), str(tmp_path / "missing")])
    assert not platform.accelerator_plugin_installed()
    for name in ("jax_cuda12_plugin-0.10.2.dist-info", "libtpu-0.0.1.dist-info",
                 "jax-rocm60-plugin-0.4.egg-info"):
        (tmp_path / name).mkdir()
        assert platform.accelerator_plugin_installed(), name
        (tmp_path / name).rmdir()


def test_warning_names_the_opt_out_when_it_is_the_reason(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "")
    monkeypatch.setenv("JSPEC_CPU_BF16", "off")
    monkeypatch.setattr(platform, "_warned_slow_bf16", False)
    with pytest.warns(platform.CPUBFloat16Warning, match="JSPEC_CPU_BF16=off"):
        assert platform.warn_if_slow_cpu_bf16("bfloat16")
    monkeypatch.setattr(platform, "_warned_slow_bf16", False)
    monkeypatch.setenv("XLA_FLAGS", platform.CPU_BF16_FLAG)  # bf16 is fast: nothing to say
    assert not platform.warn_if_slow_cpu_bf16("bfloat16")


def test_device_free_bytes_sizes_the_pool_on_an_accelerator():
    """On a backend that reports allocator statistics (GPU, TPU) the pool takes 90% of the free
    memory, capped at max_num_seqs full-length sequences; XLA:CPU reports none."""
    from jspec.config import EngineConfig, resolve
    from jspec.platform import device_free_bytes

    assert device_free_bytes() is None  # this CPU

    class FakeGPU:
        def memory_stats(self):
            return {"bytes_limit": 80_000, "bytes_in_use": 30_000}

    assert device_free_bytes(FakeGPU()) == 50_000
    cfg = EngineConfig(max_num_seqs=4, max_model_len=64, block_size=16, num_speculative_tokens=0)
    full = resolve(cfg, 64, 1000).num_kv_blocks  # 4 sequences of 5 pages + the null block
    assert full == 21
    assert resolve(cfg, 64, 1000, device_free_bytes=50_000).num_kv_blocks == 21
    assert resolve(cfg, 64, 1000, device_free_bytes=10_000).num_kv_blocks == 9
    assert resolve(EngineConfig(num_kv_blocks=7, max_model_len=64), 64, 1000,
                   device_free_bytes=10).num_kv_blocks == 7
    with pytest.raises(ValueError, match="bytes free after loading the models"):
        resolve(cfg, 64, 1000, device_free_bytes=1500)
