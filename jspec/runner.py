"""Model runner: the models' params and KV pools on device, and their compiled step functions.

Every device function is compiled ahead of time once per shape bucket (``jax.jit(...).lower(
specs)``, then ``compile_lowered``) and kept in a process-wide cache keyed by everything that
determines the executable, so two engines over the same models share compilations. ``warmup`` compiles every
bucket the engine can reach; after it, serving never compiles (``compile_events`` counts every XLA
compilation in the process, so tests can assert that).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import threading
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from jspec import device_steps, memory_maps
from jspec.config import ResolvedConfig, resolve_elastic_pool_layout
from jspec.sampler import (SamplingTensors, TokenLogprobs, VerifyResult, rejection_sample,
                           sample_tokens, token_logprobs, verify_signals)
from jspec.models import eagle, sharding
from jspec.models.config import ModelConfig
from jspec.models.params import projection_shapes
from jspec.models.transformer import KVCache, ModelInput
from jspec.kernels import backend as kernel_backend
from jspec.kernels.gpu_lowering import KernelShape
from jspec.kernels import batch_invariance
from jspec.kernels.kv_migration import pad_pairs, validate_pairs
from jspec.kernels.ragged_paged_attention import AttentionMetadata

# ----------------------------------------------------------------------------- compile tracking
_compile_lock = threading.Lock()
_backend_compiles = [0]


def _on_event(event: str, duration: float, **_: Any) -> None:
    if event == "/jax/core/compile/backend_compile_duration":
        _backend_compiles[0] += 1


jax.monitoring.register_event_duration_secs_listener(_on_event)


def compile_events() -> int:
    """XLA backend compilations so far in this process (ours and anyone else's), counting the
    executables loaded from the persistent compilation cache too (``cache_loads``): JAX reports
    both as the same event."""
    return _backend_compiles[0]


_cache_loads = [0]


def _on_cache_event(event: str, **_: Any) -> None:
    if event == "/jax/compilation_cache/cache_hits":
        _cache_loads[0] += 1


jax.monitoring.register_event_listener(_on_cache_event)


def cache_loads() -> int:
    """Executables loaded from XLA's persistent compilation cache so far in this process
    (instead of compiled: ``enable_persistent_compilation_cache``)."""
    return _cache_loads[0]


# Process-wide executables, least recently used first. Bounded, because each XLA:CPU executable
# holds hundreds of memory maps of the few tens of thousands Linux allows a process
# (jspec.memory_maps): by count here, and emptied before a compilation near the limit. An
# engine keeps its own references (ModelRunner._local), so eviction never takes an executable
# from a live engine; it only lets those of dropped engines be freed.
_EXECUTABLES: collections.OrderedDict[tuple, Any] = collections.OrderedDict()
MAX_CACHED_EXECUTABLES = 128


def _drop_cached_executables() -> int:
    dropped = len(_EXECUTABLES)
    _EXECUTABLES.clear()
    return dropped


def enable_persistent_compilation_cache(path: str) -> None:
    """Keep XLA executables on disk across processes (a second start-up of the same models and
    buckets loads instead of compiling: about 4x faster on the CPU here). Process-wide JAX
    setting; the entry points call it, library users may too."""
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


# XLA:CPU options for every executable the runner builds. XLA's MLIR fusion emitters (its
# default) compiled this engine's executables 1.7x slower than the LLVM IR emitters they
# replaced (serve's 28 buckets: 56 s against 33 s) and ran no faster (docs/benchmarks.md,
# "Start-up"). Passed per compilation, not through XLA_FLAGS, so an XLA without the option
# only loses the speed-up (an unknown name in XLA_FLAGS would abort the process).
CPU_COMPILE_OPTIONS = {"xla_cpu_use_fusion_emitters": False}
_cpu_options_known = [True]


def compile_lowered(lowered):
    """``lowered.compile()`` with ``CPU_COMPILE_OPTIONS`` on the CPU backend."""
    if jax.default_backend() == "cpu" and _cpu_options_known[0]:
        try:
            return lowered.compile(compiler_options=CPU_COMPILE_OPTIONS)
        except Exception as e:  # noqa: BLE001 - only "this XLA lacks the option" is handled
            if "No such compile option" not in str(e):
                raise
            _cpu_options_known[0] = False
    return lowered.compile()


@functools.lru_cache(maxsize=None)
def widens_one_row_dots(dtype_name: str) -> bool:
    """Whether XLA widens the weight of a one-row ``dtype_name`` dot to float32 before
    multiplying (XLA:CPU does for bf16, on every call; with two rows it multiplies the bf16
    weight as it is), read from the compiled HLO of such a dot."""
    if jax.default_backend() != "cpu" or dtype_name == "float32":
        return False
    dtype = jnp.dtype(dtype_name)
    x, w = jax.ShapeDtypeStruct((1, 64), dtype), jax.ShapeDtypeStruct((64, 128), dtype)
    dot = jax.jit(lambda x, w: jnp.dot(x, w, preferred_element_type=jnp.float32))
    return "f32[64,128]" in compile_lowered(dot.lower(x, w)).as_text()


def _to_host(a: jax.Array):
    """``a`` copied to its device's host memory (pinned where the platform offers it)."""
    kinds = {m.kind for m in next(iter(a.devices())).addressable_memories()}
    for kind in ("pinned_host", "unpinned_host"):
        if kind in kinds:
            return jax.device_put(a, a.sharding.with_memory_kind(kind))
    return np.asarray(a)


def _spec(tree):
    """Abstract values of ``tree`` (params, a KV pool), keeping their placement on a mesh."""
    def one(a):
        placed = getattr(a, "sharding", None)
        return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=placed if isinstance(
            placed, NamedSharding) else None)

    return jax.tree_util.tree_map(one, tree)


@dataclasses.dataclass
class LoadedModel:
    """A model's config and params. ``eagle``: for an EAGLE-3 head, its ``EagleConfig``
    (``cfg`` is then its one decoder layer's, over the target's vocabulary)."""

    cfg: ModelConfig
    params: dict
    name: str = "model"
    eagle: Any = None


# How a step's drafts are verified: "dist" with the draft model's distribution q, "onehot" a
# lookup's drafts (q one-hot on the drafted token), "mixed" both in one step (a mask per row)
DRAFT_KINDS = ("dist", "onehot", "mixed")


@dataclasses.dataclass(frozen=True)
class CompileSpec:
    """What the policy needs compiled: the γ buckets, the per-position signals it reads
    (``Policy.signals``), whether the draft loop computes its stop statistics
    (``Policy.wants_draft_stats``), the chains of pool models it may play
    (``Policy.possible_chains``; pool models only), and whether a drafter without a
    distribution (a lookup) may draft: its steps verify with a one-hot q
    (``sampler.rejection_sample``). With both, a step may mix them row by row."""

    gamma_buckets: tuple[int, ...] = (0,)
    signals: tuple[str, ...] = ()
    draft_stats: bool = False
    chains: frozenset[tuple[int, ...]] = frozenset({(0,)})
    lookup: bool = False


class ModelRunner:
    def __init__(self, target: LoadedModel, draft: "LoadedModel | list[LoadedModel] | None",
                 rc: ResolvedConfig, kv_dtype, spec: CompileSpec = CompileSpec()):
        self.target = target
        # The draft pool (smallest first): each model has its own KV pool over the same block
        # ids, so one block manager and one page table per sequence serve every model.
        if draft is None:
            self.pool: list[LoadedModel] = []
        elif isinstance(draft, LoadedModel):
            self.pool = [draft]
        else:
            self.pool = list(draft)
        self.rc = rc
        # Tensor parallelism (models/sharding.py): the target's params and KV pool are split
        # over the mesh, everything else (the drafts, their pools, inputs, sampling) is
        # replicated. The drafts stay whole because they are small and latency-bound: split,
        # each of their forwards would add two all-reduces per layer per drafted token for
        # almost no memory saved.
        self.mesh = sharding.make_mesh(rc.engine.tensor_parallel_size)
        if self.mesh is not None:
            self.target = target = dataclasses.replace(
                target, params=sharding.shard_params(target.params, target.cfg, self.mesh))
            self.pool = [dataclasses.replace(m, params=sharding.replicate(m.params, self.mesh))
                         for m in self.pool]
        self.gamma_buckets = spec.gamma_buckets
        self.kv_dtype = kv_dtype
        # what the policy reads: compiled in
        self.signals = tuple(sorted(spec.signals))
        self.draft_stats = bool(spec.draft_stats)
        # the chains the policy may play: what gets compiled
        self.chains = frozenset(c for c in spec.chains if c) if self.pool else frozenset()
        self.lookup = bool(spec.lookup)
        # a pool model's drafts and a lookup's in one step: every step a pool model drafts in
        # verifies with a one-hot mask over the rows (a lookup-only step keeps the cheaper
        # one-hot form), so the engine compiles two kinds of drafting verification, not three
        self.mixed = self.lookup and bool(self.chains)
        # the target's forwards in batch-invariant numerics (EngineConfig.deterministic): what
        # greedy equality with plain decoding needs; the drafts only propose, so they keep the
        # cheaper batch-dependent arithmetic
        self.batch_invariant = rc.engine.deterministic
        if self.batch_invariant:
            # the mode's premise, probed on the target's products in the layout it holds
            # (which weight_layout.choose picked for it where it could) and on the products
            # its norms and attention sum rows with
            batch_invariance.warn_if_unsupported(np.dtype(kv_dtype).name,
                                                 projection_shapes(target.cfg),
                                                 target.cfg.weight_layout)
            batch_invariance.warn_if_unsupported("float32",
                                                 batch_invariance.sum_shapes(target.cfg))
        # Elastic memory's extension (jspec/elastic.py): "segments" adds it to the target's
        # pool as a second array while the draft is offloaded (expand_target_pool) and drops it
        # at contraction; "preallocated" sizes the one array for base + extension from the
        # start. The draft's pool covers the base only: it never runs while the extension is
        # in use.
        self.extension_layout = (resolve_elastic_pool_layout(rc.engine.elastic_pool_layout)
                                 if rc.num_extension_blocks else None)
        # an EAGLE head drafts from the target's hidden states: the target's forwards write
        # them into its pool (KVCache.h) for the layers the head reads
        # (engine_setup.check_pool refuses a head beside tensor parallelism or elastic memory)
        heads = [m.eagle for m in self.pool if m.eagle is not None]
        self.aux_layers: tuple[int, ...] = tuple(heads[0].aux_layers) if heads else ()
        # each kernel's backend, judged at every shape this runner runs it at
        self.kernels = kernel_backend.select(rc.engine.kernel_backend, self._kernel_shapes())
        self.kernel_backend = str(self.kernels)
        self._attn = kernel_backend.attention_fn(self.kernels.attention)
        self._extension_in_use = False
        # blocks of the target's pool as one array: the base, plus the extension if preallocated
        self._one_array_blocks = rc.num_kv_blocks + (
            rc.num_extension_blocks if self.extension_layout == "preallocated" else 0)
        self.target_kv = self._new_kv(target.cfg, self._one_array_blocks, sharding.KV_SPEC,
                                      self.hidden_width)
        self.pool_kv: list[KVCache | None] = [
            self._new_kv(m.cfg, rc.num_kv_blocks, sharding.REPLICATED) for m in self.pool]
        self.draft_resident = bool(self.pool)
        self._draft_host = None  # the draft's params in host memory, once offloaded
        self._one_row_params: dict[int, dict] = {}  # by pool index (``draft_params``)
        self._draft_shardings = None
        self._local: dict[tuple, Any] = {}
        self._no_carry_arrays: dict[int, device_steps.Carried] = {}
        # migration plans run in chunks of one padded size: one compile, done at warm-up
        self.migrate_bucket = min(256, 1 << (max(16, rc.num_extension_blocks) - 1).bit_length())
        self.num_compiled = 0  # executables this runner had to build (not found in the cache)
        self.compile_seconds = 0.0

    def _kernel_shapes(self) -> list[KernelShape]:
        """Every model's layers over its pool, and the target's pool as two segments where
        elastic memory's "segments" layout extends it."""
        shape = functools.partial(KernelShape.of_model, block_size=self.rc.engine.block_size,
                                  dtype=self.kv_dtype)
        shapes = [shape(self.target.cfg)] + [shape(m.cfg) for m in self.pool]
        if self.extension_layout == "segments":
            shapes.append(shape(self.target.cfg, segments=2))
        return shapes

    def _new_kv(self, cfg: ModelConfig, num_blocks: int, spec, hidden_width: int = 0
                ) -> KVCache:
        """An empty KV pool; on a mesh, placed by ``spec``."""
        where = None if self.mesh is None else NamedSharding(self.mesh, spec)
        return KVCache.create(cfg, num_blocks, self.rc.engine.block_size, self.kv_dtype, where,
                              hidden_width)

    @property
    def hidden_width(self) -> int:
        """Width of the target's captured hidden states (``KVCache.h``; 0: no EAGLE head)."""
        return len(self.aux_layers) * self.target.cfg.hidden_size

    @property
    def eagle_first_width(self) -> int:
        """Tokens per row in an EAGLE head's first draft forward: what it has not taken yet,
        at most the accepted tokens and the bonus of the longest draft; longer lags (after
        plain steps, a prompt) are caught up first."""
        return max(self.gamma_buckets) + 1

    def _sds(self, shape: tuple, dtype) -> jax.ShapeDtypeStruct:
        """An input's abstract value: replicated over the mesh when there is one."""
        placed = None if self.mesh is None else NamedSharding(self.mesh, sharding.REPLICATED)
        return jax.ShapeDtypeStruct(shape, dtype, sharding=placed)

    def _compile(self, fn, specs, donate_kv: bool = False):
        """``fn`` compiled for ``specs`` (the KV pool, argument 1, donated if ``donate_kv``).
        On a mesh every output is placed explicitly: a KV pool as its input was, everything
        else replicated, so each executable's outputs are what the next one was compiled for."""
        donate = (1,) if donate_kv else ()
        if self.mesh is None:
            return compile_lowered(jax.jit(fn, donate_argnums=donate).lower(*specs))
        replicated = NamedSharding(self.mesh, sharding.REPLICATED)
        is_kv = lambda x: isinstance(x, KVCache)  # noqa: E731
        out = jax.tree_util.tree_map(
            lambda x: specs[1].k.sharding if is_kv(x) else replicated,
            jax.eval_shape(fn, *specs), is_leaf=is_kv)
        return compile_lowered(jax.jit(fn, donate_argnums=donate, out_shardings=out)
                               .lower(*specs))

    # The pool's first model is "the draft" of single-draft policies and of elastic memory.
    @property
    def draft(self) -> LoadedModel | None:
        return self.pool[0] if self.pool else None

    @draft.setter
    def draft(self, model: LoadedModel) -> None:
        self.pool[0] = model

    @property
    def draft_kv(self) -> KVCache | None:
        return self.pool_kv[0] if self.pool_kv else None

    @draft_kv.setter
    def draft_kv(self, kv: KVCache | None) -> None:
        self.pool_kv[0] = kv

    @property
    def drafters(self) -> list[int]:
        """Pool models that start some chain (they run the draft loop)."""
        return sorted({c[0] for c in self.chains})

    @property
    def intermediates(self) -> list[int]:
        """Pool models that verify inside some chain."""
        return sorted({m for c in self.chains for m in c[1:]})

    # ------------------------------------------------------------------ executables
    def _executable(self, key: tuple, model: LoadedModel | None, build: Callable[[], Any]):
        """The compiled function for ``key``, from this runner, the process cache, or built.

        The process-wide key holds everything the executable depends on: the model it runs
        (config and param dtype), the pool geometry and the attention backend, so an engine with
        or without a draft shares the target's executables with any other over the same target.
        """
        exe = self._local.get(key)
        if exe is not None:
            return exe
        model_key = None if model is None else (
            model.cfg, str(jax.tree_util.tree_leaves(model.params)[0].dtype))
        if model is not None and model.eagle is not None:
            # heads over one layer shape differ in their vocabulary, embedding and inputs
            model_key += (model.eagle, jax.tree_util.tree_structure(model.params),
                          tuple(a.shape for a in jax.tree_util.tree_leaves(model.params)))
        # sampling-only executables (model None) do not touch the KV pool
        geometry = () if model is None else (str(self.kv_dtype), self.rc.num_kv_blocks,
                                             self.rc.num_extension_blocks,
                                             self.extension_layout,
                                             self.rc.engine.block_size, self.rc.max_pages,
                                             self.kernels, self.batch_invariant,
                                             self.aux_layers)
        mesh = () if self.mesh is None else tuple(d.id for d in self.mesh.devices.flat)
        full_key = (key, model_key, geometry, mesh)
        # One compilation at a time, process-wide: building executables on several threads at
        # once crashed inside JAX's persistent-cache write (jax 0.10.2), and measured barely
        # faster on two cores (XLA's compile is itself multi-threaded).
        with _compile_lock:
            exe = _EXECUTABLES.get(full_key)
            if exe is None:
                memory_maps.make_room(_drop_cached_executables)
                t0 = time.perf_counter()
                exe = build()
                self.compile_seconds += time.perf_counter() - t0
                self.num_compiled += 1
                _EXECUTABLES[full_key] = exe
                while len(_EXECUTABLES) > MAX_CACHED_EXECUTABLES:
                    _EXECUTABLES.popitem(last=False)
            else:
                _EXECUTABLES.move_to_end(full_key)
        self._local[key] = exe
        return exe

    def _input_spec(self, num_tokens: int, num_seqs: int, num_logits: int) -> ModelInput:
        i32 = jnp.int32
        return ModelInput(
            input_ids=self._sds((num_tokens,), i32),
            attn=AttentionMetadata(
                positions=self._sds((num_tokens,), i32),
                cu_q_lens=self._sds((num_seqs + 1,), i32),
                kv_lens=self._sds((num_seqs,), i32),
                page_table=self._sds((num_seqs, self.rc.max_pages), i32),
            ),
            logits_indices=self._sds((num_logits,), i32),
        )

    def _sampling_spec(self, num_seqs: int) -> SamplingTensors:
        s = (num_seqs,)
        return SamplingTensors(
            temperature=self._sds(s, jnp.float32),
            top_k=self._sds(s, jnp.int32),
            top_p=self._sds(s, jnp.float32),
            seeds=self._sds(s, jnp.uint32),
            counters=self._sds(s, jnp.int32),
        )

    @property
    def _segmented(self) -> bool:
        """Whether the target's pool is two arrays now (expanded, "segments" layout): the
        executables for that shape run."""
        return self._extension_in_use and self.extension_layout == "segments"

    def _target_kv_spec(self, segmented: bool) -> KVCache:
        """Shapes of the target's pool: one array, or base + extension segments."""
        cfg, bs, rc = self.target.cfg, self.rc.engine.block_size, self.rc
        placed = None if self.mesh is None else NamedSharding(self.mesh, sharding.KV_SPEC)

        def seg(n):
            return jax.ShapeDtypeStruct((cfg.num_layers, n, bs, cfg.num_kv_heads, cfg.head_dim),
                                        self.kv_dtype, sharding=placed)

        if segmented:
            segs = (seg(rc.num_kv_blocks), seg(rc.num_extension_blocks))
            return KVCache(segs, segs)
        one = seg(self._one_array_blocks)
        h = (jax.ShapeDtypeStruct((self._one_array_blocks, bs, self.hidden_width), self.kv_dtype)
             if self.hidden_width else None)
        return KVCache(one, one, h)

    def _attention(self, max_q_len: int | None, target: bool = False):
        """The attention function, told (statically) that no sequence brings more than
        ``max_q_len`` new tokens when that is known: a decode-only verification then attends in
        one query tile per sequence instead of the ragged bound's 2-2.5 times as many, each of
        which gathers its sequence's whole context (``_tile_plan``). The target's is
        batch-invariant when ``batch_invariant`` is set (the Pallas kernel then keeps one
        query-tile shape per model and cuts the context at fixed places)."""
        kwargs = {} if max_q_len is None else {"max_q_len": max_q_len}
        if target and self.batch_invariant:
            kwargs["batch_invariant"] = True
        return functools.partial(self._attn, **kwargs) if kwargs else self._attn

    def verify_executable(self, num_tokens: int, num_seqs: int, gamma: int,
                          segmented: bool = False, decode_only: bool = False):
        """The target forward over a ragged batch; with γ > 0 the drafted tokens are scattered
        into their placeholder slots on device first. γ = 0 takes no draft arguments at all.
        ``segmented``: over the pool with its extension segment (γ = 0 only). ``decode_only``:
        every sequence brings at most γ + 1 tokens (the forward inside
        ``verify_accept_executable``, which the step benchmark replays alone)."""
        def build():
            opts = self._target_options(gamma + 1 if decode_only else None)
            specs = [_spec(self.target.params), self._target_kv_spec(segmented),
                     self._input_spec(num_tokens, num_seqs, num_seqs * (gamma + 1))]
            fn = (functools.partial(device_steps.verify_forward, opts=opts) if gamma
                  else opts.forward)
            if gamma:
                specs += [self._sds((num_seqs, gamma), jnp.int32)] * 2
            return self._compile(fn, specs, donate_kv=True)

        return self._executable(("verify", num_tokens, num_seqs, gamma, segmented, decode_only),
                                self.target, build)

    def verify_accept_executable(self, num_seqs: int, gamma: int, segmented: bool = False,
                                 kind: str = "dist"):
        """A decode-only step (num_seqs * (1 + γ) tokens): forward and sampling in one call.
        ``kind`` (``DRAFT_KINDS``): the drafts' distribution."""
        num_tokens = num_seqs * (1 + gamma)

        def build():
            fn = functools.partial(device_steps.verify_and_accept,
                                   opts=self._target_options(gamma + 1))
            specs = [_spec(self.target.params), self._target_kv_spec(segmented),
                     self._input_spec(num_tokens, num_seqs, num_seqs * (gamma + 1)),
                     self._sampling_spec(num_seqs)]
            if gamma:
                specs.append(self._drafts_spec(num_seqs, gamma, kind))
            else:  # the previous step's tokens and where they go (asynchronous scheduling)
                specs.append(device_steps.Carried(self._sds((num_seqs, 1), jnp.int32),
                                                  self._sds((num_seqs,), jnp.int32)))
            return self._compile(fn, specs, donate_kv=True)

        key = ("verify_accept", num_seqs, gamma, segmented) + (
            (kind,) if gamma and kind != "dist" else ())
        return self._executable(key, self.target, build)

    def _target_options(self, max_q_len: int | None) -> device_steps.StepOptions:
        return device_steps.StepOptions(self.target.cfg, self._attention(max_q_len, target=True),
                                        mesh=self.mesh, batch_invariant=self.batch_invariant,
                                        aux_layers=self.aux_layers)

    def _drafts_spec(self, num_seqs: int, gamma: int, kind: str = "dist"
                     ) -> device_steps.Drafts:
        i32 = jnp.int32
        return device_steps.Drafts(
            tokens=self._sds((num_seqs, gamma), i32), slots=self._sds((num_seqs, gamma), i32),
            logits=None if kind == "onehot" else self._sds(
                (num_seqs, gamma, self.target.cfg.vocab_size), jnp.float32),
            num_drafted=self._sds((num_seqs,), i32),
            onehot=self._sds((num_seqs,), jnp.bool_) if kind == "mixed" else None)

    def accept_executable(self, num_seqs: int, gamma: int, kind: str = "dist"):
        """Rejection sampling (γ > 0) or plain sampling (γ = 0) of the verify logits; ``kind``
        (``DRAFT_KINDS``): the drafts' distribution."""
        def build():
            vocab = self.target.cfg.vocab_size
            logits = self._sds((num_seqs * (gamma + 1), vocab), jnp.float32)
            if not gamma:
                return self._compile(sample_tokens, (logits, self._sampling_spec(num_seqs)))
            draft_logits = None if kind == "onehot" else self._sds((num_seqs, gamma, vocab),
                                                                   jnp.float32)
            specs = [logits, draft_logits, self._sds((num_seqs, gamma), jnp.int32),
                     self._sds((num_seqs,), jnp.int32), self._sampling_spec(num_seqs)]
            if kind == "mixed":
                specs.append(self._sds((num_seqs,), jnp.bool_))
                return self._compile(device_steps.accept_mixed, specs)
            return self._compile(rejection_sample, specs)

        key = ("accept", num_seqs, gamma, self.target.cfg.vocab_size) + (
            (kind,) if gamma and kind != "dist" else ())
        return self._executable(key, None, build)

    def draft_kind(self, draft_logits) -> str:
        """The verification a step's drafts take (``DRAFT_KINDS``): "onehot" for a lookup's
        alone, "mixed" for a pool model's in an engine that mixes them with lookups, else
        "dist"."""
        if draft_logits is None:
            return "onehot"
        return "mixed" if self.mixed else "dist"

    def verify_kinds(self) -> list[str]:
        """The kinds of drafting verification this engine compiles."""
        kinds = ["onehot"] if self.lookup else []
        if self.chains:
            kinds.append("mixed" if self.mixed else "dist")
        return kinds

    @property
    def logprobs_width(self) -> int:
        """K of the top-K log-probabilities a step can return (0: none; EngineConfig's
        max_logprobs, at most the vocabulary)."""
        return min(self.rc.engine.max_logprobs, self.target.cfg.vocab_size)

    def logprobs_executable(self, num_seqs: int, gamma: int):
        """Log-probabilities of a step's emitted tokens (sampler.token_logprobs); run only on
        steps where some request asked for them."""
        def build():
            vocab = self.target.cfg.vocab_size
            fn = functools.partial(token_logprobs, k=max(1, self.logprobs_width))
            specs = (self._sds((num_seqs * (gamma + 1), vocab), jnp.float32),
                     self._sds((num_seqs, gamma + 1), jnp.int32))
            return self._compile(fn, specs)

        return self._executable(("logprobs", num_seqs, gamma, self.target.cfg.vocab_size,
                                 self.logprobs_width), None, build)

    def signals_executable(self, num_seqs: int, gamma: int):
        """The policy's per-position signals (only built when it reads some)."""
        def build():
            vocab = self.target.cfg.vocab_size
            fn = functools.partial(verify_signals, which=self.signals)
            specs = (self._sds((num_seqs * (gamma + 1), vocab), jnp.float32),
                     self._sds((num_seqs, gamma, vocab), jnp.float32),
                     self._sds((num_seqs, gamma), jnp.int32))
            return self._compile(fn, specs)

        return self._executable(("signals", num_seqs, gamma, self.target.cfg.vocab_size,
                                 self.signals), None, build)

    def draft_executable(self, num_seqs: int, gamma: int, model: int = 0):
        """Pool model ``model``'s draft loop of up to ``gamma`` tokens."""
        m = self.pool[model]

        def build():
            opts = device_steps.StepOptions(m.cfg, self._attn, num_steps=gamma,
                                            with_stats=self.draft_stats, eagle=m.eagle)
            i32, f32 = jnp.int32, jnp.float32
            s = (num_seqs,)
            width = self.eagle_first_width if m.eagle else device_steps.MAX_PENDING
            inputs = device_steps.DraftInputs(
                first=self._input_spec(width * num_seqs, num_seqs, num_seqs),
                next_positions=self._sds(s, i32),
                page_table=self._sds((num_seqs, self.rc.max_pages), i32),
                gammas=self._sds(s, i32), stop_confidence=self._sds(s, f32),
                stop_entropy=self._sds(s, f32))
            if m.eagle:
                fn = functools.partial(device_steps.eagle_draft_loop, opts=opts)
                specs = (_spec(self.draft_params(model, num_seqs)), _spec(self.pool_kv[model]),
                         self._hidden_spec(),
                         inputs, self._sampling_spec(num_seqs))
            else:
                fn = functools.partial(device_steps.draft_loop, opts=opts)
                specs = (_spec(m.params), _spec(self.pool_kv[model]), inputs,
                         self._sampling_spec(num_seqs))
            return self._compile(fn, specs, donate_kv=True)

        key = ("draft", num_seqs, gamma, self.draft_stats, model)
        if m.eagle:  # its first forward's width follows the engine's longest draft
            key += (self.eagle_first_width,)
        return self._executable(key, m, build)

    def draft_params(self, model: int, num_seqs: int) -> dict:
        """The params pool model ``model``'s draft loop over ``num_seqs`` rows takes. For an
        EAGLE head drafting one row where XLA widens one-row bf16 dots to float32 at every use
        (``widens_one_row_dots``: XLA:CPU), a copy with its dot weights in float32
        (``eagle.widened``), made once and kept beside the bf16 ones: the loop then multiplies
        without converting any weight. Converting them once per call inside the loop instead
        took 0.8 of the loop's 1.1 ms (B = 1, γ = 4, 2-vCPU Intel Xeon with AMX, profiled).
        The copy costs 4 bytes per dot weight (4.3 MB for the built-in head).
        (A draft model's loop slices each layer's weights out of the stack in every
        iteration, and widened the stack drafted no faster: 2.98 against 3.05 ms, Zen 3.)"""
        m = self.pool[model]
        if m.eagle is None or num_seqs != 1 or not widens_one_row_dots(
                str(m.params["lm_head"].dtype)):
            return m.params
        wide = self._one_row_params.get(model)
        if wide is None:
            wide = self._one_row_params[model] = jax.jit(eagle.widened)(m.params)
        return wide

    def intermediate_executable(self, num_seqs: int, gamma: int, model: int):
        """Pool model ``model`` verifying a γ-token draft inside a chain
        (``device_steps.intermediate_verify``) over ``num_seqs * (gamma + MAX_PENDING)`` tokens."""
        m = self.pool[model]
        with_signal = "accept_prob" in self.signals

        def build():
            # a drafting row brings its pending tokens and its γ_i <= γ drafted ones
            width = gamma + device_steps.MAX_PENDING
            opts = device_steps.StepOptions(m.cfg, self._attention(width),
                                            with_stats=with_signal)
            fn = functools.partial(device_steps.intermediate_verify, opts=opts)
            specs = (_spec(m.params), _spec(self.pool_kv[model]),
                     self._input_spec(num_seqs * width, num_seqs, num_seqs * (gamma + 1)),
                     self._sampling_spec(num_seqs), self._drafts_spec(num_seqs, gamma))
            return self._compile(fn, specs, donate_kv=True)

        return self._executable(("intermediate", num_seqs, gamma, with_signal, model), m, build)

    def catch_up_executable(self, num_tokens: int, model: int = 0):
        """Catch-up of pool model ``model`` over ``num_tokens`` tokens. Rare (after γ = 0
        stretches, chain switches and prefills), so one row bucket (max_num_seqs) serves every
        catch-up: a third of the buckets fewer."""
        m = self.pool[model]

        def build():
            opts = device_steps.StepOptions(m.cfg, self._attn, eagle=m.eagle)
            batch = self._input_spec(num_tokens, self.catch_up_rows, 2)
            if m.eagle:
                fn = functools.partial(device_steps.eagle_catch_up, opts=opts)
                specs = (_spec(m.params), _spec(self.pool_kv[model]), self._hidden_spec(),
                         batch)
            else:
                fn = functools.partial(device_steps.catch_up, opts=opts)
                specs = (_spec(m.params), _spec(self.pool_kv[model]), batch)
            return self._compile(fn, specs, donate_kv=True)

        return self._executable(("catch_up", num_tokens, self.catch_up_rows, model), m, build)

    def _hidden_spec(self) -> jax.ShapeDtypeStruct:
        return self._target_kv_spec(False).h

    @property
    def catch_up_rows(self) -> int:
        return self.rc.seq_buckets[-1]

    @property
    def catch_up_buckets(self) -> tuple[int, ...]:
        """Token widths of catch-up calls: two, an eighth of the budget (a few tokens after a
        short γ = 0 stretch) and the whole budget (a prompt): catch-up is rare, and each width
        is an executable to compile at start-up."""
        small = next(t for t in self.rc.token_buckets
                     if t >= self.rc.max_num_batched_tokens // 8)
        return tuple(sorted({small, self.rc.max_num_batched_tokens}))

    def catch_up_tokens(self, num_tokens: int) -> int:
        return next(t for t in self.catch_up_buckets if t >= num_tokens)

    # ------------------------------------------------------------------ running
    def run_verify_forward(self, batch: ModelInput, draft_tokens, draft_slots, gamma: int,
                           decode_only: bool = False):
        """Target logits [S*(γ+1), V] of the verify batch (stays on device). ``decode_only``:
        no row brings more than γ + 1 tokens (a decode-only step at a token bucket)."""
        num_seqs = batch.attn.kv_lens.shape[0]
        forward = self.verify_executable(batch.input_ids.shape[0], num_seqs, gamma,
                                         self._segmented, decode_only)
        args = (draft_tokens, draft_slots) if gamma else ()
        logits, self.target_kv = forward(self.target.params, self.target_kv, batch, *args)
        return logits

    def run_verify_accept(self, batch: ModelInput, feed, st: SamplingTensors, gamma: int):
        """A decode-only step's verification: (VerifyResult, logits), both on device.
        ``feed``: the step's ``device_steps.Drafts`` (γ > 0), or at γ = 0 the previous step's
        tokens (``device_steps.Carried``) or None (every row feeds the host's token)."""
        num_seqs = batch.attn.kv_lens.shape[0]
        kind = "dist"
        if isinstance(feed, device_steps.Drafts):
            kind = self.draft_kind(feed.logits)
            feed = dataclasses.replace(feed, onehot=self._onehot(feed.onehot, num_seqs, kind))
        exe = self.verify_accept_executable(num_seqs, gamma, self._segmented, kind)
        if feed is None:
            feed = self._no_carry(num_seqs)
        result, logits, self.target_kv = exe(self.target.params, self.target_kv, batch, st,
                                             feed)
        return result, logits

    def _no_carry(self, num_seqs: int) -> device_steps.Carried:
        carried = self._no_carry_arrays.get(num_seqs)
        if carried is None:
            carried = self._no_carry_arrays[num_seqs] = device_steps.Carried(
                np.zeros((num_seqs, 1), np.int32), np.full(num_seqs, -1, np.int32))
        return carried

    @staticmethod
    def _onehot(rows, num_seqs: int, kind: str):
        """The per-row one-hot mask a "mixed" verification takes (none drafted by lookup when
        the step has no mask); None for the other kinds."""
        if kind != "mixed":
            return None
        return np.zeros(num_seqs, np.bool_) if rows is None else rows

    def run_accept(self, logits, draft_logits, draft_tokens, num_drafted, st: SamplingTensors,
                   gamma: int, onehot=None) -> VerifyResult:
        num_seqs = st.temperature.shape[0]
        kind = self.draft_kind(draft_logits) if gamma else "dist"
        exe = self.accept_executable(num_seqs, gamma, kind)
        if not gamma:
            return exe(logits, st)
        if kind == "mixed":
            return exe(logits, draft_logits, draft_tokens, num_drafted, st,
                       self._onehot(onehot, num_seqs, kind))
        return exe(logits, draft_logits, draft_tokens, num_drafted, st)

    def run_signals(self, logits, draft_logits, draft_tokens, gamma: int) -> dict:
        return self.signals_executable(draft_tokens.shape[0], gamma)(logits, draft_logits,
                                                                     draft_tokens)

    def run_logprobs(self, logits, tokens, gamma: int) -> TokenLogprobs:
        return self.logprobs_executable(tokens.shape[0], gamma)(logits, tokens)

    def fetch(self, result: VerifyResult, signals: dict | None, num_drafted, draft_tokens,
              gammas: np.ndarray, logprobs: TokenLogprobs | None = None):
        """The step's one host<-device transfer: (VerifyResult, signals, num_drafted, logprobs)
        as numpy. ``draft_tokens`` and ``gammas`` (planned draft length per row) are for
        wrappers that rewrite acceptance (jspec.synthetic.SyntheticAcceptanceRunner)."""
        return jax.device_get((result, signals, num_drafted, logprobs))

    def _check_draft_resident(self) -> None:
        if not self.draft_resident:
            raise RuntimeError("the draft model is offloaded (elastic memory): reload it first")

    def run_draft(self, inputs: device_steps.DraftInputs, st: SamplingTensors, gamma: int,
                  model: int = 0):
        self._check_draft_resident()
        exe = self.draft_executable(inputs.gammas.shape[0], gamma, model)
        m = self.pool[model]
        if m.eagle:  # the head's last hidden state stays on device: nothing reads it
            params = self.draft_params(model, inputs.gammas.shape[0])
            result, _, self.pool_kv[model] = exe(params, self.pool_kv[model],
                                                 self.target_kv.h, inputs, st)
        else:
            result, self.pool_kv[model] = exe(m.params, self.pool_kv[model], inputs, st)
        return result

    def run_intermediate(self, batch: ModelInput, st: SamplingTensors,
                         drafts: device_steps.Drafts, gamma: int, model: int):
        """(DraftResult for the target, IntermediateResult), both on device."""
        self._check_draft_resident()
        exe = self.intermediate_executable(st.temperature.shape[0], gamma, model)
        out, verdict, self.pool_kv[model] = exe(self.pool[model].params, self.pool_kv[model],
                                                batch, st, drafts)
        return out, verdict

    def run_catch_up(self, batch: ModelInput, model: int = 0) -> None:
        self._check_draft_resident()
        exe = self.catch_up_executable(batch.input_ids.shape[0], model)
        args = (self.target_kv.h,) if self.pool[model].eagle else ()
        self.pool_kv[model] = exe(self.pool[model].params, self.pool_kv[model], *args, batch)

    def _migration(self, key: tuple, model: LoadedModel, spec: KVCache):
        """One chunk of a migration plan (``migrate_bucket`` pairs) over a pool of ``spec``."""
        def build():
            fn = kernel_backend.migration_fn(self.kernels.migration)
            pairs = self._sds((self.migrate_bucket, 2), jnp.int32)
            return compile_lowered(fn.lower(spec.k, spec.v, pairs))

        return self._executable(("migrate", self.migrate_bucket) + key, model, build)

    def migrate_executable(self, segmented: bool):
        """Migration over the target's pool: one array, or (the contraction's case in the
        "segments" layout) two."""
        return self._migration((segmented,), self.target, self._target_kv_spec(segmented))

    def extension_executable(self):
        """Allocates the target's (zeroed) extension segments, K and V."""
        def build():
            ext = self._target_kv_spec(True).k[1]
            fn = lambda: (jnp.zeros(ext.shape, ext.dtype), jnp.zeros(ext.shape, ext.dtype))
            return compile_lowered(jax.jit(fn).lower())

        return self._executable(("extension",), self.target, build)

    def migrate_blocks(self, pairs) -> int:
        """Copy KV blocks (src, dst) in every pool this runner holds (the target's, segments
        and all, and the draft's while it is resident), in place. Destinations must be free
        blocks (validated here: ``jspec.kernels.kv_migration.validate_pairs``); the caller
        rewrites its page tables. Plans run in chunks of ``migrate_bucket`` pairs, padded with
        null pairs, so one compiled size serves every plan."""
        num_blocks = self.target_kv.num_blocks
        for kv in self.pool_kv:
            if kv is not None:
                num_blocks = min(num_blocks, kv.num_blocks)
        pairs = validate_pairs(pairs, num_blocks)
        if not len(pairs):
            return 0
        bucket = self.migrate_bucket
        target_exe = self.migrate_executable(self._segmented)
        for start in range(0, len(pairs), bucket):
            # numpy straight in: jnp.asarray would compile a 'stage' per new shape (jax 0.10)
            padded = pad_pairs(pairs[start:start + bucket], bucket)
            self.target_kv = KVCache(*target_exe(self.target_kv.k, self.target_kv.v, padded))
            for m, kv in enumerate(self.pool_kv):
                if kv is not None:
                    exe = self._migration((m,), self.pool[m], _spec(kv))
                    self.pool_kv[m] = KVCache(*exe(kv.k, kv.v, padded))
        return len(pairs)

    def sync_draft(self, model: int = 0) -> None:
        kv = self.pool_kv[model] if self.pool_kv else None
        if kv is not None:
            kv.k.block_until_ready()

    # ------------------------------------------------------------------ elastic memory
    def offload_draft(self) -> None:
        """Move the draft's weights to host memory and drop its KV pool (Nightjar §5.2).

        The weights go to the device's ``pinned_host`` memory (``unpinned_host`` where that is
        missing, numpy where neither is) and stay there as the backup the reload copies from, so
        the second offload moves nothing. The runner drops its references to the device copy;
        the memory returns to the device once nothing else holds those arrays (a caller that
        built the engine from its own ``LoadedModel`` keeps them alive). The draft's KV pool
        belongs to this runner alone and is deleted outright."""
        if not self.draft_resident:
            raise RuntimeError("the draft model is already offloaded")
        params = self.draft.params
        if self._draft_host is None:
            self._draft_shardings = jax.tree_util.tree_map(lambda a: a.sharding, params)
            self._draft_host = jax.block_until_ready(
                jax.tree_util.tree_map(_to_host, params))
        self.draft = dataclasses.replace(self.draft, params=self._draft_host)
        for arr in (self.draft_kv.k, self.draft_kv.v):
            arr.delete()
        self.draft_kv = None
        self.draft_resident = False

    def expand_target_pool(self) -> None:
        """Put the extension in use (after ``offload_draft``). "segments": allocate it as a
        second array from the memory the draft gave back; nothing is copied, the base stays
        where it is and block ids above it now address the extension. "preallocated": it is
        there already."""
        if self.extension_layout is None:
            raise RuntimeError("this runner has no elastic extension")
        if self._extension_in_use:
            raise RuntimeError("the target's KV pool is already expanded")
        if self.draft_resident:
            raise RuntimeError("offload the draft before expanding the pool into its memory")
        if self.extension_layout == "segments":
            k_ext, v_ext = self.extension_executable()()
            self.target_kv = KVCache((self.target_kv.k, k_ext), (self.target_kv.v, v_ext))
        self._extension_in_use = True

    def contract_target_pool(self, pairs) -> int:
        """Move the live blocks ``pairs`` (extension -> free base block, the block manager's
        ``contraction_plan``) and take the extension out of use; "segments" deletes it, freeing
        its memory for the draft's reload. Returns the number of blocks moved."""
        if not self._extension_in_use:
            raise RuntimeError("the target's KV pool is not expanded")
        pairs = np.asarray(pairs, np.int64).reshape(-1, 2)
        if len(pairs) and pairs[:, 1].max() >= self.rc.num_kv_blocks:
            raise ValueError("contraction moves blocks into the base pool only")
        moved = self.migrate_blocks(pairs)
        if self.extension_layout == "segments":
            (k, k_ext), (v, v_ext) = self.target_kv.k, self.target_kv.v
            self.target_kv = KVCache(k, v)
            for arr in (k_ext, v_ext):
                arr.delete()
        self._extension_in_use = False
        return moved

    def device_bytes(self) -> dict[str, int]:
        """Bytes this runner holds in one device's memory (the mesh's first under tensor
        parallelism, where every device holds the same share), by part: what elastic memory
        trades (the draft's weights and KV pool against the target's extension segment)."""
        nbytes = sharding.bytes_per_device
        return {"target_params": nbytes(self.target.params),
                "target_kv": nbytes(self.target_kv),
                "draft_params": sum(nbytes(m.params) for m in self.pool),
                "draft_kv": sum(nbytes(kv) for kv in self.pool_kv)}

    def reload_draft(self) -> None:
        """Start copying the draft's weights back and allocate its (empty) KV pool; returns at
        once (JAX dispatches both asynchronously). ``draft_ready`` says when they are there;
        until then the engine decodes at γ = 0."""
        if self.draft_resident or self.draft_kv is not None:
            raise RuntimeError("the draft model is not offloaded")
        params = jax.device_put(self._draft_host, self._draft_shardings)
        self.draft = dataclasses.replace(self.draft, params=params)
        self.draft_kv = KVCache.create(self.draft.cfg, self.rc.num_kv_blocks,
                                       self.rc.engine.block_size, self.kv_dtype)

    def draft_ready(self) -> bool:
        """After ``reload_draft``: whether the copy has landed (then the draft is resident)."""
        if self.draft_resident:
            return True
        if self.draft_kv is None:
            return False
        leaves = jax.tree_util.tree_leaves((self.draft.params, self.draft_kv))
        if all(leaf.is_ready() for leaf in leaves):
            self.draft_resident = True
        return self.draft_resident

    # ------------------------------------------------------------------ warm-up
    def bucket_plan(self, max_rows: int | None = None) -> list[tuple]:
        """Every (kind, shape...) the engine can reach (``EngineConfig`` and
        ``ResolvedConfig.verify_tokens`` say why the shapes are these); with ``max_rows``, only
        those that steps of at most that many sequences reach: the decode-only steps of their row
        buckets, and with one, no step that carries prefill beside a draft.

        Decode-only steps: per (row bucket s, γ bucket g) one verify-and-sample of s * (1 + g)
        tokens (for g > 0 one per kind of draft: a pool model's, with its distribution, a
        lookup's, one-hot, or both mixed row by row), the draft loop (g > 0) and the policy's
        signals if it reads any. Steps that carry prefill, at the widest row bucket: a verify per
        (token bucket t, g) and a sampling per g (g = 0 only when one sequence runs at a time).
        With lookups, a decode-only verify per (t, g) at the widest row bucket for the token
        buckets below its fused width: lookups' steps verified at what they found
        (``ResolvedConfig.decode_verify_width``), sampled like a prefill step. Draft catch-up:
        two widths (``catch_up_buckets``) at the widest row bucket. With elastic memory the
        contraction's migration, and in the "segments" layout the γ = 0 verifies again over the
        two-segment pool and the extension's allocation.
        """
        rc = self.rc
        drafting = ([g for g in self.gamma_buckets if g > 0]
                    if self.chains or self.lookup else [])
        # the verifications of drafts with a distribution (pool models), without (lookups),
        # and of steps that mix the two row by row
        kinds = self.verify_kinds()
        gammas = [0] + drafting
        widest = rc.seq_buckets[-1]
        # at most this many sequences at once (never more than the engine runs): their row
        # buckets decode, and with one, no step mixes prefill and drafts
        together = rc.engine.max_num_seqs if max_rows is None \
            else min(max_rows, rc.engine.max_num_seqs)
        rows = [b for b in rc.seq_buckets if b <= rc.seq_bucket(together)]
        plan = []
        for s in rows:
            plan += [("verify_accept", s, 0)]
            plan += [("verify_accept", s, g) + ((False, k) if k != "dist" else ())
                     for k in kinds for g in drafting]
            plan += [("draft", s, g, m) for g in drafting for m in self.drafters]
            plan += [("intermediate", s, g, m) for g in drafting for m in self.intermediates]
            if self.signals:
                plan += [("signals", s, g) for g in drafting]
            if self.logprobs_width:
                plan += [("logprobs", s, g) for g in gammas]
        # prefill next to a drafting sequence needs two sequences at least
        mixed = gammas if together >= 2 else [0]
        plan += [("verify", t, widest, g) for g in mixed for t in rc.token_buckets]
        if self.lookup and together >= 2:
            # decode-only steps of lookups' drafts at a token bucket narrower than the widest
            # rows' fused width (ResolvedConfig.decode_verify_width)
            plan += [("verify", t, widest, g, False, True) for g in drafting
                     for t in rc.token_buckets if t < widest * (1 + g)]
        plan += [("accept", widest, 0)]
        if together >= 2:
            plan += [("accept", widest, g) + ((k,) if k != "dist" else ())
                     for k in kinds for g in drafting]
        if drafting:
            plan += [("catch_up", t, m) for m in sorted({m for c in self.chains for m in c})
                     for t in self.catch_up_buckets]
        if self.extension_layout == "segments":
            # the pool with its extension segment runs γ = 0 only (the draft is away), and the
            # contraction's migration moves blocks between the two segments
            plan += [("verify_accept", s, 0, True) for s in rc.seq_buckets]
            plan += [("verify", t, widest, 0, True) for t in rc.token_buckets]
            plan += [("extension",), ("migrate", True)]
        elif self.extension_layout == "preallocated":
            plan += [("migrate", False)]
        return list(dict.fromkeys(plan))  # a decode shape may equal a prefill one

    def warmup(self, progress: Callable[[int, int], None] | None = None,
               max_rows: int | None = None) -> int:
        plan = self.bucket_plan(max_rows)
        for i, item in enumerate(plan):
            kind, *shape = item
            getattr(self, f"{kind}_executable")(*shape)
            if progress is not None:
                progress(i + 1, len(plan))
        return len(plan)
