"""Training code (models/corpus.py, models/tokenizer_train.py, models/train.py, jspec train /
distill): tiny configs on a slice of the real stdlib corpus, a few steps each."""

from __future__ import annotations

import numpy as np
import pytest

SEQ = 32
BATCH = 8
VOCAB = 512


@pytest.fixture(scope="module")
def stdlib_split():
    from jspec.models.corpus import discover, split_files

    return split_files(discover(include_tests=False))


@pytest.fixture(scope="module")
def data(stdlib_split):
    """(tokenizer, train windows, held-out windows) from the first 25 train files."""
    from jspec.models.corpus import pack, read_texts, tokenize_documents
    from jspec.models.tokenizer_train import train_tokenizer

    train_files, held_files = stdlib_split
    texts = read_texts(train_files[:25])
    tok = train_tokenizer(texts, vocab_size=VOCAB)
    windows = pack(tokenize_documents(tok, texts), SEQ, tok.eos_token_id, seed=0)
    held = pack(tokenize_documents(tok, read_texts(held_files[:4])), SEQ, tok.eos_token_id)
    return tok, windows, held[:32]


@pytest.fixture(scope="module")
def trained_target(data):
    from jspec.models.train import TrainConfig, config_for, init_params, train

    _, windows, _ = data
    cfg = config_for("tiny", "target", VOCAB)
    tc = TrainConfig(steps=60, batch_size=BATCH, seq_len=SEQ, lr=3e-3, warmup_steps=5)
    state = train(cfg, windows, tc, progress=False)
    return cfg, tc, init_params(cfg, tc.seed), state["params"]


# ----------------------------------------------------------------------------- data
def test_tokenizer_round_trip_and_reload(data, stdlib_split, tmp_path):
    from transformers import AutoTokenizer

    from jspec.models.tiny import SPECIAL_TOKENS
    from jspec.models.tokenizer_train import save_tokenizer

    tok, _, _ = data
    assert len(tok) == VOCAB
    assert [tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS] == list(range(5))
    text = stdlib_split[1][0].read()[:4000] + "\nnon-ascii: é ü 日本 \t tabs  \n"
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
    save_tokenizer(tok, tmp_path)
    loaded = AutoTokenizer.from_pretrained(str(tmp_path), local_files_only=True)
    assert loaded.encode(text, add_special_tokens=False) == ids
    assert loaded.eos_token_id == tok.eos_token_id == 2
    chat = loaded.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                      add_generation_prompt=True)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_corpus_discovery_and_split(stdlib_split):
    from jspec.models.corpus import discover, is_held_out, split_files

    train, held = stdlib_split
    files = discover(include_tests=False)
    assert [f.relpath for f in files] == sorted(f.relpath for f in files)
    again = split_files(discover(include_tests=False))
    assert [f.relpath for f in again[0]] == [f.relpath for f in train]
    assert [f.relpath for f in again[1]] == [f.relpath for f in held]
    assert held and train
    assert not {f.module for f in train} & {f.module for f in held}
    assert len(train) + len(held) == len(files)
    assert not any("site-packages" in f.relpath or "/test/" in f"/{f.relpath}" for f in files)
    modules = {f.module for f in files}
    share = sum(map(is_held_out, modules)) / len(modules)
    assert 0.01 < share < 0.15, share
    assert is_held_out("random") == is_held_out("random")  # hash, not Python's salted hash()
    with_tests = discover(include_tests=True)
    assert len(with_tests) > len(files)


def test_packing_and_batches():
    from jspec.models.corpus import batch_indices, pack

    docs = [np.arange(10, 10 + n, dtype=np.int32) for n in (5, 7, 3, 11)]
    w = pack(docs, 6, eos_id=2, seed=1)
    assert w.shape == ((5 + 7 + 3 + 11 + 4) // 7, 7)
    assert (pack(docs, 6, eos_id=2, seed=1) == w).all()
    order = np.random.default_rng(1).permutation(4)
    stream = np.concatenate([np.append(docs[i], 2) for i in order])
    assert (w.reshape(-1) == stream[:w.size]).all()
    assert (w == 2).sum() >= 3
    # Batches: a pure function of (step, seed); each epoch visits every window once.
    a = [batch_indices(s, 4, 10, seed=3) for s in range(5)]
    assert all((x == batch_indices(s, 4, 10, seed=3)).all() for s, x in enumerate(a))
    flat = np.concatenate(a)
    assert sorted(flat[:10]) == list(range(10)) and sorted(flat[10:20]) == list(range(10))


# ----------------------------------------------------------------------------- training
def test_training_lowers_loss(data, trained_target):
    from jspec.models.train import eval_loss

    _, windows, held = data
    cfg, _, init, trained = trained_target
    before, after = eval_loss(cfg, init, windows[:32]), eval_loss(cfg, trained, windows[:32])
    assert after < before - 1.0, (before, after)
    assert eval_loss(cfg, trained, held) < eval_loss(cfg, init, held) - 0.5


def test_checkpoint_round_trip_and_resume(data, tmp_path):
    import jax

    from jspec.models.train import (TrainConfig, _manager, config_for, init_state, restore_state,
                              save_state, train)

    _, windows, _ = data
    cfg = config_for("tiny", "target", VOCAB)
    tc = TrainConfig(steps=6, batch_size=4, seq_len=SEQ, lr=3e-3, warmup_steps=2)
    leaves = lambda s: jax.tree_util.tree_leaves(s)

    # save -> restore round trip of a whole state
    state = init_state(cfg, tc)
    m = _manager(str(tmp_path / "rt"))
    save_state(m, state)
    m.wait_until_finished()
    restored = restore_state(m, init_state(cfg, TrainConfig(seed=5)))
    m.close()
    assert jax.tree_util.tree_structure(restored) == jax.tree_util.tree_structure(state)
    for a, b in zip(leaves(restored), leaves(state)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    straight = train(cfg, windows, tc, checkpoint_dir=str(tmp_path / "a"), checkpoint_every=3,
                     progress=False)
    part = train(cfg, windows, tc, checkpoint_dir=str(tmp_path / "b"), checkpoint_every=3,
                 stop_after=3, progress=False)
    assert int(part["step"]) == 3
    resumed = train(cfg, windows, tc, checkpoint_dir=str(tmp_path / "b"), checkpoint_every=3,
                    progress=False)
    assert int(resumed["step"]) == int(straight["step"]) == 6
    for a, b in zip(leaves(straight), leaves(resumed)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)
    # and a finished run "resumed" again does nothing
    again = train(cfg, windows, tc, checkpoint_dir=str(tmp_path / "b"), progress=False)
    for a, b in zip(leaves(again["params"]), leaves(resumed["params"])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_distillation_raises_acceptance(data, trained_target):
    from jspec.models.train import TrainConfig, config_for, greedy_agreement, init_params, train

    _, windows, held = data
    t_cfg, _, _, t_params = trained_target
    d_cfg = config_for("tiny", "draft", VOCAB)
    tc = TrainConfig(steps=40, batch_size=BATCH, seq_len=SEQ, lr=3e-3, warmup_steps=5, seed=1)
    untrained = greedy_agreement(d_cfg, init_params(d_cfg, 1), t_cfg, t_params, held)
    distilled = train(d_cfg, windows, tc, teacher=(t_cfg, t_params), progress=False)["params"]
    after = greedy_agreement(d_cfg, distilled, t_cfg, t_params, held)
    assert after > untrained + 0.2, (untrained, after)
    assert after > 0.35


def test_export_then_load_gives_same_logits(data, trained_target, tmp_path):
    import jax
    import jax.numpy as jnp

    from jspec.models.loader import load_checkpoint, load_tokenizer
    from jspec.models.train import batch_logits, export_hf
    from jspec.models.transformer import dense_forward

    tok, _, held = data
    cfg, _, _, params = trained_target
    path = export_hf(str(tmp_path / "hf"), cfg, params, tok, dtype=jnp.float32)
    cfg2, runtime = load_checkpoint(path, dtype=jnp.float32)
    assert cfg2 == cfg
    assert load_tokenizer(path).encode("def f(x): return x") == tok.encode("def f(x): return x")
    tokens = jnp.asarray(held[:2, :-1])
    ref = batch_logits(cfg, params, tokens, jnp.float32)
    got = jax.vmap(lambda t: dense_forward(runtime, t, cfg=cfg2))(tokens)
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-5, atol=1e-5)


def test_default_pair_sizes():
    from jspec.models.train import config_for, forward_flops_per_token

    t, d = config_for("default", "target"), config_for("default", "draft")
    assert t.num_params() >= 10_000_000
    assert forward_flops_per_token(d, 256) <= forward_flops_per_token(t, 256) / 6
    assert 2 * (t.num_params() + d.num_params()) <= 25_000_000  # bf16 pair within 25 MB


def test_cli_parses_train_and_distill():
    from jspec.cli import build_parser

    args = build_parser().parse_args(["train", "--out", "x", "--config", "tiny", "--steps", "3"])
    assert args._train_mode == "train" and args.steps == 3 and args.config == "tiny"
    args = build_parser().parse_args(["distill", "--target", "t", "--out", "d", "--independent"])
    assert args._train_mode == "distill" and args.independent


# ----------------------------------------------------------------------------- self-generated data
def test_prefix_prompts_and_mix_windows():
    from jspec.self_distill import mix_windows, prefix_prompts

    windows = np.arange(50 * 33, dtype=np.int32).reshape(50, 33)
    prompts = prefix_prompts(windows, 200, min_len=4, max_len=20, seed=3)
    assert len(prompts) == 200 and prompts == prefix_prompts(windows, 200, 4, 20, seed=3)
    for p in prompts:
        assert 4 <= len(p) <= 20
        row, col = divmod(p[0], 33)
        assert p == windows[row, col:col + len(p)].tolist()  # a contiguous slice of one window
    assert prefix_prompts(windows, 0) == []
    with pytest.raises(ValueError, match="min_len"):
        prefix_prompts(windows, 3, min_len=30, max_len=20)
    gen = np.full((10, 33), -1, np.int32)
    mixed = mix_windows(gen, windows, 0.25, seed=1)
    assert mixed.shape == (40, 33) and (mixed[:, 0] == -1).sum() == 10
    assert len(np.unique(mixed[10:, 0])) == 30  # corpus windows drawn without replacement
    assert mix_windows(gen, windows, 1.0).shape == (10, 33)
    with pytest.raises(ValueError, match="generated_share"):
        mix_windows(gen, windows, 0.0)
    with pytest.raises(ValueError, match="no generated windows"):
        mix_windows(gen[:0], windows, 0.5)


def _exported_target_and_draft(data, trained_target, tmp_path, seed: int):
    """(target config, target directory, draft config, directory of a random tiny draft):
    the trained target and a draft of its vocabulary written as HF checkpoints."""
    import jax.numpy as jnp

    from jspec.models.train import config_for, export_hf, init_params

    tok, _, _ = data
    t_cfg, _, _, t_params = trained_target
    target = export_hf(str(tmp_path / "target"), t_cfg, t_params, tok, dtype=jnp.float32)
    d_cfg = config_for("tiny", "draft", VOCAB)
    draft = export_hf(str(tmp_path / "draft-init"), d_cfg, init_params(d_cfg, seed), tok,
                      dtype=jnp.float32)
    return t_cfg, target, d_cfg, draft


def test_distill_cli_on_self_generated_data(data, trained_target, tmp_path, capsys):
    """`jspec distill --self-generated N --init DRAFT`: the target completes N training-split
    prompts through the engine, the packed completions are cached beside the checkpoints (a
    resumed run reuses them) and the draft, started from --init, is distilled on the mix."""
    from jspec.cli import main
    from jspec.self_distill import generate_sequences

    tok, _, _ = data
    _, target, _, init = _exported_target_and_draft(data, trained_target, tmp_path, 2)

    prompt = tok.encode("def f(x):\n    return", add_special_tokens=False)
    seq = generate_sequences(target, [prompt], 6, max_num_seqs=2, progress=False)[0]
    assert seq[:len(prompt)].tolist() == prompt and len(prompt) < len(seq) <= len(prompt) + 6

    argv = ["distill", "--config", "tiny", "--target", target, "--init", init,
            "--out", str(tmp_path / "draft"), "--steps", "2", "--seq-len", str(SEQ),
            "--max-files", "3", "--self-generated", "4", "--self-max-tokens", "16",
            "--self-batch", "4", "--checkpoint-every", "1", "--eval-windows", "0",
            "--no-progress"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "self-generated windows:" in out and "saved to" in out
    cache = list((tmp_path / "draft.train-state").glob("self_generated_4_16_32.npy"))
    assert len(cache) == 1 and np.load(cache[0]).shape[1] == SEQ + 1
    assert (tmp_path / "draft" / "model.safetensors").exists()
    assert main([*argv[:argv.index("--steps") + 1], "3", *argv[argv.index("--steps") + 2:],
                 "--resume"]) == 0
    assert f"from {cache[0]}" in capsys.readouterr().out
    bad = ["distill", "--config", "default", "--target", target, "--init", init,
           "--out", str(tmp_path / "bad"), "--steps", "1", "--max-files", "1"]
    assert main(bad) == 2
    assert "is not a 'default' draft" in capsys.readouterr().err


def test_train_eagle_cli_writes_a_head_the_engine_loads(data, trained_target, tmp_path,
                                                        capsys):
    """`jspec train-eagle`: a head for the target, written in the published EAGLE-3 layout with
    its reduced vocabulary, which the loader reads back for that target; layers the target
    does not have are refused before anything trains."""
    import jax.numpy as jnp

    from jspec.cli import main
    from jspec.models.eagle_checkpoint import is_eagle_checkpoint, load_eagle
    from jspec.models.train import export_hf

    tok, _, _ = data
    t_cfg, _, _, t_params = trained_target
    target = export_hf(str(tmp_path / "target"), t_cfg, t_params, tok, dtype=jnp.float32)
    argv = ["train-eagle", "--target", target, "--out", str(tmp_path / "head"), "--steps", "2",
            "--batch-size", "2", "--seq-len", str(SEQ), "--max-files", "3", "--eval-windows",
            "4", "--draft-vocab-size", "300", "--depth", "2", "--no-progress"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "draft vocabulary 300 tokens" in out and "by depth: 1:" in out
    assert is_eagle_checkpoint(tmp_path / "head")
    ecfg, params = load_eagle(tmp_path / "head", t_cfg)
    assert ecfg.draft_vocab_size == 300 and params["lm_head"].shape == (t_cfg.hidden_size, 300)
    assert main([*argv, "--aux-layers", f"0,{t_cfg.num_layers}"]) == 2
    assert "outside the target's" in capsys.readouterr().err


def test_train_eagle_cli_trains_a_narrower_head_from_a_drafts_embedding(data, trained_target,
                                                                        tmp_path, capsys):
    """`jspec train-eagle --hidden-size`: a head narrower than the target, with its own
    embedding started from a draft model of its width (`--init-embedding`); a model of another
    width is refused."""
    import jax.numpy as jnp

    from jspec.cli import main
    from jspec.models.eagle_checkpoint import load_eagle
    from jspec.models.loader import load_checkpoint

    t_cfg, target, d_cfg, draft = _exported_target_and_draft(data, trained_target, tmp_path, 3)
    _, d_params = load_checkpoint(draft, dtype=jnp.float32)
    h = d_cfg.hidden_size
    assert h < t_cfg.hidden_size
    argv = ["train-eagle", "--target", target, "--out", str(tmp_path / "head"), "--steps", "1",
            "--batch-size", "2", "--seq-len", str(SEQ), "--max-files", "3", "--eval-windows",
            "0", "--draft-vocab-size", "300", "--depth", "2", "--no-progress", "--lr", "1e-4",
            "--warmup-steps", "1", "--export-dtype", "float32", "--hidden-size", str(h),
            "--intermediate-size", "48", "--init-embedding", draft]
    assert main(argv) == 0
    assert f"width {h}, own embedding" in capsys.readouterr().out
    ecfg, params = load_eagle(tmp_path / "head", t_cfg, dtype=jnp.float32)
    assert ecfg.own_embed and ecfg.layer.hidden_size == h
    assert ecfg.layer.intermediate_size == 48
    # one small step from the draft's embedding and output layer, not from random weights
    embed = np.asarray(d_params["embed"], np.float32)
    np.testing.assert_allclose(np.asarray(params["embed"]), embed, atol=2e-3)
    d2t = np.asarray(params["d2t"])
    np.testing.assert_allclose(np.asarray(params["lm_head"]),
                               np.asarray(d_params["lm_head"], np.float32)[:, d2t], atol=2e-3)
    wrong = [a if a != draft else target for a in argv]
    assert main(wrong) == 2
    assert "embedding of shape" in capsys.readouterr().err
