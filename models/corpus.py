"""The training corpus: the running interpreter's standard library sources (PSF license).

Discovery
    Every ``.py`` file under ``sysconfig.get_paths()["stdlib"]``, sorted by relative path, minus
    anything under ``site-packages`` / ``dist-packages`` (third-party code installed into the
    interpreter). Test directories (``test``, ``tests``, ``idle_test``) are included by default
    and left out with ``include_tests=False``. Files that are not valid UTF-8 (the stdlib's test
    suite carries a few on purpose) are skipped.

Split (fixed, by module)
    A file belongs to its *top-level* module or package: ``json/decoder.py`` -> ``json``,
    ``os.py`` -> ``os``. The top-level name is hashed with SHA-256; the first 8 bytes as a
    big-endian integer, modulo 10,000, below ``HELD_OUT_PER_10K`` (500, i.e. ~5% of top-level
    names) puts the whole module in the held-out split, anything else in train. The rule only
    depends on the name, so it is the same on every machine, every Python version and every run,
    and a package never straddles the split (no near-duplicate leakage between sibling files).
    The share of *bytes* held out varies with which packages the hash picks.

Packing
    Documents (files) are tokenized without special tokens, each followed by EOS, concatenated in
    a seeded shuffled order, and cut into non-overlapping windows of ``seq_len + 1`` tokens (the
    inputs are ``w[:-1]``, the targets ``w[1:]``); the tail shorter than a window is dropped.
    Batches are addressed by step (``batch_indices``): step ``s`` uses window positions
    ``s*B .. s*B+B-1`` of an endless stream made of one seeded permutation of all windows per
    epoch, so a resumed run sees exactly the batches an uninterrupted run would have.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np

HELD_OUT_PER_10K = 500  # ~5% of top-level modules
_EXCLUDED_DIRS = ("site-packages", "dist-packages", "__pycache__")
_TEST_DIRS = ("test", "tests", "idle_test")


@dataclass(frozen=True)
class SourceFile:
    path: str  # absolute
    relpath: str  # relative to the stdlib root, '/'-separated
    module: str  # top-level module or package name

    def read(self) -> str:
        with open(self.path, encoding="utf-8") as f:
            return f.read()


def stdlib_root() -> str:
    return sysconfig.get_paths()["stdlib"]


def top_level_module(relpath: str) -> str:
    first = relpath.replace(os.sep, "/").split("/")[0]
    return first[:-3] if first.endswith(".py") else first


def is_held_out(module: str, per_10k: int = HELD_OUT_PER_10K) -> bool:
    digest = hashlib.sha256(module.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") % 10_000 < per_10k


def discover(root: str | None = None, include_tests: bool = True) -> list[SourceFile]:
    """All stdlib ``.py`` files (sorted by relative path) that decode as UTF-8."""
    root = os.path.realpath(root or stdlib_root())
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = os.path.relpath(dirpath, root)
        parts = [] if rel_dir == "." else rel_dir.split(os.sep)
        dirnames[:] = [d for d in dirnames if d not in _EXCLUDED_DIRS
                       and (include_tests or d not in _TEST_DIRS)]
        for name in filenames:
            if not name.endswith(".py"):
                continue
            rel = "/".join(parts + [name])
            found.append(SourceFile(os.path.join(dirpath, name), rel, top_level_module(rel)))
    found.sort(key=lambda f: f.relpath)
    out = []
    for f in found:
        try:
            with open(f.path, "rb") as fh:
                fh.read().decode("utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        out.append(f)
    return out


def split_files(files: Sequence[SourceFile]) -> tuple[list[SourceFile], list[SourceFile]]:
    """(train, held_out), by the module-name hash; both keep the input order."""
    train = [f for f in files if not is_held_out(f.module)]
    held = [f for f in files if is_held_out(f.module)]
    return train, held


def read_texts(files: Iterable[SourceFile]) -> list[str]:
    return [f.read() for f in files]


# ----------------------------------------------------------------------------- packing
def tokenize_documents(tokenizer, texts: Sequence[str], batch: int = 256) -> list[np.ndarray]:
    """Token ids of each text (no special tokens), via the fast tokenizer's batch encoder."""
    backend = getattr(tokenizer, "backend_tokenizer", None) or getattr(tokenizer, "_tokenizer")
    out = []
    for i in range(0, len(texts), batch):
        for enc in backend.encode_batch(list(texts[i:i + batch]), add_special_tokens=False):
            out.append(np.asarray(enc.ids, dtype=np.int32))
    return out


def pack(docs: Sequence[np.ndarray], seq_len: int, eos_id: int, seed: int = 0) -> np.ndarray:
    """Documents -> int32 windows [N, seq_len + 1]: shuffled (by ``seed``) document order, each
    document followed by ``eos_id``, cut into non-overlapping windows; the short tail is dropped."""
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    order = np.random.default_rng(seed).permutation(len(docs))
    eos = np.asarray([eos_id], dtype=np.int32)
    parts = []
    for i in order:
        parts.append(np.asarray(docs[i], dtype=np.int32))
        parts.append(eos)
    stream = np.concatenate(parts) if parts else np.zeros(0, np.int32)
    width = seq_len + 1
    n = len(stream) // width
    return np.ascontiguousarray(stream[:n * width].reshape(n, width))


def batch_indices(step: int, batch_size: int, num_windows: int, seed: int) -> np.ndarray:
    """Window indices of the batch at ``step``: positions step*B .. step*B+B-1 of an endless
    stream, one seeded permutation of all windows per epoch. A pure function of its arguments."""
    if num_windows < 1:
        raise ValueError("no training windows: the corpus is shorter than one sequence")
    pos = step * batch_size + np.arange(batch_size, dtype=np.int64)
    epochs, offsets = np.divmod(pos, num_windows)
    out = np.empty(batch_size, dtype=np.int64)
    for epoch in np.unique(epochs):
        perm = np.random.default_rng([seed, int(epoch)]).permutation(num_windows)
        sel = epochs == epoch
        out[sel] = perm[offsets[sel]]
    return out


def get_batch(windows: np.ndarray, step: int, batch_size: int, seed: int) -> np.ndarray:
    return windows[batch_indices(step, batch_size, len(windows), seed)]


def function_prompts(files: Iterable[SourceFile], max_chars: int = 1200) -> list[str]:
    """Code-completion prompts: every function or method with a docstring, cut after the
    docstring (signature + docstring, dedented to the ``def``, ending in a newline so the model
    continues with the body). In file order, then source order; prompts longer than
    ``max_chars`` are skipped. Used with the held-out split to measure the default pair."""
    import ast
    import textwrap

    prompts = []
    for f in files:
        text = f.read()
        lines = text.splitlines()
        tree = _parse_quietly(text)
        if tree is None:
            continue
        nodes = [n for n in ast.walk(tree)
                 if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
                 and ast.get_docstring(n) is not None]
        for node in sorted(nodes, key=lambda n: n.lineno):
            doc = node.body[0]
            snippet = "\n".join(lines[node.lineno - 1:doc.end_lineno])
            if doc.end_lineno is None or len(snippet) > max_chars:
                continue
            prompts.append(textwrap.dedent(snippet) + "\n")
    return prompts


def heldout_function_prompts(limit: int | None = None, max_chars: int = 1200) -> list[str]:
    """``function_prompts`` of the held-out split (test directories excluded)."""
    _, held = split_files(discover(include_tests=False))
    prompts = function_prompts(held, max_chars)
    return prompts if limit is None else prompts[:limit]


def _parse_quietly(text: str):
    """The module's AST, or None when it does not parse. The stdlib's own sources hold old
    invalid escapes ('\\(' in non-raw strings) that the parser warns about; they are the corpus,
    not our code, so the warnings are silenced."""
    import ast
    import warnings

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", (DeprecationWarning, SyntaxWarning))
            return ast.parse(text)
    except SyntaxError:
        return None


def _outer_functions(tree) -> list:
    """Module-level functions and methods (a nested function is already part of the text of
    the function around it), in source order."""
    import ast

    kinds = (ast.FunctionDef, ast.AsyncFunctionDef)
    found, stack = [], [tree]
    while stack:
        node = stack.pop()
        for child in ast.iter_child_nodes(node):
            if isinstance(child, kinds):
                found.append(child)
            elif isinstance(child, ast.ClassDef):
                stack.append(child)
    return sorted(found, key=lambda n: n.lineno)


def _continuation_cut(node, lines: Sequence[str], min_chars: int, max_chars: int) -> str | None:
    """The function ``node``'s source (decorators included, dedented) up to the start of one of
    its statements, or None when no cut fits. The cut keeps the signature, the docstring and at
    least one statement of the body; the kept part is ``min_chars`` to ``max_chars`` long and at
    most three quarters of the function, so there is code left to write; of those, the cut
    nearest to half the function is taken, so the model has seen the names the rest reuses."""
    import ast
    import textwrap

    first = min([node.lineno] + [d.lineno for d in node.decorator_list])
    body = node.body[1:] if ast.get_docstring(node) is not None else node.body
    if not body:
        return None
    whole = len(textwrap.dedent("\n".join(lines[first - 1:node.end_lineno])))
    starts = sorted({s.lineno for s in ast.walk(node)
                     if isinstance(s, ast.stmt) and s.lineno > body[0].lineno})
    best, best_gap = None, None
    for cut in starts:
        kept = textwrap.dedent("\n".join(lines[first - 1:cut - 1])).rstrip() + "\n"
        if not min_chars <= len(kept) <= min(max_chars, 0.75 * whole):
            continue
        gap = abs(len(kept) - whole / 2)
        if best_gap is None or gap < best_gap:
            best, best_gap = kept, gap
    return best


def continuation_prompts(files: Iterable[SourceFile], min_chars: int = 200,
                         max_chars: int = 600) -> list[str]:
    """Code-continuation prompts: every module-level function or method cut part way through
    its body (``_continuation_cut``), so the model continues code whose names it has just read,
    the case where drafting by lookup in the prompt pays. In file order, then source order;
    functions without a cut that fits are skipped."""
    prompts = []
    for f in files:
        text = f.read()
        tree = _parse_quietly(text)
        if tree is None:
            continue
        lines = text.splitlines()
        for node in _outer_functions(tree):
            prompt = _continuation_cut(node, lines, min_chars, max_chars)
            if prompt is not None:
                prompts.append(prompt)
    return prompts


def heldout_continuation_prompts(limit: int | None = None) -> list[str]:
    """``continuation_prompts`` of the held-out split (test directories excluded), the files
    ``heldout_function_prompts`` reads."""
    _, held = split_files(discover(include_tests=False))
    prompts = continuation_prompts(held)
    return prompts if limit is None else prompts[:limit]
