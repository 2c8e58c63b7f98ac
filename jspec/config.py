"""Engine configuration: one frozen dataclass, validated where it is built, and the shape buckets
derived from it (every jitted function is compiled once per bucket at start-up)."""

from __future__ import annotations

import dataclasses
from typing import Any

from jspec.policies.base import drafting_buckets


def _pow2_ceil(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Knobs of one engine. ``None`` fields are derived from the models (see ``resolve``)."""

    max_num_seqs: int = 16
    max_num_batched_tokens: int | None = None  # default: enough for a full decode batch at Γmax
    max_model_len: int | None = None  # default: the target's max_position_embeddings (≤ 4096)
    block_size: int = 16
    num_kv_blocks: int | None = None  # default: max_num_seqs full-length sequences (+ null block)
    kv_cache_memory_bytes: int | None = None  # alternative to num_kv_blocks
    num_speculative_tokens: int = 4  # Γmax: the largest γ any policy may choose
    # what drafts (vLLM's speculative_config "method"): "draft_model" (the draft models given),
    # "eagle3" (an EAGLE-3 head given as the draft, models/eagle.py; the built-in target's own
    # head when no models are given), "ngram" (prompt lookup over each sequence's own tokens, jspec/proposers/ngram.py: no
    # draft model; the suffix n of [prompt_lookup_min, prompt_lookup_max] tokens is matched) or
    # "suffix" (suffix decoding, no draft model either); several joined by "+" (e.g.
    # "draft_model+ngram+suffix"): each step each sequence may draft with a different one, as
    # the policy plans (DraftPlan.drafters)
    speculative_method: str = "draft_model"
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    # "suffix" (suffix decoding, jspec/proposers/suffix.py; vLLM's option names): the suffix
    # trees' depth, the draft's length per matched token, the least chained token probability
    # drafted, and how many requests' outputs the global tree keeps
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1
    suffix_decoding_max_cached_requests: int = 1000
    policy: str = "auto"
    policy_options: tuple[tuple[str, Any], ...] = ()
    enable_chunked_prefill: bool = True
    # "auto": see resolve_dtype (bf16 unless on a CPU backend without jspec.platform's flag);
    # explicit "bfloat16" / "float32" override it.
    dtype: str = "auto"
    seed: int = 0
    # kernels: "auto" (Pallas on a GPU where they compile, else the jnp reference), "pallas",
    # "interpret" (Pallas interpreter, any platform, slow) or "reference"; pallas_kernels/backend.py
    kernel_backend: str = "auto"
    min_token_bucket: int = 8
    warmup: bool = True  # compile every bucket at start-up
    # Nightjar §5 (jspec/elastic.py): offload the draft and hand its memory to the target's KV
    # pool while speculation is off and blocks run short; take it back when load falls
    elastic_memory: bool = False
    elastic_low_watermark: float = 0.1  # τ_low as a share of the base pool's blocks
    elastic_persist_steps: int = 8  # T_persist: steps both conditions must hold before expanding
    # where the extension's blocks live (jspec/elastic.py): "segments" = a second array allocated
    # from the draft's freed memory; "preallocated" = one array sized for base + extension from
    # the start; "auto" = segments on accelerators, preallocated on CPU (no separate device
    # memory to hand over there, and one array reads faster)
    elastic_pool_layout: str = "auto"
    # devices the target is split over (models/sharding.py: Megatron tensor parallelism over a
    # 1-D mesh of the first N of jax.devices(); the drafts are replicated). vLLM's name.
    tensor_parallel_size: int = 1
    # the most top log-probabilities a request may ask for (SamplingParams.logprobs); vLLM's
    # name and default. A step computes them only when one of its requests asked; 0 compiles
    # nothing for them and refuses such requests.
    max_logprobs: int = 20
    # automatic prefix caching (vLLM's name; jspec/block_manager.py): full KV blocks are kept,
    # indexed by a hash chain over their tokens, after their request finishes, and a new request
    # whose prompt starts with them reuses them instead of prefilling them again (target and
    # draft pools alike); evicted least recently used, only when blocks are needed
    enable_prefix_caching: bool = True
    # asynchronous scheduling (vLLM's name; LLMEngine.step): the host commits each decode-only
    # step in which nothing drafts while the next one runs on device; False commits every step
    # before the next is dispatched
    async_scheduling: bool = True
    # batch-invariant target numerics (pallas_kernels/batch_invariance.py): a token's logits do
    # not depend on which sequences share its step, how many tokens are verified with it or how
    # its prompt was chunked, so greedy speculative output equals plain greedy output in bf16
    # too (vLLM's VLLM_BATCH_INVARIANT, SGLang's deterministic inference)
    deterministic: bool = True

    def __post_init__(self):
        def positive(name):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")

        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "block_size",
                     "num_kv_blocks", "kv_cache_memory_bytes", "min_token_bucket",
                     "elastic_persist_steps"):
            positive(name)
        if not isinstance(self.num_speculative_tokens, int) or self.num_speculative_tokens < 0:
            raise ValueError(f"num_speculative_tokens must be an integer >= 0, got "
                             f"{self.num_speculative_tokens!r}")
        parse_methods(self.speculative_method)
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in (lo, hi)) \
                or lo > hi:
            raise ValueError(f"need integers 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                             f"{lo!r} and {hi!r}")
        for name in ("suffix_decoding_max_tree_depth", "suffix_decoding_max_cached_requests"):
            positive(name)
        f = self.suffix_decoding_max_spec_factor
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not f > 0:
            raise ValueError(f"suffix_decoding_max_spec_factor must be > 0, got {f!r}")
        p = self.suffix_decoding_min_token_prob
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 <= p <= 1:
            raise ValueError(f"suffix_decoding_min_token_prob must be in [0, 1], got {p!r}")
        if self.dtype not in ("auto", "bfloat16", "float32"):
            raise ValueError(f"dtype must be 'auto', 'bfloat16' or 'float32', got {self.dtype!r}")
        if self.kernel_backend not in ("auto", "pallas", "interpret", "reference"):
            raise ValueError(f"kernel_backend must be 'auto', 'pallas', 'interpret' or "
                             f"'reference', got {self.kernel_backend!r}")
        m = self.max_logprobs
        if isinstance(m, bool) or not isinstance(m, int) or m < 0:
            raise ValueError(f"max_logprobs must be an integer >= 0, got {m!r}")
        tp = self.tensor_parallel_size
        if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
            raise ValueError(f"tensor_parallel_size must be a positive integer, got {tp!r}")
        if tp > 1 and self.elastic_memory:
            raise ValueError("elastic_memory does not support tensor_parallel_size > 1 yet: "
                             "its pool migration runs on one device")
        for name in ("elastic_memory", "async_scheduling", "deterministic"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        w = self.elastic_low_watermark
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not 0.0 <= w < 1.0:
            raise ValueError(f"elastic_low_watermark must be a fraction in [0, 1), got {w!r}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 2:
            raise ValueError("num_kv_blocks must be >= 2 (block 0 is reserved)")
        if self.elastic_pool_layout not in ELASTIC_POOL_LAYOUTS:
            raise ValueError(f"elastic_pool_layout must be one of "
                             f"{', '.join(map(repr, ELASTIC_POOL_LAYOUTS))}, got "
                             f"{self.elastic_pool_layout!r}")

    @property
    def policy_kwargs(self) -> dict[str, Any]:
        return dict(self.policy_options)

    @property
    def drafters(self) -> tuple[str, ...]:
        """The drafters ``speculative_method`` names, the draft model first."""
        return parse_methods(self.speculative_method)

    @property
    def lookups(self) -> tuple[str, ...]:
        """The drafters without a model among them."""
        return tuple(m for m in self.drafters if m in LOOKUP_METHODS)

    @property
    def uses_draft_model(self) -> bool:
        """Whether a model drafts (a draft model or an EAGLE head)."""
        return any(m in MODEL_METHODS for m in self.drafters)


ELASTIC_POOL_LAYOUTS = ("auto", "segments", "preallocated")
SPECULATIVE_METHODS = ("draft_model", "eagle3", "ngram", "suffix")
MODEL_METHODS = ("draft_model", "eagle3")  # the drafters that are models of the pool
LOOKUP_METHODS = ("ngram", "suffix")  # the drafters that run no model


def parse_methods(spelling) -> tuple[str, ...]:
    """The drafters a ``speculative_method`` names: one of SPECULATIVE_METHODS, or several
    joined by "+" (each once), the model first, then the lookups as given. A draft model and an
    EAGLE head do not draft in one engine yet (a step runs one model)."""
    if not isinstance(spelling, str) or not spelling.strip():
        raise ValueError(f"speculative_method must be one of "
                         f"{', '.join(map(repr, SPECULATIVE_METHODS))} or several joined by "
                         f"'+', got {spelling!r}")
    methods = [m.strip() for m in spelling.split("+")]
    for m in methods:
        if m not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_method names {m!r}; each drafter must be one of "
                             f"{', '.join(map(repr, SPECULATIVE_METHODS))}")
    if len(set(methods)) < len(methods):
        raise ValueError(f"speculative_method {spelling!r} names a drafter twice")
    if all(m in methods for m in MODEL_METHODS):
        raise ValueError(f"speculative_method {spelling!r} names a draft model and an EAGLE "
                         f"head; an engine drafts with one of them (beside lookups)")
    return tuple(sorted(methods, key=lambda m: m not in MODEL_METHODS))


def drafts_with_model(spelling) -> bool:
    """Whether a ``speculative_method`` names a model among its drafters (a draft model or an
    EAGLE head); without one, lookups draft from the target's tokens alone."""
    return any(m in MODEL_METHODS for m in parse_methods(spelling))


def resolve_elastic_pool_layout(layout: str) -> str:
    """'auto' -> 'segments' where the device has memory of its own (GPU, TPU), 'preallocated' on
    XLA:CPU, where "device" and host memory are the same RAM: offloading the draft frees
    nothing there, and reading one array is 25-40% faster per step than reading two
    (docs/benchmarks.md, "Elastic memory")."""
    if layout != "auto":
        return layout
    import jax

    return "preallocated" if jax.default_backend() == "cpu" else "segments"


def resolve_dtype(dtype: str) -> str:
    """'auto' -> 'bfloat16' on accelerators and on a CPU backend started with the bf16 flag of
    ``jspec.platform``; 'float32' on a CPU without it (there bf16 measured 3x slower)."""
    if dtype != "auto":
        return dtype
    import jax

    from jspec.platform import cpu_bf16_flag_set

    if jax.default_backend() == "cpu" and not cpu_bf16_flag_set():
        return "float32"
    return "bfloat16"


@dataclasses.dataclass(frozen=True)
class ResolvedConfig:
    """EngineConfig with every derived value filled in and the bucket lists."""

    engine: EngineConfig
    max_model_len: int
    max_num_batched_tokens: int
    num_kv_blocks: int
    max_pages: int  # page-table width: covers max_model_len plus lookahead slots
    seq_buckets: tuple[int, ...]
    token_buckets: tuple[int, ...]
    # elastic memory: target-pool blocks above num_kv_blocks, usable while the draft is away
    num_extension_blocks: int = 0

    def seq_bucket(self, n: int) -> int:
        for b in self.seq_buckets:
            if b >= n:
                return b
        raise ValueError(f"{n} sequences exceed max_num_seqs={self.engine.max_num_seqs}")

    def verify_tokens(self, num_tokens: int, num_rows: int, gamma: int, has_prefill: bool
                      ) -> int:
        """Token width of a verify batch. A decode-only step of ``num_rows`` rows (a sequence
        bucket) at γ bucket ``gamma`` is exactly num_rows * (1 + gamma) wide, so decoding needs
        one verify executable per (rows, γ) instead of one per token bucket too; a step that
        carries prefill rounds up to a token bucket and runs at the widest row bucket. That is
        what keeps start-up compilation short (``ModelRunner.bucket_plan``)."""
        if has_prefill:
            return self.token_bucket(num_tokens)
        if num_tokens > num_rows * (1 + gamma):
            raise ValueError(f"{num_tokens} decode tokens exceed {num_rows} rows x "
                             f"(1 + γ={gamma})")
        return num_rows * (1 + gamma)

    def ragged_verify_pays(self, num_tokens: int, num_rows: int, gamma: int,
                           head_share: float) -> bool:
        """Whether a decode-only step of ``num_tokens`` verified tokens over ``num_rows`` rows
        at γ bucket ``gamma`` costs less verified as a step with prefill is (its tokens padded
        to a token bucket, its logits rows to the widest row bucket) than at its fused width
        num_rows * (1 + gamma). Worth asking when rows verify fewer than γ tokens: a lookup
        verifies only what it found. Costs in forward tokens, a logits row costing
        ``head_share`` of one (the LM head's share of the model's work per token)."""
        if self.engine.max_num_seqs < 2:  # no step with prefill beside a drafting row
            return False
        widest = self.seq_buckets[-1]
        fused = num_rows * (1 + gamma) * (1 + head_share)
        try:
            ragged = self.token_bucket(num_tokens) + widest * (1 + gamma) * head_share
        except ValueError:  # wider than the token budget
            return False
        return ragged < fused

    def decode_verify_width(self, num_tokens: int, num_rows: int, gamma: int,
                            lookups_only: bool, head_share: float) -> tuple[int, bool]:
        """(width, ragged) of a decode-only step's verification: at a token bucket where its
        drafts came from lookups alone and that costs less (``ragged_verify_pays``), else its
        fused width num_rows * (1 + gamma)."""
        if gamma and lookups_only and self.ragged_verify_pays(num_tokens, num_rows, gamma,
                                                              head_share):
            return self.token_bucket(num_tokens), True
        return num_rows * (1 + gamma), False

    def token_bucket(self, n: int) -> int:
        for b in self.token_buckets:
            if b >= n:
                return b
        raise ValueError(f"{n} tokens exceed max_num_batched_tokens={self.max_num_batched_tokens}")


# share of an accelerator's free memory (after the weights are loaded) the KV pools may take when
# no size is given; the rest is headroom for activations, logits and XLA's scratch
DEVICE_MEMORY_FRACTION = 0.9


def resolve(config: EngineConfig, target_max_positions: int, kv_bytes_per_block: int,
            device_free_bytes: int | None = None) -> ResolvedConfig:
    """``device_free_bytes``: the accelerator's free memory (``jspec.platform.device_free_bytes``,
    None on CPU); with neither ``num_kv_blocks`` nor ``kv_cache_memory_bytes`` the pool takes
    ``DEVICE_MEMORY_FRACTION`` of it, capped at what ``max_num_seqs`` full-length sequences
    need."""
    lookahead = config.num_speculative_tokens
    max_model_len = config.max_model_len or min(target_max_positions, 4096)
    if max_model_len > target_max_positions:
        raise ValueError(f"max_model_len={max_model_len} exceeds the target model's "
                         f"max_position_embeddings={target_max_positions}")
    decode_tokens = config.max_num_seqs * (1 + lookahead)
    if config.max_num_batched_tokens is None:
        budget = max(_pow2_ceil(decode_tokens), 256)
        if not config.enable_chunked_prefill:
            budget = max(budget, max_model_len)
    else:
        budget = config.max_num_batched_tokens
        if budget < 1 + lookahead:
            raise ValueError(f"max_num_batched_tokens={budget} cannot hold one decode step of "
                             f"{1 + lookahead} tokens (1 + num_speculative_tokens)")
        if not config.enable_chunked_prefill and budget < max_model_len:
            raise ValueError(f"without chunked prefill max_num_batched_tokens={budget} must be "
                             f">= max_model_len={max_model_len}")
    block_size = config.block_size
    pages_per_seq = -(-(max_model_len + lookahead + 1) // block_size)
    if config.num_kv_blocks is not None:
        num_blocks = config.num_kv_blocks
    elif config.kv_cache_memory_bytes is not None:
        num_blocks = config.kv_cache_memory_bytes // kv_bytes_per_block
        if num_blocks < 2:
            raise ValueError(f"kv_cache_memory_bytes={config.kv_cache_memory_bytes} holds fewer "
                             f"than 2 KV blocks of {kv_bytes_per_block} bytes")
    else:
        num_blocks = config.max_num_seqs * pages_per_seq + 1
        if device_free_bytes is not None:
            fits = int(device_free_bytes * DEVICE_MEMORY_FRACTION) // kv_bytes_per_block
            if fits < 2:
                raise ValueError(f"the device has {device_free_bytes} bytes free after loading "
                                 f"the models: fewer than 2 KV blocks of {kv_bytes_per_block} "
                                 "bytes; use smaller models or set num_kv_blocks")
            num_blocks = min(num_blocks, fits)
    seq_buckets = []
    # from 1 row: at B = 1 a 2-row bucket verified twice the tokens it needed (10 instead of 5
    # at γ = 4) and measured ~30% slower end to end (docs/benchmarks.md, "Against PyTorch")
    b = 1
    while b < config.max_num_seqs:
        seq_buckets.append(b)
        b *= 2
    seq_buckets.append(config.max_num_seqs)
    token_buckets = []
    t = max(config.min_token_bucket, 2)
    while t < budget:
        token_buckets.append(t)
        t *= 2
    token_buckets.append(budget)
    return ResolvedConfig(
        engine=config,
        max_model_len=max_model_len,
        max_num_batched_tokens=budget,
        num_kv_blocks=num_blocks,
        max_pages=pages_per_seq,
        seq_buckets=tuple(seq_buckets),
        token_buckets=tuple(sorted(set(token_buckets))),
    )


def gamma_buckets(possible_gammas: set[int], max_gamma: int) -> tuple[int, ...]:
    """Draft-length buckets: 0, powers of two and Γmax, keeping only those that some possible γ
    rounds up to (a static policy compiles one drafting bucket, not five)."""
    candidates = [0, *drafting_buckets(max_gamma)]
    used = set()
    for g in possible_gammas:
        used.add(next(c for c in candidates if c >= g))
    return tuple(sorted(used))


def gamma_bucket(buckets: tuple[int, ...], gamma: int) -> int:
    for b in buckets:
        if b >= gamma:
            return b
    raise ValueError(f"γ={gamma} exceeds the largest bucket {buckets[-1]}")
