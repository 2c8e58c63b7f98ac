"""Batch-invariant numerics: a token's logits that do not depend on the batch it ran in.

Greedy speculative decoding is lossless only if the target scores a token the same way whether
it is decoded alone, verified with γ drafted tokens, in a batch of 32 sequences or inside a
prefill chunk. In exact arithmetic it is; in floating point each dot product's rounding depends
on the order its terms are added, and a matmul library picks that order from the *shape* of the
call. In bfloat16 a one-ulp difference in one activation is enough to flip a near-tie in the
final argmax, after which the two outputs diverge for good.

What orders the sums on XLA:CPU (measured with ``tests/test_batch_invariance.py``'s probe on
bf16 dots with float32 accumulation, every weight shape of the built-in pair and of 1.5B-7B
models, 1-1024 rows): a row of ``x @ w`` comes out the same for every row count from three up,
in any position of the batch, but a one-row and a two-row call each use an order of their own
(matrix-vector and narrow-panel paths). The same holds for attention's batched dots, whatever
the batch dimensions. Elementwise work and per-row reductions (RMSNorm, softmax) do not depend
on the other rows.

So a batch-invariant forward never runs a dot over fewer than ``MIN_DOT_ROWS`` rows: it pads
the flat tokens and the logits rows up to it (padding tokens write to the null block and are
never read), and attention always takes the tiled path with query tiles of at least that many
(token, head) rows, so decode, verification and prefill attend with the same arithmetic. The
floor is 4, one above the measured threshold. Attention's reduction over the context already
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


class BatchInvarianceWarning(UserWarning):
    """This backend breaks the batch-invariant mode's premise (``probe_dots``): greedy
    speculative output may differ from plain greedy output here."""


def pad_rows(x: jax.Array, min_rows: int = MIN_DOT_ROWS) -> jax.Array:
    """``x`` with its leading axis zero-padded to at least ``min_rows`` (static shapes)."""
    short = min_rows - x.shape[0]
    if short <= 0:
        return x
    return jnp.pad(x, [(0, short)] + [(0, 0)] * (x.ndim - 1))


def min_q_block(group: int, min_rows: int = MIN_DOT_ROWS) -> int:
    """The smallest power-of-two query tile whose (token, head) rows reach ``min_rows`` for
    ``group`` query heads per KV head."""
    tokens = -(-min_rows // max(1, group))
    return 1 << (tokens - 1).bit_length()


# row counts the probe compares: the floor, just past it, and a step's typical sizes
_PROBE_ROWS = (MIN_DOT_ROWS + 1, 8, 64, 256)


@functools.lru_cache(maxsize=None)
def probe_dots(dtype_name: str, depth: int, width: int, layout: str = "in_out") -> str | None:
    """Whether this backend's ``[rows, depth] @ [depth, width]`` dots (``dtype_name`` inputs,
    float32 accumulation; the weight stored ``[depth, width]``, or ``[width, depth]`` for
    ``layout`` "out_in") give a row the same bits for every row count from ``MIN_DOT_ROWS`` up:
    None if so, else what differed. The premise of the mode, checked once per process and
    shape on the machine that runs it (a few milliseconds of compiling)."""
    rng = np.random.default_rng(0)
    dtype = jnp.dtype(dtype_name)
    w = rng.standard_normal((depth, width)) * 0.05
    contract = 0
    if layout == "out_in":
        w, contract = np.ascontiguousarray(w.T), 1
    w = jnp.asarray(w, dtype)
    x = jnp.asarray(rng.standard_normal((max(_PROBE_ROWS), depth)), dtype)
    dot = jax.jit(lambda x, w: jax.lax.dot_general(x, w, (((1,), (contract,)), ((), ())),
                                                   preferred_element_type=jnp.float32))
    row = np.asarray(dot(x[:MIN_DOT_ROWS], w))[0]
    for rows in _PROBE_ROWS:
        if not np.array_equal(np.asarray(dot(x[:rows], w))[0], row):
            return (f"a {dtype_name} dot's first row differs between {MIN_DOT_ROWS} and {rows} "
                    f"rows ([rows, {depth}] @ [{depth}, {width}], weights {layout})")
    return None


def warn_if_unsupported(dtype_name: str, depth: int, width: int, layout: str = "in_out") -> None:
    """Warn once per shape if ``probe_dots`` finds this backend's dots batch-dependent."""
    reason = probe_dots(dtype_name, depth, width, layout)
    if reason is not None:
        warnings.warn(f"deterministic mode cannot make logits batch-invariant on this backend: "
                      f"{reason}; greedy speculative output may differ from plain greedy "
                      "output here", BatchInvarianceWarning, stacklevel=3)
