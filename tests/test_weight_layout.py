"""Weight layouts and layer buffers (models/params.py ``lay_out``) and the per-machine choice
between them (jspec/weight_layout.py). The rest of the suite runs what tests/conftest.py names;
these tests run the others through the forward and the engine and check the choice itself."""

from __future__ import annotations

import dataclasses
import json
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import make_engine, run_to_completion
from jspec import weight_layout
from jspec.models.params import init_params, lay_out, projection_shapes
from jspec.models.tiny import tiny_config
from jspec.runner import LoadedModel
from jspec.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


def test_conversion_swaps_the_projections_and_shares_a_tied_head():
    cfg = tiny_config("llama", vocab_size=256, tie_word_embeddings=True)
    params = init_params(cfg, seed=0)
    out, out_cfg = lay_out(params, cfg, "out_in")
    assert out_cfg.weight_layout == "out_in" and cfg.weight_layout == "in_out"
    for name in weight_layout.PROJECTIONS:
        np.testing.assert_array_equal(out["layers"][name],
                                      np.swapaxes(params["layers"][name], -1, -2))
    assert out["lm_head"] is out["embed"]  # no second copy of a tied head
    np.testing.assert_array_equal(out["layers"]["attn_norm"], params["layers"]["attn_norm"])
    back, back_cfg = lay_out(out, out_cfg, "in_out")
    assert back_cfg == cfg
    for a, b in zip(jax.tree_util.tree_leaves(back), jax.tree_util.tree_leaves(params)):
        np.testing.assert_array_equal(a, b)
    assert lay_out(params, cfg, "in_out")[0] is params
    with pytest.raises(ValueError, match="weight layout must be one of"):
        lay_out(params, cfg, "column")


def _cast(m: LoadedModel, dtype) -> LoadedModel:
    return LoadedModel(m.cfg, jax.tree_util.tree_map(lambda a: jnp.asarray(a, dtype), m.params),
                       m.name)


@pytest.fixture(scope="module")
def bf16_models(engine_models):
    return tuple(_cast(m, jnp.bfloat16) for m in engine_models[:2])


def test_speculative_equals_plain_with_the_other_layout(bf16_models, mixed_prompts,
                                                        monkeypatch):
    """Deterministic mode's guarantee in bf16 with the weights laid out 'out_in': a batch of
    speculative sequences, each verified beside other rows and prefill chunks, gives what
    plain decoding gives each prompt alone."""
    monkeypatch.setenv(weight_layout.ENV, "out_in")
    plain, spec = speculative_equals_plain(bf16_models, mixed_prompts[:6])
    assert plain.target.cfg.weight_layout == "out_in"
    assert spec.metrics.spec_decode_num_accepted_tokens > 0


def speculative_equals_plain(bf16_models, prompts):
    """Asserts that the bf16 pair's speculative decoding of ``prompts`` in one batch gives what
    plain decoding gives each prompt alone; returns (plain engine, speculative engine)."""
    target, draft = bf16_models
    plain = make_engine(target, None, dtype="bfloat16")
    alone = [run_to_completion(plain, [p], GREEDY)["0"].token_ids for p in prompts]
    spec = make_engine(target, draft, policy_options=(("gamma", 3),), dtype="bfloat16")
    outs = run_to_completion(spec, prompts, GREEDY)
    assert [outs[str(i)].token_ids for i in range(len(prompts))] == alone
    return plain, spec


def test_both_layouts_compute_the_same_model(engine_models, ten_prompts, greedy_reference,
                                            monkeypatch):
    """fp32 greedy decoding with the weights laid out 'out_in' reproduces the suite's reference
    (laid out as conftest.py says)."""
    monkeypatch.setenv(weight_layout.ENV, "out_in")
    engine = make_engine(engine_models[0], None)
    assert engine.target.cfg.weight_layout == "out_in"
    greedy = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    outs = run_to_completion(engine, ten_prompts, greedy)
    assert [outs[str(i)].token_ids for i in range(len(ten_prompts))] == greedy_reference


@pytest.fixture
def probe_params():
    cfg = tiny_config("llama", vocab_size=256)
    return cfg, init_params(cfg, seed=0, dtype=jnp.bfloat16)


@pytest.fixture
def fake_probe(monkeypatch, tmp_path):
    """``calls, answer = fake_probe(name, record)``: ``weight_layout.<name>`` (a probe) replaced
    by one that appends ``record(*its arguments)`` to ``calls`` and returns the seconds last
    given to ``answer``; the choices are cached in a fresh directory."""
    monkeypatch.setenv("JSPEC_CACHE", str(tmp_path))
    calls, seconds = [], {}

    def install(name, record):
        def measure(*args):
            calls.append(record(*args))
            return dict(seconds)
        monkeypatch.setattr(weight_layout, name, measure)
        return calls, lambda answer: seconds.update(answer)
    return install


def test_the_choice_is_cached_per_machine_and_keeps_the_default_without_a_clear_win(
        probe_params, fake_probe, monkeypatch, tmp_path, capsys):
    cfg, params = probe_params
    monkeypatch.setenv(weight_layout.ENV, "auto")
    calls, fake = fake_probe("measure", sorted)
    fake({"in_out": 1.0, "out_in": 0.97})  # 3% faster is inside the margin: the default stays
    assert weight_layout.choose(cfg, params) == "in_out"
    # measured twice (two measurements must agree before the cache keeps an answer)
    assert calls == [sorted(["wqkv", "wo", "w_gate_up", "w_down", "lm_head"])] * 2
    assert "weight layout 'in_out'" in capsys.readouterr().err
    assert weight_layout.choose(cfg, params) == "in_out" and len(calls) == 2  # cached
    entry, = (tmp_path / "weight_layout").glob("*.json")
    assert json.loads(entry.read_text())["key"]["shapes"]["w_gate_up"] == [
        cfg.hidden_size, 2 * cfg.intermediate_size]
    # another machine's timings (a fresh cache): a clear win is taken
    monkeypatch.setenv("JSPEC_CACHE", str(tmp_path / "other"))
    fake({"in_out": 1.0, "out_in": 0.8})
    assert weight_layout.choose(cfg, params) == "out_in"
    # JSPEC_PROFILE_CACHE=off: measured again, nothing written
    monkeypatch.setenv("JSPEC_CACHE", str(tmp_path / "none"))
    monkeypatch.setenv("JSPEC_PROFILE_CACHE", "off")
    assert weight_layout.choose(cfg, params) == "out_in"
    assert not (tmp_path / "none").exists()
    # a cache directory that cannot be written: measured, nothing cached, no error
    monkeypatch.setenv("JSPEC_PROFILE_CACHE", "on")
    blocked = tmp_path / "file"
    blocked.write_text("")
    monkeypatch.setenv("JSPEC_CACHE", str(blocked))
    assert weight_layout.choose(cfg, params) == "out_in"


def test_a_deterministic_target_takes_a_layout_whose_dots_are_batch_invariant(
        probe_params, fake_probe, monkeypatch, tmp_path, capsys):
    """In deterministic mode the faster layout is taken only if this backend's dots in it give
    a row the same bits in every batch (float32 dots stored [in, out] do not on the Intel Xeon);
    else the other, where that one's do."""
    from jspec.kernels import batch_invariance

    cfg, params = probe_params
    monkeypatch.setenv(weight_layout.ENV, "auto")
    _, fake = fake_probe("measure", sorted)
    fake({"in_out": 1.0, "out_in": 1.02})  # "in_out" the faster
    differs = {"in_out": "row 0 of a float32 dot differs between 4 and 260 rows"}
    probed = []

    def probe(dtype_name, shapes, layout):
        probed.append((dtype_name, layout, list(shapes)))
        return differs.get(layout)

    monkeypatch.setattr(batch_invariance, "probe_shapes", probe)
    assert weight_layout.choose(cfg, params) == "in_out" and not probed  # no mode, no probe
    assert weight_layout.choose(cfg, params, batch_invariant=True) == "out_in"
    assert probed[0] == ("bfloat16", "in_out", projection_shapes(cfg))
    assert ("'in_out' is faster but not batch-invariant here: row 0 of a float32 dot "
            "differs") in capsys.readouterr().err
    assert weight_layout.choose(cfg, params) == "in_out"  # cached apart
    # where neither layout's dots are invariant the faster stays (and the engine warns)
    differs["out_in"] = "the other differs too"
    monkeypatch.setenv("JSPEC_CACHE", str(tmp_path / "other"))
    assert weight_layout.choose(cfg, params, batch_invariant=True) == "in_out"


def test_the_real_probe_times_both_layouts(probe_params):
    cfg, params = probe_params
    seconds = weight_layout.measure(weight_layout.probe_weights(params, cfg))
    assert set(seconds) == {"in_out", "out_in"} and min(seconds.values()) > 0


def test_the_override_and_what_keeps_the_default(probe_params, monkeypatch):
    cfg, params = probe_params
    monkeypatch.setattr(weight_layout, "measure", lambda w: pytest.fail("measured"))
    for layout in ("in_out", "out_in"):
        monkeypatch.setenv(weight_layout.ENV, layout)
        assert weight_layout.choose(cfg, params) == layout
    monkeypatch.setenv(weight_layout.ENV, "auto")
    assert weight_layout.choose(cfg, params, tensor_parallel_size=2) == "in_out"
    monkeypatch.setenv(weight_layout.ENV, "out_in")
    with pytest.raises(ValueError, match="tensor parallelism shards weights laid out 'in_out'"):
        weight_layout.choose(cfg, params, tensor_parallel_size=2)
    monkeypatch.setenv(weight_layout.ENV, "rows")
    with pytest.raises(ValueError, match="JSPEC_WEIGHT_LAYOUT='rows': expected one of auto, "
                                         "in_out, out_in"):
        weight_layout.choose(cfg, params)


def test_tensor_parallel_sharding_refuses_the_other_layout(probe_params):
    from jspec.models import sharding

    cfg, params = probe_params
    params, cfg = lay_out(params, cfg, "out_in")
    mesh = types.SimpleNamespace(size=2)  # refused before any device is touched
    with pytest.raises(ValueError, match="shards weights laid out 'in_out', got 'out_in'"):
        sharding.shard_params(params, cfg, mesh)


def test_per_layer_buffers_hold_the_same_weights_in_either_layout():
    cfg = tiny_config("llama", vocab_size=256, tie_word_embeddings=True)
    params = init_params(cfg, seed=0)
    split, split_cfg = lay_out(params, cfg, buffers="per_layer")
    assert (split_cfg.layer_buffers, split_cfg.weight_layout) == ("per_layer", "in_out")
    assert isinstance(split["layers"], tuple) and len(split["layers"]) == cfg.num_layers
    for i, lp in enumerate(split["layers"]):
        for name, w in lp.items():
            np.testing.assert_array_equal(w, params["layers"][name][i])
    # layout and buffers converted together, and back in two steps
    both, both_cfg = lay_out(params, cfg, "out_in", "per_layer")
    for i, lp in enumerate(both["layers"]):
        np.testing.assert_array_equal(lp["w_down"], params["layers"]["w_down"][i].T)
    assert both["lm_head"] is both["embed"]
    back, back_cfg = lay_out(*lay_out(both, both_cfg, "in_out"), buffers="stacked")
    assert back_cfg == cfg
    for a, b in zip(jax.tree_util.tree_leaves(back), jax.tree_util.tree_leaves(params)):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match="layer buffers must be one of"):
        lay_out(params, cfg, buffers="flat")


def test_per_layer_buffers_compute_the_same_forward():
    """The unrolled forward over per-layer buffers gives the scan's logits, pool and captured
    hidden states (fp32), paged and dense: to rounding, as XLA compiles the unrolled program's
    fusions apart from the scan's."""
    from jspec.models.transformer import KVCache, dense_forward, forward
    from jspec.bench.model_step import make_batch

    cfg = tiny_config("llama", vocab_size=256)
    batch, num_blocks = make_batch(3, 2, 20, 8)
    aux = (0, cfg.num_layers - 1)
    for layout in ("in_out", "out_in"):
        params, laid_cfg = lay_out(init_params(cfg, seed=1), cfg, layout)
        split, split_cfg = lay_out(params, laid_cfg, buffers="per_layer")
        outs = []
        for p, c in ((params, laid_cfg), (split, split_cfg)):
            kv = KVCache.create(c, num_blocks, 8, jnp.float32,
                                hidden_width=len(aux) * c.hidden_size)
            logits, kv = jax.jit(forward, static_argnames=("cfg", "aux_layers"))(
                p, kv, batch, cfg=c, aux_layers=aux)
            dense = dense_forward(p, jnp.arange(9), cfg=c, aux_layers=aux)
            outs.append((logits, kv.k, kv.v, kv.h, *dense))
        for a, b in zip(*outs):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_the_engine_decodes_the_same_with_per_layer_buffers(engine_models, bf16_models,
                                                              ten_prompts, greedy_reference,
                                                              mixed_prompts, monkeypatch):
    """fp32 greedy decoding with the target's buffers per layer reproduces the suite's
    reference; in bf16 (laid out 'out_in' too) speculative decoding gives what plain decoding
    gives each prompt."""
    monkeypatch.setenv(weight_layout.BUFFERS_ENV, "per_layer")
    engine = make_engine(engine_models[0], None)
    assert engine.target.cfg.layer_buffers == "per_layer"
    greedy = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    outs = run_to_completion(engine, ten_prompts, greedy)
    assert [outs[str(i)].token_ids for i in range(len(ten_prompts))] == greedy_reference
    monkeypatch.setenv(weight_layout.ENV, "out_in")
    _, spec = speculative_equals_plain(bf16_models, mixed_prompts[:4])
    assert spec.runner.pool[0].cfg.layer_buffers == "stacked"  # the draft loop's: stacked
    assert spec.limits.layer_buffers == "per_layer"


def test_only_an_answer_two_measurements_agree_on_is_kept(monkeypatch, tmp_path):
    """A measurement that flips the choice (a busy moment) is outvoted: where the first two
    disagree a third decides, and that answer is what the cache keeps."""
    monkeypatch.setenv("JSPEC_CACHE", str(tmp_path))
    for answers, kept in ([("a", 1.0), ("a", 2.0)], ("a", 2.0)), \
            ([("a", 1.0), ("b", 2.0), ("b", 3.0)], ("b", 3.0)), \
            ([("b", 1.0), ("a", 2.0), ("b", 3.0)], ("b", 3.0)):
        pending = list(answers)
        key = {"case": len(list(tmp_path.rglob("*.json")))}
        assert weight_layout._cached("probe", key, ("a", "b"), lambda: pending.pop(0)) == kept
        assert not pending  # measured as many times as it took, no more
        assert weight_layout._cached("probe", key, ("a", "b"), pytest.fail) == (kept[0], None)


def test_the_buffer_choice_is_cached_and_keeps_stacked_without_a_clear_win(
        probe_params, fake_probe, monkeypatch, tmp_path, capsys):
    cfg, params = probe_params
    monkeypatch.setenv(weight_layout.BUFFERS_ENV, "auto")
    calls, fake = fake_probe("measure_buffers", lambda layers, cfg, layout: (
        sorted(layers), layout, layers["wo"].shape))
    fake({"stacked": 1.0, "per_layer": 0.93})  # inside the margin
    assert weight_layout.choose_buffers(cfg, params, "out_in") == "stacked"
    # probed laid out as asked: [L, out, in]
    assert calls == [(sorted(weight_layout.PROJECTIONS), "out_in",
                      (cfg.num_layers, cfg.hidden_size, cfg.q_size))] * 2
    assert "layer weights 'stacked'" in capsys.readouterr().err
    assert weight_layout.choose_buffers(cfg, params, "out_in") == "stacked"
    assert len(calls) == 2  # cached
    assert weight_layout.choose_buffers(cfg, params, "in_out") == "stacked"
    assert len(calls) == 4  # another layout is another entry
    monkeypatch.setenv("JSPEC_CACHE", str(tmp_path / "other"))
    fake({"stacked": 1.0, "per_layer": 0.7})
    assert weight_layout.choose_buffers(cfg, params, "out_in") == "per_layer"


def test_a_model_too_deep_for_the_memory_maps_stays_stacked_unmeasured(
        probe_params, monkeypatch, capsys):
    from jspec import memory_maps

    cfg, params = probe_params
    monkeypatch.setenv(weight_layout.BUFFERS_ENV, "auto")
    monkeypatch.setattr(weight_layout, "measure_buffers", lambda *a: pytest.fail("measured"))
    # the default limit holds 40 layers per layer (20 maps x 40 executables each, half of it)
    assert weight_layout.per_layer_fits(40, 65530) and not weight_layout.per_layer_fits(41, 65530)
    assert weight_layout.per_layer_fits(10_000, None)  # no limit to read
    limit = 2 * weight_layout.per_layer_maps(cfg.num_layers) - 1  # one map short
    monkeypatch.setattr(memory_maps, "map_limit", lambda: limit)
    assert weight_layout.choose_buffers(cfg, params, "in_out") == "stacked"
    err = capsys.readouterr().err
    assert (f"{cfg.num_layers} layers held per layer would take about "
            f"{weight_layout.per_layer_maps(cfg.num_layers):,} of the {limit:,} memory maps") in err
    monkeypatch.setenv(weight_layout.BUFFERS_ENV, "per_layer")  # the override still rules
    assert weight_layout.choose_buffers(cfg, params, "in_out") == "per_layer"


def test_the_buffer_probe_runs_the_first_layers_that_hold_its_bytes(probe_params, monkeypatch):
    cfg, params = probe_params
    layers = weight_layout.probe_layers(params, cfg, "in_out")
    assert layers["wqkv"].shape[0] == cfg.num_layers  # a small model: every layer
    seconds = weight_layout.measure_buffers(layers, cfg, "in_out")
    assert set(seconds) == {"stacked", "per_layer"} and min(seconds.values()) > 0
    one_layer = sum(params["layers"][k][0].nbytes for k in weight_layout.PROJECTIONS)
    monkeypatch.setattr(weight_layout, "PROBE_BYTES", one_layer + 1)
    layers = weight_layout.probe_layers(params, cfg, "out_in")
    assert layers["wo"].shape == (2, cfg.hidden_size, cfg.q_size)
    np.testing.assert_array_equal(layers["wo"][1], params["layers"]["wo"][1].T)


def test_the_buffer_override_and_what_keeps_stacked(probe_params, monkeypatch):
    from jspec.models import sharding

    cfg, params = probe_params
    monkeypatch.setattr(weight_layout, "measure_buffers", lambda *a: pytest.fail("measured"))
    for buffers in ("stacked", "per_layer"):
        monkeypatch.setenv(weight_layout.BUFFERS_ENV, buffers)
        assert weight_layout.choose_buffers(cfg, params, "in_out") == buffers
    monkeypatch.setenv(weight_layout.BUFFERS_ENV, "auto")
    assert weight_layout.choose_buffers(cfg, params, "in_out", tensor_parallel_size=2) == "stacked"
    split, split_cfg = lay_out(params, cfg, buffers="per_layer")
    assert weight_layout.choose_buffers(split_cfg, split, "in_out") == "per_layer"
    monkeypatch.setenv(weight_layout.BUFFERS_ENV, "per_layer")
    with pytest.raises(ValueError, match="JSPEC_LAYER_BUFFERS=per_layer: tensor parallelism"):
        weight_layout.choose_buffers(cfg, params, "in_out", tensor_parallel_size=2)
    monkeypatch.setenv(weight_layout.BUFFERS_ENV, "rows")
    with pytest.raises(ValueError, match="JSPEC_LAYER_BUFFERS='rows': expected one of auto, "
                                         "stacked, per_layer"):
        weight_layout.choose_buffers(cfg, params, "in_out")
    with pytest.raises(ValueError, match="shards stacked layer weights, got 'per_layer'"):
        sharding.shard_params(split, split_cfg, types.SimpleNamespace(size=2))


def test_a_row_floor_pads_single_rows_and_keeps_the_product():
    from jspec.models.transformer import project

    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.standard_normal((16, 24)), jnp.float32)
    x = jnp.asarray(rng.standard_normal((1, 16)), jnp.float32)
    for layout, weight in (("in_out", w), ("out_in", w.T)):
        padded = jax.jit(lambda x, w: project(x, w, layout, min_rows=2))(x, weight)
        assert padded.shape == (1, 24)
        np.testing.assert_allclose(padded, x @ w, rtol=1e-5, atol=1e-5)
    hlo = jax.jit(lambda x, w: project(x, w, "in_out", min_rows=2)).lower(x, w).as_text()
    assert "tensor<2x16xf32>" in hlo  # the product runs over two rows
    wide = jnp.ones((3, 16), jnp.float32)  # rows enough: nothing padded
    hlo = jax.jit(lambda x, w: project(x, w, "in_out", min_rows=2)).lower(wide, w).as_text()
    assert "pad" not in hlo
    with pytest.raises(ValueError, match="min_dot_rows must be a positive integer"):
        tiny_config("llama", min_dot_rows=0)


def test_the_engine_decodes_the_same_with_single_rows_padded(engine_models, bf16_models,
                                                           ten_prompts, greedy_reference,
                                                           mixed_prompts, monkeypatch):
    """With every model's single rows padded to two, fp32 greedy decoding one sequence at a
    time reproduces the suite's reference: plainly, by a target without batch-invariant
    numerics (whose single rows are then padded), and with a draft (the draft loop's are); in
    bf16 speculative decoding gives what plain decoding gives each prompt."""
    monkeypatch.setenv(weight_layout.ROWS_ENV, "2")
    greedy = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    for draft in (None, engine_models[1]):
        options = {} if draft is None else {"policy_options": (("gamma", 3),)}
        engine = make_engine(engine_models[0], draft, deterministic=False, max_num_seqs=1,
                             **options)
        assert engine.target.cfg.min_dot_rows == 2
        outs = run_to_completion(engine, ten_prompts[:4], greedy)
        assert [outs[str(i)].token_ids for i in range(4)] == greedy_reference[:4]
    assert engine.runner.pool[0].cfg.min_dot_rows == 2
    assert engine.metrics.spec_decode_num_accepted_tokens > 0
    _, spec = speculative_equals_plain(bf16_models, mixed_prompts[:4])
    assert spec.runner.pool[0].cfg.min_dot_rows == 2


def test_the_row_floor_is_cached_and_pads_only_for_a_clear_win(
        probe_params, fake_probe, monkeypatch, tmp_path, capsys):
    cfg, params = probe_params
    monkeypatch.setenv(weight_layout.ROWS_ENV, "auto")
    calls, fake = fake_probe("measure_rows", lambda weights, layout: (
        sorted(weights), layout, weights["wo"].shape))
    fake({"1": 1.0, "2": 0.97})  # inside the margin
    laid, laid_cfg = lay_out(params, cfg, "out_in", "per_layer")
    assert weight_layout.choose_min_rows(laid_cfg, laid) == 1
    # the first layer's weights as the model holds them: [out, in]
    assert calls == [(sorted([*weight_layout.PROJECTIONS, "lm_head"]), "out_in",
                      (cfg.hidden_size, cfg.q_size))] * 2
    assert "dot rows 1" in capsys.readouterr().err
    assert weight_layout.choose_min_rows(laid_cfg, laid) == 1 and len(calls) == 2  # cached
    monkeypatch.setenv("JSPEC_CACHE", str(tmp_path / "other"))
    fake({"1": 1.0, "2": 0.5})
    assert weight_layout.choose_min_rows(cfg, params) == 2
    # what laid_out gives the engine: every model gets its own measured floor
    assert weight_layout.laid_out(cfg, params, "in_out", drafts=True)[1].min_dot_rows == 2
    # chosen already, or forced: nothing measured
    monkeypatch.setattr(weight_layout, "measure_rows", lambda *a: pytest.fail("measured"))
    chosen = dataclasses.replace(cfg, min_dot_rows=2)
    assert weight_layout.choose_min_rows(chosen, params) == 2
    monkeypatch.setenv(weight_layout.ROWS_ENV, "1")
    assert weight_layout.choose_min_rows(cfg, params) == 1
    monkeypatch.setenv(weight_layout.ROWS_ENV, "3")
    with pytest.raises(ValueError, match="JSPEC_DOT_ROWS='3': expected one of auto, 1, 2"):
        weight_layout.choose_min_rows(cfg, params)


def test_the_real_row_probe_times_both_floors(probe_params):
    cfg, params = probe_params
    laid, laid_cfg = lay_out(params, cfg, "out_in", "per_layer")
    weights = weight_layout.probe_weights(laid, laid_cfg)
    np.testing.assert_array_equal(weights["w_gate_up"], params["layers"]["w_gate_up"][0].T)
    seconds = weight_layout.measure_rows(weights, "out_in")
    assert set(seconds) == {"1", "2"} and min(seconds.values()) > 0
