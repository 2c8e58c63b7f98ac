"""What an engine is built from, checked: the draft pool, the chains the policy may play, the
KV cache's dtype and size, and elastic memory's extension."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from jspec.block_manager import BlockManager
from jspec.config import EngineConfig, ResolvedConfig, resolve
from jspec.elastic import ElasticMemory, extension_blocks, tree_bytes
from jspec.platform import device_free_bytes
from jspec.runner import LoadedModel
from jspec.scheduler import Scheduler, SchedulerConfig
from jspec.models.sharding import check_shardable
from jspec.models.transformer import KVCache
from jspec.policies import Policy, make_policy
from jspec.policies.profile import StepProfile, model_signature
from jspec.policies.static import OffPolicy
from jspec.weight_layout import choose as choose_layout
from jspec.weight_layout import laid_out


def draft_pool(target: LoadedModel, draft) -> list[LoadedModel]:
    """The draft models as a pool, smallest first (by parameter count: SpecRouter's chains run
    from small to large), each sharing the target's vocabulary and named uniquely."""
    if draft is None:
        return []
    pool = [draft] if isinstance(draft, LoadedModel) else list(draft)
    for m in pool:
        if not isinstance(m, LoadedModel):
            raise ValueError(f"a draft must be a LoadedModel, got {type(m).__name__}")
        if m.cfg.vocab_size != target.cfg.vocab_size:
            which = "draft" if len(pool) == 1 else f"draft {m.name!r}"
            raise ValueError(
                f"{which} vocabulary ({m.cfg.vocab_size} tokens) differs from the target's "
                f"({target.cfg.vocab_size}); speculative decoding needs a shared vocabulary")
    pool.sort(key=lambda m: m.cfg.num_params())
    names = [m.name for m in pool]
    if len(set(names)) < len(names):
        # same basename from different directories: number them, smallest first
        for i, m in enumerate(pool):
            pool[i] = dataclasses.replace(m, name=f"{m.name}{i}")
    return pool


def lay_out_weights(config: EngineConfig, target: LoadedModel, pool: list[LoadedModel]
                    ) -> tuple[LoadedModel, list[LoadedModel]]:
    """The target and the pool's draft models with their projection weights in the layout this
    machine multiplies fastest, and the target's layer weights stacked or in a buffer per
    layer, whichever this machine runs faster for it (jspec/weight_layout.py). Draft models keep
    theirs stacked: they run inside the draft loop (a ``while_loop``), where per-layer buffers
    measured slower (docs/benchmarks.md, "Layer buffers"). An EAGLE head keeps its own. In
    deterministic mode the layout is one whose dots are batch-invariant for the target, where
    one is (``weight_layout.choose``)."""
    tp = config.tensor_parallel_size
    layout = choose_layout(target.cfg, target.params, tp, batch_invariant=config.deterministic)

    def converted(m: LoadedModel, drafts: bool) -> LoadedModel:
        if m.eagle is not None:
            return m
        params, cfg = laid_out(m.cfg, m.params, layout, tp, drafts)
        return m if cfg == m.cfg else dataclasses.replace(m, cfg=cfg, params=params)

    return converted(target, False), [converted(m, True) for m in pool]


def check_lookup(config: EngineConfig, pool: list[LoadedModel]) -> tuple[str, ...]:
    """The drafters without a model the engine runs (``speculative_method`` naming "ngram" or
    "suffix"). Alone they run no draft model: a draft given beside them is refused; named with
    "draft_model" they need one. Elastic memory (which offloads the draft model) is refused
    beside a lookup."""
    lookups = config.lookups
    if not lookups:
        return ()
    method = config.speculative_method
    if pool and not config.uses_draft_model:
        raise ValueError(f"speculative_method {method!r} drafts without a draft model, but "
                         f"{len(pool)} draft model(s) were given; give none, or name "
                         f"'draft_model' too (e.g. 'draft_model+{lookups[0]}')")
    if config.uses_draft_model and not pool:
        model = config.drafters[0]
        what = "EAGLE head" if model == "eagle3" else "draft model"
        raise ValueError(f"speculative_method {method!r} names {model!r}, but no {what} was "
                         f"given")
    if config.elastic_memory:
        raise ValueError(f"elastic_memory offloads the draft model; it does not run beside "
                         f"a drafter without one (speculative_method {method!r})")
    return lookups


def check_lookup_policy(policy: Policy, method: str) -> None:
    """A lookup's drafts have no distribution and cost no draft forward: a policy that may
    draft by lookup cannot read the draft's distribution (signals, stop rules, ``select``),
    chain draft models or reason from a draft model's step-time profile."""
    needs = [what for what, needed in (
        (f"the draft distribution's signals {sorted(policy.signals)}", policy.signals),
        ("the draft's confidence and entropy", policy.wants_draft_stats
         or policy.wants_select),
        ("a pool of draft models", policy.wants_pool),
        ("a draft model's step-time profile", policy.needs_profile)) if needed]
    if needs:
        raise ValueError(f"policy {policy.name!r} needs {needs[0]}, which speculative_method "
                         f"{method!r} does not have (it drafts by lookup, with no draft "
                         f"model); use a policy without it, e.g. 'auto', 'static' or 'off'")


def check_chains(policy: Policy, pool_size: int, num_models: int | None = None,
                 heads: frozenset[int] = frozenset()) -> frozenset[tuple[int, ...]]:
    """The chains the policy may play, checked against the pool (its ``num_models`` draft
    models first, then the lookups): indices in range, strictly increasing (each level a
    larger model than the one it verifies), at most two drafts, a lookup and an EAGLE head
    (pool indices ``heads``) only alone."""
    if not pool_size:
        return frozenset()
    num_models = pool_size if num_models is None else num_models
    chains = frozenset(plays(policy))
    for c in chains:
        if (len(c) > 2 or any(not 0 <= m < pool_size for m in c)
                or any(a >= b for a, b in zip(c, c[1:]))):
            raise ValueError(f"policy {policy.name!r} may play chain {c}, which the pool of "
                             f"{pool_size} draft(s) cannot run (pool indices, smallest model "
                             f"first, increasing, at most two drafts)")
        if len(c) > 1 and any(m >= num_models for m in c):
            raise ValueError(f"policy {policy.name!r} may play chain {c}: a drafter without a "
                             f"model drafts alone, it cannot be a level of a chain")
        if len(c) > 1 and heads & set(c):
            raise ValueError(f"policy {policy.name!r} may play chain {c}: an EAGLE head drafts "
                             f"alone, it cannot be a level of a chain")
    return chains


def check_pool(config: EngineConfig, pool: list[LoadedModel]) -> None:
    heads = [m for m in pool if m.eagle is not None]
    if "eagle3" in config.drafters and (len(heads) != 1 or len(pool) != 1):
        raise ValueError(f"speculative_method {config.speculative_method!r} drafts with an "
                         f"EAGLE-3 head: give one head as the draft (got "
                         f"{', '.join(m.name for m in pool) or 'none'})")
    if len(heads) > 1:
        raise ValueError(f"{len(heads)} EAGLE heads were given; an engine drafts with one")
    if heads and config.elastic_memory:
        raise ValueError("elastic_memory offloads a draft model; an EAGLE head drafts from the "
                         "target's hidden states and is not offloaded: turn one of them off")
    if heads and config.tensor_parallel_size > 1:
        raise ValueError("an EAGLE head does not draft beside a tensor-parallel target yet "
                         "(tensor_parallel_size=1, or a draft model)")
    if len(pool) > 1 and config.elastic_memory:
        raise ValueError("elastic_memory offloads one draft model; it does not support a "
                         f"pool of {len(pool)} drafts yet")
    if config.elastic_memory and not pool:
        raise ValueError("elastic_memory offloads the draft model to grow the KV cache; "
                         "it needs a draft")


def kv_dtype_of(config: EngineConfig, target: LoadedModel) -> np.dtype:
    """The KV cache takes the models' dtype unless one is forced."""
    if config.dtype == "auto":
        return np.dtype(jax.tree_util.tree_leaves(target.params)[0].dtype)
    return np.dtype(jax.numpy.dtype(config.dtype))


def size_cache(config: EngineConfig, target: LoadedModel, pool: list[LoadedModel],
               kv_dtype) -> tuple[ResolvedConfig, ElasticMemory | None]:
    """The resolved configuration (KV blocks, buckets) and, with elastic memory, its
    controller state sized to the draft's memory in target blocks."""
    # tensor parallel: each device holds 1/N of the target's KV heads (models/sharding.py),
    # so block bytes, the memory budget and the free memory are all per device
    tp = config.tensor_parallel_size
    if tp > 1:
        check_shardable(target.cfg, tp)
    # an EAGLE head reads the target's hidden states of every token, kept beside its K/V
    hidden = sum(len(m.eagle.aux_layers) * target.cfg.hidden_size for m in pool if m.eagle)
    target_block_bytes = KVCache.bytes_per_block(target.cfg, config.block_size, kv_dtype,
                                                 hidden)
    # every pool model keeps its own KV pool over the same block ids
    draft_block_bytes = sum(KVCache.bytes_per_block(m.cfg, config.block_size, kv_dtype)
                            for m in pool)
    # on an accelerator the pool is sized from the memory left once the weights are loaded
    free = device_free_bytes() if config.num_kv_blocks is None else None
    rc = resolve(config, target.cfg.max_position_embeddings,
                 target_block_bytes // tp + draft_block_bytes, free)
    if not config.elastic_memory:
        return rc, None
    num_ext = extension_blocks(tree_bytes(pool[0].params), draft_block_bytes,
                               target_block_bytes, rc.num_kv_blocks)
    rc = dataclasses.replace(rc, num_extension_blocks=num_ext)
    return rc, ElasticMemory(rc.num_kv_blocks - 1, num_ext, config.elastic_low_watermark,
                             config.elastic_persist_steps)


def engine_policy(config: EngineConfig, policy: Policy | None, target: LoadedModel,
                  pool: list[LoadedModel]) -> tuple[Policy, tuple[str, ...]]:
    """The policy the engine runs (the config's unless one is given; ``off`` without a draft)
    and the pool's names as chains, policy options and metrics call them (one draft is
    "draft" whatever it was loaded as, one EAGLE head "eagle3")."""
    policy = policy or make_policy(config.policy, config.num_speculative_tokens,
                                   **config.policy_kwargs)
    lookups = config.lookups
    if not pool and not lookups and not isinstance(policy, OffPolicy):
        policy = OffPolicy(0)
    lone = "eagle3" if pool and pool[0].eagle is not None else "draft"
    models = tuple(m.name for m in pool) if len(pool) > 1 else (lone,) if pool else ()
    pool_names = models + lookups
    policy.set_pool(pool_names)
    policy.set_lookups(range(len(models), len(pool_names)))
    if lookups and any(m >= len(models) for c in plays(policy) for m in c):
        check_lookup_policy(policy, config.speculative_method)
    profile = getattr(policy, "profile", None)
    if isinstance(profile, StepProfile) and pool:
        profile.check_models(model_signature(target.cfg), model_signature(pool[0].cfg))
    if policy.max_gamma > config.num_speculative_tokens:
        raise ValueError(f"policy max_gamma={policy.max_gamma} exceeds "
                         f"num_speculative_tokens={config.num_speculative_tokens}")
    return policy, pool_names


def plays(policy: Policy) -> set[tuple[int, ...]]:
    """Every chain the policy may plan: its ``possible_chains`` and, for a policy that picks a
    drafter per row (``DraftPlan.drafters``), each of those drafters alone."""
    return ({tuple(int(m) for m in c) for c in policy.possible_chains()}
            | {(int(d),) for d in policy.possible_drafters()})


def make_scheduler(rc: ResolvedConfig, models: list[LoadedModel], lookahead: int
                   ) -> tuple[BlockManager, Scheduler]:
    """The block manager over every model's pool (target first) and the scheduler, reserving
    ``lookahead`` KV slots per decoding sequence (only what the policy can ever use)."""
    config = rc.engine
    block_manager = BlockManager(
        rc.num_kv_blocks + rc.num_extension_blocks, config.block_size,
        rc.num_extension_blocks, enable_caching=config.enable_prefix_caching,
        num_pool_models=max(1, len(models) - 1),
        namespace=repr([model_signature(m.cfg) for m in models]).encode())
    scheduler = Scheduler(SchedulerConfig(
        max_num_seqs=config.max_num_seqs, max_num_batched_tokens=rc.max_num_batched_tokens,
        max_model_len=rc.max_model_len, lookahead_slots=lookahead,
        enable_chunked_prefill=config.enable_chunked_prefill), block_manager)
    return block_manager, scheduler


