"""Every kernel lowered for CUDA, on CPU, at every configuration the engine compiles.

JAX lowers a Pallas kernel for a GPU without one (``.lower(lowering_platforms=("cuda",))``):
the kernel's jaxpr becomes Triton IR inside an XLA custom call. These tests lower the engine's
own GPU functions (``backend.attention_fn("pallas")``, ``backend.migration_fn("pallas")``) and
read the call: Triton (not Mosaic GPU, which JAX picks for a ``pallas_call`` without Triton's
compiler parameters), the engine's warps and stages, the grid the kernel was planned with; and
the Triton IR itself where a property lives there (full-precision f32 dots, pages loaded per
iteration, no branch per page). They cannot tell whether Triton then compiles the IR for a
given GPU, nor how fast it runs; that needs the GPU.
Also here: backend selection judging each kernel on its own and refusing what cannot lower, and
the settings recorded per GPU model that the kernels lower with.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jspec.kernels import backend, gpu_lowering
from jspec.kernels import ragged_paged_attention as rpa
from jspec.kernels.gpu_lowering import KernelShape
from jspec.kernels.ragged_paged_attention import AttentionMetadata

sds = jax.ShapeDtypeStruct
TRITON_TARGET = "__gpu$xla.gpu.triton"  # JAX 0.10's custom call for a Pallas Triton kernel
i32 = functools.partial(sds, dtype=jnp.int32)


def custom_calls(text: str) -> list[dict]:
    """Each custom call of the module: target, and the attributes of its backend config (the
    serialized Triton IR left out) as strings."""
    calls = []
    for line in text.splitlines():
        m = re.search(r"custom_call @([\w$.]+)\(", line)
        if not m:
            continue
        line = re.sub(r'ir = "(?:[^"\\]|\\.)*"', 'ir = ""', line)
        attrs = dict(re.findall(r"([a-z_]\w*) = (\"[^\"]*\"|[-\w]+)", line))
        calls.append({"target": m.group(1),
                      "aliases": line.count("output_operand_alias<"),
                      "results": re.findall(r"tensor<([\dx]+)x\w+>", line.split("->")[-1]),
                      **{k: v.strip('"') for k, v in attrs.items()}})
    return calls


def the_triton_call(text: str, kernel: str, name: str) -> dict:
    """The module's one kernel call, checked to be Triton with the engine's parameters."""
    calls = custom_calls(text)
    assert not [c for c in calls if "mosaic" in c["target"].lower()], calls
    kernels = [c for c in calls if c.get("name") == name]
    assert len(kernels) == 1, calls
    (call,) = kernels
    params = gpu_lowering.compiler_params(kernel)
    assert call["target"] == TRITON_TARGET
    assert (int(call["num_warps"]), int(call["num_stages"])) == (params.num_warps,
                                                                 params.num_stages)
    return call


def lower(fn, *args) -> str:
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


# ----------------------------------------------------------------------------- attention
# (query heads, kv heads, head_dim, block_size, pool dtype): Qwen2.5-0.5B's and -7B's attention
# in bf16, and float32 pools with plain multi-head attention and with 4:1 GQA at block 32
MODELS = {
    "qwen05b-gqa7-d64-bf16": (14, 2, 64, 16, jnp.bfloat16),
    "qwen7b-gqa7-d128-bf16": (28, 4, 128, 16, jnp.bfloat16),
    "mha-d64-f32": (4, 4, 64, 16, jnp.float32),
    "gqa4-d128-bs32-f32": (8, 2, 128, 32, jnp.float32),
}
# (sequences, tokens, max_q_len) of the batches the engine compiles: 1-token decode, a γ = 4
# verification (γ + 1 = 5 tokens each, bounded), a 32-token prefill chunk, and a mixed batch
# (prefill chunk, decode and verification together, no bound)
STEPS = {"decode": (4, 4, 1), "verify": (4, 20, 5), "prefill": (1, 32, None),
         "mixed": (3, 24, None)}
# the pool's variants: a sliding window and elastic memory's two-segment pool
POOLS = {"plain": (None, 1), "window": (32, 1), "segmented": (None, 2),
         "segmented-window": (32, 2)}
NUM_BLOCKS, PAGES = 12, 8


def lower_attention(model: tuple, step: str, pool: str = "plain", pages: int = PAGES,
                    steps: dict = STEPS, **kwargs) -> tuple[str, tuple[int, int, int]]:
    """The engine's attention lowered for CUDA at ``model`` (a ``MODELS`` value), with a page
    table ``pages`` wide; also the grid (query tiles, kv heads, context splits) it should have
    with the default settings."""
    heads, kv_heads, head_dim, block_size, dtype = model
    seqs, tokens, max_q_len = steps[step]
    window, segments = POOLS[pool]
    dims = (block_size, kv_heads, head_dim)
    kv = (sds((2, NUM_BLOCKS) + dims, dtype) if segments == 1 else
          (sds((2, NUM_BLOCKS) + dims, dtype), sds((2, 4) + dims, dtype)))
    md = AttentionMetadata(positions=i32((tokens,)), cu_q_lens=i32((seqs + 1,)),
                           kv_lens=i32((seqs,)), page_table=i32((seqs, pages)))
    fn = functools.partial(backend.attention_fn("pallas"), sm_scale=head_dim ** -0.5,
                           sliding_window=window, max_q_len=max_q_len, **kwargs)
    text = lower(fn, sds((tokens, heads, head_dim), dtype), kv, kv, i32(()), md)
    invariant = kwargs.get("batch_invariant", False)
    q_block, _ = rpa.kernel_tile(heads // kv_heads, max_q_len, batch_invariant=invariant)
    tiles = -(-tokens // q_block) + seqs if q_block > 1 else tokens
    if max_q_len is not None:
        tiles = min(tiles, seqs * -(-max_q_len // q_block))
    ppi = rpa.pages_per_iteration(kwargs.get("pages_per_iter", rpa.PAGES_PER_ITER), pages,
                                  block_size, head_dim, jnp.dtype(dtype).itemsize)
    chunks = -(-pages // ppi)
    splits = rpa.context_splits(tiles, kv_heads, chunks, kwargs.get("programs", rpa.PROGRAMS),
                                invariant)
    return text, (tiles, kv_heads, splits)


def grid(call: dict) -> tuple[int, int, int]:
    return int(call["grid_x"]), int(call["grid_y"]), int(call["grid_z"])


@pytest.mark.parametrize("pages", [PAGES, 256], ids=["short", "long"])
@pytest.mark.parametrize("invariant", [False, True], ids=["fast", "batch-invariant"])
@pytest.mark.parametrize("step", STEPS)
@pytest.mark.parametrize("model", MODELS)
def test_attention_lowers_through_triton(model, step, invariant, pages):
    """Every model and step, with the engine's drafts' numerics and its target's
    (``deterministic``: batch-invariant), over page tables of one chunk and of many (the
    context split over programs and merged)."""
    text, expected = lower_attention(MODELS[model], step, pages=pages,
                                     batch_invariant=invariant)
    call = the_triton_call(text, "attention", "ragged_paged_attention")
    assert grid(call) == expected


@pytest.mark.parametrize("invariant", [False, True], ids=["fast", "batch-invariant"])
@pytest.mark.parametrize("step", STEPS)
@pytest.mark.parametrize("pool", ["window", "segmented", "segmented-window"])
def test_attention_over_windows_and_segmented_pools_lowers_through_triton(pool, step,
                                                                          invariant):
    text, expected = lower_attention(MODELS["qwen05b-gqa7-d64-bf16"], step, pool, pages=64,
                                     batch_invariant=invariant)
    assert expected[2] > 1  # the split is lowered too
    call = the_triton_call(text, "attention", "ragged_paged_attention")
    assert grid(call) == expected


# 4k-token contexts at block 16 (256 pages): one decode, 32 decodes, 32 γ = 4 verifications
LONG = {"b1-decode": (1, 1, 1), "b32-decode": (32, 32, 1), "b32-verify": (32, 160, 5)}


@pytest.mark.parametrize("step, model, settings, expected_grid, rows", [
    # a lone decode over 2 kv heads: 32 splits of one 8-page chunk each, 64 programs...
    ("b1-decode", "qwen05b-gqa7-d64-bf16", {}, (1, 2, 32), 16),
    # ... 128 with 4 pages per iteration
    ("b1-decode", "qwen05b-gqa7-d64-bf16", {"pages_per_iter": 4}, (1, 2, 64), 16),
    ("b1-decode", "qwen7b-gqa7-d128-bf16", {}, (1, 4, 32), 16),
    # a 32 x 128 f32 page is 16 KiB: 2 pages per iteration, 128 chunks, 64 splits (the most)
    ("b1-decode", "gqa4-d128-bs32-f32", {}, (1, 2, 64), 16),
    # 32 sequences are 64 programs before any split: 4 splits reach 256
    ("b32-decode", "qwen05b-gqa7-d64-bf16", {}, (32, 2, 4), 16),
    ("b32-decode", "qwen05b-gqa7-d64-bf16", {"programs": 64}, (32, 2, 1), 16),
    # γ + 1 = 5 tokens x 7 heads = 35 rows: one 64-row tile per sequence
    ("b32-verify", "qwen05b-gqa7-d64-bf16", {}, (32, 2, 4), 64),
    # batch-invariant: one 64-row tile shape and 8 context slots, whatever the batch
    ("b1-decode", "qwen05b-gqa7-d64-bf16", {"batch_invariant": True}, (1, 2, 8), 64),
    ("b32-verify", "qwen05b-gqa7-d64-bf16", {"batch_invariant": True}, (32, 2, 8), 64),
])
def test_attention_splits_the_context_of_small_batches(step, model, settings, expected_grid,
                                                       rows):
    """Flash-decoding: the grid (query tiles, kv heads, context splits) and the split's
    softmax state (acc [tiles, kv heads, splits, rows, D], max and sum) as lowered for CUDA."""
    head_dim = MODELS[model][2]
    text, _ = lower_attention(MODELS[model], step, pages=256, steps=LONG, **settings)
    call = the_triton_call(text, "attention", "ragged_paged_attention")
    assert grid(call) == expected_grid
    tiles, kv_heads, splits = expected_grid
    state = f"{tiles}x{kv_heads}x{splits}x{rows}"
    if splits == 1:  # the tile is normalised in the kernel: one output in the model's dtype
        assert call["results"] == [f"{tiles}x{kv_heads}x1x{rows}x{head_dim}"]
    else:
        assert call["results"] == [f"{state}x{head_dim}", state, state]


def test_attention_with_a_head_dim_triton_cannot_take_fails_to_lower():
    """What backend selection guards against: head_dim 80 (phi-2) is no power of two."""
    with pytest.raises(ValueError, match="power of 2"):
        lower_attention((4, 2, 80, 16, jnp.float32), "decode")


@pytest.fixture
def triton_ir(monkeypatch):
    """The Triton IR (MLIR text) of every Pallas kernel lowered while the fixture is active.
    The custom call carries it as bytecode; this reads it from JAX's Pallas-to-Triton lowering
    (a private function of JAX 0.10: if it moves, these tests fail loudly at the patch)."""
    from jax._src.pallas.triton import pallas_call_registration as registration

    modules = []
    real = registration.lowering.lower_jaxpr_to_triton_module

    def spy(*args, **kwargs):
        result = real(*args, **kwargs)
        modules.append(result.module.operation.get_asm())
        return result

    monkeypatch.setattr(registration.lowering, "lower_jaxpr_to_triton_module", spy)
    return modules


def ops(module: str, op: str) -> list[str]:
    return [line.strip() for line in module.splitlines() if re.search(rf"\b{op}\b", line)]


@pytest.mark.parametrize("model", MODELS)
def test_attention_dots_of_float32_pools_run_at_full_precision(model, triton_ir):
    """Without an explicit precision, Triton multiplies f32 inputs as TF32 (~1e-3 error)."""
    lower_attention(MODELS[model], "decode")
    (module,) = triton_ir
    dots = ops(module, "tt.dot")
    assert len(dots) == 2  # q k^T and p v, once per loop iteration
    if MODELS[model][4] == jnp.float32:
        assert all("xf32> * tensor<" in d and "tf32" not in d for d in dots), dots
    else:
        assert all("xbf16> * tensor<" in d for d in dots), dots


@pytest.mark.parametrize("settings, pages", [({}, 8), ({"pages_per_iter": 4, "programs": 8}, 4),
                                             ({"pages_per_iter": 16}, 8)])  # <= table width
@pytest.mark.parametrize("pool", ["plain", "segmented"])
def test_attention_reads_several_pages_per_iteration_and_never_branches_per_page(
        pool, settings, pages, triton_ir):
    """Each loop iteration loads ``pages`` pages of K and of V as one masked gather each (from
    both segments under complementary masks when the pool has two); no ``scf.if`` anywhere,
    the split of a segmented pool included (one context split here, so no guarded store)."""
    text, (_, _, splits) = lower_attention(MODELS["qwen05b-gqa7-d64-bf16"], "decode", pool,
                                           **settings)
    assert splits == 1
    (module,) = triton_ir
    assert not ops(module, "scf.if")
    (loop,) = ops(module, "scf.for")
    page_loads = [op for op in ops(module, "tt.load") if f"<{pages}x16x64x!tt.ptr<bf16>>" in op]
    assert len(page_loads) == 2 * POOLS[pool][1]
    assert all(op.count("%") == 4 for op in page_loads), page_loads  # result, ptr, mask, other


# ----------------------------------------------------------------------------- migration
# (layers, kv heads, head_dim, dtype): rows of one chunk, of two 4096-element chunks, and one
# that is no power of two (3 kv heads x 80: copied in 15 chunks of 256)
POOL_SHAPES = {"l2-kv2-d64-bf16": (2, 2, 64, jnp.bfloat16),
               "l3-kv4-d128-f32": (3, 4, 128, jnp.float32),
               "l2-kv3-d80-bf16": (2, 3, 80, jnp.bfloat16)}
BUCKET = 16  # pairs per launch (ModelRunner.migrate_bucket's smallest)


@pytest.mark.parametrize("segments", [1, 2])
@pytest.mark.parametrize("pool", POOL_SHAPES)
def test_migration_lowers_through_triton_one_program_per_pair_and_layer(pool, segments):
    layers, kv_heads, head_dim, dtype = POOL_SHAPES[pool]
    dims = (16, kv_heads, head_dim)
    kv = (sds((layers, NUM_BLOCKS) + dims, dtype) if segments == 1 else
          (sds((layers, NUM_BLOCKS) + dims, dtype), sds((layers, 4) + dims, dtype)))
    text = lower(backend.migration_fn("pallas"), kv, kv, i32((BUCKET, 2)))
    call = the_triton_call(text, "migration", "kv_migration")
    assert (int(call["grid_x"]), int(call["grid_y"])) == (BUCKET, layers)
    assert call["aliases"] == 2 * segments  # every K and V segment is written in place


# ----------------------------------------------------------------------------- selection
GOOD = KernelShape(num_heads=14, kv_heads=2, head_dim=64, block_size=16, num_layers=2,
                   dtype="bfloat16")
D80 = KernelShape(num_heads=32, kv_heads=32, head_dim=80, block_size=16, num_layers=2,
                  dtype="float16")


@pytest.fixture
def on_a_gpu(monkeypatch):
    """Selection as on a GPU, where a kernel that lowers is then compiled and run once: here
    that run is recorded (and made to fail for the kernels in ``failing``) instead."""
    ran, failing = [], {}

    def run(kernel, shape):
        ran.append((kernel, shape))
        if kernel in failing:
            raise RuntimeError(failing[kernel])

    monkeypatch.setattr(backend, "platform", lambda: "gpu")
    monkeypatch.setattr(gpu_lowering, "_run_on_gpu", run)
    monkeypatch.delenv("JSPEC_KERNEL_BACKEND", raising=False)
    gpu_lowering.problem.cache_clear()
    yield ran, failing
    gpu_lowering.problem.cache_clear()


def warnings_of(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_selection_runs_each_kernel_that_lowers_at_every_shape(on_a_gpu, caplog):
    ran, _ = on_a_gpu
    window = dataclasses.replace(GOOD, sliding_window=64, segments=2)
    assert backend.select("auto", [GOOD, window]) == backend.Kernels("pallas", "pallas")
    assert backend.select("pallas", [GOOD]) == backend.Kernels("pallas", "pallas")
    assert sorted(ran, key=str) == sorted([(k, s) for k in gpu_lowering.KERNELS
                                           for s in (GOOD, window)], key=str)
    assert not warnings_of(caplog)


@pytest.mark.parametrize("field, value", [("head_dim", 80), ("block_size", 12)])
def test_selection_refuses_attention_at_a_shape_it_cannot_lower(on_a_gpu, caplog, field,
                                                                 value):
    ran, _ = on_a_gpu
    bad = dataclasses.replace(GOOD, **{field: value})
    with caplog.at_level(logging.WARNING):
        chosen = backend.select("auto", [GOOD, bad])
    assert chosen == backend.Kernels(attention="reference", migration="pallas")
    assert str(chosen) == "attention reference, migration pallas"
    (message,) = warnings_of(caplog)
    assert "attention kernel" in message and f"{field} {value} is not a power of two" in message
    assert ("attention", bad) not in ran  # refused before anything compiles
    with pytest.raises(ValueError, match=f"the attention kernel .*{field} {value} is not a "
                                         "power of two"):
        backend.select("pallas", [bad])


def test_selection_falls_back_for_migration_alone_when_it_fails_on_the_gpu(on_a_gpu, caplog):
    _, failing = on_a_gpu
    failing["migration"] = "out of resources: shared memory"
    with caplog.at_level(logging.WARNING):
        assert backend.select("auto", [GOOD]) == backend.Kernels("pallas", "reference")
    (message,) = warnings_of(caplog)
    assert "migration kernel" in message and "out of resources: shared memory" in message
    with pytest.raises(ValueError, match="the migration kernel .*shared memory"):
        backend.select("pallas", [GOOD])


def test_selection_reports_a_lowering_failure_no_rule_foresaw(on_a_gpu, monkeypatch, caplog):
    """The shape rules are the known limits; the lowering itself is the check behind them."""
    monkeypatch.setattr(gpu_lowering, "_shape_rule", lambda kernel, shape: None)
    with caplog.at_level(logging.WARNING):
        assert backend.select("auto", [D80]) == backend.Kernels("reference", "pallas")
    (message,) = warnings_of(caplog)
    assert "Triton lowering fails" in message and "power of 2" in message
    assert "head_dim 80" in message  # the model shape it failed at


def test_the_engine_judges_the_kernels_at_every_shape_it_runs_them_at(engine_models,
                                                                        monkeypatch):
    """The target's and the draft's layers, and the target's two-segment pool where elastic
    memory extends it by a second array."""
    from conftest import make_engine
    from jspec.policies.static import StaticPolicy

    target, draft, _ = engine_models
    seen = []
    real = backend.select
    monkeypatch.setattr(backend, "select",
                        lambda name, shapes: seen.append(list(shapes)) or real(name, shapes))
    engine = make_engine(target, draft, policy=StaticPolicy(7, gamma=3), num_kv_blocks=24,
                         elastic_memory=True, elastic_pool_layout="segments", warmup=False)
    shape = functools.partial(KernelShape.of_model, block_size=16, dtype=np.float32)
    assert seen == [[shape(target.cfg), shape(draft.cfg), shape(target.cfg, segments=2)]]
    assert engine.runner.kernels == backend.Kernels("reference", "reference")  # on CPU
    assert engine.runner.kernel_backend == "reference"


# ----------------------------------------------------------------------------- tuned settings
FAKE_GPU = "NVIDIA Fake 80GB HBM3"


@pytest.fixture
def tuning_file(tmp_path, monkeypatch):
    """A tuning file of its own, read as if this process ran on a ``FAKE_GPU``."""
    path = tmp_path / "kernel_tuning.json"
    monkeypatch.setenv(gpu_lowering.TUNING_ENV, str(path))
    monkeypatch.setattr(gpu_lowering, "device_name", lambda: FAKE_GPU)
    gpu_lowering.settings.cache_clear()
    yield path
    gpu_lowering.settings.cache_clear()


def test_no_gpu_model_off_a_gpu():
    assert gpu_lowering.device_name() is None
    assert gpu_lowering.recorded("attention", None) is None


def test_the_kernels_lower_with_the_settings_recorded_for_this_gpu_model(tuning_file,
                                                                         triton_ir):
    assert gpu_lowering.tuning_path() == tuning_file
    assert gpu_lowering.settings("attention") == gpu_lowering.DEFAULTS["attention"]
    gpu_lowering.record("NVIDIA Other GPU", "attention", {"num_warps": 2})
    gpu_lowering.record(FAKE_GPU, "attention",
                        {"num_warps": 8, "num_stages": 3, "pages_per_iter": 4},
                        seconds=[1e-4, 2e-4])
    gpu_lowering.record(FAKE_GPU, "migration", {"num_warps": 2, "num_stages": 1})
    data = json.loads(tuning_file.read_text())
    assert set(data) == {"NVIDIA Other GPU", FAKE_GPU}
    assert data[FAKE_GPU]["attention"]["seconds"] == [1e-4, 2e-4]
    gpu_lowering.settings.cache_clear()  # settings are read once per process
    assert gpu_lowering.settings("attention") == {"num_warps": 8, "num_stages": 3,
                                                  "pages_per_iter": 4, "programs": 256}

    text, _ = lower_attention(MODELS["qwen05b-gqa7-d64-bf16"], "decode")
    call = the_triton_call(text, "attention", "ragged_paged_attention")
    assert (call["num_warps"], call["num_stages"]) == ("8", "3")
    (module,) = triton_ir
    assert len([op for op in ops(module, "tt.load") if "<4x16x64x!tt.ptr<bf16>>" in op]) == 2
    kv = sds((2, NUM_BLOCKS, 16, 2, 64), jnp.bfloat16)
    text = lower(backend.migration_fn("pallas"), kv, kv, i32((BUCKET, 2)))
    call = the_triton_call(text, "migration", "kv_migration")
    assert (call["num_warps"], call["num_stages"]) == ("2", "1")


def test_settings_of_other_gpu_models_or_an_unusable_file_leave_the_defaults(tuning_file,
                                                                             caplog):
    defaults = gpu_lowering.DEFAULTS["attention"]
    gpu_lowering.record("NVIDIA Other GPU", "attention", {"num_warps": 8})
    assert gpu_lowering.settings("attention") == defaults
    for content, reason in [("{not json", "cannot be read"),
                            (json.dumps({FAKE_GPU: {"attention": {"settings": {
                                "num_warps": 3}}}}), "num_warps must be a power of two"),
                            (json.dumps({FAKE_GPU: {"attention": {"warps": 8}}}),
                             "no settings mapping")]:
        tuning_file.write_text(content)
        gpu_lowering.settings.cache_clear()
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            assert gpu_lowering.settings("attention") == defaults
        (message,) = warnings_of(caplog)
        assert "ignoring the recorded attention kernel settings" in message and reason in message
    with pytest.raises(ValueError, match="attention has no setting block_rows"):
        gpu_lowering.record(FAKE_GPU, "attention", {"block_rows": 64})
    with pytest.raises(ValueError, match="num_stages must be a positive integer"):
        gpu_lowering.record(FAKE_GPU, "migration", {"num_stages": 0})
