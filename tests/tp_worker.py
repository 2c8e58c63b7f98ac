"""Run by tests/test_tensor_parallel.py in a subprocess started with XLA_FLAGS splitting the CPU
into 4 devices (XLA reads it once per process, and the test process already runs JAX on one).

For each model family and tensor_parallel_size it decodes the same prompts greedily with and
without speculation, and prints one JSON object: the tokens, the compilations after warm-up and
where the params and KV pools ended up.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time

import jax
import numpy as np

from jspec.bench import model_step
from jspec.config import EngineConfig
from jspec.engine import LLMEngine
from jspec.runner import LoadedModel, compile_events
from jspec.sampling_params import SamplingParams
from jspec.models.params import init_params
from jspec.models.tiny import DRAFT_OVERRIDES, tiny_config

# few shapes (and no logprobs buckets): every engine below compiles its buckets anew
ENGINE_KW = dict(dtype="float32", max_num_seqs=2, max_model_len=96, max_num_batched_tokens=16,
                 num_speculative_tokens=3, block_size=16, min_token_bucket=16, max_logprobs=0)
VOCAB = 256
RUNS = {"qwen2": [(1, True), (2, False), (4, True)],
        "llama": [(1, True), (4, True)]}


def spec_of(array) -> str:
    return str(getattr(array.sharding, "spec", "single-device"))


def pallas_under_shard_map(vocab: int = VOCAB, tp: int = 2, backend: str = "interpret"
                           ) -> float:
    """The shard_mapped forward on ``tp`` devices with the ``backend`` attention (the Pallas
    kernel in interpret mode by default) against the single-device reference forward: max
    |logit difference|. A vocabulary that ``tp`` does not divide keeps embedding and head
    replicated."""
    import functools

    import jax.numpy as jnp
    from jax.sharding import NamedSharding

    from jspec.models import sharding
    from jspec.models.transformer import KVCache, ModelInput, forward
    from jspec.kernels.backend import attention_fn
    from jspec.kernels.ragged_paged_attention import AttentionMetadata

    cfg = tiny_config("qwen2", vocab_size=vocab, num_heads=8, num_kv_heads=4)
    params = init_params(cfg, seed=3, std=0.2)
    i32 = lambda *v: np.array(v, np.int32)  # noqa: E731
    # a 3-token prefill chunk and a 2-token verify window over 17 cached tokens, one padding
    batch = ModelInput(i32(5, 7, 9, 11, 13, 0),
                       AttentionMetadata(positions=i32(0, 1, 2, 17, 18, 0),
                                         cu_q_lens=i32(0, 3, 5), kv_lens=i32(3, 19),
                                         page_table=i32([1, 0], [2, 3])),
                       i32(2, 3, 4))
    kv = KVCache.create(cfg, 4, 16, jnp.float32)
    kv = KVCache(kv.k.at[:, 2:4].set(0.5), kv.v.at[:, 2:4].set(-0.25))  # some cached context
    reference, _ = jax.jit(functools.partial(forward, cfg=cfg))(params, kv, batch)
    mesh = sharding.make_mesh(tp)
    sharded, _ = jax.jit(functools.partial(forward, cfg=cfg, mesh=mesh,
                                           attention_fn=attention_fn(backend)))(
        sharding.shard_params(params, cfg, mesh),
        jax.device_put(kv, NamedSharding(mesh, sharding.KV_SPEC)),
        sharding.replicate(batch, mesh))
    return float(jnp.abs(sharded - reference).max())


def main() -> None:
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, VOCAB, size=n).tolist() for n in (5, 23, 40)]
    sp = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    report = {"devices": len(jax.devices()), "runs": []}
    for family, runs in RUNS.items():
        # GQA (8 query heads over 4 KV heads): divisible by 4 devices
        cfg = tiny_config(family, vocab_size=VOCAB, num_heads=8, num_kv_heads=4)
        params = init_params(cfg, seed=0, std=0.2)
        noise = np.random.default_rng(1)
        noisy = jax.tree_util.tree_map(
            lambda a: a + 0.003 * noise.standard_normal(a.shape).astype(np.float32), params)
        target, draft = LoadedModel(cfg, params, "target"), LoadedModel(cfg, noisy, "draft")
        small_cfg = tiny_config(family, vocab_size=VOCAB, **DRAFT_OVERRIDES)  # 1 KV head
        small = LoadedModel(small_cfg, init_params(small_cfg, seed=5, std=0.2), "small")
        for tp, speculate in runs:
            engine = LLMEngine(target, draft if speculate else None,
                               EngineConfig(**dict(ENGINE_KW, tensor_parallel_size=tp,
                                                   policy="static" if speculate else "off")))
            before, t0 = compile_events(), time.perf_counter()
            for i, p in enumerate(prompts):
                engine.add_request(str(i), p, sp)
            tokens = {}
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        tokens[out.request_id] = list(out.token_ids)
            r = engine.runner
            layers = r.target.params["layers"]
            report["runs"].append({
                "family": family, "tp": tp, "speculate": speculate, "tokens": tokens,
                "compiles_after_warmup": compile_events() - before,
                "accepted": engine.metrics.spec_decode_num_accepted_tokens,
                "specs": {"wqkv": spec_of(layers["wqkv"]), "wo": spec_of(layers["wo"]),
                          "w_gate_up": spec_of(layers["w_gate_up"]),
                          "w_down": spec_of(layers["w_down"]),
                          "embed": spec_of(r.target.params["embed"]),
                          "lm_head": spec_of(r.target.params["lm_head"]),
                          "target_kv": spec_of(r.target_kv.k),
                          "draft_params": spec_of(r.draft.params["layers"]["wqkv"])
                          if r.draft else None,
                          "draft_kv": spec_of(r.draft_kv.k) if r.draft else None},
                "kv_devices": len(r.target_kv.k.sharding.device_set),
                "device_bytes": r.device_bytes(), "seconds": time.perf_counter() - t0,
            })
        # a draft whose heads do not divide stays whole: replicated, so it runs
        if family == "qwen2":
            engine = LLMEngine(target, small, EngineConfig(**ENGINE_KW, tensor_parallel_size=4,
                                                           warmup=False))
            engine.add_request("0", prompts[0], sp)
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        report["small_draft_tp4_tokens"] = list(out.token_ids)
    report["pallas_max_abs_diff"] = pallas_under_shard_map()
    report["odd_vocab_max_abs_diff"] = pallas_under_shard_map(vocab=VOCAB + 2, tp=4,
                                                              backend="reference")
    # `jspec bench model-step --tensor-parallel-size 2` (its tables go to stderr here)
    parser = argparse.ArgumentParser()
    model_step.add_arguments(parser)
    args = parser.parse_args(["--small", "--tensor-parallel-size", "2", "--dtypes", "fp32",
                              "--batch-sizes", "1", "--query-lens", "1"])
    with contextlib.redirect_stdout(sys.stderr):
        measured = model_step.measure(args)
    report["model_step"] = [{k: r[k] for k in ("model", "weight_bytes", "weight_bytes_per_device",
                                                "params_bytes_per_device", "kv_bytes_per_device")}
                            for r in measured["runs"]]
    json.dump(report, sys.stdout)


if __name__ == "__main__":
    main()
