"""The paged ragged forward must equal the dense single-sequence forward.

A small harness plays the block manager: it hands out shuffled physical blocks (never the null
block 0), builds padded ragged batches (padding tokens, padding sequence rows), rolls sequences
back after rejected verification tokens and frees whole trailing blocks, the way the engine does.
Every logit row asked for is compared with ``dense_forward`` of the full sequence (causality makes
a row of the full-length forward equal to the same row of any prefix), and pool blocks no
sequence owns must come out of every step untouched.

Bucket sizes (T, S, R, P, pool size) are fixed for the whole module, so each config compiles the
paged forward once and the dense forward once; scenarios only change array contents.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jspec.models.params import init_params
from jspec.models.tiny import TINY_INIT_STD, tiny_config
from jspec.models.transformer import KVCache, ModelInput, dense_forward, forward
from jspec.kernels.ragged_paged_attention import (
    AttentionMetadata,
    ragged_paged_attention_reference,
)

T, S, R, P = 16, 4, 16, 8  # tokens, sequence rows, logit rows, pages per sequence
NUM_BLOCKS = S * P + 6  # every row at full length, spares, and the null block
ATOL = 1e-4

paged_forward = jax.jit(forward, static_argnames=("cfg", "attention_fn"), donate_argnames=("kv",))
dense = jax.jit(dense_forward, static_argnames=("cfg",))

LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                  "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
# Two pages per attention chunk, so the online softmax runs over several chunks.
chunked_attention = functools.partial(ragged_paged_attention_reference, chunk_pages=2)

# name -> (config, block size, attention fn)
CASES = {
    # GQA ratio 2, untied head, block size 4.
    "llama-gqa2-bs4": (tiny_config("llama"), 4, ragged_paged_attention_reference),
    # GQA ratio 1, tied head, attention_bias (q/k/v and o biases), llama3 rope, block size 16.
    "llama-mha-tied-bias-llama3-bs16": (
        tiny_config("llama", num_kv_heads=4, tie_word_embeddings=True, qkv_bias=True,
                    o_bias=True, rope_scaling=LLAMA3_SCALING),
        16, ragged_paged_attention_reference),
    # GQA ratio 7, Qwen2 qkv bias, tied head, linear rope.
    "qwen2-gqa7-linear-bs4": (
        tiny_config("qwen2", num_heads=7, num_kv_heads=1,
                    rope_scaling={"rope_type": "linear", "factor": 2.0}),
        4, ragged_paged_attention_reference),
    # Sliding window 8 spanning pages of 4, attention walked in chunks of 2 pages.
    "mistral-window8-bs4-chunked": (tiny_config("mistral", sliding_window=8), 4,
                                    chunked_attention),
}


@functools.lru_cache(maxsize=None)
def case_params(name: str):
    cfg, _, _ = CASES[name]
    return init_params(cfg, seed=list(CASES).index(name), dtype=jnp.float32, std=TINY_INIT_STD)


class PagedHarness:
    """Host-side bookkeeping of a few sequences in a paged pool, checked against the oracle."""

    def __init__(self, case: str, seed: int = 0):
        self.cfg, self.block_size, self.attention_fn = CASES[case]
        self.params = case_params(case)
        self.capacity = P * self.block_size
        self.rng = np.random.default_rng(seed)
        shape = (self.cfg.num_layers, NUM_BLOCKS, self.block_size, self.cfg.num_kv_heads,
                 self.cfg.head_dim)
        # Free blocks start full of large finite garbage: reading one would show in the logits.
        self.kv = KVCache(jnp.asarray(self.rng.normal(0, 30, shape), jnp.float32),
                          jnp.asarray(self.rng.normal(0, 30, shape), jnp.float32))
        free = list(range(1, NUM_BLOCKS))
        self.rng.shuffle(free)
        self.free = free
        self.tables: dict[int, list[int]] = {}
        self.lens: dict[int, int] = {}
        self.tokens: dict[int, np.ndarray] = {}
        self._dense: dict[int, np.ndarray] = {}
        self.rows_checked = 0

    # -- sequences
    def start(self, sid: int) -> None:
        self.tokens[sid] = self.rng.integers(0, self.cfg.vocab_size, self.capacity)
        self.tables[sid] = []
        self.lens[sid] = 0

    def finish(self, sid: int) -> None:
        self._release(self.tables.pop(sid))
        del self.lens[sid], self.tokens[sid]
        self._dense.pop(sid, None)

    def _release(self, blocks: list[int]) -> None:
        for block in blocks:  # scatter back into the free list so reuse order stays shuffled
            self.free.insert(int(self.rng.integers(0, len(self.free) + 1)), block)

    def dense_logits(self, sid: int) -> np.ndarray:
        if sid not in self._dense:
            self._dense[sid] = np.asarray(dense(self.params, jnp.asarray(self.tokens[sid]),
                                                cfg=self.cfg))
        return self._dense[sid]

    # -- one model step
    def step(self, work: list[tuple[int, int, int, bool]]) -> None:
        """work: (sequence, new tokens, how many trailing ones get rejected, all logits?)."""
        assert 1 <= len(work) <= S and sum(n for _, n, _, _ in work) <= T
        bs = self.block_size
        input_ids = self.rng.integers(0, self.cfg.vocab_size, T).astype(np.int32)
        positions = self.rng.integers(0, self.capacity, T).astype(np.int32)  # padding: junk
        cu_q_lens = np.zeros(S + 1, np.int32)
        kv_lens = np.zeros(S, np.int32)
        page_table = np.zeros((S, P), np.int32)
        logits_indices = np.zeros(R, np.int32)
        expected: list[tuple[int, int, int]] = []  # (logit row, sequence, position)
        cursor = 0
        for row, (sid, n_new, n_reject, all_logits) in enumerate(work):
            start = self.lens[sid]
            end = start + n_new
            assert 1 <= n_new and 0 <= n_reject < n_new and end <= self.capacity
            table = self.tables[sid]
            while len(table) * bs < end:
                table.append(self.free.pop())
            new = self.tokens[sid][start:end].copy()
            if n_reject:  # rejected draft tokens: anything but the true continuation
                new[n_new - n_reject:] = (new[n_new - n_reject:] + 1
                                          + self.rng.integers(0, self.cfg.vocab_size - 1,
                                                              n_reject)) % self.cfg.vocab_size
            input_ids[cursor:cursor + n_new] = new
            positions[cursor:cursor + n_new] = np.arange(start, end)
            cu_q_lens[row + 1] = cursor + n_new
            kv_lens[row] = end
            page_table[row, :len(table)] = table
            # Only rows whose inputs are all true tokens can be compared with the oracle.
            scored = range(n_new) if all_logits else [n_new - 1]
            for j in scored:
                if j < n_new - n_reject:
                    expected.append((len(expected), sid, start + j))
                    logits_indices[len(expected) - 1] = cursor + j
            cursor += n_new
        cu_q_lens[len(work) + 1:] = cursor  # padding sequence rows: zero new tokens, kv_len 0
        assert len(expected) <= R

        owned = {b for table in self.tables.values() for b in table}
        unowned = np.array(sorted(set(range(1, NUM_BLOCKS)) - owned))
        before_k = np.asarray(self.kv.k)[:, unowned]
        before_v = np.asarray(self.kv.v)[:, unowned]

        batch = ModelInput(
            input_ids=jnp.asarray(input_ids),
            attn=AttentionMetadata(positions=jnp.asarray(positions),
                                   cu_q_lens=jnp.asarray(cu_q_lens),
                                   kv_lens=jnp.asarray(kv_lens),
                                   page_table=jnp.asarray(page_table)),
            logits_indices=jnp.asarray(logits_indices),
        )
        logits, self.kv = paged_forward(self.params, self.kv, batch, cfg=self.cfg,
                                        attention_fn=self.attention_fn)
        logits = np.asarray(logits)
        assert logits.shape == (R, self.cfg.vocab_size)
        for row, sid, pos in expected:
            np.testing.assert_allclose(logits[row], self.dense_logits(sid)[pos], atol=ATOL,
                                       rtol=0, err_msg=f"sequence {sid} position {pos}")
        self.rows_checked += len(expected)
        np.testing.assert_array_equal(np.asarray(self.kv.k)[:, unowned], before_k)
        np.testing.assert_array_equal(np.asarray(self.kv.v)[:, unowned], before_v)

        # Commit: a rollback is a length change plus freeing whole trailing blocks.
        for sid, n_new, n_reject, _ in work:
            self.lens[sid] += n_new - n_reject
            keep = -(-self.lens[sid] // bs)
            self._release(self.tables[sid][keep:])
            del self.tables[sid][keep:]


def _run(case: str, steps: list[list[tuple]], sequences: int) -> PagedHarness:
    h = PagedHarness(case)
    for sid in range(sequences):
        h.start(sid)
    for work in steps:
        h.step([(w + (0, True))[:4] if len(w) == 2 else w for w in work])
    assert h.rows_checked > 0
    return h


case_names = pytest.mark.parametrize("case", list(CASES))


@case_names
def test_whole_prompt_prefill_then_decode(case):
    # 16 tokens end exactly on a page boundary (pages of 4 and 16); the decode token sits just
    # past it. The second sequence's 13 tokens end just past a boundary of 4.
    _run(case, [[(0, 16)], [(1, 13, 0, False), (0, 1)]], sequences=2)


@case_names
def test_chunked_prefill_then_token_by_token_decode(case):
    # Context lengths 5, 8, 9, 16, 17, 18, ...: on and just past boundaries of 4 and 16.
    steps = [[(0, 5)], [(0, 3)], [(0, 1)], [(0, 7)]] + [[(0, 1)]] * 5
    _run(case, steps, sequences=1)


@case_names
def test_verification_chunks_with_rollback(case):
    steps = [
        [(0, 12, 0, False)],
        [(0, 4, 2, True)],   # verify 4, reject 2 -> 14
        [(0, 5, 0, True)],   # verify 5 across the 16 boundary, all accepted -> 19
        [(0, 4, 3, True)],   # reject 3 -> 20
        [(0, 9, 8, True)],   # 20..28 written, back to 21: whole trailing blocks freed
        [(0, 8, 0, True)],   # rewrite over the stale K/V -> 29
        [(0, 1)],
    ]
    _run(case, steps, sequences=1)


@case_names
def test_ragged_batch_with_padding(case):
    # Three live sequences of different lengths, one padding sequence row, padding tokens.
    steps = [
        [(0, 7, 0, True), (1, 4, 0, False), (2, 1, 0, True)],
        [(1, 1, 0, True), (0, 4, 1, True), (2, 8, 0, True)],
        [(2, 4, 3, True), (1, 3, 0, True), (0, 5, 0, False)],
        [(0, 1), (1, 1), (2, 1)],
        [(2, 1), (0, 2, 1, True), (1, 12, 0, True)],
    ]
    _run(case, steps, sequences=3)


@case_names
@settings(max_examples=15, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data())
def test_random_ragged_schedules(case, data):
    """Random mixes of prefill chunks, decode and verification with rollback; sequences finish
    and new ones reuse their blocks (stale K/V included)."""
    h = PagedHarness(case, seed=data.draw(st.integers(0, 2**16), label="seed"))
    next_sid = 0
    for _ in range(data.draw(st.integers(2, 6), label="steps")):
        live = list(h.lens)
        while len(live) < S and data.draw(st.booleans(), label="start"):
            h.start(next_sid)
            live.append(next_sid)
            next_sid += 1
        if not live:
            h.start(next_sid)
            live.append(next_sid)
            next_sid += 1
        budget = T
        work = []
        for sid in data.draw(st.permutations(live), label="order"):
            room = min(budget, h.capacity - h.lens[sid])
            if room < 1 or (work and not data.draw(st.booleans(), label="schedule")):
                continue
            n_new = data.draw(st.integers(1, room), label="new")
            n_reject = data.draw(st.integers(0, n_new - 1), label="reject")
            work.append((sid, n_new, n_reject, data.draw(st.booleans(), label="all")))
            budget -= n_new
        if not work:
            break
        h.step(work)
        for sid in list(h.lens):
            if h.lens[sid] >= h.capacity - 1 or data.draw(st.integers(0, 5), label="f") == 0:
                h.finish(sid)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_float32_dots_ask_for_ieee_products_and_bfloat16_dots_for_the_default(dtype):
    """A GPU computes float32 dots in TF32 unless asked for HIGHEST: every dot of the model's
    projections, output head and attention paths with float32 operands must ask (CPU ignores the
    flag), and dots with bfloat16 operands keep the default (tensor cores)."""
    from jspec.kernels.ragged_paged_attention import ragged_paged_attention_tiled

    cfg = tiny_config("llama")
    params = init_params(cfg, seed=0, dtype=jnp.dtype(dtype), std=TINY_INIT_STD)
    tokens = jnp.arange(8, dtype=jnp.int32)
    texts = [dense.lower(params, tokens, cfg=cfg).as_text()]
    q = jnp.zeros((4, cfg.num_heads, cfg.head_dim), dtype)
    pool = jnp.zeros((1, 3, 4, cfg.num_kv_heads, cfg.head_dim), dtype)
    md = AttentionMetadata(positions=jnp.arange(4, dtype=jnp.int32),
                           cu_q_lens=jnp.array([0, 4], jnp.int32),
                           kv_lens=jnp.array([4], jnp.int32),
                           page_table=jnp.array([[1, 2]], jnp.int32))
    texts.append(jax.jit(lambda q, k, v, md: ragged_paged_attention_tiled(
        q, k, v, 0, md, sm_scale=1.0, max_q_len=4)).lower(q, pool, pool, md).as_text())
    dots = [line for text in texts for line in text.splitlines() if "dot_general" in line]
    assert len(dots) >= 8  # four projections and the head, the attention's two per path
    for line in dots:
        operands = line.rsplit(":", 1)[1].split("->")[0]
        want = "DEFAULT" if "bf16" in operands else "HIGHEST"
        assert f"precision = [{want}, {want}]" in line, line
    if dtype == "bfloat16":  # the projections stay on the tensor cores
        assert any("precision = [DEFAULT, DEFAULT]" in line for line in dots)
    # the per-token reference is the oracle: float32 products whatever the pool holds
    ref = jax.jit(lambda q, k, v, md: ragged_paged_attention_reference(
        q, k, v, 0, md, sm_scale=1.0)).lower(q, pool, pool, md).as_text()
    ref_dots = [line for line in ref.splitlines() if "dot_general" in line]
    assert ref_dots and all("precision = [HIGHEST, HIGHEST]" in line for line in ref_dots)
