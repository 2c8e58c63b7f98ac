"""Incremental detokenization and stop-string matching.

Decoding only the tail of the output (a window starting a few tokens back) keeps each step O(1)
in the output length; a window whose text ends in U+FFFD is an incomplete UTF-8 sequence from a
byte-level tokenizer, so its text is held back until the next token completes it.
"""

from __future__ import annotations


class IncrementalDetokenizer:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.token_ids: list[int] = []
        self.text = ""
        self._prefix_offset = 0
        self._read_offset = 0
        # A fast (Rust) tokenizer decodes without transformers' per-call argument handling,
        # which costs several times the decode itself; with clean-up off the text is the same.
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._raw_decode = getattr(backend, "decode", None)

    def _decode(self, ids: list[int]) -> str:
        if self._raw_decode is not None:
            return self._raw_decode(ids, skip_special_tokens=True)
        return self.tokenizer.decode(ids, skip_special_tokens=True,
                                     clean_up_tokenization_spaces=False)

    def add(self, token_id: int) -> str:
        """Append one token; return the text it completes (possibly empty)."""
        self.token_ids.append(token_id)
        if self.tokenizer is None:
            return ""
        ids = self.token_ids
        prefix_text = self._decode(ids[self._prefix_offset:self._read_offset])
        full = self._decode(ids[self._prefix_offset:])
        if len(full) > len(prefix_text) and not full.endswith("\ufffd"):
            delta = full[len(prefix_text):]
            self._prefix_offset = self._read_offset
            self._read_offset = len(ids)
            self.text += delta
            return delta
        return ""


def find_stop(text: str, new_len: int, stops: tuple[str, ...]) -> int:
    """Index in ``text`` where the earliest stop string begins, searching only where the last
    ``new_len`` characters could have completed one; -1 if none."""
    if not stops:
        return -1
    best = -1
    for stop in stops:
        begin = max(0, len(text) - new_len - len(stop) + 1)
        idx = text.find(stop, begin)
        if idx != -1 and (best == -1 or idx < best):
            best = idx
    return best
