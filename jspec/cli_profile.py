"""`jspec profile`: measure a model pair's step times on this machine for the cost-aware policies.

Writes a ``jspec.policies.profile.StepProfile`` as JSON:

* target forward time over a grid of (batch size B, new tokens per sequence q, context L): q = 1
  is plain decode, q = γ+1 a verification window;
* draft forward time of one token per sequence over (B, L): one step of the draft loop;
* the switching cost c_prefill(C, B) = prefill time with speculation − without, over catch-up
  lengths C and batch sizes B. Both sides run the same target prefill; the difference is the
  draft catching up on the C tokens per sequence it skipped, so that is what is timed (a draft
  forward over B sequences x C new tokens at context ``--catch-up-context``).

Each point is the fastest of ``--repeats`` calls after a warm-up call (compilation excluded).
Policies load it with ``--policy-option profile=PROFILE.json`` and refuse a profile measured for
other model shapes.
"""

from __future__ import annotations

import argparse
import os
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", metavar="DIR", help="default: the built-in pair's target")
    parser.add_argument("--draft", metavar="DIR", help="default: the built-in pair's draft")
    parser.add_argument("--synthetic", metavar="SHAPE", default=None,
                        help="profile random-weight models of this shape (jspec/synthetic.py, "
                             "e.g. qwen2.5-0.5b) for the cost-realistic benchmark mode")
    parser.add_argument("--out", required=True, metavar="PROFILE.json")
    parser.add_argument("--dtype", choices=["auto", "bfloat16", "float32"], default="auto")
    parser.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 2, 4, 8, 16, 32])
    parser.add_argument("--query-lens", nargs="+", type=int, default=[1, 2, 3, 5, 8],
                        help="new tokens per sequence (γ+1); cover Γmax+1")
    parser.add_argument("--contexts", nargs="+", type=int, default=[128, 512])
    parser.add_argument("--catch-up-lens", nargs="+", type=int, default=[2, 8, 32])
    parser.add_argument("--catch-up-context", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-progress", action="store_true")


def _check_axis(name: str, values: list[int], minimum: int = 1) -> list[int]:
    if any(v < minimum for v in values):
        raise ValueError(f"--{name} values must be >= {minimum}, got {values}")
    return sorted(set(values))


def run(args: argparse.Namespace) -> int:
    import numpy as np

    batch_sizes = _check_axis("batch-sizes", args.batch_sizes)
    query_lens = _check_axis("query-lens", args.query_lens)
    contexts = _check_axis("contexts", args.contexts, minimum=0)
    catch_up_lens = _check_axis("catch-up-lens", args.catch_up_lens)
    if args.repeats < 1 or args.block_size < 1:
        raise ValueError("--repeats and --block-size must be >= 1")
    if (args.target is None) != (args.draft is None):
        raise ValueError("give both --target and --draft, or neither for the built-in pair")
    if args.synthetic is not None:
        from jspec.synthetic import check_shape

        check_shape(args.synthetic, args.target)
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

    import jax
    from tqdm.auto import tqdm

    from jspec.bench.model_step import ForwardTimer
    from jspec.config import EngineConfig, resolve_dtype
    from jspec.engine_setup import lay_out_weights
    from jspec.default_models import default_pair
    from jspec.llm import load_model
    from jspec.policies.profile import StepProfile, model_signature

    dtype = resolve_dtype(args.dtype)
    if args.synthetic is not None:
        from jspec.synthetic import synthetic_models

        target, draft = synthetic_models(args.synthetic, dtype)
    else:
        target_dir, draft_dir = (args.target, args.draft) if args.target else default_pair()
        target = load_model(target_dir, dtype, "target")
        draft = load_model(draft_dir, dtype, "draft")
    # the weight layout an engine would run these models in on this machine
    target, (draft,) = lay_out_weights(EngineConfig(), target, [draft])
    limit = min(target.cfg.max_position_embeddings, draft.cfg.max_position_embeddings)
    if max(contexts) + max(query_lens) > limit or args.catch_up_context + max(catch_up_lens) > limit:
        raise ValueError(f"the grid reaches past the models' {limit} positions")
    kv_dtype = np.dtype(jax.numpy.dtype(dtype))
    t_time = ForwardTimer(target.cfg, target.params, kv_dtype, args.block_size, args.repeats)
    d_time = ForwardTimer(draft.cfg, draft.params, kv_dtype, args.block_size, args.repeats)

    points = (len(batch_sizes) * len(contexts) * (len(query_lens) + 1)
              + len(catch_up_lens) * len(batch_sizes))
    bar = tqdm(total=points, desc="profile", disable=args.no_progress)
    target_time = np.zeros((len(batch_sizes), len(query_lens), len(contexts)))
    draft_time = np.zeros((len(batch_sizes), len(contexts)))
    catch_up = np.zeros((len(catch_up_lens), len(batch_sizes)))
    try:
        for b, B in enumerate(batch_sizes):
            for li, L in enumerate(contexts):
                for qi, q in enumerate(query_lens):
                    target_time[b, qi, li] = t_time(B, q, L)
                    bar.update(1)
                draft_time[b, li] = d_time(B, 1, L)
                bar.update(1)
            for ci, C in enumerate(catch_up_lens):
                catch_up[ci, b] = d_time(B, C, args.catch_up_context)
                bar.update(1)
    finally:
        bar.close()
    device = f"{jax.default_backend()}: {jax.devices()[0].device_kind}"
    profile = StepProfile(model_signature(target.cfg), model_signature(draft.cfg), device, dtype,
                          batch_sizes, query_lens, contexts, catch_up_lens, target_time,
                          draft_time, catch_up)
    profile.save(args.out)
    print(f"profile of {profile.target} / {profile.draft} on {device} ({dtype}) -> {args.out}")
    mid = contexts[0]
    print(f"step time (ms) at context {mid}:  B  " + " ".join(f"γ={q - 1:<6}" for q in query_lens))
    for B in batch_sizes:
        print(f"{'':>32}{B:>3}  " + " ".join(f"{profile.step_time(B, q - 1, mid) * 1e3:<8.2f}"
                                             for q in query_lens))
    sys.stdout.flush()
    return 0
