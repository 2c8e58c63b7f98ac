"""Byte-level BPE tokenizer for the default model pair, trained with ``tokenizers``.

Same conventions as ``jspec.models.tiny`` (it reuses its pipeline and constants): NFC normalizer, the
GPT-style pre-tokenizer split, byte-level alphabet (so every NFC string round-trips), special
tokens at ids 0..4 in the order ``<|endoftext|>`` (pad), ``<|bos|>``, ``<|eos|>``,
``<|im_start|>``, ``<|im_end|>``, and the ChatML-like chat template. ``save_tokenizer`` writes it
with ``save_pretrained`` so ``AutoTokenizer.from_pretrained(dir)`` loads it offline.
"""

from __future__ import annotations

import os
from typing import Iterable

from jspec.models.tiny import (BOS, CHAT_TEMPLATE, EOS, IM_END, IM_START, PAD, SPECIAL_TOKENS,
                         _PRETOKENIZE_REGEX)

DEFAULT_VOCAB_SIZE = 4096


def train_tokenizer(texts: Iterable[str], vocab_size: int = DEFAULT_VOCAB_SIZE,
                    min_frequency: int = 2, model_max_length: int = 4096):
    """Train a byte-level BPE on ``texts`` -> ``PreTrainedTokenizerFast`` (vocab ``vocab_size``
    including the 5 special tokens)."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from jspec.models.loader import import_transformers

    PreTrainedTokenizerFast = import_transformers().PreTrainedTokenizerFast

    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size must be >= {256 + len(SPECIAL_TOKENS)} (bytes + special "
                         f"tokens), got {vocab_size}")
    tok = Tokenizer(models.BPE())
    # The same pipeline transformers' Qwen2Tokenizer rebuilds in code when it loads a qwen2
    # checkpoint, so the tokenizer encodes identically whichever class loads it.
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    for i, token in enumerate(SPECIAL_TOKENS):
        if tok.token_to_id(token) != i:
            raise AssertionError(f"special token {token!r} got id {tok.token_to_id(token)}")
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=[IM_START, IM_END],
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
        model_max_length=model_max_length,
    )


def save_tokenizer(tokenizer, path: str | os.PathLike) -> str:
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    tokenizer.save_pretrained(path)
    return path


def train_stdlib_tokenizer(vocab_size: int = DEFAULT_VOCAB_SIZE, include_tests: bool = True,
                           max_files: int | None = None):
    """Tokenizer trained on the *train* split of the stdlib corpus (held-out modules unseen)."""
    from jspec.models.corpus import discover, split_files

    train, _ = split_files(discover(include_tests=include_tests))
    if max_files is not None:
        train = train[:max_files]
    return train_tokenizer((f.read() for f in train), vocab_size=vocab_size)
