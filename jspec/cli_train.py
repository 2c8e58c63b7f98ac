"""`jspec train`, `jspec distill` and `jspec train-eagle`: train the built-in target / distil its
draft / train an EAGLE-3 head for it on the stdlib corpus (see models/train.py and
models/eagle_train.py for the recipes and models/corpus.py for the data and split).

`jspec train --out DIR` writes an HF checkpoint (weights, config, tokenizer) to DIR; the orbax
training state lives in `--checkpoint-dir` (default `DIR.train-state`, outside the checkpoint),
together with the tokenizer the run uses, so `--resume` continues with the same vocabulary and
the same batches. `jspec distill --target DIR --out DIR2` trains a draft against the target.
"""

from __future__ import annotations

import argparse
import os

# `jspec distill` shares this module; cli.py maps both names here and `run` dispatches on
# args._train_mode (set by add_arguments via the parser's prog name).


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", required=True, help="output HF checkpoint directory")
    parser.add_argument("--config", choices=("tiny", "default"), default="default",
                        help="model shape (models/train.py: config_for)")
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--lr", type=float, default=1e-3, help="peak learning rate")
    parser.add_argument("--warmup-steps", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--checkpoint-every", type=int, default=200,
                        help="save the training state every N steps (and at the end)")
    parser.add_argument("--checkpoint-dir", default=None,
                        help="orbax training state directory (default: OUT.train-state)")
    parser.add_argument("--resume", action="store_true",
                        help="continue from the latest checkpoint in --checkpoint-dir")
    parser.add_argument("--no-tests", action="store_true",
                        help="leave the stdlib's test directories out of the corpus")
    parser.add_argument("--max-files", type=int, default=None,
                        help="use only the first N training files (quick runs)")
    parser.add_argument("--compute-dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument("--export-dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument("--eval-windows", type=int, default=64,
                        help="held-out windows to evaluate at the end (0: skip)")
    parser.add_argument("--no-progress", action="store_true")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    mode = parser.prog.split()[-1]
    mode = mode if mode in ("distill", "train-eagle") else "train"
    parser.set_defaults(_train_mode=mode)
    _common(parser)
    if mode == "train-eagle":
        parser.add_argument("--target", required=True, help="target HF checkpoint directory")
        parser.add_argument("--draft-vocab-size", type=int, default=2048,
                            help="the head's vocabulary: the most frequent target tokens of "
                                 "the training windows (at most the target's)")
        parser.add_argument("--aux-layers", default=None,
                            help="comma-separated target layers whose input the head reads "
                                 "(default: EAGLE-3's low, middle and high layer)")
        parser.add_argument("--depth", type=int, default=3,
                            help="training-time test: passes unrolled per step (1: none)")
        parser.add_argument("--hidden-size", type=int, default=None,
                            help="the head's width (default: the target's); a narrower head "
                                 "has its own token embedding")
        parser.add_argument("--num-heads", type=int, default=None,
                            help="the head's attention heads, of the target's head size "
                                 "(default: the target's, or width / head size if narrower)")
        parser.add_argument("--num-kv-heads", type=int, default=None,
                            help="the head's key/value heads (default: the target's, or 1 if "
                                 "narrower)")
        parser.add_argument("--intermediate-size", type=int, default=None,
                            help="the head's MLP width (default: the target's)")
        parser.add_argument("--init-embedding", metavar="DIR", default=None,
                            help="start a narrower head's token embedding, final norm and "
                                 "output layer from this checkpoint of its width over the "
                                 "target's vocabulary (e.g. the draft model)")
        _self_generated_arguments(parser)
        return
    if mode == "train":
        parser.add_argument("--tokenizer", default=None,
                            help="HF tokenizer directory (default: train one on the corpus)")
        parser.add_argument("--vocab-size", type=int, default=None,
                            help="BPE vocabulary when training a tokenizer (default: 4096; "
                                 "512 for --config tiny)")
    else:
        parser.add_argument("--target", required=True, help="target HF checkpoint directory")
        parser.add_argument("--role", choices=("draft", "intermediate"), default="draft",
                            help="the student's shape: the pool's small draft or its middle "
                                 "model (models/train.py: config_for)")
        parser.add_argument("--independent", action="store_true",
                            help="train the draft on the data alone (cross entropy), no KL")
        parser.add_argument("--init", metavar="DIR", default=None,
                            help="start from this draft checkpoint instead of random weights "
                                 "(a second, self-generated distillation round)")
        _self_generated_arguments(parser)


def _self_generated_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--self-generated", type=int, default=0, metavar="N",
                        help="train on N target completions of training-split prompts mixed "
                             "with corpus windows (jspec/self_distill.py); 0: corpus only")
    parser.add_argument("--self-max-tokens", type=int, default=96,
                        help="tokens per self-generated completion")
    parser.add_argument("--self-share", type=float, default=0.5,
                        help="share of the training windows that are self-generated")
    parser.add_argument("--self-batch", type=int, default=16,
                        help="sequences the target completes at once")


def _load_corpus(args, tokenizer):
    import numpy as np

    from jspec.models.corpus import discover, pack, read_texts, split_files, tokenize_documents

    train_files, held_files = split_files(discover(include_tests=not args.no_tests))
    if args.max_files is not None:
        train_files = train_files[:args.max_files]
    eos = tokenizer.eos_token_id
    windows = pack(tokenize_documents(tokenizer, read_texts(train_files)), args.seq_len, eos,
                   seed=args.seed)
    held = pack(tokenize_documents(tokenizer, read_texts(held_files)), args.seq_len, eos,
                seed=args.seed)
    print(f"corpus: {len(train_files)} train files -> {windows.shape[0]} windows "
          f"({windows.shape[0] * args.seq_len:,} tokens); {len(held_files)} held-out files -> "
          f"{held.shape[0]} windows")
    return windows, held[:args.eval_windows] if args.eval_windows else np.zeros((0, 1), np.int32)


def _self_generated(args, corpus, tokenizer, ckpt_dir: str):
    """Corpus windows mixed with windows packed from the target's own completions; the packed
    completions are kept in the checkpoint directory so ``--resume`` sees the same data."""
    import numpy as np

    from jspec.self_distill import generate_sequences, mix_windows, prefix_prompts
    from jspec.models.corpus import discover, function_prompts, pack, split_files

    if args.self_generated < 0 or args.self_max_tokens < 1 or args.self_batch < 1:
        raise ValueError("--self-generated must be >= 0, --self-max-tokens and --self-batch "
                         ">= 1")
    cache = os.path.join(ckpt_dir, f"self_generated_{args.self_generated}_"
                                   f"{args.self_max_tokens}_{args.seq_len}.npy")
    if os.path.exists(cache):
        generated = np.load(cache)
        print(f"self-generated windows: {len(generated)} from {cache}")
    else:
        train_files, _ = split_files(discover(include_tests=not args.no_tests))
        funcs = function_prompts(train_files)
        rng = np.random.default_rng([args.seed, 5])
        n_funcs = min(len(funcs), (2 * args.self_generated) // 3)
        prompts = [funcs[i] for i in np.sort(rng.choice(len(funcs), n_funcs, replace=False))]
        prompts += prefix_prompts(corpus, args.self_generated - n_funcs, seed=args.seed)
        print(f"self-generated data: the target completes {n_funcs} function prompts and "
              f"{len(prompts) - n_funcs} corpus prefixes, {args.self_max_tokens} tokens each ...")
        seqs = generate_sequences(args.target, prompts, args.self_max_tokens,
                                  max_num_seqs=args.self_batch, progress=not args.no_progress)
        generated = pack(seqs, args.seq_len, tokenizer.eos_token_id, seed=args.seed)
        np.save(cache, generated)
        print(f"self-generated windows: {len(generated)} "
              f"({sum(len(s) for s in seqs):,} tokens), saved to {cache}")
    mixed = mix_windows(generated, corpus, args.self_share, seed=args.seed)
    print(f"distillation windows: {len(generated)} self-generated + "
          f"{len(mixed) - len(generated)} corpus")
    return mixed


def run(args) -> int:
    import jax.numpy as jnp

    from jspec.models.loader import load_checkpoint, load_tokenizer
    from jspec.models.modeling import params_for_module
    from jspec.models.tokenizer_train import save_tokenizer, train_stdlib_tokenizer
    from jspec.models.train import (TrainConfig, config_for, eval_loss, export_hf, greedy_agreement,
                              train)

    for name in ("steps", "batch_size", "seq_len"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    ckpt_dir = os.path.abspath(args.checkpoint_dir or args.out.rstrip("/") + ".train-state")
    if not args.resume and os.path.isdir(ckpt_dir) and any(
            e.isdigit() for e in os.listdir(ckpt_dir)):
        raise ValueError(f"{ckpt_dir!r} already holds training checkpoints; pass --resume to "
                         "continue, or remove it")
    os.makedirs(ckpt_dir, exist_ok=True)
    tok_dir = os.path.join(ckpt_dir, "tokenizer")

    if args._train_mode == "train-eagle":
        return _train_eagle(args, ckpt_dir)
    teacher = None
    if args._train_mode == "distill":
        tokenizer = load_tokenizer(args.target)
        t_cfg, t_params = load_checkpoint(args.target, dtype=jnp.float32)
        teacher = (t_cfg, params_for_module(t_cfg, t_params))
        cfg = config_for(args.config, args.role, vocab_size=t_cfg.vocab_size)
    else:
        if os.path.isdir(tok_dir):
            tokenizer = load_tokenizer(tok_dir)
        elif args.tokenizer:
            tokenizer = load_tokenizer(args.tokenizer)
        else:
            vocab = args.vocab_size or (512 if args.config == "tiny" else 4096)
            print(f"training a {vocab}-token byte-level BPE on the stdlib train split ...")
            tokenizer = train_stdlib_tokenizer(vocab, include_tests=not args.no_tests,
                                               max_files=args.max_files)
        cfg = config_for(args.config, "target", vocab_size=len(tokenizer))
    if not os.path.isdir(tok_dir):
        save_tokenizer(tokenizer, tok_dir)
    if args.seq_len > cfg.max_position_embeddings:
        raise ValueError(f"--seq-len {args.seq_len} exceeds max positions "
                         f"{cfg.max_position_embeddings}")

    windows, held = _load_corpus(args, tokenizer)
    init = None
    if args._train_mode == "distill":
        if args.self_generated:
            windows = _self_generated(args, windows, tokenizer, ckpt_dir)
        if args.init:
            i_cfg, i_params = load_checkpoint(args.init, dtype=jnp.float32)
            if (i_cfg.num_layers, i_cfg.hidden_size, i_cfg.vocab_size) != (
                    cfg.num_layers, cfg.hidden_size, cfg.vocab_size):
                raise ValueError(f"--init {args.init!r} is not a {args.config!r} {args.role} "
                                 f"({i_cfg.num_layers} layers, hidden {i_cfg.hidden_size}, "
                                 f"vocab {i_cfg.vocab_size})")
            init = params_for_module(i_cfg, i_params)
    tc = TrainConfig(steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len,
                     lr=args.lr, warmup_steps=args.warmup_steps, seed=args.seed,
                     compute_dtype=args.compute_dtype,
                     distill_mode="ce" if getattr(args, "independent", False) else "kl")
    print(f"model: {cfg.num_params() / 1e6:.2f}M params; {tc.steps} steps x "
          f"{tc.batch_size * tc.seq_len} tokens")
    state = train(cfg, windows, tc, checkpoint_dir=ckpt_dir,
                  checkpoint_every=args.checkpoint_every, resume=args.resume, teacher=teacher,
                  init=init,
                  progress=not args.no_progress, desc=args._train_mode)
    params = state["params"]
    if len(held) and held.shape[1] == args.seq_len + 1:
        bs = min(8, len(held))
        # the same number of training windows as held-out ones, so the two losses compare
        print(f"train loss: {eval_loss(cfg, params, windows[:len(held)], bs):.4f} "
              f"({len(held)} windows)")
        print(f"held-out loss: {eval_loss(cfg, params, held, bs):.4f}")
        if teacher is not None:
            agree = greedy_agreement(cfg, params, teacher[0], teacher[1], held, bs)
            print(f"held-out greedy agreement with the target: {agree:.3f}")
    export_hf(args.out, cfg, params, tokenizer, dtype=jnp.dtype(args.export_dtype))
    print(f"wrote {args.out}")
    return 0


def _train_eagle(args, ckpt_dir: str) -> int:
    """`jspec train-eagle`: the head trained on corpus windows mixed with the target's own
    completions, written in the EAGLE-3 layout with its held-out agreement per depth."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jspec.models.eagle_checkpoint import save_eagle
    from jspec.models.eagle_train import (draft_vocabulary, head_config, held_out_agreement,
                                          init_head, train_head)
    from jspec.models.loader import load_checkpoint, load_tokenizer

    if args.depth < 1:
        raise ValueError(f"--depth must be >= 1, got {args.depth}")
    tokenizer = load_tokenizer(args.target)
    t_cfg, t_params = load_checkpoint(args.target, dtype=jnp.float32)
    aux = None
    if args.aux_layers:
        try:
            aux = tuple(int(x) for x in args.aux_layers.split(","))
        except ValueError:
            raise ValueError(f"--aux-layers takes comma-separated layer numbers, got "
                             f"{args.aux_layers!r}") from None
        bad = [a for a in aux if not 0 <= a < t_cfg.num_layers]
        if bad:
            raise ValueError(f"--aux-layers {bad} outside the target's {t_cfg.num_layers} layers")
    if args.seq_len > t_cfg.max_position_embeddings:
        raise ValueError(f"--seq-len {args.seq_len} exceeds the target's max positions "
                         f"{t_cfg.max_position_embeddings}")
    windows, held = _load_corpus(args, tokenizer)
    if args.self_generated:
        windows = _self_generated(args, windows, tokenizer, ckpt_dir)
    vocab = min(args.draft_vocab_size, t_cfg.vocab_size)
    d2t = draft_vocabulary(windows, vocab, t_cfg.vocab_size, tuple(t_cfg.eos_token_ids))
    ecfg = head_config(t_cfg, vocab, aux, hidden_size=args.hidden_size,
                       num_heads=args.num_heads, num_kv_heads=args.num_kv_heads,
                       intermediate_size=args.intermediate_size)
    init_from = None
    if args.init_embedding:
        # init_head checks its embedding against the target's vocabulary at the head's width
        _, init_from = load_checkpoint(args.init_embedding, dtype=jnp.float32)
    params = init_head(ecfg, d2t, seed=args.seed, init_from=init_from)
    n = sum(a.size for a in jax.tree_util.tree_leaves(params)) - params["d2t"].size
    covered = np.isin(windows, d2t).mean()
    print(f"head: {n / 1e6:.2f}M params (width {ecfg.layer.hidden_size}, "
          f"{'own' if ecfg.own_embed else 'shared'} embedding), reads target layers "
          f"{ecfg.aux_layers}; draft "
          f"vocabulary {vocab} tokens ({covered:.1%} of the training tokens); {args.steps} steps "
          f"x {args.batch_size} x {args.seq_len} tokens, depth {args.depth}")
    params, agree = train_head(t_cfg, t_params, ecfg, params, windows[:, :args.seq_len],
                               steps=args.steps, batch_size=args.batch_size, lr=args.lr,
                               warmup=args.warmup_steps, depth=args.depth, seed=args.seed,
                               progress=not args.no_progress)
    if len(held):
        agree = held_out_agreement(t_cfg, t_params, ecfg, params, held[:, :args.seq_len],
                                   depth=args.depth)
        print("held-out top-1 agreement with the target by depth: "
              + ", ".join(f"{i + 1}: {a:.3f}" for i, a in enumerate(agree)))
    dtype = jnp.dtype(args.export_dtype)
    out = jax.tree_util.tree_map(lambda a: a if a.dtype == jnp.int32 else a.astype(dtype),
                                 params)
    save_eagle(args.out, ecfg, out, layout="eagle3")
    print(f"wrote {args.out}")
    return 0
