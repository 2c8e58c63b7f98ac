"""Suffix decoding (vLLM's ``method: "suffix"``; Oliaro et al., "SuffixDecoding: Extreme
Speculative Decoding for Emerging AI Applications", arXiv 2411.04975, §3-4): drafts from suffix
trees over token sequences, with no draft model.

Two trees serve each request (§3.1): its own, over its prompt and its output so far, and a global
one over the outputs of finished requests, bounded to the newest ``max_cached_requests`` of them
(the oldest are removed again). A tree here is a suffix trie
cut at ``max_depth`` tokens: every substring of at most that length is a path from the root, and
each node counts how often its path occurred.

Drafting (§3.2-3.3): the longest suffix of the sequence (at most ``max_depth`` tokens) that is a
path with a continuation is the match; from its node the draft follows the most frequent child
while the chain of child frequencies (count / parent's children's counts) stays at or above
``min_token_prob``, at most ``max_spec_factor`` × match length tokens (and the row's γ). The
score, the sum of those chained probabilities, estimates the accepted tokens; the tree with the
higher score drafts. The chained probabilities go with the draft to a policy that chooses
drafters per sequence (``LookupProposer.survey``). Only path drafts: tree verification is not
built.

The trie ends at ``max_depth``, so a match is at most ``max_depth`` − γ tokens long, leaving room
for the draft. A request's own tree is never built: what it would draft is computed from the
request's token array (``sequence_draft``: the earlier occurrences of the matched suffix,
narrowed token by token), which costs microseconds where a trie over a 2k-token prompt took
~80 ms to build in Python. The global tree is a trie in flat arrays on the host
(``SuffixTree``): each output token costs up to ``max_depth`` edge lookups to insert.
"""

from __future__ import annotations

import collections
from array import array

import numpy as np

from jspec.proposers.ngram import LookupProposer, TokenBuffers, longest_earlier_suffix

_NONE, _STALE = -1, -2  # no node; a best child not known (recomputed when a draft reads it)


class SuffixTree:
    """A suffix trie over any number of token sequences, cut at ``max_depth``.

    Nodes are integers (the root is 0) and every field of a node is an entry of a flat array;
    the edges are one dict from ``node << 32 | token`` to the child. The garbage collector
    walks these few containers and nothing in them: the global tree reaches a million nodes over
    ``max_cached_requests`` = 1000 outputs, which as nested lists and dicts took ~380 MiB and
    made each full collection walk 2.6M objects (425 ms, every running request stalled)."""

    def __init__(self, max_depth: int):
        self.max_depth = max_depth
        self._edge: dict[int, int] = {}  # node << 32 | token -> child
        self._count = array("q", [0])  # how often the node's path occurred
        self._total = array("q", [0])  # Σ of its children's counts
        self._token = array("q", [-1])  # the token of the edge into it
        self._first = array("q", [_NONE])  # its children as a list: the first ...
        self._next = array("q", [_NONE])  # ... each one's next sibling and previous one
        self._prev = array("q", [_NONE])
        self._best = array("q", [_NONE])  # its most frequent child, _NONE, or _STALE
        self._free = array("q")  # node ids to reuse

    @property
    def num_nodes(self) -> int:
        """Nodes in the tree, the root included."""
        return len(self._count) - len(self._free)

    def count(self, path) -> int:
        """How often ``path`` occurred (0 where it is not in the tree)."""
        node = self._node(path)
        return 0 if node is None else self._count[node]

    def add(self, tokens, start: int = 0) -> None:
        """Count every substring (of at most ``max_depth`` tokens) that ends in
        ``tokens[start:]``; those ending before ``start`` were added by an earlier call over the
        same sequence."""
        self._count_paths(tokens, start, +1)

    def remove(self, tokens) -> None:
        """Undo ``add(tokens)``: every count it added goes back down, and nodes at 0 go."""
        self._count_paths(tokens, 0, -1)

    def _new_node(self, parent: int, tok: int) -> int:
        if self._free:
            node = self._free.pop()
        else:
            node = len(self._count)
            for arr in (self._count, self._total, self._token, self._first, self._next,
                        self._prev, self._best):
                arr.append(0)
        self._count[node] = self._total[node] = 0
        self._token[node] = tok
        self._first[node] = self._best[node] = self._prev[node] = _NONE
        head = self._next[node] = self._first[parent]
        if head != _NONE:
            self._prev[head] = node
        self._first[parent] = node
        self._edge[parent << 32 | tok] = node
        return node

    def _drop_node(self, parent: int, node: int) -> None:
        """Unlink a node whose count reached 0 from its parent and free it. Its descendants
        reach 0 in the same removal and are freed without unlinking (``_count_paths``)."""
        del self._edge[parent << 32 | self._token[node]]
        prev, nxt = self._prev[node], self._next[node]
        if prev == _NONE:
            self._first[parent] = nxt
        else:
            self._next[prev] = nxt
        if nxt != _NONE:
            self._prev[nxt] = prev
        self._free.append(node)

    def _count_paths(self, tokens, start: int, delta: int) -> None:
        # frontier[j]: the node of the sequence's last j tokens (frontier[0] is the root), so
        # each new token extends at most max_depth paths: O(depth) per token
        depth = self.max_depth
        edge, count, total, best, token = (self._edge, self._count, self._total, self._best,
                                           self._token)
        frontier = [0]
        for j in range(1, min(depth - 1, start) + 1):
            node = self._node(tokens[start - j:start])
            if node is None:
                break
            frontier.append(node)
        for tok in tokens[start:]:
            tok = int(tok)
            grown = [0]
            for node in frontier[:depth]:
                child = edge.get(node << 32 | tok)
                if child is None:
                    if delta < 0:
                        break  # removed already: so are the longer paths through it
                    child = self._new_node(node, tok)
                count[child] += delta
                if delta < 0 and count[node] <= 0 and node:
                    # a node dropped earlier in this removal: its subtree goes with it, and
                    # nothing reads its links again (its id is not reused before the end)
                    del edge[node << 32 | tok]
                    self._free.append(child)
                    grown.append(child)
                    continue
                total[node] += delta
                b = best[node]
                if delta < 0:
                    if b == child:
                        best[node] = _STALE
                    if count[child] <= 0:
                        self._drop_node(node, child)
                elif b == _NONE or (b >= 0 and b != child and (
                        count[child], -tok) > (count[b], -token[b])):
                    best[node] = child
                grown.append(child)
            frontier = grown[:depth]

    def _node(self, path) -> int | None:
        """The node of ``path``, or None where it is not in the tree."""
        node, edge = 0, self._edge
        for t in path:
            node = edge.get(node << 32 | int(t))
            if node is None:
                return None
        return node

    def _best_child(self, node: int) -> int:
        """``node``'s most frequent child (ties to the smaller token id, as
        ``sequence_draft``), kept until a child's count falls; _NONE without children."""
        b = self._best[node]
        if b != _STALE:
            return b
        b, key, child = _NONE, None, self._first[node]
        while child != _NONE:
            k = (self._count[child], -self._token[child])
            if key is None or k > key:
                b, key = child, k
            child = self._next[child]
        self._best[node] = b
        return b

    def draft(self, tokens, k: int, max_spec_factor: float, min_token_prob: float
              ) -> tuple[list[int], list[float]]:
        """(draft, the chained probability of each drafted token) continuing ``tokens`` (module
        docstring; the score is their sum); ([], []) without a match."""
        length = len(tokens)
        # the trie ends at max_depth: a match of m tokens leaves max_depth - m to draft.
        # Every suffix of a path is a path, so the longest suffix that is one is found by
        # bisection; from there down, the first whose node has children is the match.
        lo, hi = 0, min(max(self.max_depth - k, 1), length)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self._node(tokens[length - mid:]) is None:
                hi = mid - 1
            else:
                lo = mid
        for m in range(lo, 0, -1):
            node = self._node(tokens[length - m:])
            if self._first[node] == _NONE:
                continue
            limit = min(k, int(max_spec_factor * m))
            out, probs, prob = [], [], 1.0
            while len(out) < limit and self._first[node] != _NONE:
                child = self._best_child(node)
                prob *= self._count[child] / self._total[node]
                if prob < min_token_prob:
                    break
                out.append(int(self._token[child]))
                probs.append(prob)
                node = child
            return out, probs
        return [], []


def _most_frequent(tokens: np.ndarray) -> tuple[int, int]:
    """(token, count): the most frequent of ``tokens``, the smallest such token on a tie (a
    few dozen tokens count faster in Python than through ``np.unique``'s sort)."""
    if len(tokens) > 64:
        values, counts = np.unique(tokens, return_counts=True)
        best = int(np.argmax(counts))  # the first maximum: the smallest token id
        return int(values[best]), int(counts[best])
    counts = collections.Counter(tokens.tolist())
    top = max(counts.values())
    return min(t for t, c in counts.items() if c == top), top


def sequence_draft(tokens: np.ndarray, max_depth: int, k: int, max_spec_factor: float,
                   min_token_prob: float, match: tuple[int, np.ndarray] | None = None
                   ) -> tuple[list[int], list[float]]:
    """``SuffixTree(max_depth)`` over the one sequence ``tokens``, drafting its continuation
    (``SuffixTree.draft``), computed from the token array instead of a trie: the occurrences
    of the matched suffix, narrowed to those that go on with each drafted token. A request's
    own tree costs nothing to build this way; a trie over a 2k-token prompt took ~80 ms.
    ``match``: ``longest_earlier_suffix(tokens, max(max_depth - k, 1))`` if the caller has it."""
    m, ends = match if match is not None else longest_earlier_suffix(
        tokens, max(max_depth - k, 1))
    if not m:
        return [], []
    limit = min(k, int(max_spec_factor * m), max_depth - m)  # the trie ends at max_depth
    last = len(tokens) - 1
    out, probs, prob = [], [], 1.0
    while len(out) < limit:
        ends = ends[ends < last]  # occurrences with a token after them
        if not ends.size:
            break
        if ends.size == 1:  # one occurrence: what follows it, each token with probability 1
            e = int(ends[0])
            rest = tokens[e + 1:e + 1 + min(limit - len(out), last - e)].tolist()
            out += rest
            probs += [prob] * len(rest)
            break
        following = tokens[ends + 1]
        token, count = _most_frequent(following)
        prob *= count / len(following)
        if prob < min_token_prob:
            break
        out.append(token)
        probs.append(prob)
        ends = ends[following == token] + 1
    return out, probs


class SuffixProposer(LookupProposer):
    """Suffix decoding over a per-request and a global suffix tree (module docstring)."""

    name = "suffix"

    def __init__(self, max_depth: int, max_spec_factor: float, min_token_prob: float,
                 max_cached_requests: int, max_num_seqs: int,
                 tokens: TokenBuffers | None = None):
        self.max_depth = max_depth
        self.max_spec_factor = max_spec_factor
        self.min_token_prob = min_token_prob
        self.max_cached_requests = max_cached_requests
        # its longest match leaves room for a draft of one token (``draft_with_probs``)
        super().__init__(max_num_seqs, max(max_depth - 1, 1), tokens)
        self.global_tree = SuffixTree(max_depth)
        # the steps' sequences (``after_dispatch``), until they end; by object, as a request
        # id may be used again once its request ended
        self._running: dict[int, object] = {}
        # the finished requests' outputs the global tree holds, oldest first
        self._cached: collections.deque[list[int]] = collections.deque()

    def _retire_finished(self) -> None:
        """Outputs of the requests that finished since the last step into the global tree.
        ~4 ms of Python per 128-token output (depth 24), so it runs after the step's
        verification is dispatched (``after_dispatch``), never before a draft."""
        for key, seq in list(self._running.items()):
            if seq.status.finished:
                del self._running[key]
                output = list(seq.output_token_ids)
                self.global_tree.add(output)
                self._cached.append(output)
                if len(self._cached) > self.max_cached_requests:
                    self.global_tree.remove(self._cached.popleft())

    def reset_cache(self) -> int:
        """Empty the global tree; requests still running join it when they finish."""
        forgotten = len(self._cached)
        self.global_tree = SuffixTree(self.max_depth)
        self._cached.clear()
        return forgotten

    def draft(self, seq, gamma: int) -> list[int]:
        return self.draft_with_probs(seq, gamma)[0]

    def draft_with_probs(self, seq, gamma: int) -> tuple[list[int], list[float]]:
        """The draft of the tree with the higher score, and its chained probabilities."""
        tokens, match = self.tokens.lookup_input(seq, max(self.max_depth - gamma, 1))
        own = sequence_draft(tokens, self.max_depth, gamma, self.max_spec_factor,
                             self.min_token_prob, match)
        other = self.global_tree.draft(tokens[-self.max_depth:].tolist(), gamma,
                                       self.max_spec_factor, self.min_token_prob)
        return other if sum(other[1]) > sum(own[1]) else own

    def after_dispatch(self, st) -> None:
        """Every sequence of every step has its output join the global tree when it ends,
        whichever drafter served it (or none)."""
        for row in st.rows:
            self._running[id(row.seq)] = row.seq
        self._retire_finished()
