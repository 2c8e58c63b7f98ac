"""The code-continuation and mixed workloads of `jspec bench serving`: continuation prompts cut
from held-out functions (on a hand-made file and on the real held-out split), the even
interleave, the mixed pool's categories and ``--category`` on it, the errors (a file given,
a shared data file missing), and the per-category metrics. No engine runs."""

from __future__ import annotations

import collections

import pytest

from conftest import parse_serving_args
from jspec.bench import serving
from jspec.bench import workloads as W
from jspec.bench.serving_metrics import RequestRecord, category_metrics
from jspec.models import corpus

DATA = W.data_dir()
needs_data = pytest.mark.skipif(
    not all((DATA / W.DATA_FILES[s]).exists() for s in W.MIXED_SOURCES if s in W.DATA_FILES),
    reason=f"shared data files not found in {DATA} (set JSPEC_DATA_DIR)")

SOURCE = '''\
import os


def short(x):
    return x


class Walker:
    def walk(self, root, pattern):
        """Yield the paths under root whose name matches pattern."""
        found = []
        for dirpath, dirnames, filenames in os.walk(root):
            for name in filenames:
                if name.endswith(pattern):
                    found.append(os.path.join(dirpath, name))

        def key(path):
            return (len(path), path)

        found.sort(key=key)
        for path in found:
            yield path
        return len(found)
'''


def one_file(tmp_path, text: str = SOURCE) -> list[corpus.SourceFile]:
    path = tmp_path / "walker.py"
    path.write_text(text)
    return [corpus.SourceFile(str(path), "walker.py", "walker")]


# ----------------------------------------------------------------------------- code-continuation
def test_continuation_cut_on_a_hand_made_file(tmp_path):
    prompts = corpus.continuation_prompts(one_file(tmp_path), min_chars=100, max_chars=600)
    # `short` is too short to cut; the nested `key` is part of `walk`, not a prompt of its own
    assert len(prompts) == 1
    walk = prompts[0]
    assert walk.startswith('def walk(self, root, pattern):\n    """Yield')  # dedented method
    assert walk.endswith("\n") and not walk.endswith("\n\n")
    whole = "\n".join(line[4:] for line in SOURCE.splitlines()[8:])
    assert whole.startswith(walk.rstrip("\n"))  # a prefix of the method, cut at a line
    assert "found = []" in walk  # keeps at least one statement of the body
    assert 100 <= len(walk) <= 0.75 * len(whole)
    # the cut before a statement nearest to half the method (236 of 435 characters)
    assert len(walk) == 236 and walk.endswith("if name.endswith(pattern):\n")
    # a cut must fit the bounds: none does here
    assert corpus.continuation_prompts(one_file(tmp_path), min_chars=120, max_chars=150) == []


def test_continuation_skips_unparsable_and_docstring_only(tmp_path):
    assert corpus.continuation_prompts(one_file(tmp_path, "def f(:\n    pass\n")) == []
    only_doc = 'def f():\n    """' + "x" * 400 + '"""\n'
    assert corpus.continuation_prompts(one_file(tmp_path, only_doc), min_chars=10) == []


@pytest.fixture(scope="module")
def continuation():
    return W.load_workload("code-continuation")


def test_code_continuation_workload(continuation):
    assert len(continuation) >= 100
    assert [p.text for p in continuation] == [p.text for p in W.load_code_continuation()]
    assert all(p.category == p.source == "code-continuation" for p in continuation)
    assert [p.index for p in continuation] == list(range(len(continuation)))
    assert all(200 <= len(p.text) <= 600 and p.text.strip() for p in continuation)
    assert len({p.text for p in continuation}) == len(continuation)
    assert [p.text for p in W.load_code_continuation(3)] == [p.text for p in continuation[:3]]
    # every line comes from the held-out files (dedented), none is made up
    _, held = corpus.split_files(corpus.discover(include_tests=False))
    source = "\n".join(corpus.read_texts(held))
    for p in continuation:
        for line in p.text.splitlines():
            assert line.strip() in source, line
    with pytest.raises(ValueError, match="code-continuation workload reads the held-out "
                                         "corpus split, not a file"):
        W.load_workload("code-continuation", "x.py")


# ----------------------------------------------------------------------------- mixed
def test_interleave_spreads_every_pool_evenly():
    pools = [[W.Prompt(f"{name}{k}", name, name, k) for k in range(n)]
             for name, n in (("a", 6), ("b", 3), ("c", 1))]
    mixed = W.interleave(pools)
    assert "".join(p.text[0] for p in mixed) == "abaabcaaba"
    assert sorted(p.text for p in mixed) == sorted(p.text for pool in pools for p in pool)
    for name in "ab":  # each pool keeps its own order
        assert [p.index for p in mixed if p.source == name] == sorted(
            p.index for p in mixed if p.source == name)
    assert W.interleave([]) == []


@pytest.fixture(scope="module")
def mixed():
    return W.load_workload("mixed")


@needs_data
def test_mixed_workload_holds_every_source(mixed, continuation):
    spec_bench, sharegpt = W.load_workload("spec-bench"), W.load_workload("sharegpt")
    code = W.load_workload("code")
    assert len(mixed) == len(spec_bench) + len(sharegpt) + len(code) + len(continuation)
    counts = collections.Counter(p.category for p in mixed)
    assert counts == (collections.Counter(p.category for p in spec_bench)
                      + collections.Counter(sharegpt=len(sharegpt), code=len(code))
                      + collections.Counter({"code-continuation": len(continuation)}))
    assert counts["summarization"] == counts["rag"] == 80 and counts["writing"] == 10
    # prompts keep their own source, index and text
    spec = [p for p in mixed if p.source == "spec-bench"]
    assert sorted(spec, key=lambda p: p.index) == spec_bench
    assert {p.source for p in mixed} == set(W.MIXED_SOURCES)
    assert [p.text for p in W.load_workload("mixed")] == [p.text for p in mixed]  # deterministic
    # any stretch of the pool mixes its sources
    head = collections.Counter(p.source for p in mixed[:40])
    assert set(head) == set(W.MIXED_SOURCES)


@needs_data
def test_mixed_category_filter_through_serving(mixed):
    args = parse_serving_args("--workload", "mixed", "--category",
                              "summarization,rag,code-continuation")
    plan = serving.plan_benchmark(args)
    counts = collections.Counter(p.category for p in plan.prompts)
    assert set(counts) == {"summarization", "rag", "code-continuation"}
    assert counts["summarization"] == counts["rag"] == 80
    assert serving._workload_path(args) == [str(DATA / W.DATA_FILES["spec-bench"]),
                                            str(DATA / W.DATA_FILES["sharegpt"])]
    with pytest.raises(ValueError, match="no prompts of category 'summary'"):
        W.of_categories(mixed, ["summary"])


def test_mixed_takes_no_file(capsys):
    from jspec.cli import main

    with pytest.raises(ValueError, match="mixed workload reads each source's file from the "
                                         "shared data directory"):
        W.load_workload("mixed", "x.json")
    for name in ("mixed", "code-continuation"):
        assert main(["bench", "serving", "--workload", name, "--workload-file", "x.json"]) == 2
        err = capsys.readouterr().err
        assert f"--workload {name}" in err and "--workload-file is for spec-bench" in err
    assert serving._workload_path(parse_serving_args("--workload", "code-continuation")) is None


def test_mixed_names_the_missing_data_file(tmp_path, monkeypatch):
    monkeypatch.setenv("JSPEC_DATA_DIR", str(tmp_path))
    with pytest.raises(ValueError, match="needs spec_bench_question.jsonl") as e:
        W.load_workload("mixed")
    assert str(tmp_path / "spec_bench_question.jsonl") in str(e.value)
    (tmp_path / "spec_bench_question.jsonl").write_text('{"turns": ["q"]}\n')
    with pytest.raises(ValueError, match="needs ShareGPT_V3_filtered_500.json"):
        W.load_workload("mixed")


# ----------------------------------------------------------------------------- per category
def test_category_metrics():
    def rec(name, category, tokens, drafted, accepted, steps):
        return RequestRecord(name, 0.0, 5, tokens, category=category,
                             chunk_times=[1.0, 2.0], chunk_tokens=[1, tokens - 1], finish=2.0,
                             num_drafted=drafted, num_accepted=accepted, num_spec_steps=steps)

    recs = [rec("a", "rag", 5, 8, 6, 2), rec("b", "rag", 3, 4, 0, 2),
            rec("c", "code", 9, 4, 4, 1), RequestRecord("d", 0.0, 5, 4, category="code",
                                                        error="boom")]
    by = category_metrics(recs)
    assert list(by) == ["code", "rag"]
    assert by["rag"]["num_requests"] == 2 and by["rag"]["output_tokens"] == 8
    assert by["rag"]["acceptance_rate"] == pytest.approx(6 / 12)
    assert by["rag"]["mean_accepted_length"] == pytest.approx((6 + 4) / 4)
    assert by["rag"]["tpot_s"]["mean"] == pytest.approx((1 / 4 + 1 / 2) / 2)
    assert (by["code"]["num_requests"], by["code"]["num_finished"]) == (2, 1)
    assert by["code"]["mean_accepted_length"] == pytest.approx(5.0)
