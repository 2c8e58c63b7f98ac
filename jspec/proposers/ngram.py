"""Prompt lookup (vLLM's ``method: "ngram"``): a sequence drafts what followed the latest earlier
occurrence of its own last n tokens, in its prompt or its output so far, trying n from
``prompt_lookup_max`` down to ``prompt_lookup_min``. No model runs: input-grounded work
(summaries, retrieval answers, code edits) repeats long stretches of its input, and a repeat
costs only the verification of its tokens.

The lookup runs on the host, where the tokens already are (a drafting step commits the step
before it first, so every token is known): per row a few vectorised comparisons over its
tokens, microseconds at a 2k-token context (``jspec bench step`` times it as the step's draft
stage). Each request's tokens are kept in a growing numpy buffer, appended to as the output
grows, so a step never copies a whole context.

The drafts have no distribution: the target verifies them with a one-hot q
(``sampler.rejection_sample``), which keeps sampling exact.
"""

from __future__ import annotations

import bisect
from typing import NamedTuple

import numpy as np

from jspec.device_steps import DraftResult
from jspec.proposers.base import Proposer
from jspec.sequence import PENDING_TOKEN


# the most earlier occurrences of the tokens a step added for which ``_Tokens`` brings a
# sequence's match up to date a token at a time on the host rather than scanning anew with numpy
# (~6 array operations, ~45 µs a row in the engine loop on the 2-vCPU AMD EPYC)
_ADVANCE_LIMIT = 256


def suffix_runs(tokens: np.ndarray, n_max: int, ends: np.ndarray | None = None
                ) -> tuple[np.ndarray, np.ndarray]:
    """(ends, runs): where the last token of ``tokens`` occurred before it, in order, and for
    each such occurrence how many tokens (at most ``n_max``) going back from it match the
    sequence's own tail. ``ends``: where the last token occurred before, if the caller keeps
    an index (else found by a scan)."""
    length = len(tokens)
    if length < 2 or n_max < 1:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    if ends is None:
        ends = np.flatnonzero(tokens[:length - 1] == tokens[length - 1])
    if not ends.size:
        return ends, np.zeros(0, np.int64)
    # every occurrence at once (a loop that narrows the occurrences token by token cost ~4
    # numpy calls per token, and suffix decoding matches up to ~20 tokens)
    back = np.arange(min(n_max, length - 1))
    at = ends[:, None] - back[None, :]
    same = (at >= 0) & (tokens[np.maximum(at, 0)] == tokens[length - 1 - back][None, :])
    runs = np.argmin(np.concatenate([same, np.zeros((len(ends), 1), bool)], axis=1), axis=1)
    return ends, runs


def longest_of(ends: list[int], runs: list[int], n_max: int) -> tuple[int, np.ndarray]:
    """(n, ends) of ``longest_earlier_suffix`` from ``suffix_runs`` (as lists) computed up to
    any bound of at least ``n_max``. On lists: a row's occurrences are few, and numpy's
    per-call cost would be most of the work."""
    if not ends:
        return 0, np.zeros(0, np.int64)
    matched = min(max(runs), n_max)
    return matched, np.array([e for e, r in zip(ends, runs) if min(r, n_max) == matched],
                             np.int64)


def longest_earlier_suffix(tokens: np.ndarray, n_max: int, ends: np.ndarray | None = None
                           ) -> tuple[int, np.ndarray]:
    """(n, ends): the longest suffix of ``tokens``, at most ``n_max`` long, that also occurs
    earlier (ending before the last token), and where each earlier occurrence ends, in
    order; (0, empty) when the last token never occurred before. ``ends``: where the last
    token occurred before, if the caller keeps an index (else found by a scan)."""
    ends, runs = suffix_runs(tokens, n_max, ends)
    return longest_of(ends.tolist(), runs.tolist(), n_max)


def ngram_lookup(tokens: np.ndarray, n_min: int, n_max: int, k: int,
                 match: tuple[int, np.ndarray] | None = None) -> np.ndarray:
    """The draft for a sequence of ``tokens``: the up to ``k`` tokens that followed the latest
    earlier occurrence of its last n tokens, for the largest n in [n_min, n_max] that occurs
    earlier (empty when none does).

    An occurrence is earlier when it ends before the last token; what followed it may run into
    the sequence's own tail (a repeating pattern drafts its continuation)."""
    if k <= 0:
        return tokens[:0]
    matched, ends = match if match is not None else longest_earlier_suffix(tokens, n_max)
    if matched < n_min:
        return tokens[:0]
    start = int(ends[-1]) + 1  # the latest occurrence of the longest suffix
    return tokens[start:start + k]


class _Tokens:
    """One request's tokens in a buffer that grows by doubling."""

    __slots__ = ("buf", "size", "where", "runs")

    def __init__(self, tokens: list[int]):
        self.buf = np.array(tokens, np.int32)
        self.size = len(tokens)
        # token -> where it occurs, ascending: a lookup starts from the earlier occurrences
        # of the newest token without scanning the whole context
        self.where: dict[int, list[int]] = {}
        self._index(0)
        # (size, bound, ends, runs): ``suffix_runs`` of the tokens at that size as lists,
        # shared by the engine's lookups (each surveys every row every step)
        self.runs: tuple[int, int, list[int], list[int]] | None = None

    def match(self, n_max: int, bound: int) -> tuple[int, np.ndarray]:
        """``longest_earlier_suffix(tokens, n_max)``, from runs computed once per size up to
        ``bound`` (or ``n_max`` if larger)."""
        runs = self.runs
        if runs is not None and runs[0] != self.size:
            runs = self.runs if self._advance(runs) else None
        # runs that reach their bound may run on past it: a longer bound needs a scan
        if runs is None or (n_max > runs[1] and runs[3] and max(runs[3]) >= runs[1]):
            bound = max(n_max, bound)
            ends, lengths = suffix_runs(self.buf[:self.size], bound, self.earlier())
            runs = self.runs = (self.size, bound, ends.tolist(), lengths.tolist())
        return longest_of(runs[2], runs[3], n_max)

    def _advance(self, runs) -> bool:
        """Bring ``runs`` (computed at an earlier size) up to this size a token at a time: an
        occurrence of the token at p that ends at e matches one more token than the
        occurrence of the token at p - 1 that ended at e - 1 did. False (nothing changed)
        where the tokens added occur too often for this to cost less than a scan."""
        size, bound, ends, lengths = runs
        added = self.buf[size:self.size].tolist()
        where = [self.where[t] for t in added]
        if sum(len(w) for w in where) > _ADVANCE_LIMIT:
            return False
        for p, occurs in enumerate(where, size):
            before = dict(zip(ends, lengths))
            ends = occurs[:bisect.bisect_left(occurs, p)]
            lengths = [min(before.get(e - 1, 0) + 1, bound) for e in ends]
        self.runs = (self.size, bound, ends, lengths)
        return True

    def _index(self, start: int) -> None:
        where = self.where
        for p, t in enumerate(self.buf[start:self.size].tolist(), start):
            where.setdefault(t, []).append(p)

    def earlier(self) -> np.ndarray:
        """Where the newest token occurred before it."""
        if not self.size:
            return np.zeros(0, np.int64)
        return np.array(self.where[int(self.buf[self.size - 1])][:-1], np.int64)

    def sync(self, seq, total: int) -> np.ndarray:
        """Bring the buffer up to ``seq``'s first ``total`` tokens (only the new outputs are
        copied)."""
        if total < self.size:  # cannot happen while tokens only grow; rebuild if it does
            self.__init__(seq.token_ids()[:total])
            return self.buf[:self.size]
        if total > self.size:
            if total > len(self.buf):
                grown = np.empty(max(total, 2 * len(self.buf)), np.int32)
                grown[:self.size] = self.buf[:self.size]
                self.buf = grown
            prompt = seq.num_prompt_tokens
            new = seq.output_token_ids[self.size - prompt:total - prompt] \
                if self.size >= prompt else seq.token_ids()[self.size:total]
            self.buf[self.size:total] = new
            start, self.size = self.size, total
            self._index(start)
        return self.buf[:self.size]


def _pending(seq) -> int:
    """1 when ``seq``'s newest token is still on device (``PENDING_TOKEN``), else 0."""
    return int(seq.num_tokens > seq.num_prompt_tokens
               and seq.output_token_ids[-1] == PENDING_TOKEN)


class TokenBuffers:
    """Each request's tokens as a numpy array, kept up to date by copying only new tokens;
    buffers of requests no longer scheduled are dropped once there are many."""

    def __init__(self, max_num_seqs: int, match_bound: int = 0):
        self._buffers: dict[str, _Tokens] = {}
        self._keep = 2 * max_num_seqs
        # the longest suffix any of the sharing lookups matches (each raises it to its own):
        # each row's runs are computed once to it
        self.match_bound = match_bound

    def lookup_input(self, seq, n_max: int) -> tuple[np.ndarray, tuple[int, np.ndarray]]:
        """(tokens, ``longest_earlier_suffix(tokens, n_max)``): what a lookup starts from."""
        entry = self.entry(seq)
        return entry.buf[:entry.size], entry.match(n_max, self.match_bound)

    def entry(self, seq) -> _Tokens:
        """``seq``'s buffer, brought up to the last token the host knows: with asynchronous
        scheduling a sequence may end in the placeholder of a token still on device
        (``PENDING_TOKEN``), which the buffer must never hold."""
        total = seq.num_tokens - _pending(seq)
        entry = self._buffers.get(seq.request_id)
        if entry is None:
            entry = self._buffers[seq.request_id] = _Tokens(seq.token_ids()[:total])
        else:
            entry.sync(seq, total)
        return entry

    def prune(self, rows) -> None:
        """Drop the buffers of requests not among ``rows`` (the step's), when there are more
        than twice as many as can run."""
        if len(self._buffers) > self._keep:
            live = {r.seq.request_id for r in rows}
            self._buffers = {rid: b for rid, b in self._buffers.items() if rid in live}


class Survey(NamedTuple):
    """What a lookup would draft for each surveyed sequence: ``lengths`` [n] tokens, and
    ``probs`` [n, γ] its own estimate that the draft's first j + 1 tokens are all accepted
    (suffix decoding's chained frequencies), NaN past the draft or where it has none."""

    lengths: np.ndarray
    probs: np.ndarray


class LookupProposer(Proposer):
    """A drafter that looks each drafting row's continuation up on the host (``draft``), with
    no distribution: the shared step of prompt lookup and suffix decoding."""

    def __init__(self, max_num_seqs: int, match_bound: int,
                 tokens: TokenBuffers | None = None):
        # each request's tokens; one engine's lookups share them (each syncs and indexes a
        # sequence's new tokens once per step, not once per lookup, and computes each row's
        # match once, to ``match_bound``, the longest suffix any of them matches)
        self.tokens = tokens if tokens is not None else TokenBuffers(max_num_seqs)
        self.tokens.match_bound = max(self.tokens.match_bound, match_bound)
        # request -> (its length, its draft at Γmax) from the plan's survey, reused by the
        # step's propose while the sequence has not grown since
        self._surveyed: dict[str, tuple[int, np.ndarray]] = {}

    def draft(self, seq, gamma: int) -> list[int] | np.ndarray:
        """Up to ``gamma`` tokens to follow ``seq``'s."""
        raise NotImplementedError

    def draft_with_probs(self, seq, gamma: int) -> tuple[list[int] | np.ndarray,
                                                         list[float] | None]:
        """``draft`` and the lookup's own probability that each drafted token is accepted
        with all before it, None where the lookup has no such estimate."""
        return self.draft(seq, gamma), None

    def survey(self, seqs, gamma: int) -> Survey:
        """What the lookup would draft for each of ``seqs`` (at most ``gamma`` tokens), for a
        policy that chooses drafters per sequence before the step: the drafts are kept for
        the step's ``propose``. A sequence whose newest token is still on device
        (asynchronous scheduling) is judged by the tokens before it."""
        self._surveyed = {}
        out = Survey(np.zeros(len(seqs), np.int64), np.full((len(seqs), gamma), np.nan))
        for i, seq in enumerate(seqs):
            draft, probs = self.draft_with_probs(seq, gamma)
            draft = np.asarray(draft, np.int32)
            if not _pending(seq):  # the draft the step would make: kept for it
                self._surveyed[seq.request_id] = (seq.num_tokens, draft)
            out.lengths[i] = len(draft)
            if probs is not None:
                out.probs[i, :len(probs)] = probs
        return out

    def _draft_of(self, seq, gamma: int):
        kept = self._surveyed.get(seq.request_id)
        if kept is not None and kept[0] == seq.num_tokens and not _pending(seq):
            return kept[1][:gamma]  # surveyed at Γmax: a shorter draft is its prefix
        return self.draft(seq, gamma)

    def propose(self, st) -> None:
        tokens = np.zeros((st.num_rows, st.gamma), np.int32)
        drafted = np.zeros(st.num_rows, np.int32)
        for i in st.decode_idx.tolist():
            row = st.rows[i]
            if row.gamma_planned <= 0:
                continue
            draft = self._draft_of(row.seq, row.gamma_planned)
            tokens[i, :len(draft)] = draft
            drafted[i] = len(draft)
            row.gamma_verify = len(draft)  # nothing found: the row verifies no draft slot
        self.tokens.prune(st.rows)
        zeros = np.zeros((st.num_rows, st.gamma), np.float32)
        st.draft = DraftResult(tokens, None, drafted, zeros, zeros)
        st.num_drafted = drafted

    def replay(self, st):
        rows = [(st.rows[i].seq, st.rows[i].gamma_planned) for i in st.decode_idx.tolist()]
        return lambda: [self.draft(seq, g) for seq, g in rows if g > 0]

    def commit_row(self, st, row, seq, old_num_tokens, num_accepted, num_drafted) -> None:
        """Nothing to keep in step: the lookup catches up with the sequence when it next
        drafts."""


class NgramProposer(LookupProposer):
    """Prompt lookup over each sequence's own tokens (module docstring)."""

    name = "ngram"

    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int, max_num_seqs: int,
                 tokens: TokenBuffers | None = None):
        if not 1 <= prompt_lookup_min <= prompt_lookup_max:
            raise ValueError(f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                             f"{prompt_lookup_min} and {prompt_lookup_max}")
        super().__init__(max_num_seqs, prompt_lookup_max, tokens)
        self.n_min, self.n_max = prompt_lookup_min, prompt_lookup_max

    def draft(self, seq, gamma: int) -> np.ndarray:
        tokens, match = self.tokens.lookup_input(seq, self.n_max)
        return ngram_lookup(tokens, self.n_min, self.n_max, gamma, match)
