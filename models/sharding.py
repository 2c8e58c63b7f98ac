"""Tensor parallelism: where every parameter and KV-pool axis lives on a 1-D device mesh.

The rules are Megatron's (Shoeybi et al., 2019, §3): in each layer the q/k/v projections and the
MLP's gate/up projections are column-parallel (each device holds whole attention heads and a
slice of the intermediate width), the output projection and the MLP's down projection are
row-parallel (each device holds the matching input rows and the partial products are summed
across the mesh: two all-reduces per layer). The KV pools follow the heads: each device keeps
its own KV heads for every block, so attention runs per device on its own heads with no
communication. The vocabulary is split too: the embedding by rows (a looked-up row lives on
one device; the others contribute zeros to an all-reduce) and the output head by columns (the
logits are gathered), because on a real model (Qwen2.5: 152k x 3.6k) a replicated head is the
largest single read of a decode step on every device; a vocabulary that does not divide by the
mesh keeps both replicated. Norms and biases of row-parallel layers stay replicated.

The runtime pytree fuses q, k, v into one ``wqkv`` and gate, up into one ``w_gate_up``
(models/params.py). Splitting those fused columns evenly would hand device 0 all of q and part
of k, so before sharding their columns are reordered shard-major (``shard_major``): device s
holds [q_s | k_s | v_s] and [gate_s | up_s], a fused matrix of the same form for a model with
1/N of the heads and intermediate width (``local_config``). Inside ``shard_map`` every device
then runs the unchanged layer code on that local model (jspec.models.transformer.forward).

The draft models stay replicated (the runner's choice, jspec/runner.py says why).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jspec.models.config import ModelConfig
from jspec.models.params import param_shapes

AXIS = "tp"
# KV pools are [layers, blocks, block_size, kv_heads, head_dim]: split over KV heads
KV_SPEC = P(None, None, None, AXIS, None)
REPLICATED = P()


def make_mesh(tensor_parallel_size: int, devices=None) -> Mesh | None:
    """A 1-D mesh over the first ``tensor_parallel_size`` devices (JAX's global device list, so
    after ``jax.distributed.initialize`` it spans hosts); None for 1 (no mesh, one device)."""
    if not isinstance(tensor_parallel_size, int) or tensor_parallel_size < 1:
        raise ValueError(f"tensor_parallel_size must be a positive integer, got "
                         f"{tensor_parallel_size!r}")
    if tensor_parallel_size == 1:
        return None
    devices = list(jax.devices() if devices is None else devices)
    if tensor_parallel_size > len(devices):
        hint = (f"; on CPU start the process with XLA_FLAGS="
                f"--xla_force_host_platform_device_count={tensor_parallel_size} to split it into "
                "that many devices" if devices[0].platform == "cpu" else "")
        raise ValueError(f"tensor_parallel_size={tensor_parallel_size} needs "
                         f"{tensor_parallel_size} devices; JAX sees {len(devices)} "
                         f"({devices[0].platform}){hint}")
    return Mesh(np.array(devices[:tensor_parallel_size]), (AXIS,))


def check_shardable(cfg: ModelConfig, tp: int, role: str = "target") -> None:
    """Every head and intermediate column must land on exactly one device: refuse otherwise,
    naming what does not divide."""
    for name in ("num_kv_heads", "num_heads", "intermediate_size"):
        value = getattr(cfg, name)
        if value % tp:
            raise ValueError(f"tensor_parallel_size={tp} does not divide the {role}'s {name} "
                             f"({value}): each device must hold whole heads; choose a size "
                             f"that divides {value}")


def vocab_sharded(cfg: ModelConfig, tp: int) -> bool:
    return tp > 1 and cfg.vocab_size % tp == 0


def local_config(cfg: ModelConfig, tp: int) -> ModelConfig:
    """The model one device computes: its share of the heads and of the intermediate width."""
    return dataclasses.replace(cfg, num_heads=cfg.num_heads // tp,
                               num_kv_heads=cfg.num_kv_heads // tp,
                               intermediate_size=cfg.intermediate_size // tp)


def param_specs(cfg: ModelConfig, tp: int) -> dict:
    """A PartitionSpec per parameter (same structure as jspec.models.params.param_shapes)."""
    vocab = vocab_sharded(cfg, tp)
    column, row = P(None, None, AXIS), P(None, AXIS, None)
    rules = {"attn_norm": REPLICATED, "wqkv": column, "bqkv": P(None, AXIS), "wo": row,
             "bo": REPLICATED, "mlp_norm": REPLICATED, "w_gate_up": column, "w_down": row}
    shapes = param_shapes(cfg)
    return {"embed": P(AXIS, None) if vocab else REPLICATED,
            "layers": {name: rules[name] for name in shapes["layers"]},
            "final_norm": REPLICATED,
            "lm_head": P(None, AXIS) if vocab else REPLICATED}


def _qkv_columns(cfg: ModelConfig, tp: int) -> np.ndarray:
    q, kv = cfg.q_size, cfg.kv_size
    parts = []
    for s in range(tp):
        parts += [np.arange(s * q // tp, (s + 1) * q // tp),
                  q + np.arange(s * kv // tp, (s + 1) * kv // tp),
                  q + kv + np.arange(s * kv // tp, (s + 1) * kv // tp)]
    return np.concatenate(parts)


def _gate_up_columns(cfg: ModelConfig, tp: int) -> np.ndarray:
    inter = cfg.intermediate_size
    parts = []
    for s in range(tp):
        chunk = np.arange(s * inter // tp, (s + 1) * inter // tp)
        parts += [chunk, inter + chunk]
    return np.concatenate(parts)


def shard_major(params: dict, cfg: ModelConfig, tp: int) -> dict:
    """``params`` with the fused projections' columns reordered so an even split over ``tp``
    devices gives each its own [q_s | k_s | v_s] and [gate_s | up_s] (identity for tp = 1)."""
    if tp == 1:
        return params
    qkv, gate_up = _qkv_columns(cfg, tp), _gate_up_columns(cfg, tp)
    layers = dict(params["layers"])
    layers["wqkv"] = layers["wqkv"][:, :, qkv]
    if "bqkv" in layers:
        layers["bqkv"] = layers["bqkv"][:, qkv]
    layers["w_gate_up"] = layers["w_gate_up"][:, :, gate_up]
    return dict(params, layers=layers)


def shard_params(params: dict, cfg: ModelConfig, mesh: Mesh) -> dict:
    """Place a model's params on ``mesh`` by the rules above. Host (numpy) params go straight to
    their shards, so a model larger than one device's memory never lands on one device whole."""
    tp = mesh.size
    check_shardable(cfg, tp)
    if cfg.weight_layout != "in_out":  # the specs below name the [in, out] axes
        raise ValueError(f"tensor parallelism shards weights laid out 'in_out', got "
                         f"{cfg.weight_layout!r}")
    if cfg.layer_buffers != "stacked":  # the specs below name the stacked [L, ...] arrays
        raise ValueError(f"tensor parallelism shards stacked layer weights, got "
                         f"{cfg.layer_buffers!r}")
    host = jax.tree_util.tree_map(np.asarray, params)
    specs = param_specs(cfg, tp)
    return jax.tree_util.tree_map(lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec)),
                                  shard_major(host, cfg, tp), specs)


def bytes_per_device(tree) -> int:
    """Bytes of ``tree``'s device arrays held by one device (the lowest-numbered one holding the
    first array; under these rules every device of the mesh holds the same share). Arrays in
    host memory (an offloaded draft's pinned_host copy) and numpy arrays do not count. Reads
    shapes and placements only, never the data: a server's metrics thread calls it while the
    engine thread donates the KV pools it lists."""
    # by identity: a tied output head laid out "out_in" is the embedding array itself
    arrays = list({id(a): a for a in jax.tree_util.tree_leaves(tree) if isinstance(a, jax.Array)
                   and a.sharding.memory_kind in (None, "device")}.values())
    if not arrays:
        return 0
    first = min(arrays[0].sharding.device_set, key=lambda d: d.id)
    return sum(math.prod(a.sharding.shard_shape(a.shape)) * a.dtype.itemsize
               for a in arrays if first in a.sharding.device_set)


def replicate(tree, mesh: Mesh):
    """Every leaf of ``tree`` whole on every device of ``mesh`` (the drafts, the inputs).
    Through host memory: on a mesh spanning processes, device_put of an array already on a
    local device built arrays whose shards could not be listed (jax 0.10.2)."""
    where = NamedSharding(mesh, REPLICATED)
    return jax.tree_util.tree_map(lambda a: jax.device_put(np.asarray(a), where), tree)
