"""Batch-invariant numerics: a token's logits that do not depend on the batch it ran in.

Greedy speculative decoding is lossless only if the target scores a token the same way whether
it is decoded alone, verified with γ drafted tokens, in a batch of 32 sequences or inside a
prefill chunk. In exact arithmetic it is; in floating point each dot product's rounding depends
on the order its terms are added, and a matmul library picks that order from the *shape* of the
call. In bfloat16 a one-ulp difference in one activation is enough to flip a near-tie in the
final argmax, after which the two outputs diverge for good.

What orders the sums on XLA:CPU (measured with ``tests/test_batch_invariance.py``'s probe on
bf16 dots with float32 accumulation, every weight shape of the built-in pair and of 1.5B-7B
models, 1-1024 rows): a one-row and a two-row call each use an order of their own (matrix-vector
and narrow-panel paths), and so can the last one or two rows of a longer call, which the library
runs as a panel of their own: on the 2-vCPU Intel Xeon with AMX a bf16 ``[rows, 384] @ [384,
384]`` gives rows 16-17 of an 18-row call other bits than the same rows of a 20-row call, and the
same at every 16k + 1 and 16k + 2 rows. Every other count from four up keeps one order, in any
position of the batch, and so do attention's batched dots, whatever the batch dimensions.
Elementwise work does not depend on the other rows; XLA:CPU's reductions do: a float32 sum over a
row's last axis changes its order with the number of rows (on that Xeon: from 5 rows at 960
columns, 16 at 384, 64 at 128), so RMSNorm's mean of squares and attention's softmax denominator
would differ between a token decoded alone and in a batch. The mode computes those sums as
products (``row_sum``), which keep one order for every row count it runs. Float32 dots depend on
the weight's layout (models/params.py): on that Xeon, weights stored ``[out, in]`` give a row the
same bits from two rows up, weights stored ``[in, out]`` change order at 51 rows, and at five
for a 960-deep product. So an engine in this mode takes a layout whose dots pass
``probe_shapes`` for the target (jspec/weight_layout.py) where one does, and warns where none
does.

So a batch-invariant forward never runs a dot over fewer than ``MIN_DOT_ROWS`` rows, nor one
past a panel of ``ROW_PANEL`` rows over a count that is not a multiple of ``MIN_DOT_ROWS``: it pads
the flat tokens and the logits rows (``invariant_rows``; padding tokens write to the null block
and are never read), so no call has a last panel of one to three rows, and attention always takes
the tiled path with query tiles of at least that many (token, head) rows, so decode, verification
and prefill attend with the same arithmetic. Attention's reduction over the context already
has a fixed order: 128-token chunks at absolute positions, and chunks past a query's context
are exact no-ops of the online softmax.

This is the mode vLLM calls batch invariance (``VLLM_BATCH_INVARIANT``) and SGLang
deterministic inference; they fix GPU kernels' tile sizes and split counts for the same reason.
"""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np

MIN_DOT_ROWS = 4
# rows a matmul library multiplies as one panel (XLA:CPU's YNNPACK on the Intel Xeon: 16); a call
# wider than this is padded to a multiple of MIN_DOT_ROWS, so its last panel is never a tail of
# one to three rows. Calls up to one panel keep their width: padding a 5-token verification to 8
# rows cost its bf16 forward 1.09x there.
ROW_PANEL = 16


class BatchInvarianceWarning(UserWarning):
    """This backend breaks the batch-invariant mode's premise (``probe_dots``): greedy
    speculative output may differ from plain greedy output here."""


def invariant_rows(rows: int) -> int:
    """The rows a batch-invariant dot over ``rows`` rows runs: at least ``MIN_DOT_ROWS``, and past
    ``ROW_PANEL`` rows a multiple of ``MIN_DOT_ROWS``."""
    if rows <= ROW_PANEL:
        return max(rows, MIN_DOT_ROWS)
    return -(-rows // MIN_DOT_ROWS) * MIN_DOT_ROWS


def pad_rows(x: jax.Array) -> jax.Array:
    """``x`` with its leading axis zero-padded to ``invariant_rows`` of it (static shapes)."""
    short = invariant_rows(x.shape[0]) - x.shape[0]
    if short <= 0:
        return x
    return jnp.pad(x, [(0, short)] + [(0, 0)] * (x.ndim - 1))


# columns of the ones a row sum multiplies by: a product of at least this many keeps one order
# for every row count (a single column takes the matrix-vector path, whose order changes)
SUM_COLUMNS = 8
ATTENTION_CHUNK = 128  # tokens the jnp attention reduces at a time (ragged_paged_attention)


def row_sum(x: jax.Array) -> jax.Array:
    """``x.sum(-1)`` (float32) in an order that does not depend on how many rows ``x`` has:
    the product of its rows, padded as a dot's are (``pad_rows``), with ones."""
    lead, width = x.shape[:-1], x.shape[-1]
    rows = x.astype(jnp.float32).reshape(-1, width)
    ones = jnp.ones((width, SUM_COLUMNS), jnp.float32)
    total = jnp.dot(pad_rows(rows), ones, precision=jax.lax.Precision.HIGHEST)[:rows.shape[0], 0]
    return total.reshape(lead)


def sum_shapes(cfg) -> list[tuple[int, int]]:
    """The (depth, width) of the products ``row_sum`` runs in a model's forward: over its
    hidden size (RMSNorm) and over attention's 128-token chunks."""
    return [(cfg.hidden_size, SUM_COLUMNS), (ATTENTION_CHUNK, SUM_COLUMNS)]


def min_q_block(group: int, min_rows: int = MIN_DOT_ROWS) -> int:
    """The smallest power-of-two query tile whose (token, head) rows reach ``min_rows`` for
    ``group`` query heads per KV head."""
    tokens = -(-min_rows // max(1, group))
    return 1 << (tokens - 1).bit_length()


# row counts the probe compares beside the floor, each as the mode runs it (``invariant_rows``):
# counts that leave a last panel of one or two rows past 4 and 8 (a 5-token verification is one),
# a whole panel, and a last panel of four rows past 16, 32, 64 and 256, each against the widest
_PROBE_ROWS = (5, 9, 10, 16, 20, 36, 68, 260)


@functools.lru_cache(maxsize=None)
def probe_dots(dtype_name: str, depth: int, width: int, layout: str = "in_out") -> str | None:
    """Whether this backend's ``[rows, depth] @ [depth, width]`` dots (``dtype_name`` inputs,
    float32 accumulation; the weight stored ``[depth, width]``, or ``[width, depth]`` for
    ``layout`` "out_in") give every row the same bits for every row count the mode runs
    (``invariant_rows``): None if so, else what differed. The premise of the mode,
    checked once per process and shape on the machine that runs it (a few milliseconds of
    compiling)."""
    rng = np.random.default_rng(0)
    dtype = jnp.dtype(dtype_name)
    w = rng.standard_normal((depth, width)) * 0.05
    contract = 0
    if layout == "out_in":
        w, contract = np.ascontiguousarray(w.T), 1
    w = jnp.asarray(w, dtype)
    counts = tuple(sorted({MIN_DOT_ROWS} | {invariant_rows(n) for n in _PROBE_ROWS}))
    x = jnp.asarray(rng.standard_normal((max(counts), depth)), dtype)
    # one program of a product per row count: one compilation per shape, not per count
    dots = jax.jit(lambda x, w: [jax.lax.dot_general(x[:rows], w, (((1,), (contract,)), ((), ())),
                                                     preferred_element_type=jnp.float32)
                                 for rows in counts])
    *narrower, widest = (np.asarray(y) for y in dots(x, w))
    for rows, y in zip(counts, narrower):
        differs = np.flatnonzero((y != widest[:rows]).any(axis=1))
        if differs.size:
            return (f"row {differs[0]} of a {dtype_name} dot differs between {rows} and "
                    f"{max(counts)} rows ([rows, {depth}] @ [{depth}, {width}], weights "
                    f"{layout})")
    return None


# columns a probe multiplies at most: a row's order of summation is over the depth, and a
# 256-row probe of a 128k-token output head in float32 would take minutes on a CPU
PROBE_WIDTH = 2048


def probe_shapes(dtype_name: str, shapes, layout: str = "in_out") -> str | None:
    """``probe_dots`` over a model's products, ``shapes`` as (depth, width) pairs (each width
    capped at ``PROBE_WIDTH``): None if every one is batch-invariant, else the first that is
    not, named."""
    for depth, width in dict.fromkeys((d, min(w, PROBE_WIDTH)) for d, w in shapes):
        reason = probe_dots(dtype_name, depth, width, layout)
        if reason is not None:
            return reason
    return None


def warn_if_unsupported(dtype_name: str, shapes, layout: str = "in_out") -> None:
    """Warn, naming the first product that differs, if ``probe_shapes`` finds this backend's
    dots batch-dependent."""
    reason = probe_shapes(dtype_name, shapes, layout)
    if reason is not None:
        warnings.warn(f"deterministic mode cannot make logits batch-invariant on this backend: "
                      f"{reason}; greedy speculative output may differ from plain greedy "
                      "output here", BatchInvarianceWarning, stacklevel=3)
