"""Pallas kernels against their pure-jnp references, and the backend switch. The kernels run
interpreted (any machine) or, with ``JSPEC_KERNEL_TESTS=compiled`` on a GPU, compiled as the
engine runs them (tests/kernel_mode.py).

Shapes are fixed per case (T tokens, S sequence rows, P pages, pool size) so each case compiles
the kernel and the reference once; hypothesis varies only array contents: how many tokens each
sequence brings (1..16, or a long prefill chunk), context lengths (often exactly on or one past a
page boundary), which physical blocks the pages map to, padding rows.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jspec.kernels import backend
from jspec.kernels.kv_migration import (
    migrate_blocks,
    migrate_blocks_reference,
    pad_pairs,
    validate_pairs,
)
from jspec.kernels.ragged_paged_attention import (
    AttentionMetadata,
    ragged_paged_attention,
    ragged_paged_attention_reference,
    ragged_paged_attention_tiled,
    reference_q_block,
)

import kernel_mode

kernel_mode.skip_module_without_gpu()
ragged_paged_attention = kernel_mode.as_tested(ragged_paged_attention, "attention")
migrate_blocks = kernel_mode.as_tested(migrate_blocks, "migration")

T, S = 48, 5  # flat tokens, sequence rows
LAYERS = 2

# name -> (kv heads, group, head_dim, block size, pages per sequence, dtype, sliding window)
CASES = {
    "gqa1-d64-bs16-f32": (2, 1, 64, 16, 6, jnp.float32, None),
    "gqa2-d128-bs16-f32": (2, 2, 128, 16, 4, jnp.float32, None),
    "gqa8-d64-bs8-f32": (1, 8, 64, 8, 10, jnp.float32, None),
    "gqa3-d64-bs4-window-f32": (2, 3, 64, 4, 20, jnp.float32, 11),
    "gqa2-d64-bs16-bf16": (2, 2, 64, 16, 6, jnp.bfloat16, None),
    "gqa8-d128-bs16-bf16": (1, 8, 128, 16, 4, jnp.bfloat16, None),
}
TOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}


@functools.lru_cache(maxsize=None)
def _fns(name):
    kvh, group, head_dim, block_size, pages, dtype, window = CASES[name]
    kw = dict(sm_scale=head_dim ** -0.5, sliding_window=window)
    kernel = jax.jit(lambda q, k, v, layer, md: ragged_paged_attention(
        q, k, v, layer, md, interpret=True, **kw))
    ref = jax.jit(lambda q, k, v, layer, md: ragged_paged_attention_reference(
        q, k, v, layer, md, **kw))
    return kernel, ref


def _context_len(draw, block_size, max_len, q_len):
    kind = draw(st.sampled_from(["on", "past", "any"]))
    pages = draw(st.integers(1, max_len // block_size))
    if kind == "on":
        n = pages * block_size
    elif kind == "past":
        n = min(pages * block_size + 1, max_len)
    else:
        n = draw(st.integers(1, max_len))
    return max(n, q_len)


@st.composite
def ragged_batches(draw, name):
    kvh, group, head_dim, block_size, pages, dtype, window = CASES[name]
    max_len = pages * block_size
    live = draw(st.integers(1, S))
    q_lens, budget = [], T
    for _ in range(live):
        if budget == 0:
            break
        long_chunk = draw(st.booleans()) and budget > 16
        q = draw(st.integers(17, min(budget, 40)) if long_chunk
                 else st.integers(1, min(16, budget)))
        q_lens.append(q)
        budget -= q
    kv_lens = [_context_len(draw, block_size, max_len, q) for q in q_lens]
    seed = draw(st.integers(0, 2 ** 31 - 1))
    return q_lens, kv_lens, seed


def _make_inputs(name, q_lens, kv_lens, seed):
    kvh, group, head_dim, block_size, pages, dtype, window = CASES[name]
    rng = np.random.default_rng(seed)
    num_blocks = S * pages + 3
    cu = np.zeros(S + 1, np.int32)
    cu[1:len(q_lens) + 1] = np.cumsum(q_lens)
    cu[len(q_lens) + 1:] = cu[len(q_lens)]
    positions = np.zeros(T, np.int32)
    kv = np.zeros(S, np.int32)
    table = np.zeros((S, pages), np.int32)
    free = rng.permutation(np.arange(1, num_blocks))  # block 0 is the null block
    used = 0
    for i, (q, n) in enumerate(zip(q_lens, kv_lens)):
        positions[cu[i]:cu[i + 1]] = np.arange(n - q, n)
        kv[i] = n
        need = -(-n // block_size)
        table[i, :need] = free[used:used + need]
        used += need
    md = AttentionMetadata(jnp.asarray(positions), jnp.asarray(cu), jnp.asarray(kv),
                           jnp.asarray(table))
    shape = (LAYERS, num_blocks, block_size, kvh, head_dim)
    q = jnp.asarray(rng.normal(size=(T, kvh * group, head_dim)), dtype)
    k = jnp.asarray(rng.normal(size=shape), dtype)
    v = jnp.asarray(rng.normal(size=shape), dtype)
    return q, k, v, md, int(cu[-1])


def _check_ragged_batches(name, kernel, ref, max_examples):
    """``kernel`` against ``ref`` on ``max_examples`` ragged batches of case ``name``."""
    dtype = CASES[name][5]

    @settings(max_examples=max_examples, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(ragged_batches(name))
    def check(batch):
        q, k, v, md, live = _make_inputs(name, *batch)
        layer = jnp.asarray(1, jnp.int32)
        out = np.asarray(kernel(q, k, v, layer, md).astype(jnp.float32))[:live]
        expect = np.asarray(ref(q, k, v, layer, md).astype(jnp.float32))[:live]
        np.testing.assert_allclose(out, expect, atol=TOL[dtype], rtol=0)

    check()


@pytest.mark.parametrize("name", list(CASES))
def test_attention_kernel_matches_reference(name):
    kernel, ref = _fns(name)
    _check_ragged_batches(name, kernel, ref, max_examples=10)


def test_attention_kernel_decode_verify_and_prefill_in_one_launch():
    """A hand-made mixed batch: a decode token, a 5-token verification window, a 37-token
    prefill chunk past a page boundary, and a sequence whose context is exactly 2 pages."""
    name = "gqa2-d128-bs16-f32"
    kernel, ref = _fns(name)
    q, k, v, md, live = _make_inputs(name, [1, 5, 37, 3], [40, 16, 49, 32], seed=3)
    out = np.asarray(kernel(q, k, v, 0, md))[:live]
    np.testing.assert_allclose(out, np.asarray(ref(q, k, v, 0, md))[:live], atol=1e-5, rtol=0)


def test_attention_kernel_q_block_is_a_parameter():
    name = "gqa1-d64-bs16-f32"
    kvh, group, head_dim, *_ = CASES[name]
    q, k, v, md, live = _make_inputs(name, [3, 20, 1], [3, 70, 64], seed=5)
    ref = ragged_paged_attention_reference(q, k, v, 0, md, sm_scale=0.125)
    # (7: any size interpreted; a Triton tile must be a power of two)
    for q_block in (1, 4 if kernel_mode.COMPILED else 7):
        out = ragged_paged_attention(q, k, v, 0, md, sm_scale=0.125, q_block=q_block,
                                     interpret=True)
        np.testing.assert_allclose(np.asarray(out)[:live], np.asarray(ref)[:live], atol=1e-5)


@functools.lru_cache(maxsize=None)
def _tiled_fn(name, q_block):
    kvh, group, head_dim, block_size, pages, dtype, window = CASES[name]
    return jax.jit(lambda q, k, v, layer, md: ragged_paged_attention_tiled(
        q, k, v, layer, md, sm_scale=head_dim ** -0.5, sliding_window=window, q_block=q_block,
        chunk_pages=2))


@pytest.mark.parametrize("name", ["gqa1-d64-bs16-f32", "gqa8-d64-bs8-f32",
                                  "gqa3-d64-bs4-window-f32", "gqa2-d64-bs16-bf16"])
def test_tiled_attention_matches_per_token_reference(name):
    """The path the ``reference`` backend runs (one K/V gather per query tile) against the
    per-token oracle, over ragged batches of decode, verification and prefill rows; several
    chunks of pages (chunk_pages=2) so the online softmax crosses chunk boundaries. One-token
    tiles too: over one kv head (gqa8) they take the tiles' products, not the per-token path."""
    _, ref = _fns(name)
    dtype = CASES[name][5]
    default = reference_q_block(T, S)
    assert default == 8  # 48 tokens over 5 rows: tiles of 8
    fns = [_tiled_fn(name, qb) for qb in (default, 3, 1)]

    @settings(max_examples=8, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(ragged_batches(name))
    def check(batch):
        q, k, v, md, live = _make_inputs(name, *batch)
        layer = jnp.asarray(1, jnp.int32)
        expect = np.asarray(ref(q, k, v, layer, md).astype(jnp.float32))[:live]
        for fn in fns:
            out = np.asarray(fn(q, k, v, layer, md).astype(jnp.float32))[:live]
            np.testing.assert_allclose(out, expect, atol=TOL[dtype], rtol=0)

    check()


@pytest.mark.parametrize("name", ["gqa2-d64-bs16-bf16", "gqa8-d128-bs16-bf16"])
def test_batch_invariant_tiled_attention(name):
    """With ``batch_invariant`` a sequence's attention output in bf16 is bit-identical whether
    its tokens come alone (a 1-token decode) or as a verification window beside other
    sequences' decode and prefill rows, and it stays within bf16's tolerance of the oracle.
    (float32 dots on XLA:CPU change their summation order with the row count at several
    thresholds, so float32 is not bit-invariant: pallas_kernels/batch_invariance.py.)"""
    kvh, group, head_dim, block_size, pages, dtype, window = CASES[name]
    kw = dict(sm_scale=head_dim ** -0.5, sliding_window=window, batch_invariant=True)
    _, ref = _fns(name)
    # sequence 1 has a 40-token context; its last 5 tokens are the rows compared
    q, k, v, md, live = _make_inputs(name, [1, 5, 37], [40, 40, 49], seed=11)
    layer = jnp.asarray(0, jnp.int32)
    batched = np.asarray(ragged_paged_attention_tiled(q, k, v, layer, md, **kw))
    np.testing.assert_allclose(batched[:live].astype(np.float32),
                               np.asarray(ref(q, k, v, layer, md))[:live].astype(np.float32),
                               atol=TOL[dtype], rtol=0)
    rows = batched[1:6]
    for j in range(5):  # each of those tokens decoded alone: one token, one sequence
        md1 = AttentionMetadata(md.positions[1 + j:2 + j], jnp.asarray([0, 1], jnp.int32),
                                md.positions[1 + j:2 + j] + 1, md.page_table[1:2])
        alone = ragged_paged_attention_tiled(q[1 + j:2 + j], k, v, layer, md1, max_q_len=1,
                                             **kw)
        np.testing.assert_array_equal(np.asarray(alone)[0], rows[j], err_msg=f"token {j}")


def test_reference_q_block():
    assert reference_q_block(32, 32) == 1  # plain decoding: per-token gathers are per-sequence
    assert reference_q_block(256, 32) == 8
    assert reference_q_block(160, 32) == 4
    assert reference_q_block(256, 2) == 128
    assert reference_q_block(8, 16) == 1



@pytest.mark.parametrize("name", ["gqa1-d64-bs16-f32", "gqa3-d64-bs4-window-f32",
                                  "gqa2-d64-bs16-bf16"])
def test_a_bound_on_new_tokens_gives_one_tile_per_sequence_and_the_same_attention(name):
    """A decode-only verification (every sequence at most γ + 1 = 5 tokens, a padding row, flat
    padding tokens): with ``max_q_len`` the tiled path and the kernel plan one tile per sequence
    (the ragged bound plans ceil(T / q_block) + S) and still match the per-token oracle."""
    from jspec.kernels.ragged_paged_attention import _tile_plan

    kernel_dtype = CASES[name][5]
    head_dim, block_size, window = CASES[name][2], CASES[name][3], CASES[name][6]
    kw = dict(sm_scale=head_dim ** -0.5, sliding_window=window, max_q_len=5)
    _, ref = _fns(name)
    q, k, v, md, live = _make_inputs(name, [5, 1, 5, 3], [37, 5, 64, 18], seed=7)
    assert _tile_plan(md, T, 5, block_size, window, max_q_len=5)[0].shape == (S,)
    assert _tile_plan(md, T, 5, block_size, window)[0].shape == (-(-T // 5) + S,)
    expect = np.asarray(ref(q, k, v, 1, md).astype(jnp.float32))[:live]
    for out in (ragged_paged_attention_tiled(q, k, v, 1, md, **kw),
                ragged_paged_attention(q, k, v, 1, md, interpret=True, **kw)):
        np.testing.assert_allclose(np.asarray(out.astype(jnp.float32))[:live], expect,
                                   atol=TOL[kernel_dtype], rtol=0)


def _split(pool, n0):
    """A one-array pool as two segments (base ``n0`` blocks, the rest the extension)."""
    return (pool[:, :n0], pool[:, n0:])


@pytest.mark.parametrize("name", ["gqa2-d128-bs16-f32", "gqa3-d64-bs4-window-f32"])
def test_attention_over_a_segmented_pool_equals_the_one_array_pool(name):
    """Elastic memory's expanded pool: the same blocks held as base + extension segments give
    the same attention, bit for bit, on all three paths (per-token reference, the tiled
    reference, the kernel), with pages on both sides of the split."""
    kernel, ref = _fns(name)
    tiled = _tiled_fn(name, reference_q_block(T, S))
    q, k, v, md, live = _make_inputs(name, [1, 5, 30, 3], [40, 16, 49, 20], seed=11)
    n0 = k.shape[1] // 2
    table = np.asarray(md.page_table)
    assert (table[table > 0] < n0).any() and (table >= n0).any()  # both segments are read
    ks, vs = _split(k, n0), _split(v, n0)
    for fn in (ref, tiled, kernel):
        whole = np.asarray(fn(q, k, v, 1, md))[:live]
        split = np.asarray(fn(q, ks, vs, 1, md))[:live]
        assert np.array_equal(whole, split)


def test_segment_writes_land_in_the_segment_that_holds_the_block():
    from jspec.kernels import segments

    pool = jnp.zeros((2, 6, 4, 1, 2), jnp.float32)
    blocks = jnp.asarray([1, 4, 5, 0], jnp.int32)
    offsets = jnp.asarray([0, 3, 1, 2], jnp.int32)
    vals = jnp.arange(8, dtype=jnp.float32).reshape(4, 1, 2) + 1
    whole = segments.write_slots(pool, 1, blocks, offsets, vals)
    split = segments.write_slots(_split(pool, 4), 1, blocks, offsets, vals)
    assert [s.shape[1] for s in split] == [4, 2]
    assert np.array_equal(np.concatenate([np.asarray(s) for s in split], axis=1),
                          np.asarray(whole))
    assert segments.num_blocks(split) == 6
    got = segments.read_blocks(split, jnp.asarray([[5, 1], [4, 0]]), layer=1)
    assert np.array_equal(np.asarray(got), np.asarray(whole[1, jnp.asarray([[5, 1], [4, 0]])]))
    got = segments.read_blocks(split, jnp.asarray([4, 1]))
    assert np.array_equal(np.asarray(got), np.asarray(whole[:, jnp.asarray([4, 1])]))

# ----------------------------------------------------------------------------- GPU shaping
def test_kernel_query_tile_follows_the_bound_on_new_tokens():
    """(tokens, rows) of a tile: rows are tokens x heads per kv head, a power of two, >= 16."""
    from jspec.kernels.ragged_paged_attention import kernel_tile

    assert kernel_tile(7, max_q_len=5) == (5, 64)  # a γ = 4 verification: one tile, not two
    assert kernel_tile(7, max_q_len=1) == (1, 16)  # decode: 7 rows of 16
    assert kernel_tile(2, max_q_len=5) == (5, 16)
    assert kernel_tile(7, max_q_len=40) == (9, 64)  # 280 rows: tiles of TILE_ROWS instead
    assert kernel_tile(7) == (9, 64) and kernel_tile(1) == (64, 64)  # prefill chunks
    assert kernel_tile(1, q_block=7) == (7, 16)
    # batch-invariant: 64 rows whatever the bound, so the dots keep one shape
    assert kernel_tile(7, max_q_len=1, batch_invariant=True) == (1, 64)
    assert kernel_tile(7, max_q_len=5, batch_invariant=True) == (5, 64)
    assert kernel_tile(7, batch_invariant=True) == (9, 64)


def test_pages_per_iteration_bounded_by_keys_and_bytes():
    from jspec.kernels.ragged_paged_attention import pages_per_iteration

    assert pages_per_iteration(8, 256, 16, 64, 2) == 8
    assert pages_per_iteration(8, 256, 16, 128, 2) == 8  # 32 KiB of K: the most
    assert pages_per_iteration(16, 256, 16, 128, 2) == 8
    assert pages_per_iteration(16, 256, 16, 64, 2) == 16
    assert pages_per_iteration(8, 256, 16, 128, 4) == 4  # f32
    assert pages_per_iteration(8, 3, 16, 64, 2) == 4  # no wider than the page table needs
    assert pages_per_iteration(1, 256, 4, 64, 4) == 4  # at least 16 keys
    assert pages_per_iteration(6, 256, 16, 64, 2) == 8  # a power of two


def test_context_splits_fill_the_gpu_for_small_batches_only():
    from jspec.kernels.ragged_paged_attention import context_splits

    # 4k-token contexts at block 16 in chunks of 8 pages: 32 chunks
    assert context_splits(1, 2, 32) == 32  # B = 1 over 2 kv heads: 64 programs, not 2
    assert context_splits(1, 2, 64) == 64 and context_splits(1, 2, 512) == 64  # MAX_SPLITS
    assert context_splits(32, 2, 32) == 4  # 256 programs
    assert context_splits(128, 2, 32) == 1
    assert context_splits(1, 2, 32, programs=16) == 8
    assert context_splits(1, 2, 3) == 3  # a split reads at least one chunk
    assert context_splits(1, 2, 32, batch_invariant=True) == 8  # fixed per model
    assert context_splits(128, 2, 32, batch_invariant=True) == 8


def _long_decode(group, dtype, context, block_size=4, pages=80, seed=0):
    """One decode token at position ``context - 1`` (a second, empty sequence row, flat padding
    tokens), its pages scattered over the pool: the lone decode flash-decoding splits."""
    rng = np.random.default_rng(seed)
    kvh, head_dim, tokens = 2, 64, 4
    num_blocks = pages + 2
    need = -(-context // block_size)
    table = np.zeros((2, pages), np.int32)
    table[0, :need] = rng.permutation(np.arange(1, num_blocks))[:need]
    md = AttentionMetadata(jnp.asarray([context - 1, 0, 0, 0], jnp.int32),
                           jnp.asarray([0, 1, 1], jnp.int32),
                           jnp.asarray([context, 0], jnp.int32), jnp.asarray(table))
    shape = (LAYERS, num_blocks, block_size, kvh, head_dim)
    q = jnp.asarray(rng.normal(size=(tokens, kvh * group, head_dim)), dtype)
    k = jnp.asarray(rng.normal(size=shape), dtype)
    v = jnp.asarray(rng.normal(size=shape), dtype)
    return q, k, v, md


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_a_lone_decode_split_over_the_context_matches_the_reference(dtype):
    """B = 1 decode over a 301-token context (76 pages of 4): split over up to 19 programs per
    kv head (one per 4-page chunk) and merged, split in 3, and not split (float32), all equal
    to the per-token oracle; the 76-page context ends inside a chunk and a page."""
    from jspec.kernels.ragged_paged_attention import context_splits

    q, k, v, md = _long_decode(7, dtype, context=301)
    ref = np.asarray(ragged_paged_attention_reference(q, k, v, 1, md, sm_scale=0.125)
                     .astype(jnp.float32))[:1]
    assert context_splits(1, 2, 80 // 4) == 20  # 19 of them read pages, the 20th none
    kernel = jax.jit(functools.partial(ragged_paged_attention, sm_scale=0.125, max_q_len=1,
                                       pages_per_iter=4, interpret=True),
                     static_argnames="programs")
    for programs in (256, 6, 1) if dtype == jnp.float32 else (256,):
        out = kernel(q, k, v, 1, md, programs=programs)
        np.testing.assert_allclose(np.asarray(out.astype(jnp.float32))[:1], ref,
                                   atol=TOL[dtype], rtol=0, err_msg=f"programs={programs}")


# kernel settings beside the defaults: pages per iteration (1 and 2 are raised to 16 keys'
# worth), splits as many as there are chunks, and the batch-invariant mode's fixed slots
SETTINGS = {
    "ppi2-split": dict(pages_per_iter=2, programs=4096),
    "ppi4-split-bounded": dict(pages_per_iter=4, programs=4096, max_q_len=40),
    "invariant": dict(pages_per_iter=1, batch_invariant=True, invariant_splits=3),
}


@functools.lru_cache(maxsize=None)
def _kernel_with(name, setting):
    kvh, group, head_dim, block_size, pages, dtype, window = CASES[name]
    kw = dict(sm_scale=head_dim ** -0.5, sliding_window=window, **SETTINGS[setting])
    return jax.jit(lambda q, k, v, layer, md: ragged_paged_attention(
        q, k, v, layer, md, interpret=True, **kw))


@pytest.mark.parametrize("setting", SETTINGS)
@pytest.mark.parametrize("name", ["gqa3-d64-bs4-window-f32", "gqa2-d64-bs16-bf16"])
def test_attention_kernel_settings_match_reference(name, setting):
    """Ragged batches (decode, verification, prefill chunks, padding rows) with the context
    split over programs and merged, several pages per iteration, the invariant mode."""
    _, ref = _fns(name)
    _check_ragged_batches(name, _kernel_with(name, setting), ref, max_examples=4)


def test_batch_invariant_kernel_gives_a_token_the_same_bits_alone_or_in_a_batch():
    """The kernel's batch-invariant mode (the engine's target under ``deterministic``): a
    verification window's tokens beside decode and prefill rows give bit for bit what each
    token gives decoded alone, with the context cut into 3 fixed slots of 2 pages. (Without
    the mode, ``programs=16`` splits the batch's contexts in 2 and the lone token's in 6, and
    the bits differ.)"""
    name = "gqa2-d64-bs16-bf16"
    kvh, group, head_dim, block_size, pages, dtype, window = CASES[name]
    kernel = jax.jit(functools.partial(
        ragged_paged_attention, sm_scale=head_dim ** -0.5, batch_invariant=True,
        pages_per_iter=1, invariant_splits=3, programs=16, interpret=True),
        static_argnames="max_q_len")
    _, ref = _fns(name)
    q, k, v, md, live = _make_inputs(name, [1, 5, 37], [40, 70, 49], seed=11)
    layer = jnp.asarray(0, jnp.int32)
    batched = np.asarray(kernel(q, k, v, layer, md))
    np.testing.assert_allclose(batched[:live].astype(np.float32),
                               np.asarray(ref(q, k, v, layer, md))[:live].astype(np.float32),
                               atol=TOL[dtype], rtol=0)
    for j in range(5):  # each of those tokens decoded alone: one token, one sequence
        md1 = AttentionMetadata(md.positions[1 + j:2 + j], jnp.asarray([0, 1], jnp.int32),
                                md.positions[1 + j:2 + j] + 1, md.page_table[1:2])
        alone = kernel(q[1 + j:2 + j], k, v, layer, md1, max_q_len=1)
        np.testing.assert_array_equal(np.asarray(alone)[0], batched[1 + j], err_msg=f"token {j}")


# ----------------------------------------------------------------------------- migration
MIG_SHAPE = (3, 24, 4, 2, 64)  # layers, blocks, block size, kv heads, head_dim


@st.composite
def migration_plans(draw):
    n = draw(st.integers(0, 8))
    blocks = draw(st.permutations(list(range(1, MIG_SHAPE[1]))))
    return [(blocks[i], blocks[n + i]) for i in range(n)]


@settings(max_examples=15, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(migration_plans(), st.integers(0, 2 ** 31 - 1))
def test_migration_kernel_matches_reference_and_leaves_the_rest_untouched(plan, seed):
    rng = np.random.default_rng(seed)
    k = rng.normal(size=MIG_SHAPE).astype(np.float32)
    v = rng.normal(size=MIG_SHAPE).astype(np.float32)
    pairs = jnp.asarray(pad_pairs(validate_pairs(plan, MIG_SHAPE[1]), 8))
    rk, rv = migrate_blocks_reference(jnp.asarray(k), jnp.asarray(v), pairs)
    ok, ov = migrate_blocks(jnp.asarray(k), jnp.asarray(v), pairs, interpret=True)
    ok, ov = np.asarray(ok), np.asarray(ov)
    assert np.array_equal(ok, np.asarray(rk)) and np.array_equal(ov, np.asarray(rv))
    moved = {d for _, d in plan}
    for b in range(MIG_SHAPE[1]):
        if b in moved:
            src = next(s for s, d in plan if d == b)
            assert np.array_equal(ok[:, b], k[:, src]) and np.array_equal(ov[:, b], v[:, src])
        else:  # bit for bit
            assert ok[:, b].tobytes() == k[:, b].tobytes()
            assert ov[:, b].tobytes() == v[:, b].tobytes()


def test_migration_in_bf16_is_exact():
    k = jnp.asarray(np.random.default_rng(1).normal(size=MIG_SHAPE), jnp.bfloat16)
    v = k + 1
    pairs = jnp.asarray(pad_pairs(validate_pairs([(20, 3), (5, 9)], MIG_SHAPE[1]), 4))
    rk, rv = migrate_blocks_reference(k, v, pairs)
    ok, ov = migrate_blocks(k, v, pairs, interpret=True)  # donates k and v
    assert np.array_equal(np.asarray(ok), np.asarray(rk))
    assert np.array_equal(np.asarray(ov), np.asarray(rv))


def test_migration_between_segments_matches_the_one_array_pool():
    """Contraction's moves: live blocks of the extension segment into free base blocks (and,
    for generality, one the other way), kernel and reference, against the unsplit pool."""
    rng = np.random.default_rng(4)
    k = jnp.asarray(rng.normal(size=MIG_SHAPE), jnp.float32)
    v = k * 2
    n0 = 16
    plan = [(17, 3), (23, 5), (20, 9), (2, 18)]
    pairs = jnp.asarray(pad_pairs(validate_pairs(plan, MIG_SHAPE[1]), 8))
    wk, wv = migrate_blocks_reference(k, v, pairs)
    for fn in (migrate_blocks_reference, functools.partial(migrate_blocks, interpret=True)):
        sk, sv = fn(_split(k, n0), _split(v, n0), pairs)
        assert [a.shape[1] for a in sk] == [n0, MIG_SHAPE[1] - n0]
        assert np.array_equal(np.concatenate([np.asarray(a) for a in sk], axis=1), wk)
        assert np.array_equal(np.concatenate([np.asarray(a) for a in sv], axis=1), wv)


@pytest.mark.parametrize("shape", [(2, 7, 16, 4, 128),  # a row of two 4096-element chunks
                                   (2, 7, 16, 3, 80)])  # 3840 elements: 15 chunks of 256
@pytest.mark.parametrize("split", [None, 4])
def test_migration_copies_rows_of_several_chunks_whole(shape, split):
    """Rows longer than one chunk, or of no power-of-two length, over one or two segments."""
    k = jnp.asarray(np.random.default_rng(5).normal(size=shape), jnp.float32)
    v = -k
    pairs = jnp.asarray(pad_pairs(validate_pairs([(6, 1), (2, 5)], shape[1]), 4))
    wk, wv = migrate_blocks_reference(k, v, pairs)
    if split is None:
        got = migrate_blocks(k + 0, v + 0, pairs, interpret=True)
    else:
        got = [np.concatenate([np.asarray(a) for a in pool], axis=1) for pool in
               migrate_blocks(_split(k, split), _split(v, split), pairs, interpret=True)]
    assert np.array_equal(np.asarray(got[0]), np.asarray(wk))
    assert np.array_equal(np.asarray(got[1]), np.asarray(wv))


@pytest.mark.parametrize("plan, message", [
    ([(3, 5), (5, 7)], "both a source and a destination"),
    ([(3, 5), (4, 5)], "destination block 5 appears more than once"),
    ([(3, 99)], "block 99 is outside the pool"),
    ([(0, 4)], "null block"),
    ([(4, 0)], "null block"),
    ([(6, 6)], "onto itself"),
])
def test_migration_rejects_overlapping_or_bad_plans(plan, message):
    with pytest.raises(ValueError, match=message):
        validate_pairs(plan, 24)


# ----------------------------------------------------------------------------- backend switch
@pytest.mark.skipif(kernel_mode.COMPILED, reason="the backend choice on a CPU; compiled "
                    "kernel tests run on a GPU")
def test_backend_resolution_on_cpu(monkeypatch):
    monkeypatch.delenv("JSPEC_KERNEL_BACKEND", raising=False)
    assert backend.platform() == "cpu"
    both = lambda name: backend.Kernels(name, name)  # noqa: E731
    assert backend.select("auto") == both("reference")
    assert backend.select("interpret") == both("interpret")
    assert backend.select("reference") == both("reference")
    with pytest.raises(ValueError, match="needs a GPU.*'interpret'"):
        backend.select("pallas")
    with pytest.raises(ValueError, match="unknown; choose from"):
        backend.select("triton")
    monkeypatch.setenv("JSPEC_KERNEL_BACKEND", "interpret")
    assert backend.select("auto") == both("interpret")
    assert backend.select("reference") == both("reference")  # an explicit config wins
    monkeypatch.setenv("JSPEC_KERNEL_BACKEND", "bogus")
    with pytest.raises(ValueError, match="'bogus' is unknown"):
        backend.select("auto")


def test_backend_functions():
    assert backend.attention_fn("reference") is ragged_paged_attention_tiled
    assert backend.attention_fn("interpret").keywords == {"interpret": True}
    with pytest.raises(ValueError, match="select"):
        backend.attention_fn("auto")
    k = jnp.arange(np.prod(MIG_SHAPE), dtype=jnp.float32).reshape(MIG_SHAPE)
    pairs = jnp.asarray(pad_pairs(validate_pairs([(7, 2)], MIG_SHAPE[1]), 2))
    for name in ("reference", "interpret"):
        nk, nv = backend.migration_fn(name)(k + 0, k + 1, pairs)
        assert np.array_equal(np.asarray(nk[:, 2]), np.asarray(k[:, 7]))
        assert np.array_equal(np.asarray(nv[:, 2]), np.asarray(k[:, 7] + 1))


# ----------------------------------------------------------------------------- in the engine
def test_engine_on_the_interpreted_kernel_is_lossless(engine_models):
    """The whole engine (prefill chunks, draft loop, catch-up, verification) with every attention
    call going through the Pallas kernel (interpreted, or compiled: tests/kernel_mode.py):
    greedy output equals the target-only run on the reference attention."""
    from conftest import make_engine, run_to_completion
    from jspec.sampling_params import SamplingParams
    from jspec.policies.static import StaticPolicy

    target, draft, _ = engine_models
    prompts = [list(range(5, 45)), [7], list(range(100, 117))]
    greedy = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    expect = run_to_completion(make_engine(target, None), prompts, greedy)
    engine = make_engine(target, draft, policy=StaticPolicy(7, gamma=3),
                         kernel_backend=kernel_mode.ENGINE_BACKEND, warmup=False)
    assert engine.runner.kernel_backend == kernel_mode.ENGINE_BACKEND
    got = run_to_completion(engine, prompts, greedy)
    for i in range(len(prompts)):
        assert got[str(i)].token_ids == expect[str(i)].token_ids
    assert engine.metrics.spec_decode_num_draft_tokens > 0


def test_runner_migrates_target_and_draft_pools(engine_models):
    from conftest import make_engine

    target, draft, _ = engine_models
    engine = make_engine(target, draft, warmup=False, num_kv_blocks=24)
    runner = engine.runner
    rng = np.random.default_rng(0)
    for name in ("target_kv", "draft_kv"):
        kv = getattr(runner, name)
        setattr(runner, name, type(kv)(jnp.asarray(rng.normal(size=kv.k.shape), kv.k.dtype),
                                       jnp.asarray(rng.normal(size=kv.v.shape), kv.v.dtype)))
    before = {n: (np.asarray(getattr(runner, n).k), np.asarray(getattr(runner, n).v))
              for n in ("target_kv", "draft_kv")}
    assert runner.migrate_blocks([(20, 2), (23, 5), (17, 9)]) == 3
    for n, (k, v) in before.items():
        ek, ev = k.copy(), v.copy()
        for s, d in [(20, 2), (23, 5), (17, 9)]:
            ek[:, d], ev[:, d] = k[:, s], v[:, s]
        assert np.array_equal(np.asarray(getattr(runner, n).k), ek)
        assert np.array_equal(np.asarray(getattr(runner, n).v), ev)
    with pytest.raises(ValueError, match="both a source and a destination"):
        runner.migrate_blocks([(20, 2), (2, 3)])
    assert runner.migrate_blocks([]) == 0
