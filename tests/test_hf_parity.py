"""Our checkpoints load in Hugging Face transformers unchanged and give the same logits.

Needs torch (not a dependency of the project); skipped without it. For each family a tiny random
checkpoint is written with our save_checkpoint, loaded by ``AutoModelForCausalLM`` in float32, and
its logits on a random prompt compared with our dense forward and our paged forward (two prefill
chunks through a shuffled page table).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from jspec.models.loader import load_checkpoint  # noqa: E402
from jspec.models.tiny import write_tiny_checkpoint  # noqa: E402
from jspec.models.transformer import KVCache, ModelInput, dense_forward, forward  # noqa: E402
from jspec.kernels.ragged_paged_attention import AttentionMetadata  # noqa: E402

MAX_ABS_ERR = 1e-4
PROMPT_LEN = 40
CHUNK = 24  # paged forward: 24 tokens, then the remaining 16 plus padding
BLOCK_SIZE = 8
NUM_BLOCKS = 12

dense = jax.jit(dense_forward, static_argnames=("cfg",))
paged = jax.jit(forward, static_argnames=("cfg",), donate_argnames=("kv",))

CASES = {
    "llama": ("llama", {}),
    # llama3 scaling with an original context of 16 < the prompt, plus attention_bias.
    "llama-llama3-rope-bias": ("llama", dict(
        qkv_bias=True, o_bias=True,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 16})),
    "llama-linear-rope-mha": ("llama", dict(num_kv_heads=4, tie_word_embeddings=True,
                                            rope_scaling={"rope_type": "linear", "factor": 4.0})),
    "qwen2": ("qwen2", {}),
    "qwen2-gqa7": ("qwen2", dict(num_heads=7, num_kv_heads=1)),
    # A window of 8 is far smaller than the 40-token prompt.
    "mistral-window8": ("mistral", dict(sliding_window=8)),
}


def hf_logits(path, ids: np.ndarray) -> tuple[np.ndarray, object]:
    kwargs = {"dtype": torch.float32}
    if int(transformers.__version__.split(".")[0]) < 5:
        kwargs = {"torch_dtype": torch.float32}
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        path, output_loading_info=True, **kwargs)
    # Loads "unchanged": nothing missing (randomly initialized), nothing unexpected.
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    model.eval()
    with torch.no_grad():
        out = model(torch.tensor(ids[None], dtype=torch.long)).logits[0]
    return out.float().numpy(), model


def paged_logits(cfg, params, ids: np.ndarray) -> np.ndarray:
    rng = np.random.default_rng(0)
    kv = KVCache.create(cfg, NUM_BLOCKS, BLOCK_SIZE, jnp.float32)
    pages = -(-PROMPT_LEN // BLOCK_SIZE)
    page_table = np.zeros((2, pages + 1), np.int32)  # row 1 is a padding sequence row
    page_table[0, :pages] = rng.permutation(np.arange(1, NUM_BLOCKS))[:pages]
    rows = []
    for start in range(0, PROMPT_LEN, CHUNK):
        n = min(CHUNK, PROMPT_LEN - start)
        input_ids = np.zeros(CHUNK, np.int32)
        input_ids[:n] = ids[start:start + n]
        positions = np.zeros(CHUNK, np.int32)
        positions[:n] = np.arange(start, start + n)
        md = AttentionMetadata(positions=jnp.asarray(positions),
                               cu_q_lens=jnp.asarray([0, n, n], jnp.int32),
                               kv_lens=jnp.asarray([start + n, 0], jnp.int32),
                               page_table=jnp.asarray(page_table))
        batch = ModelInput(jnp.asarray(input_ids), md, jnp.arange(CHUNK, dtype=jnp.int32))
        logits, kv = paged(params, kv, batch, cfg=cfg)
        rows.append(np.asarray(logits)[:n])
    return np.concatenate(rows)


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers(tmp_path, tiny_tokenizer, case):
    model_type, overrides = CASES[case]
    path = write_tiny_checkpoint(tmp_path, model_type, seed=7, dtype=jnp.float32,
                                 tokenizer=tiny_tokenizer, **overrides)
    cfg, params = load_checkpoint(path, dtype=jnp.float32)
    ids = np.random.default_rng(1).integers(0, cfg.vocab_size, PROMPT_LEN)

    reference, model = hf_logits(path, ids)
    assert type(model).__name__.lower().startswith(model_type)
    ours_dense = np.asarray(dense(params, jnp.asarray(ids), cfg=cfg))
    ours_paged = paged_logits(cfg, params, ids)
    dense_err = float(np.abs(ours_dense - reference).max())
    paged_err = float(np.abs(ours_paged - reference).max())
    print(f"{case}: max |logit err| dense {dense_err:.2e} paged {paged_err:.2e} "
          f"(max |logit| {np.abs(reference).max():.2f})")
    assert dense_err <= MAX_ABS_ERR
    assert paged_err <= MAX_ABS_ERR


def test_scaling_and_window_matter():
    """The rope-scaling and sliding-window parity cases would catch a model that ignored them:
    our logits with the feature switched off differ from those with it on."""
    from jspec.models.params import init_params
    from jspec.models.tiny import TINY_INIT_STD, tiny_config

    ids = jnp.asarray(np.random.default_rng(1).integers(0, 512, PROMPT_LEN))
    for model_type, key in (("llama", "llama-llama3-rope-bias"), ("mistral", "mistral-window8")):
        cfg = tiny_config(model_type, **CASES[key][1])
        plain = tiny_config(model_type, **{**CASES[key][1], "rope_scaling": None,
                                           "sliding_window": None})
        params = init_params(cfg, seed=7, dtype=jnp.float32, std=TINY_INIT_STD)
        diff = np.abs(np.asarray(dense(params, ids, cfg=cfg))
                      - np.asarray(dense(params, ids, cfg=plain))).max()
        assert diff > 100 * MAX_ABS_ERR, key


def test_bf16_checkpoint_loads_bit_exact(tmp_path, tiny_tokenizer):
    path = write_tiny_checkpoint(tmp_path, "qwen2", seed=3, dtype=jnp.bfloat16,
                                 tokenizer=tiny_tokenizer)
    cfg, params = load_checkpoint(path, dtype=jnp.bfloat16)
    kwargs = ({"dtype": torch.bfloat16} if int(transformers.__version__.split(".")[0]) >= 5
              else {"torch_dtype": torch.bfloat16})
    model = transformers.AutoModelForCausalLM.from_pretrained(path, **kwargs)
    state = {k: v.float().numpy() for k, v in model.state_dict().items()}
    np.testing.assert_array_equal(state["model.embed_tokens.weight"],
                                  np.asarray(params["embed"], np.float32))
    q = cfg.q_size
    np.testing.assert_array_equal(state["model.layers.1.self_attn.q_proj.weight"],
                                  np.asarray(params["layers"]["wqkv"][1, :, :q], np.float32).T)
    np.testing.assert_array_equal(state["model.layers.1.self_attn.v_proj.bias"],
                                  np.asarray(params["layers"]["bqkv"][1, q + cfg.kv_size:],
                                             np.float32))
