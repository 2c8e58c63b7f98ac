"""Tiny random models and a tiny tokenizer, for tests, notebooks and smoke runs (no model hub).

Everything here is deterministic: the tokenizer is a byte-level BPE trained in a few
milliseconds on a small text kept in this file (not on the stdlib's source, which changes from
one Python version to the next), and weights come from a seeded numpy generator.
"""

from __future__ import annotations

import os
from typing import Any

import jax.numpy as jnp

from jspec.models.config import ModelConfig
from jspec.models.loader import save_checkpoint
from jspec.models.params import init_params

# Special tokens take the first ids, in this order.
# The pad token is spelled like Qwen's <|endoftext|>: transformers loads any qwen2 checkpoint's
# tokenizer as Qwen2Tokenizer, which adds <|endoftext|> (as unk) when the vocabulary lacks it.
PAD, BOS, EOS, IM_START, IM_END = (
    "<|endoftext|>", "<|bos|>", "<|eos|>", "<|im_start|>", "<|im_end|>"
)
SPECIAL_TOKENS = (PAD, BOS, EOS, IM_START, IM_END)
PAD_ID, BOS_ID, EOS_ID, IM_START_ID, IM_END_ID = range(len(SPECIAL_TOKENS))
TOKENIZER_VOCAB_SIZE = 512

# ChatML-like: every turn is <|im_start|>role\ncontent<|im_end|>\n.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Training text: some prose and some Python, so merges cover both.
_CORPUS = '''
The engine serves many requests at once. Each step it takes a batch of sequences, runs the
draft model for a few tokens, and then asks the target model to verify all of them in one pass.
When the draft agrees with the target, several tokens are accepted for the price of one step;
when it does not, the rejected tokens are rolled back and the target's own token is kept.
A policy decides how many tokens to draft for each sequence, learning from what was accepted.
Under heavy load the draft may cost more than it saves, so the policy can turn it off, move its
weights to the host, and give its memory to the key-value cache of the target.

Hello, world! How are you today? I am fine, thank you. What is the weather like?
It is sunny and warm, with a light wind from the west. The quick brown fox jumps over the lazy
dog. Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 256 1024 2048 3.14159 2.71828.

def attention(query, keys, values, mask=None):
    """Scaled dot-product attention over the last two axes."""
    scores = query @ keys.transpose(-1, -2) / math.sqrt(query.shape[-1])
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    weights = softmax(scores, axis=-1)
    return weights @ values


class BlockManager:
    def __init__(self, num_blocks, block_size):
        self.block_size = block_size
        self.free_blocks = list(range(1, num_blocks))
        self.ref_counts = [0] * num_blocks

    def allocate(self, num_tokens):
        needed = (num_tokens + self.block_size - 1) // self.block_size
        if needed > len(self.free_blocks):
            raise RuntimeError("out of blocks")
        blocks = [self.free_blocks.pop() for _ in range(needed)]
        for block in blocks:
            self.ref_counts[block] += 1
        return blocks

    def free(self, blocks):
        for block in blocks:
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self.free_blocks.append(block)


for i in range(10):
    print(f"step {i}: loss={loss:.4f} tokens/s={rate:.1f}")
result = {"name": "tiny", "layers": 2, "hidden": 64, "ok": True, "items": [1, 2, 3]}
'''


# GPT-style split: contractions, letter runs, single digits, punctuation runs, whitespace.
_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)


def build_tiny_tokenizer(vocab_size: int = TOKENIZER_VOCAB_SIZE, corpus: str | None = None):
    """A byte-level BPE ``PreTrainedTokenizerFast`` with pad/bos/eos, ChatML tokens and a chat
    template, trained on a short built-in text. Byte-level means every (NFC-normalized) string
    round-trips through encode/decode."""
    from jspec.models.tokenizer_train import train_tokenizer  # it imports this module's constants

    return train_tokenizer([corpus if corpus is not None else _CORPUS], vocab_size=vocab_size,
                           min_frequency=0)


_FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    # Untied, no biases: plain Llama.
    "llama": dict(tie_word_embeddings=False),
    # Qwen2(.5) small models: q/k/v biases and a tied head.
    "qwen2": dict(qkv_bias=True, tie_word_embeddings=True, rope_theta=1000000.0),
    # Mistral: a sliding window small enough that tests with short prompts exercise it.
    "mistral": dict(sliding_window=16, tie_word_embeddings=False),
}


def tiny_config(model_type: str = "llama", **overrides) -> ModelConfig:
    """A 2-layer, hidden-64 config of the given family; any ModelConfig field can be overridden.

    ``rope_scaling`` may be given as a dict (it is frozen into the hashable tuple form)."""
    if model_type not in _FAMILY_DEFAULTS:
        raise ValueError(f"no tiny config for model_type {model_type!r}; supported: "
                         f"{', '.join(_FAMILY_DEFAULTS)}")
    fields: dict[str, Any] = dict(
        model_type=model_type,
        vocab_size=TOKENIZER_VOCAB_SIZE,
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        intermediate_size=128,
        rms_norm_eps=1e-6,
        max_position_embeddings=512,
        bos_token_id=BOS_ID,
        eos_token_ids=(EOS_ID, IM_END_ID),
    )
    fields.update(_FAMILY_DEFAULTS[model_type])
    fields.update(overrides)
    if isinstance(fields.get("rope_scaling"), dict):
        fields["rope_scaling"] = tuple(sorted(fields["rope_scaling"].items()))
    return ModelConfig(**fields)


# Draft shape relative to the tiny target: half the width, one layer.
DRAFT_OVERRIDES = dict(num_layers=1, hidden_size=32, num_heads=2, num_kv_heads=1, head_dim=16,
                       intermediate_size=64)

# Large enough that logits are far from flat, so greedy argmax is well separated.
TINY_INIT_STD = 0.2


def write_tiny_checkpoint(
    path: str | os.PathLike,
    model_type: str = "llama",
    seed: int = 0,
    dtype=jnp.float32,
    vocab_size: int | None = None,
    tokenizer=None,
    **cfg_overrides,
) -> str:
    """Write a random tiny HF checkpoint (config, weights, tokenizer) to ``path``; returns it.

    ``vocab_size`` may exceed the tokenizer's (padded embedding rows, as real models have) but
    not be smaller."""
    tokenizer = tokenizer if tokenizer is not None else build_tiny_tokenizer()
    tok_size = len(tokenizer)
    vocab_size = tok_size if vocab_size is None else vocab_size
    if vocab_size < tok_size:
        raise ValueError(f"vocab_size {vocab_size} is smaller than the tokenizer's {tok_size}")
    cfg = tiny_config(model_type, vocab_size=vocab_size, **cfg_overrides)
    params = init_params(cfg, seed=seed, dtype=dtype, std=TINY_INIT_STD)
    return save_checkpoint(path, cfg, params, tokenizer=tokenizer)


def write_tiny_pair(
    directory: str | os.PathLike, model_type: str = "llama", seed: int = 0, dtype=jnp.float32
) -> tuple[str, str]:
    """A tiny target (2 layers, hidden 64) and a smaller draft (1 layer, hidden 32) sharing one
    tokenizer and vocabulary, written to ``directory/target`` and ``directory/draft``."""
    directory = os.fspath(directory)
    tokenizer = build_tiny_tokenizer()
    target = write_tiny_checkpoint(os.path.join(directory, "target"), model_type, seed=seed,
                                   dtype=dtype, tokenizer=tokenizer)
    draft = write_tiny_checkpoint(os.path.join(directory, "draft"), model_type, seed=seed + 1,
                                  dtype=dtype, tokenizer=tokenizer, **DRAFT_OVERRIDES)
    return target, draft
