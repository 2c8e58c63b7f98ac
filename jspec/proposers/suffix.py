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
higher score drafts. Only path drafts: tree verification is not built.

The trie ends at ``max_depth``, so a match is at most ``max_depth`` − γ tokens long, leaving room
for the draft. A request's own tree is never built: what it would draft is computed from the
request's token array (``sequence_draft``: the earlier occurrences of the matched suffix,
narrowed token by token), which costs microseconds where a trie over a 2k-token prompt took
~80 ms to build in Python. The global tree is a trie of nested dicts on the host: each output
token costs ``max_depth`` dict updates to insert.
"""

from __future__ import annotations

import collections

import numpy as np

from jspec.proposers.ngram import LookupProposer, TokenBuffers, longest_earlier_suffix

# a node: [count, {token: node}, (best token, its node, children's total count) or None]; the
# last is computed when a draft first reads the node and dropped when a child's count changes
_COUNT, _KIDS, _BEST = 0, 1, 2


class SuffixTree:
    """A suffix trie over any number of token sequences, cut at ``max_depth``."""

    def __init__(self, max_depth: int):
        self.max_depth = max_depth
        self.root: list = [0, {}, None]

    def add(self, tokens, start: int = 0) -> None:
        """Count every substring (of at most ``max_depth`` tokens) that ends in
        ``tokens[start:]``; those ending before ``start`` were added by an earlier call over the
        same sequence."""
        self._count(tokens, start, +1)

    def remove(self, tokens) -> None:
        """Undo ``add(tokens)``: every count it added goes back down, and nodes at 0 go."""
        self._count(tokens, 0, -1)

    def _count(self, tokens, start: int, delta: int) -> None:
        # frontier[j]: the node of the sequence's last j tokens (frontier[0] is the root), so
        # each new token extends at most max_depth paths: O(depth) per token
        depth = self.max_depth
        frontier = [self.root]
        for j in range(1, min(depth - 1, start) + 1):
            node = self.root
            for t in tokens[start - j:start]:
                node = node[_KIDS].get(t)
                if node is None:
                    break
            if node is None:
                break
            frontier.append(node)
        for tok in tokens[start:]:
            grown = [self.root]
            for node in frontier[:depth]:
                child = node[_KIDS].get(tok)
                if child is None:
                    if delta < 0:
                        break  # removed already: so are the longer paths through it
                    child = node[_KIDS][tok] = [0, {}, None]
                child[_COUNT] += delta
                node[_BEST] = None
                if child[_COUNT] <= 0:
                    del node[_KIDS][tok]  # its descendants reach 0 in this same removal
                grown.append(child)
            frontier = grown[:depth]

    def _node(self, path):
        """The node of ``path``, or None where it is not in the tree."""
        node = self.root
        for t in path:
            node = node[_KIDS].get(t)
            if node is None:
                return None
        return node

    def draft(self, tokens, k: int, max_spec_factor: float, min_token_prob: float
              ) -> tuple[list[int], float]:
        """(draft, score) continuing ``tokens`` (module docstring); ([], 0) without a match."""
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
            if not node[_KIDS]:
                continue
            limit = min(k, int(max_spec_factor * m))
            out, score, prob = [], 0.0, 1.0
            while len(out) < limit and node[_KIDS]:
                tok, child, total = node[_BEST] or _best_child(node)
                prob *= child[_COUNT] / total
                if prob < min_token_prob:
                    break
                out.append(int(tok))
                score += prob
                node = child
            return out, score
        return [], 0.0


def _best_child(node) -> tuple:
    """(token, node, total) of ``node``'s most frequent child (ties to the smaller token id, as
    ``sequence_draft``) and its children's total count, kept on the node until a count
    changes: a node near the root has hundreds of children, and every draft reads it."""
    tok, child = max(node[_KIDS].items(), key=lambda kv: (kv[1][_COUNT], -kv[0]))
    node[_BEST] = best = (tok, child, sum(c[_COUNT] for c in node[_KIDS].values()))
    return best


def sequence_draft(tokens: np.ndarray, max_depth: int, k: int, max_spec_factor: float,
                   min_token_prob: float, ends: np.ndarray | None = None
                   ) -> tuple[list[int], float]:
    """``SuffixTree(max_depth)`` over the one sequence ``tokens``, drafting its continuation
    (``SuffixTree.draft``), computed from the token array instead of a trie: the occurrences
    of the matched suffix, narrowed to those that go on with each drafted token. A request's
    own tree costs nothing to build this way; a trie over a 2k-token prompt took ~80 ms."""
    m, ends = longest_earlier_suffix(tokens, max(max_depth - k, 1), ends)
    if not m:
        return [], 0.0
    limit = min(k, int(max_spec_factor * m), max_depth - m)  # the trie ends at max_depth
    last = len(tokens) - 1
    out, score, prob = [], 0.0, 1.0
    while len(out) < limit:
        ends = ends[ends < last]  # occurrences with a token after them
        if not ends.size:
            break
        if ends.size == 1:  # one occurrence: what follows it, each token with probability 1
            e = int(ends[0])
            rest = tokens[e + 1:e + 1 + min(limit - len(out), last - e)].tolist()
            out += rest
            score += prob * len(rest)
            break
        following = tokens[ends + 1]
        values, counts = np.unique(following, return_counts=True)
        best = int(np.argmax(counts))  # the first maximum: the smallest token id
        prob *= counts[best] / len(following)
        if prob < min_token_prob:
            break
        out.append(int(values[best]))
        score += prob
        ends = ends[following == values[best]] + 1
    return out, score


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
        super().__init__(max_num_seqs, tokens)
        self.global_tree = SuffixTree(max_depth)
        self._running: dict[str, object] = {}  # sequences drafted for, until they finish
        # the finished requests' outputs the global tree holds, oldest first
        self._cached: collections.deque[list[int]] = collections.deque()

    def _retire_finished(self) -> None:
        """Outputs of the requests that finished since the last step into the global tree."""
        for rid, seq in list(self._running.items()):
            if seq.status.finished:
                del self._running[rid]
                output = list(seq.output_token_ids)
                self.global_tree.add(output)
                self._cached.append(output)
                if len(self._cached) > self.max_cached_requests:
                    self.global_tree.remove(self._cached.popleft())

    def draft(self, seq, gamma: int) -> list[int]:
        tokens, ends = self.tokens.lookup_input(seq)
        own, score = sequence_draft(tokens, self.max_depth, gamma, self.max_spec_factor,
                                    self.min_token_prob, ends)
        other, other_score = self.global_tree.draft(tokens[-self.max_depth:].tolist(), gamma,
                                                    self.max_spec_factor, self.min_token_prob)
        return other if other_score > score else own

    def propose(self, st) -> None:
        self._retire_finished()
        for row in st.rows:  # every scheduled request's output joins the tree when it ends
            self._running[row.seq.request_id] = row.seq
        super().propose(st)
