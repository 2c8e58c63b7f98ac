"""The offline API: ``LLM(target=..., draft=...)`` then ``generate`` / ``chat``, as in vLLM."""

from __future__ import annotations

import dataclasses
import itertools
import os
from typing import Any, Sequence as Seq

from jspec.config import EngineConfig
from jspec.outputs import RequestOutput
from jspec.request_checks import check_messages, is_token_id, render_chat, type_error
from jspec.sampling_params import SamplingParams


def load_model(path: str | os.PathLike, dtype: str, name: str, on_host: bool = False,
               target=None):
    """A HF checkpoint directory -> LoadedModel (params on the default device, or in host
    memory with ``on_host``: the tensor-parallel runner shards them from there). ``dtype`` is
    'bfloat16' or 'float32' (``jspec.config.resolve_dtype``); a bfloat16 that is slow on this CPU
    backend warns (``jspec.platform.warn_if_slow_cpu_bf16``)."""
    import jax.numpy as jnp

    from jspec.platform import warn_if_slow_cpu_bf16
    from jspec.runner import LoadedModel
    from jspec.models.loader import load_checkpoint

    warn_if_slow_cpu_bf16(dtype, stacklevel=2)
    jdtype = jnp.bfloat16 if dtype == "bfloat16" else jnp.float32
    if target is not None and is_eagle_checkpoint(path):
        return load_eagle_head(path, jdtype, name, target)
    cfg, params = load_checkpoint(path, dtype=jdtype, on_host=on_host)
    return LoadedModel(cfg=cfg, params=params, name=name)


def load_eagle_head(path, dtype, name: str, target):
    """An EAGLE-3 head's directory -> LoadedModel for ``target`` (a LoadedModel): the head's
    decoder layer as its config, its ``EagleConfig`` beside, and the target's embedding shared
    when the head has none of its own (the published heads mostly do not)."""
    import numpy as np

    from jspec.runner import LoadedModel
    from jspec.models.eagle_checkpoint import load_eagle

    ecfg, params = load_eagle(path, target.cfg, dtype)
    if np.array_equal(np.asarray(params["d2t"]), np.arange(target.cfg.vocab_size)):
        params = {k: v for k, v in params.items() if k != "d2t"}  # no mapping to apply
    if not ecfg.own_embed:
        params = dict(params, embed=target.params["embed"])
    return LoadedModel(cfg=ecfg.layer, params=params, name=name, eagle=ecfg)


def is_eagle_checkpoint(path) -> bool:
    from jspec.models.eagle_checkpoint import is_eagle_checkpoint as is_head

    return isinstance(path, (str, os.PathLike)) and is_head(path)


def _pool_names(paths: list) -> list[str]:
    """Names of a pool's models by their directories (what a chain, a policy option and the
    metrics call them; the engine names a lone draft "draft")."""
    return [os.path.basename(os.path.normpath(os.fspath(p))) or "draft" for p in paths]


# vLLM options a vLLM user may pass that jspec does not take, and what to do instead
_VLLM_ONLY_OPTIONS = {
    "gpu_memory_utilization": "the KV cache takes 90% of the memory free after loading by "
                              "default; size it with kv_cache_memory_bytes or num_kv_blocks",
    "trust_remote_code": "jspec runs llama, qwen2 and mistral checkpoints with its own code, "
                         "never a checkpoint's",
    "enforce_eager": "every shape bucket is compiled ahead of time; warmup=False compiles "
                     "them on first use instead",
    "pipeline_parallel_size": "only tensor parallelism is built (tensor_parallel_size)",
    "quantization": "weights run in bfloat16 or float32 (dtype)",
}


def check_engine_options(options: dict[str, Any]) -> None:
    """Every keyword an LLM / build_engine passes on must be an EngineConfig field: a ValueError
    naming the option (and, for vLLM's own options, what to do instead) rather than a TypeError
    from deep inside."""
    fields = {f.name for f in dataclasses.fields(EngineConfig)} - {"policy_options"}
    for name in options:
        if name in fields:
            continue
        if name in _VLLM_ONLY_OPTIONS:
            raise ValueError(f"option {name!r} is not supported: {_VLLM_ONLY_OPTIONS[name]}")
        raise ValueError(f"unknown option {name!r}; engine options are "
                         f"{', '.join(sorted(fields | {'policy_options'}))}")


def _from_vllm_spelling(target, draft, model, speculative_config: dict | None,
                        num_speculative_tokens: int | None):
    """(target, draft, Γmax, engine options) from jspec's spelling or vLLM's (``model=``,
    ``speculative_config={"model": ..., "num_speculative_tokens": N, "method":
    "draft_model"}``, or ``{"method": "ngram", "num_speculative_tokens": N,
    "prompt_lookup_max": n, "prompt_lookup_min": m}``: given one of the two bounds, the other
    is the same, as in vLLM); mixing the two spellings for the same thing is an error."""
    options: dict[str, Any] = {}
    if model is not None:
        if target is not None:
            raise ValueError("give the target once: target= (jspec) or model= (vLLM)")
        target = model
    if isinstance(speculative_config, (list, tuple)):
        return _several_drafters(target, draft, speculative_config, num_speculative_tokens)
    if speculative_config is not None:
        if not isinstance(speculative_config, dict):
            raise ValueError(f"speculative_config must be a dict (or a list of them, one per "
                             f"drafter), got "
                             f"{type(speculative_config).__name__}")
        spec = dict(speculative_config)
        method = spec.pop("method", None)
        if method in ("eagle", "medusa", "mlp_speculator"):
            raise ValueError(f"speculative_config method {method!r} is not supported; of the "
                             "draft heads, EAGLE-3 heads are: method 'eagle3'")
        if method not in (None, "draft_model", "eagle3", "ngram", "suffix"):
            raise ValueError(f"speculative_config method {method!r} is not supported; "
                             "supported: 'draft_model', 'eagle3', 'ngram', 'suffix'")
        if method == "eagle3":
            options["speculative_method"] = method
            head = spec.get("model", draft)
            if head is None and target is not None:
                raise ValueError("speculative_config method 'eagle3' needs 'model': the head's "
                                 "directory (the built-in target's head needs no target either)")
            if head is not None and not is_eagle_checkpoint(head):
                raise ValueError(f"speculative_config method 'eagle3': {os.fspath(head)!r} is "
                                 "not an EAGLE-3 head (its config.json names neither "
                                 "LlamaForCausalLMEagle3 nor speculators_model_type 'eagle3')")
        if method == "suffix":
            if "model" in spec:
                raise ValueError("speculative_config method 'suffix' drafts from suffix trees "
                                 "and takes no 'model'")
            options["speculative_method"] = method
            for key in [k for k in spec if k.startswith("suffix_decoding_")]:
                options[key] = spec.pop(key)
        if method == "ngram":
            if "model" in spec:
                raise ValueError("speculative_config method 'ngram' drafts by lookup in the "
                                 "sequence's own tokens and takes no 'model'")
            options["speculative_method"] = method
            lo, hi = spec.pop("prompt_lookup_min", None), spec.pop("prompt_lookup_max", None)
            if lo is not None or hi is not None:
                options["prompt_lookup_min"] = lo if lo is not None else hi
                options["prompt_lookup_max"] = hi if hi is not None else lo
        if "model" in spec:
            if draft is not None:
                raise ValueError("give the draft once: draft= (jspec) or "
                                 "speculative_config['model'] (vLLM)")
            draft = spec.pop("model")
        if "num_speculative_tokens" in spec:
            n = spec.pop("num_speculative_tokens")
            if num_speculative_tokens is not None and num_speculative_tokens != n:
                raise ValueError(f"num_speculative_tokens={num_speculative_tokens} and "
                                 f"speculative_config['num_speculative_tokens']={n} disagree")
            num_speculative_tokens = n
        if spec:
            extra = {"ngram": ", prompt_lookup_min, prompt_lookup_max",
                     "suffix": ", suffix_decoding_max_tree_depth, "
                               "suffix_decoding_max_spec_factor, "
                               "suffix_decoding_min_token_prob, "
                               "suffix_decoding_max_cached_requests"}.get(method, "")
            raise ValueError(f"speculative_config key {sorted(spec)[0]!r} is not supported; "
                             f"supported: model, num_speculative_tokens, method{extra}")
    if num_speculative_tokens is None:
        num_speculative_tokens = EngineConfig.num_speculative_tokens  # the config's default
    return target, draft, num_speculative_tokens, options


def _several_drafters(target, draft, configs, num_speculative_tokens: int | None):
    """A list of speculative configs, one per drafter (e.g. ``[{"method": "draft_model",
    "model": DIR}, {"method": "ngram"}, {"method": "suffix"}]``): one engine that may draft
    each sequence with any of them (``speculative_method`` "draft_model+ngram+suffix"). Their
    ``num_speculative_tokens``, where given, must agree: it is the engine's Γmax."""
    if not configs:
        raise ValueError("speculative_config is an empty list; give one config per drafter")
    given = {c.get("num_speculative_tokens") for c in configs if isinstance(c, dict)} - {None}
    if len(given) > 1:
        raise ValueError(f"the speculative configs give num_speculative_tokens "
                         f"{sorted(given)}; one engine has one Γmax, give the same for all")
    methods, options = [], {}
    for config in configs:
        target, draft, num_speculative_tokens, more = _from_vllm_spelling(
            target, draft, None, config, num_speculative_tokens)
        methods.append(more.pop("speculative_method", "draft_model"))
        options.update(more)
    options["speculative_method"] = "+".join(methods)
    return target, draft, num_speculative_tokens, options


def build_engine(target: "str | os.PathLike | LoadedModel | None" = None,
                 draft: "str | os.PathLike | LoadedModel | Seq[str | os.PathLike | LoadedModel]"
                        " | None" = None,
                 *, tokenizer: str | os.PathLike | None = None,
                 policy_obj=None, **engine_kwargs: Any):
    """Load the models and build an LLMEngine; ``target=None`` uses the built-in default pair
    (with its middle model too when the policy runs chains of several drafts: SpecRouter).
    ``target`` / ``draft`` are checkpoint directories or models already loaded (then
    ``tokenizer`` is required); ``draft`` may be a list: a pool of drafts for SpecRouter's
    chains."""
    from jspec.config import resolve_dtype
    from jspec.default_models import cache_dir, default_head, default_pair, default_pool
    from jspec.engine import LLMEngine
    from jspec.platform import configure_cpu_devices, warn_if_slow_cpu_bf16
    from jspec.runner import LoadedModel, enable_persistent_compilation_cache
    from jspec.models.loader import load_tokenizer

    if os.environ.get("JSPEC_COMPILATION_CACHE", "on").lower() not in ("0", "off", "false"):
        enable_persistent_compilation_cache(str(cache_dir() / "xla"))

    policy_options = engine_kwargs.pop("policy_options", None) or {}
    check_engine_options(engine_kwargs)
    config = EngineConfig(policy_options=tuple(sorted(policy_options.items())), **engine_kwargs)
    if config.tensor_parallel_size > 1:  # CPU only: a mesh of host devices, if still possible
        configure_cpu_devices(config.tensor_parallel_size)
    names = None
    if target is None:
        if draft is not None and not (isinstance(draft, (list, tuple)) and not draft):
            raise ValueError("a draft was given without a target; give both or neither")
        target, draft = default_pair()
        if not config.uses_draft_model:
            draft = None  # lookups draft: only the built-in target loads
        elif "eagle3" in config.drafters:
            draft = default_head()
        from jspec.policies import make_policy

        probe = policy_obj or make_policy(config.policy, config.num_speculative_tokens,
                                          **config.policy_kwargs)
        if probe.wants_pool:
            target, pool = default_pool()
            names, draft = list(pool), list(pool.values())
    if isinstance(draft, (list, tuple)):
        if not draft:
            draft = None
        elif len(draft) == 1:
            draft = draft[0]
        else:
            draft = list(draft)
            names = names or _pool_names(draft)
    # an explicit bfloat16 on a CPU backend started without jspec.platform's flag: warn once
    # ("auto" resolves to float32 there)
    warn_if_slow_cpu_bf16(config.dtype, stacklevel=2)
    dtype = resolve_dtype(config.dtype)
    # models already in memory (random-weight benchmark models) come as LoadedModels
    if isinstance(target, LoadedModel) and tokenizer is None:
        raise ValueError("a target given as a loaded model needs a tokenizer directory")
    target_model = target if isinstance(target, LoadedModel) else load_model(
        target, dtype, "target", on_host=config.tensor_parallel_size > 1)
    if isinstance(draft, list):
        draft_model = [d if isinstance(d, LoadedModel) else load_model(d, dtype, name,
                                                                       target=target_model)
                       for d, name in zip(draft, names)]
    else:
        draft_model = draft if draft is None or isinstance(draft, LoadedModel) else load_model(
            draft, dtype, "draft", target=target_model)
    tok = load_tokenizer(tokenizer or target)
    drafts = draft_model if isinstance(draft_model, list) else [draft_model]
    paths = draft if isinstance(draft, list) else [draft]
    for path, model in zip(paths, drafts):
        if model is not None and not isinstance(path, LoadedModel):
            which = "draft" if len(drafts) == 1 else f"draft {model.name!r}"
            check_same_vocabulary(tok, target_model, path, model, which)
    return LLMEngine(target_model, draft_model, config, tokenizer=tok, policy=policy_obj)


def check_same_vocabulary(tokenizer, target, path: str | os.PathLike, draft, which: str
                          ) -> None:
    """A draft must map every token to the same id as the target: equal vocabulary sizes are
    not enough (a draft whose tokenizer swaps two entries proposes other tokens than it means,
    and the target rejects them: output stays the target's, speculation just stops paying,
    silently). Compared by content, token -> id, against the draft directory's own tokenizer
    files; a directory without them can only be compared by size (``LLMEngine`` does that)."""
    from jspec.models.loader import has_tokenizer, load_tokenizer

    if draft.cfg.vocab_size != target.cfg.vocab_size or not has_tokenizer(path):
        return  # the engine refuses other sizes, naming both
    ours, theirs = tokenizer.get_vocab(), load_tokenizer(path).get_vocab()
    if ours == theirs:
        return
    missing = float("inf")
    differing = (t for t in set(ours) | set(theirs) if ours.get(t) != theirs.get(t))
    token = min(differing, key=lambda t: (min(ours.get(t, missing), theirs.get(t, missing)), t))
    where = {name: (f"id {vocab[token]}" if token in vocab else "absent")
             for name, vocab in (("target", ours), ("draft", theirs))}
    raise ValueError(f"{which} vocabulary differs from the target's: token {token!r} is "
                     f"{where['target']} in the target's tokenizer and {where['draft']} in the "
                     f"tokenizer of {which} ({os.fspath(path)!r}); speculative decoding needs "
                     f"the same tokenizer")


_PROMPT_FORMS = ("a string, a list of token ids, a {'prompt': text} or {'prompt_token_ids': ids} "
                 "dict, or a list of those")


def _prompt_list(prompts) -> tuple[list, bool]:
    """([(prompt as the engine takes it, its cache salt)], whether a list of prompts was
    given) from everything ``LLM.generate`` accepts; each prompt's own checks are the
    engine's."""
    if isinstance(prompts, (str, dict)) or (isinstance(prompts, (list, tuple)) and prompts
                                            and is_token_id(prompts[0])):
        return [_prompt_of(prompts)], False
    if not isinstance(prompts, (list, tuple)):
        raise type_error("prompts", _PROMPT_FORMS, prompts)
    return [_prompt_of(p) for p in prompts], True


def _prompt_of(prompt):
    """(prompt as the engine takes it: text or token ids, its cache salt or None), from
    vLLM's dict forms too (``{"prompt": ..., "cache_salt": ...}``)."""
    if not isinstance(prompt, dict):
        return prompt, None
    keys = set(prompt) - {"cache_salt"}
    salt = prompt.get("cache_salt")
    if keys == {"prompt_token_ids"}:
        return list(prompt["prompt_token_ids"]), salt
    if keys == {"prompt"}:
        return prompt["prompt"], salt
    raise ValueError(f"a prompt dict takes exactly one of 'prompt' (text) or 'prompt_token_ids' "
                     f"(token ids), and optionally 'cache_salt'; got keys {sorted(prompt)}")


class LLM:
    """Offline batched generation with speculative decoding.

    >>> llm = LLM()                                   # built-in default pair
    >>> llm = LLM(target="path/to/target", draft="path/to/draft", policy="static",
    ...           num_speculative_tokens=4)
    >>> outs = llm.generate(["def fib(n):"], SamplingParams(max_tokens=32, temperature=0))
    >>> outs[0].text, outs[0].spec.acceptance_rate
    >>> llm = LLM(target="7b", draft=["0.5b", "1.5b"], policy="specrouter")  # a pool: chains
    >>> llm = LLM(model="7b", speculative_config={"model": "0.5b",      # vLLM's spelling
    ...                                           "num_speculative_tokens": 4})
    >>> llm = LLM(target="7b", speculative_method="ngram")  # prompt lookup, no draft model

    ``draft`` may be a list of checkpoint directories sharing the target's vocabulary: a pool
    from which SpecRouter (``policy="specrouter"``) picks chains such as small -> mid -> target;
    the other policies draft with the pool's smallest model. With no models given,
    ``policy="specrouter"`` runs the built-in pool (draft, mid, target).

    ``tensor_parallel_size=N`` splits the target over N devices (docs/distributed.md). On a
    machine without accelerators the first such LLM splits the CPU into N devices if JAX has
    not started yet (else set ``XLA_FLAGS=--xla_force_host_platform_device_count=N`` before).

    Engine options (``max_num_seqs``, ``max_model_len``, ``max_num_batched_tokens``,
    ``block_size``, ``num_kv_blocks``, ``kv_cache_memory_bytes``, ``enable_chunked_prefill``,
    ``enable_prefix_caching``, ``async_scheduling``, ``deterministic``, ``dtype``, ``seed``,
    ``policy_options``, ``warmup``, ``tensor_parallel_size``, ``speculative_method``,
    ``prompt_lookup_min``, ``prompt_lookup_max``) are those of ``EngineConfig``. The warm-up compiles every shape
    bucket of these options (or loads them from the compilation cache) with a progress bar on
    stderr, which ``use_tqdm=False`` turns off; after it no prompt count, prompt length or
    sampling option compiles anything.
    """

    def __init__(self, target: str | os.PathLike | None = None,
                 draft: "str | os.PathLike | Seq[str | os.PathLike] | None" = None, *,
                 policy: str = "auto",
                 num_speculative_tokens: int | None = None, dtype: str = "auto",
                 tokenizer: str | os.PathLike | None = None,
                 model: str | os.PathLike | None = None,
                 speculative_config: dict | None = None, use_tqdm: bool = True,
                 **engine_kwargs: Any):
        from jspec.warmup import warmup

        target, draft, num_speculative_tokens, spec_options = _from_vllm_spelling(
            target, draft, model, speculative_config, num_speculative_tokens)
        for name, value in spec_options.items():
            if name in engine_kwargs and engine_kwargs[name] != value:
                raise ValueError(f"{name}={engine_kwargs[name]!r} and speculative_config's "
                                 f"{value!r} disagree")
        engine_kwargs.update(spec_options)
        warm = engine_kwargs.pop("warmup", EngineConfig.warmup)
        self.engine = build_engine(target, draft, tokenizer=tokenizer, policy=policy,
                                   num_speculative_tokens=num_speculative_tokens, dtype=dtype,
                                   warmup=False, **engine_kwargs)
        if warm:
            warmup(self.engine, progress=use_tqdm)
        self._ids = itertools.count()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def metrics(self) -> dict:
        return self.engine.metrics.as_dict()

    def generate(self, prompts: str | list[int] | Seq[str | list[int]],
                 sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate for each prompt (text, token ids, or as vLLM takes them
        ``{"prompt": text}`` / ``{"prompt_token_ids": ids}``, either with an optional
        ``"cache_salt"``: see ``LLMEngine.add_request``); outputs come back in prompt order."""
        pairs, batch = _prompt_list(prompts)
        names = [f"prompts[{i}]: " if batch else "" for i in range(len(pairs))]
        return self._submit([p for p, _ in pairs], names, sampling_params, use_tqdm,
                            [salt for _, salt in pairs])

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
             use_tqdm: bool = True) -> list[RequestOutput]:
        """Apply the tokenizer's chat template to one conversation (a list of ``{"role",
        "content"}`` messages) or a list of them. Messages are checked and rendered as the
        server does (``jspec.request_checks``: roles, content, text parts, the template)."""
        batch = isinstance(messages, (list, tuple)) and bool(messages) and all(
            isinstance(conv, (list, tuple)) for conv in messages)
        conversations = list(messages) if batch else [messages]
        prompts, names = [], []
        for i, conv in enumerate(conversations):
            param = f"messages[{i}]" if batch else "messages"
            ids = render_chat(self.tokenizer, check_messages(conv, param), param)
            try:
                self.engine.limits.check_prompt_length(
                    len(ids), "the conversation rendered with the chat template")
            except ValueError as e:
                raise ValueError(f"{param}: {e}") from None
            prompts.append(ids)
            names.append(f"{param}: ")
        return self._submit(prompts, names, sampling_params, use_tqdm, [None] * len(prompts))

    def _submit(self, prompts: list, names: list[str],
                sampling_params: SamplingParams | Seq[SamplingParams] | None,
                use_tqdm: bool, salts: list[str | None]) -> list[RequestOutput]:
        """Validate every request (its errors prefixed with its name in ``names``; ``salts``:
        their cache salts), then run them all."""
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompts)
        elif not isinstance(sampling_params, (list, tuple)):
            raise ValueError(f"sampling_params must be a SamplingParams or a list of them, got "
                             f"{type(sampling_params).__name__}")
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(f"got {len(params_list)} sampling params for {len(prompts)} "
                                 f"prompts")
        # validate everything before anything runs
        for name, prompt, sp, salt in zip(names, prompts, params_list, salts):
            try:
                self.engine.validate_request(prompt, sp, salt)
            except ValueError as e:
                if not name:
                    raise
                raise ValueError(f"{name}{e}") from None
        ids = [f"gen-{next(self._ids)}" for _ in prompts]
        for rid, prompt, sp, salt in zip(ids, prompts, params_list, salts):
            self.engine.add_request(rid, prompt, sp, cache_salt=salt)
        return self._run(ids, use_tqdm)

    def _progress(self, out_tokens: int, start: tuple[float, int, int]) -> dict[str, str]:
        """Throughput and acceptance since ``start`` (step time, drafted, accepted)."""
        m = self.engine.metrics
        seconds = m.step_time - start[0]
        drafted = m.spec_decode_num_draft_tokens - start[1]
        accepted = m.spec_decode_num_accepted_tokens - start[2]
        return {"tok_s": f"{out_tokens / max(seconds, 1e-9):.1f}",
                "accept": f"{accepted / drafted if drafted else 0.0:.2f}"}

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        from tqdm.auto import tqdm

        results: dict[str, RequestOutput] = {}
        self.engine.stream_outputs = False  # only finished requests matter here
        bar = tqdm(total=len(ids), desc="generate", unit="req", disable=not use_tqdm)
        out_tokens = 0
        # the bar reports this call, not the engine's lifetime: counters from here on
        m = self.engine.metrics
        start = (m.step_time, m.spec_decode_num_draft_tokens, m.spec_decode_num_accepted_tokens)
        try:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        results[out.request_id] = out
                        out_tokens += len(out.token_ids)
                        bar.update(1)
                        bar.set_postfix(self._progress(out_tokens, start))
        finally:
            bar.close()
        return [results[i] for i in ids]
