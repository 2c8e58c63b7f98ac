"""Prompt sources for the serving benchmarks, and how prompt/output lengths are fitted to a model.

Sources (``load_workload(name, path)``; each file's path is an argument whose default is the copy
in the shared data directory, ``<repo>/../shared/data`` or ``$JSPEC_DATA_DIR``; see that
directory's README for provenance and licences):

* ``spec-bench``: Spec-Bench ``question.jsonl`` (``spec_bench_question.jsonl``), the first turn
  of each question; the category (writing, coding, translation, ...) is kept.
* ``alpaca``: the Alpaca JSON sample (``alpaca_data_1k_sample.json``): the instruction, then a
  blank line and the input when the input is not empty.
* ``sharegpt``: the ShareGPT JSON subset (``ShareGPT_V3_filtered_500.json``): the first turn
  whose ``from`` is ``human``.
* ``code``: signatures + docstrings of the functions in the default pair's held-out split of the
  stdlib corpus (``jspec.models.corpus.heldout_function_prompts``); no file.
* ``code-continuation``: functions and methods of the same held-out files cut part way through
  their body, 200 to 600 characters (``jspec.models.corpus.heldout_continuation_prompts``), so
  the model continues code whose names it has just read: input-grounded, like Spec-Bench's
  summarization and rag; no file.
* ``mixed``: every prompt of ``spec-bench`` (each keeping its own category), ``sharegpt``,
  ``code`` and ``code-continuation``, each category spread evenly through the pool
  (``interleave``); its files are always the shared data directory's. Requests draw from the
  pool at random, so each source's share of them is its share of the pool (the shipped files
  on Python 3.11: 500 sharegpt, 480 spec-bench, 152 code, 116 code-continuation).
* ``multiturn``: conversations (``load_conversations``), from a ShareGPT-format file (default:
  the same ``ShareGPT_V3_filtered_500.json``). An entry with several human turns is one
  conversation, its human turns in order (the ``gpt`` replies are dropped: the engine's own
  outputs take their place). The shipped file has only ONE human turn per entry (its first; no
  replies, see the data README), so there consecutive single-turn entries are grouped, ``turns``
  at a time, into one conversation: its "follow-up" messages are other users' opening messages,
  not real follow-ups. What it measures is the serving pattern (a growing shared prefix), not
  the text. ``build_conversations`` turns them into token ids, see "Conversations" below.

A missing or malformed file is a ``ValueError`` that names the file (and the line or record).

Sampling is deterministic: ``sample_order(len(prompts), n, seed)`` walks seeded permutations of
the pool, a fresh one each time the pool is exhausted, so n larger than the pool repeats prompts
only after using every one.

Length rule (``fit_lengths``), with L = the engine's ``max_model_len``:

1. output budget o = min(requested output, ``max_tokens``, L − 1), at least 1. The requested
   output is ``max_tokens`` for dataset prompts and the trace's GeneratedTokens for a trace;
2. prompt length p = min(wanted prompt length, ``max_prompt_tokens`` if given, L − o), at
   least 1. The wanted length is the prompt's own token count for dataset prompts, and
   round(ContextTokens × ``context_scale``) for a trace;
3. a prompt longer than p keeps its first p tokens (the instruction / signature comes first);
   a trace request asking for more tokens than its prompt has continues with the next prompts of
   the sampled order, concatenated token ids, until it has p tokens.

So p + o ≤ L always: the engine never clips a request's output, and the output budget wins over
the prompt when both do not fit (serving cost is dominated by decoding, which is what the
benchmarks compare).

Conversations (``build_conversations``, with L = the engine's context limit): each user message is
wrapped as ``"User: {msg}\\n\\nAssistant:"`` (the first) or ``"\\n\\nUser: {msg}\\n\\nAssistant:"``
(the later ones), each piece tokenized on its own, so the ids a turn adds never depend on what came
before (like a chat template's). The output budget o of every turn is rule 1's; the message keeps
its first min(its tokens, ``max_prompt_tokens`` if given, L − o − wrapper) tokens
(``max_prompt_tokens`` caps each user message, wrapper excluded). Turn k's prompt is built while the
benchmark runs (``jspec.bench.serving.drive_conversations``): turn k−1's prompt ids + turn k−1's
output ids (what the engine generated) + turn k's wrapped message; the conversation ends early
(truncated) when that prompt + o would exceed L."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

DATA_FILES = {
    "spec-bench": "spec_bench_question.jsonl",
    "alpaca": "alpaca_data_1k_sample.json",
    "sharegpt": "ShareGPT_V3_filtered_500.json",
}
WORKLOADS = ("code", "code-continuation", "spec-bench", "alpaca", "sharegpt", "multiturn",
             "mixed")
# the workloads that read no file of their own, and why (what an error says when given one)
NO_FILE = {"code": "reads the held-out corpus split",
           "code-continuation": "reads the held-out corpus split",
           "mixed": "reads each source's file from the shared data directory (set "
                    "JSPEC_DATA_DIR for another)"}
FILE_WORKLOADS = tuple(w for w in WORKLOADS if w not in NO_FILE)
MIXED_SOURCES = ("spec-bench", "sharegpt", "code", "code-continuation")
DEFAULT_TURNS = 4  # user turns per conversation assembled from single-turn entries
# how a user message is wrapped into the token ids its turn adds (module docstring)
FIRST_HEAD, NEXT_HEAD, TAIL = "User: ", "\n\nUser: ", "\n\nAssistant:"


@dataclasses.dataclass(frozen=True)
class Prompt:
    text: str
    category: str
    source: str  # workload name
    index: int  # position in its file (or in the held-out prompt list)


@dataclasses.dataclass
class BenchRequest:
    """One request of a benchmark: what to send and when (seconds after the start)."""

    request_id: str
    arrival: float
    prompt_token_ids: list[int]
    max_tokens: int
    category: str
    prompt_index: int  # index of its (first) prompt in the workload (its conversation's)
    # multiturn: its conversation's id and its turn in it (1 = the conversation's first message)
    conversation_id: int | None = None
    turn: int | None = None


@dataclasses.dataclass(frozen=True)
class Conversation:
    """A conversation's user messages, in order (the replies come from the engine)."""

    messages: tuple[str, ...]
    category: str
    index: int  # position in the conversation pool
    entries: tuple[int, ...]  # the file records it was taken from


@dataclasses.dataclass
class BenchConversation:
    """One conversation of a benchmark: when it starts and the token ids each user turn adds
    (wrapper included); the prompts themselves are built as it runs (module docstring)."""

    conversation_id: int
    arrival: float  # when its first turn is due (seconds after the start)
    turns: list[list[int]]
    max_tokens: int  # output budget of every turn
    category: str
    conversation_index: int  # its position in the conversation pool


@dataclasses.dataclass(frozen=True)
class FitOptions:
    """How a benchmark draws its requests from the pool (``sample_order``) and fits their
    lengths to the engine (``fit_lengths``; ``context_limit`` is the module docstring's L)."""

    context_limit: int  # tokens one sequence may hold, prompt and output
    max_tokens: int  # the output budget asked for
    max_prompt_tokens: int | None = None  # a cap on each prompt (multiturn: each user message)
    seed: int = 0  # of the sampled order


@dataclasses.dataclass(frozen=True)
class TraceLengths:
    """What a trace asks of each request, per arrival (``Arrivals.context_tokens`` /
    ``generated_tokens``): without them each prompt keeps its own length and every output
    budget is ``max_tokens``."""

    context_tokens: np.ndarray | None = None
    generated_tokens: np.ndarray | None = None
    context_scale: float = 1.0  # the prompt built is round(context tokens x this) long


def data_dir() -> Path:
    """``$JSPEC_DATA_DIR`` if set, else ``shared/data`` beside the repository checkout."""
    env = os.environ.get("JSPEC_DATA_DIR")
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[2].parent / "shared" / "data"


def default_path(workload: str) -> Path:
    if workload == "multiturn":
        workload = "sharegpt"
    if workload not in DATA_FILES:
        raise ValueError(f"workload {workload!r} has no data file; file workloads: "
                         f"{', '.join(DATA_FILES)}")
    return data_dir() / DATA_FILES[workload]


def _read_text(path: Path, what: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except FileNotFoundError:
        raise ValueError(f"{what} file {str(path)!r} not found (set JSPEC_DATA_DIR or pass the "
                         f"path)") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read {what} file {str(path)!r}: {e}") from None


def _load_json_array(path: Path, what: str) -> list:
    text = _read_text(path, what)
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{what} file {str(path)!r} is not JSON (line {e.lineno}: {e.msg})"
                         ) from None
    if not isinstance(data, list):
        raise ValueError(f"{what} file {str(path)!r} must hold a JSON array, got "
                         f"{type(data).__name__}")
    return data


def _nonempty_str(value, path: Path, where: str, field: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"{str(path)!r} {where}: {field} must be a non-empty string")
    return value


def load_spec_bench(path: str | os.PathLike | None = None) -> list[Prompt]:
    """Spec-Bench questions: the first turn of each, with its category."""
    path = Path(path) if path is not None else default_path("spec-bench")
    prompts = []
    for number, line in enumerate(_read_text(path, "Spec-Bench").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{str(path)!r} line {number}: not JSON ({e.msg})") from None
        if not isinstance(row, dict) or not isinstance(row.get("turns"), list) \
                or not row["turns"]:
            raise ValueError(f"{str(path)!r} line {number}: expected an object with a non-empty "
                             f"\"turns\" list")
        text = _nonempty_str(row["turns"][0], path, f"line {number}", "turns[0]")
        category = row.get("category")
        prompts.append(Prompt(text, category if isinstance(category, str) else "unknown",
                              "spec-bench", len(prompts)))
    if not prompts:
        raise ValueError(f"Spec-Bench file {str(path)!r} holds no questions")
    return prompts


def load_alpaca(path: str | os.PathLike | None = None) -> list[Prompt]:
    """Alpaca records: instruction, plus a blank line and the input when there is one."""
    path = Path(path) if path is not None else default_path("alpaca")
    prompts = []
    for i, row in enumerate(_load_json_array(path, "Alpaca")):
        if not isinstance(row, dict):
            raise ValueError(f"{str(path)!r} record {i}: expected an object")
        text = _nonempty_str(row.get("instruction"), path, f"record {i}", "instruction")
        extra = row.get("input", "")
        if not isinstance(extra, str):
            raise ValueError(f"{str(path)!r} record {i}: input must be a string")
        if extra.strip():
            text = f"{text}\n\n{extra}"
        prompts.append(Prompt(text, "alpaca", "alpaca", i))
    if not prompts:
        raise ValueError(f"Alpaca file {str(path)!r} holds no records")
    return prompts


def load_sharegpt(path: str | os.PathLike | None = None) -> list[Prompt]:
    """ShareGPT conversations: the first human turn of each (entries without one are skipped)."""
    path = Path(path) if path is not None else default_path("sharegpt")
    prompts = []
    for i, row in enumerate(_load_json_array(path, "ShareGPT")):
        turns = row.get("conversations") if isinstance(row, dict) else None
        if not isinstance(turns, list):
            raise ValueError(f"{str(path)!r} record {i}: expected an object with a "
                             f"\"conversations\" list")
        for turn in turns:
            if isinstance(turn, dict) and turn.get("from") == "human":
                text = _nonempty_str(turn.get("value"), path, f"record {i}", "value")
                prompts.append(Prompt(text, "sharegpt", "sharegpt", i))
                break
    if not prompts:
        raise ValueError(f"ShareGPT file {str(path)!r} holds no human turns")
    return prompts


HUMAN_ROLES = ("human", "user")


def load_conversations(path: str | os.PathLike | None = None,
                       turns: int = DEFAULT_TURNS) -> list[Conversation]:
    """Conversations from a ShareGPT-format file (module docstring): an entry with several human
    (or ``user``) turns is a conversation of its first ``turns`` of them (0: all); consecutive
    entries with one human turn are grouped ``turns`` at a time (the last group may be shorter;
    a multi-turn entry ends the group before it). Entries without a human turn are skipped."""
    if turns < 0:
        raise ValueError(f"turns must be >= 0, got {turns}")
    path = Path(path) if path is not None else default_path("multiturn")
    convs: list[Conversation] = []
    group: list[tuple[int, str]] = []

    def add(items: list[tuple[int, str]], category: str) -> None:
        convs.append(Conversation(tuple(m for _, m in items), category, len(convs),
                                  tuple(i for i, _ in items)))

    def flush() -> None:
        if group:
            add(group, "sharegpt-grouped")
            group.clear()

    for i, row in enumerate(_load_json_array(path, "ShareGPT")):
        entry = row.get("conversations") if isinstance(row, dict) else None
        if not isinstance(entry, list):
            raise ValueError(f"{str(path)!r} record {i}: expected an object with a "
                             f"\"conversations\" list")
        human = [_nonempty_str(t.get("value"), path, f"record {i}", "value") for t in entry
                 if isinstance(t, dict) and t.get("from") in HUMAN_ROLES]
        if len(human) == 1:
            group.append((i, human[0]))
            if turns and len(group) == turns:
                flush()
        elif human:
            flush()
            add([(i, m) for m in (human[:turns] if turns else human)], "sharegpt")
    flush()
    if not convs:
        raise ValueError(f"ShareGPT file {str(path)!r} holds no human turns")
    return convs


def load_code(limit: int | None = None) -> list[Prompt]:
    from jspec.models.corpus import heldout_function_prompts

    texts = heldout_function_prompts(limit)
    if not texts:
        raise ValueError("no held-out function prompts found (is the stdlib source available?)")
    return [Prompt(t, "code", "code", i) for i, t in enumerate(texts)]


def load_code_continuation(limit: int | None = None) -> list[Prompt]:
    from jspec.models.corpus import heldout_continuation_prompts

    texts = heldout_continuation_prompts(limit)
    if not texts:
        raise ValueError("no held-out code-continuation prompts found (is the stdlib source "
                         "available?)")
    return [Prompt(t, "code-continuation", "code-continuation", i) for i, t in enumerate(texts)]


def load_mixed() -> list[Prompt]:
    """Every prompt of the ``MIXED_SOURCES``, each category spread evenly (``interleave`` of
    the categories; Spec-Bench's file holds its categories in blocks). Each prompt keeps its own
    category, source and index, so results split by category. A missing data file is named up
    front: the loaders' own message suggests passing a path, which mixed does not take."""
    for name in MIXED_SOURCES:
        if name in DATA_FILES and not default_path(name).exists():
            raise ValueError(f"the mixed workload needs {DATA_FILES[name]} ({name}) in the "
                             f"shared data directory: {str(default_path(name))!r} not found "
                             f"(set JSPEC_DATA_DIR)")
    groups: dict[str, list[Prompt]] = {}
    for name in MIXED_SOURCES:
        for prompt in load_workload(name):
            groups.setdefault(prompt.category, []).append(prompt)
    return interleave(list(groups.values()))


def interleave(pools: Sequence[Sequence[Prompt]]) -> list[Prompt]:
    """Every prompt of every pool, each pool spread evenly through the result (the k-th of a pool
    of n sits at about k/n of the way; ties in pool order), so any stretch of the result holds
    each pool in its share. Deterministic."""
    keyed = sorted(((k + 0.5) / len(pool), j, k) for j, pool in enumerate(pools)
                   for k in range(len(pool)))
    return [pools[j][k] for _, j, k in keyed]


def load_workload(name: str, path: str | os.PathLike | None = None) -> list[Prompt]:
    if name in NO_FILE and path is not None:
        raise ValueError(f"the {name} workload {NO_FILE[name]}, not a file")
    fileless = {"code": load_code, "code-continuation": load_code_continuation,
                "mixed": load_mixed}
    if name in fileless:
        return fileless[name]()
    loaders = {"spec-bench": load_spec_bench, "alpaca": load_alpaca, "sharegpt": load_sharegpt}
    if name == "multiturn":
        raise ValueError("the multiturn workload is conversations: load_conversations")
    if name not in loaders:
        raise ValueError(f"unknown workload {name!r}; known: {', '.join(WORKLOADS)}")
    return loaders[name](path)


def of_categories(prompts: list[Prompt], categories: Sequence[str]) -> list[Prompt]:
    """The prompts of the given categories (Spec-Bench's, say); an unknown one is an error that
    lists those there are."""
    known = sorted({p.category for p in prompts})
    unknown = [c for c in categories if c not in known]
    if unknown:
        raise ValueError(f"no prompts of category {unknown[0]!r}; the workload's categories: "
                         f"{', '.join(known)}")
    return [p for p in prompts if p.category in set(categories)]


def sample_order(pool_size: int, n: int, seed: int) -> np.ndarray:
    """n indices into a pool: consecutive seeded permutations, so every prompt is used once
    before any repeats."""
    if pool_size < 1:
        raise ValueError("cannot sample from an empty prompt pool")
    rng = np.random.default_rng(seed)
    chunks, have = [], 0
    while have < n:
        chunks.append(rng.permutation(pool_size))
        have += pool_size
    return np.concatenate(chunks)[:n] if chunks else np.zeros(0, np.int64)


def fit_lengths(prompt_len: int, output_len: int, max_model_len: int, max_tokens: int,
                max_prompt_tokens: int | None = None) -> tuple[int, int]:
    """(prompt tokens, output tokens) for a request, by the rule in the module docstring."""
    if max_model_len < 2:
        raise ValueError(f"max_model_len must be >= 2, got {max_model_len}")
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    out = max(1, min(int(output_len), max_tokens, max_model_len - 1))
    limit = max_model_len - out
    if max_prompt_tokens is not None:
        limit = min(limit, max_prompt_tokens)
    return max(1, min(int(prompt_len), limit)), out


def build_requests(prompts: Sequence[Prompt], encode: Callable[[str], list[int]],
                   arrival_times: np.ndarray, fit: FitOptions,
                   trace: TraceLengths = TraceLengths()) -> list[BenchRequest]:
    """One request per arrival, prompts drawn by ``sample_order``, lengths by ``fit_lengths``.

    With a ``trace``'s context / generated tokens the prompt is built to that many tokens
    (times its ``context_scale``) and the output budget is the trace's; without them each
    prompt keeps its own length and every output budget is ``fit.max_tokens``."""
    if trace.context_scale <= 0:
        raise ValueError(f"context_scale must be > 0, got {trace.context_scale}")
    context_tokens, generated_tokens = trace.context_tokens, trace.generated_tokens
    max_tokens = fit.max_tokens
    n = len(arrival_times)
    order = sample_order(len(prompts), n, fit.seed)
    cache: dict[int, list[int]] = {}

    def tokens(i: int) -> list[int]:
        if i not in cache:
            ids = list(encode(prompts[i].text))
            if not ids:
                raise ValueError(f"{prompts[i].source} prompt {prompts[i].index} encodes to no "
                                 f"tokens")
            cache[i] = ids
        return cache[i]

    requests = []
    for k in range(n):
        first = int(order[k])
        ids = tokens(first)
        if context_tokens is not None:
            wanted = max(1, int(round(float(context_tokens[k]) * trace.context_scale)))
        else:
            wanted = len(ids)
        want_out = int(generated_tokens[k]) if generated_tokens is not None else max_tokens
        p, o = fit_lengths(wanted, want_out, fit.context_limit, max_tokens,
                           fit.max_prompt_tokens)
        ids = list(ids[:p])
        nxt = k + 1
        while len(ids) < p:  # a trace asks for more context than this prompt has
            ids += tokens(int(order[nxt % n]))[:p - len(ids)]
            nxt += 1
        requests.append(BenchRequest(request_id=f"req-{k}", arrival=float(arrival_times[k]),
                                     prompt_token_ids=ids, max_tokens=o,
                                     category=prompts[first].category, prompt_index=first))
    return requests


def build_conversations(conversations: Sequence[Conversation], encode: Callable[[str], list[int]],
                        arrival_times: np.ndarray, fit: FitOptions,
                        encode_first: Callable[[str], list[int]] | None = None
                        ) -> list[BenchConversation]:
    """One conversation per arrival (its start), drawn by ``sample_order``; each user message
    wrapped and fitted as the module docstring says. ``encode`` tokenizes a piece without
    special tokens; ``encode_first`` (default ``encode``) the first piece of a conversation, so
    a tokenizer's BOS starts the conversation once."""
    encode_first = encode_first or encode
    context_limit, max_tokens, max_prompt_tokens = (fit.context_limit, fit.max_tokens,
                                                    fit.max_prompt_tokens)
    n = len(arrival_times)
    order = sample_order(len(conversations), n, fit.seed)
    first_head, next_head, tail = (list(encode_first(FIRST_HEAD)), list(encode(NEXT_HEAD)),
                                   list(encode(TAIL)))
    _, out = fit_lengths(1, max_tokens, context_limit, max_tokens)
    # the longest message a first turn can hold with its output
    room = context_limit - out - len(first_head) - len(tail)
    if room < 1:
        raise ValueError(f"a context limit of {context_limit} tokens leaves no room for a user "
                         f"message with {out} output tokens and the conversation wrapper")
    cache: dict[tuple[int, int], list[int]] = {}

    def message(c: int, k: int) -> list[int]:
        if (c, k) not in cache:
            conv = conversations[c]
            ids = list(encode(conv.messages[k]))
            if not ids:
                raise ValueError(f"conversation {conv.index} message {k} encodes to no tokens")
            keep = min(len(ids), room)
            if max_prompt_tokens is not None:
                keep = min(keep, max_prompt_tokens)
            cache[(c, k)] = ids[:keep]
        return cache[(c, k)]

    result = []
    for k in range(n):
        c = int(order[k])
        conv = conversations[c]
        turns = [(first_head if t == 0 else next_head) + message(c, t) + tail
                 for t in range(len(conv.messages))]
        result.append(BenchConversation(conversation_id=k, arrival=float(arrival_times[k]),
                                        turns=turns, max_tokens=out, category=conv.category,
                                        conversation_index=c))
    return result
