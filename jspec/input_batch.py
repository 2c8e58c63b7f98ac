"""Host-side (numpy) assembly of the flat ragged batches the device functions take.

A step's rows are the scheduled sequences in schedule order, padded to the sequence bucket; the
same row order is used by the draft loop and the verification so their [S, G] outputs line up
without any host shuffling.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jspec.block_manager import BlockManager
from jspec.device_steps import MAX_PENDING
from jspec.sampler import SamplingTensors
from jspec.sequence import Sequence
from jspec.models.transformer import ModelInput
from jspec.kernels.ragged_paged_attention import AttentionMetadata


@dataclasses.dataclass(eq=False)
class RowWork:
    """What one row does this step."""

    seq: Sequence
    num_new_tokens: int  # target tokens of the chunk (decode: 1, before drafts are added)
    is_decode: bool
    samples: bool  # the chunk reaches the end of the sequence: a token is emitted
    lookahead: int = 0  # KV slots the scheduler reserved past the token: γ may not exceed it
    gamma_planned: int = 0  # the policy's draft length, clipped (the draft loop drafts ≤ this)
    gamma_verify: int = 0  # draft slots in the verify batch (planned, or what select kept)
    drafter: int = -1  # the pool index that drafts the row this step (-1: none)
    num_emitted: int = 0  # tokens appended at commit


def _model_input(input_ids, positions, cu_q_lens, kv_lens, page_table, logits_indices):
    return ModelInput(input_ids, AttentionMetadata(positions, cu_q_lens, kv_lens, page_table),
                      logits_indices)


def page_tables(rows: list[RowWork], num_rows: int, max_pages: int, bm: BlockManager
                ) -> np.ndarray:
    table = np.zeros((num_rows, max_pages), np.int32)
    for i, row in enumerate(rows):
        bm.fill_page_table(table, i, row.seq.request_id)
    return table


def sampling_tensors(rows: list[RowWork], num_rows: int) -> SamplingTensors:
    temperature = np.zeros(num_rows, np.float32)
    top_k = np.zeros(num_rows, np.int32)
    top_p = np.ones(num_rows, np.float32)
    seeds = np.zeros(num_rows, np.uint32)
    counters = np.zeros(num_rows, np.int32)
    for i, row in enumerate(rows):
        sp = row.seq.sampling_params
        temperature[i] = sp.temperature
        top_k[i] = sp.top_k
        top_p[i] = sp.top_p
        seeds[i] = row.seq.seed
        counters[i] = row.seq.num_tokens
    return SamplingTensors(temperature, top_k, top_p, seeds, counters)


def with_carried_tokens(batch: ModelInput, carry_rows: np.ndarray, tokens: np.ndarray
                        ) -> ModelInput:
    """``batch`` (a decode-only γ = 0 batch: token i is row i's) with the tokens its rows took
    from the previous step on device written in: the host's record of what ran. A new array:
    the dispatched one may still be in use."""
    ids = np.array(batch.input_ids)
    fed = carry_rows >= 0
    ids[:len(carry_rows)][fed] = tokens[carry_rows[fed]]
    return ModelInput(ids, batch.attn, batch.logits_indices)


def verify_input(rows: list[RowWork], num_tokens: int, num_rows: int, gamma: int,
                 table: np.ndarray) -> tuple[ModelInput, np.ndarray]:
    """The target batch (drafted tokens as placeholders) and where the drafts go.

    Returns (batch, draft_slots [S, G]); a slot of ``num_tokens`` means "not verified" (dropped
    by the device-side scatter). Per-row work is a few Python scalars; the arrays are built in
    bulk (this runs every step).
    """
    if not gamma and all(row.is_decode for row in rows):
        return _plain_decode_input(rows, num_tokens, num_rows, table)
    return _ragged_input(rows, num_tokens, num_rows, gamma, table)


def _plain_decode_input(rows: list[RowWork], num_tokens: int, num_rows: int, table: np.ndarray
                        ) -> tuple[ModelInput, np.ndarray]:
    """``verify_input`` of a step in which every row decodes one token and none drafts (the
    steps of plain decoding): row i's token is token i, in a few operations."""
    n = len(rows)
    firsts = np.fromiter((row.seq.num_computed for row in rows), np.int64, n)
    input_ids = np.zeros(num_tokens, np.int32)
    input_ids[:n] = [row.seq.token_at(f) for row, f in zip(rows, firsts.tolist())]
    positions = np.zeros(num_tokens, np.int32)
    positions[:n] = firsts
    cu_q_lens = np.full(num_rows + 1, n, np.int32)
    cu_q_lens[:n + 1] = np.arange(n + 1)
    kv_lens = np.zeros(num_rows, np.int32)
    kv_lens[:n] = firsts + 1
    logits_indices = np.zeros(num_rows, np.int32)
    logits_indices[:n] = np.arange(n)
    batch = _model_input(input_ids, positions, cu_q_lens, kv_lens, table, logits_indices)
    return batch, np.full((num_rows, 0), num_tokens, np.int32)


def _ragged_input(rows: list[RowWork], num_tokens: int, num_rows: int, gamma: int,
                  table: np.ndarray) -> tuple[ModelInput, np.ndarray]:
    """``verify_input`` of any step: prompt chunks and decoding rows with their drafts."""
    n = len(rows)
    q_lens = np.empty(n, np.int64)
    firsts = np.empty(n, np.int64)
    gammas = np.zeros(n, np.int64)
    for i, row in enumerate(rows):
        firsts[i] = row.seq.num_computed
        if row.is_decode:
            q_lens[i] = 1 + row.gamma_verify
            gammas[i] = row.gamma_verify
        else:
            q_lens[i] = row.num_new_tokens
    ends = np.cumsum(q_lens)
    starts = ends - q_lens
    total = int(ends[-1]) if n else 0

    input_ids = np.zeros(num_tokens, np.int32)
    for i, row in enumerate(rows):
        seq, first = row.seq, row.seq.num_computed
        if row.is_decode:  # the newest token; its drafts are scattered in on device
            input_ids[starts[i]] = seq.token_at(first)
        else:
            input_ids[starts[i]:ends[i]] = seq.token_ids()[first:first + row.num_new_tokens]
    positions = np.zeros(num_tokens, np.int32)
    positions[:total] = np.arange(total) - np.repeat(starts - firsts, q_lens)
    cu_q_lens = np.full(num_rows + 1, total, np.int32)
    cu_q_lens[0] = 0
    cu_q_lens[1:n + 1] = ends
    kv_lens = np.zeros(num_rows, np.int32)
    kv_lens[:n] = firsts + q_lens
    # logits rows [S, G+1]: decode row i judges its drafts at start_i + j (j <= γ_i); a prefill
    # row only needs its last token (every column points there)
    cols = np.arange(gamma + 1)
    base = np.where(gammas > 0, 0, q_lens - 1)
    logits_indices = np.zeros((num_rows, gamma + 1), np.int32)
    logits_indices[:n] = (starts + base)[:, None] + np.minimum(cols[None, :], gammas[:, None])
    draft_slots = np.full((num_rows, gamma), num_tokens, np.int32)
    if gamma:
        j = np.arange(gamma)
        draft_slots[:n] = np.where(j[None, :] < gammas[:, None], starts[:, None] + 1 + j[None, :],
                                   num_tokens)
    batch = _model_input(input_ids, positions, cu_q_lens, kv_lens, table,
                         logits_indices.reshape(-1))
    return batch, draft_slots


def _feed_pending(seq: Sequence, model: int, start: int, input_ids: np.ndarray,
                  positions: np.ndarray, num_drafts: int = 0) -> int:
    """Write the tokens pool model ``model`` has not seen (1 or 2: longer lags are caught up
    first) at ``start``, positions for them and ``num_drafts`` placeholders after them; returns
    how many were pending."""
    first, end = seq.draft_computed[model], seq.num_tokens
    pending = end - first
    assert 1 <= pending <= MAX_PENDING, "a pool model's lag must be caught up before it runs"
    for j in range(pending):
        input_ids[start + j] = seq.token_at(first + j)
    positions[start:start + pending + num_drafts] = np.arange(first, end + num_drafts)
    return pending


def draft_first_input(rows: list[RowWork], num_rows: int, table: np.ndarray, model: int = 0,
                      head_width: int = 0) -> tuple[ModelInput, np.ndarray, np.ndarray]:
    """Iteration 0 of the draft loop of pool model ``model``: each drafting row feeds its
    pending tokens (1 or 2) and asks for logits at the last.

    ``head_width`` > 0: the model is an EAGLE head (jspec/proposers/eagle.py), which takes
    token t at position t - 1 and counts in ``draft_computed`` the tokens it has taken (token 0
    never is); each row feeds up to ``head_width`` of them, and a row with none to take (a
    one-token prompt: the target has no state yet) drafts nothing.

    Returns (batch with width*S tokens and S logits rows, next_positions [S]: where drafted
    token 1 goes, gammas [S]).
    """
    width = head_width or MAX_PENDING
    shift = 1 if head_width else 0
    num_tokens = width * num_rows
    input_ids = np.zeros(num_tokens, np.int32)
    positions = np.zeros(num_tokens, np.int32)
    cu_q_lens = np.zeros(num_rows + 1, np.int32)
    kv_lens = np.zeros(num_rows, np.int32)
    logits_indices = np.zeros(num_rows, np.int32)
    next_positions = np.zeros(num_rows, np.int32)
    gammas = np.zeros(num_rows, np.int32)
    start = 0
    for i, row in enumerate(rows):
        seq = row.seq
        end = seq.num_tokens
        if row.gamma_planned > 0 and end > shift:
            if head_width:
                first = max(seq.draft_computed[model], 1)
                q_len = end - first
                assert q_len <= width, "an EAGLE head's lag must be caught up before it drafts"
                input_ids[start:start + q_len] = seq.token_ids()[first:end]
                positions[start:start + q_len] = np.arange(first - 1, end - 1)
            else:
                q_len = _feed_pending(seq, model, start, input_ids, positions)
            kv_lens[i] = end - shift
            logits_indices[i] = start + q_len - 1
            next_positions[i] = end - shift
            gammas[i] = row.gamma_planned
            start += q_len
        cu_q_lens[i + 1] = start
    cu_q_lens[len(rows) + 1:] = start
    batch = _model_input(input_ids, positions, cu_q_lens, kv_lens, table, logits_indices)
    return batch, next_positions, gammas


def intermediate_input(rows: list[RowWork], num_rows: int, gamma: int, table: np.ndarray,
                       model: int) -> tuple[ModelInput, np.ndarray]:
    """The batch in which pool model ``model`` verifies the first model's draft (a two-level
    chain): each drafting row feeds its pending tokens (1 or 2, as in ``draft_first_input``)
    and then its γ_i drafted tokens as placeholders (scattered in on device, like the target's
    verify batch); prefill and non-drafting rows bring nothing. Logits rows are dense [S, G+1]
    (column j judges draft token j+1; column γ_i is the bonus). Returns (batch with
    ``num_rows * (G + 2)`` tokens, draft_slots [S, G])."""
    num_tokens = num_rows * (gamma + MAX_PENDING)
    input_ids = np.zeros(num_tokens, np.int32)
    positions = np.zeros(num_tokens, np.int32)
    cu_q_lens = np.zeros(num_rows + 1, np.int32)
    kv_lens = np.zeros(num_rows, np.int32)
    logits_indices = np.zeros((num_rows, gamma + 1), np.int32)
    draft_slots = np.full((num_rows, gamma), num_tokens, np.int32)
    cols = np.arange(gamma + 1)
    start = 0
    for i, row in enumerate(rows):
        g = row.gamma_planned
        if g > 0:
            pending = _feed_pending(row.seq, model, start, input_ids, positions, g)
            end = row.seq.num_tokens
            kv_lens[i] = end + g
            logits_indices[i] = start + pending - 1 + np.minimum(cols, g)
            draft_slots[i, :g] = start + pending + np.arange(g)
            start += pending + g
        cu_q_lens[i + 1] = start
    cu_q_lens[len(rows) + 1:] = start
    batch = _model_input(input_ids, positions, cu_q_lens, kv_lens, table,
                         logits_indices.reshape(-1))
    return batch, draft_slots


def catch_up_segments(rows: list[RowWork], model: int = 0, max_lag: int = MAX_PENDING,
                      first_token: int = 0) -> list[tuple[Sequence, int, int, int]]:
    """(seq, row index, first, end) of tokens pool model ``model`` must be fed before it runs:
    everything but the newest token, for drafting rows whose ``model`` KV lags by more than
    ``max_lag`` tokens (what the draft loop's first forward takes). ``first_token``: the first
    token the model ever takes (an EAGLE head's is 1: token t goes at position t - 1)."""
    segments = []
    for i, row in enumerate(rows):
        seq = row.seq
        computed = max(seq.draft_computed[model], first_token)
        if row.gamma_planned > 0 and seq.num_tokens - computed > max_lag:
            segments.append((seq, i, computed, seq.num_tokens - 1))
    return segments


def pack_catch_up(segments, budget: int, max_rows: int):
    """Split catch-up segments into chunks of at most ``budget`` tokens and ``max_rows``
    sequences; a long lag spans several chunks (each continues where the last stopped)."""
    chunks, current, used = [], [], 0
    for seq, row, first, end in segments:
        while first < end:
            if used == budget or len(current) == max_rows:
                chunks.append(current)
                current, used = [], 0
            take = min(end - first, budget - used)
            current.append((seq, row, first, first + take))
            used += take
            first += take
    if current:
        chunks.append(current)
    return chunks


def catch_up_input(chunk, num_tokens: int, num_rows: int, table: np.ndarray) -> ModelInput:
    """table: the step's page table; rows of the chunk are picked from it."""
    input_ids = np.zeros(num_tokens, np.int32)
    positions = np.zeros(num_tokens, np.int32)
    cu_q_lens = np.zeros(num_rows + 1, np.int32)
    kv_lens = np.zeros(num_rows, np.int32)
    chunk_table = np.zeros((num_rows, table.shape[1]), np.int32)
    start = 0
    for i, (seq, row, first, end) in enumerate(chunk):
        n = end - first
        input_ids[start:start + n] = seq.token_ids()[first:end]
        positions[start:start + n] = np.arange(first, end)
        kv_lens[i] = end
        chunk_table[i] = table[row]
        start += n
        cu_q_lens[i + 1] = start
    cu_q_lens[len(chunk) + 1:] = start
    return _model_input(input_ids, positions, cu_q_lens, kv_lens, chunk_table,
                        np.zeros(2, np.int32))
