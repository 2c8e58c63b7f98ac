"""The multi-turn conversation workload of `jspec bench serving` and its prefix-caching
comparison: conversations assembled from single-turn and multi-turn ShareGPT files, their token
ids, per-turn metric math on hand-made records, the on / off run expansion and ratios, and one
tiny end-to-end run (caching on and off) checking that every turn's prompt is the previous
prompt + the engine's own output + the new message. No timing assertions."""

from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import parse_serving_args, tiny_serving_args
from jspec.bench import workloads as W
from jspec.bench.serving_metrics import RequestRecord, turn_metrics

DATA = W.data_dir()
needs_data = pytest.mark.skipif(
    not (DATA / W.DATA_FILES["sharegpt"]).exists(),
    reason=f"shared data files not found in {DATA} (set JSPEC_DATA_DIR)")


def human(text):
    return {"from": "human", "value": text}


def gpt(text):
    return {"from": "gpt", "value": text}


def write_sharegpt(path, entries):
    path.write_text(json.dumps([{"id": f"e{i}", "conversations": c}
                                for i, c in enumerate(entries)]))
    return path


def encode(text):  # one token per character
    return [ord(ch) for ch in text]


# ----------------------------------------------------------------------------- conversations
def test_single_turn_entries_are_grouped(tmp_path):
    path = write_sharegpt(tmp_path / "single.json", [
        [human("a0")], [human("a1")], [gpt("no human turn: skipped")], [human("a2")],
        [human("a3")], [human("a4")]])
    convs = W.load_conversations(path, turns=2)
    assert [c.messages for c in convs] == [("a0", "a1"), ("a2", "a3"), ("a4",)]
    assert [c.entries for c in convs] == [(0, 1), (3, 4), (5,)]
    assert [c.index for c in convs] == [0, 1, 2]
    assert {c.category for c in convs} == {"sharegpt-grouped"}
    assert [c.messages for c in W.load_conversations(path, turns=4)] == [
        ("a0", "a1", "a2", "a3"), ("a4",)]


def test_multi_turn_entries_keep_their_human_turns(tmp_path):
    path = write_sharegpt(tmp_path / "full.json", [
        [human("q1"), gpt("r1"), human("q2"), gpt("r2"), human("q3")],
        [human("s1")], [human("s2")],
        [{"from": "user", "value": "u1"}, {"from": "assistant", "value": "x"}, human("u2")],
        [human("s3")]])
    convs = W.load_conversations(path, turns=4)
    # a multi-turn entry ends the group of single-turn entries before it
    assert [c.messages for c in convs] == [("q1", "q2", "q3"), ("s1", "s2"), ("u1", "u2"),
                                           ("s3",)]
    assert [c.category for c in convs] == ["sharegpt", "sharegpt-grouped", "sharegpt",
                                           "sharegpt-grouped"]
    assert convs[0].entries == (0, 0, 0) and convs[1].entries == (1, 2)
    assert W.load_conversations(path, turns=2)[0].messages == ("q1", "q2")  # capped at K
    with pytest.raises(ValueError, match="turns"):
        W.load_conversations(path, turns=-1)
    bad = write_sharegpt(tmp_path / "bad.json", [[human("x"), human("")]])
    with pytest.raises(ValueError, match="record 0: value"):
        W.load_conversations(bad)


@needs_data
def test_shipped_sharegpt_file_makes_grouped_conversations():
    firsts = W.load_workload("sharegpt")
    convs = W.load_conversations(turns=4)  # the default file: one human turn per entry
    assert len(convs) == 125 and all(len(c.messages) == 4 for c in convs)
    assert convs[0].messages == tuple(p.text for p in firsts[:4])
    assert convs[1].entries == (4, 5, 6, 7)
    assert len(W.load_conversations(turns=3)) == 167  # 166 of 3 and the last 2 entries


def test_build_conversations_wraps_and_fits_messages():
    convs = [W.Conversation(("hello", "x" * 200, "bye"), "c", 0, (0, 1, 2))]
    bos = [1]
    out = W.build_conversations(convs, encode, np.array([0.5, 2.0]),
                                W.FitOptions(context_limit=128, max_tokens=16, seed=0),
                                encode_first=lambda t: bos + encode(t))
    assert [c.conversation_id for c in out] == [0, 1] and [c.arrival for c in out] == [0.5, 2.0]
    c = out[0]
    assert c.max_tokens == 16 and c.conversation_index == 0 and c.category == "c"
    head, nxt, tail = bos + encode("User: "), encode("\n\nUser: "), encode("\n\nAssistant:")
    assert c.turns[0] == head + encode("hello") + tail  # BOS only at the conversation's start
    assert c.turns[2] == nxt + encode("bye") + tail
    # a message keeps its first L - o - (first turn's wrapper) tokens
    room = 128 - 16 - len(head) - len(tail)
    assert c.turns[1] == nxt + encode("x" * room) + tail
    capped = W.build_conversations(convs, encode, np.array([0.0]),
                                   W.FitOptions(context_limit=128, max_tokens=16,
                                                max_prompt_tokens=3))[0]
    assert capped.turns[1] == nxt + encode("xxx") + tail
    assert capped.turns[0] == encode("User: hel") + tail
    with pytest.raises(ValueError, match="no room for a user message"):
        W.build_conversations(convs, encode, np.array([0.0]),
                              W.FitOptions(context_limit=30, max_tokens=16))


def test_build_conversations_samples_every_conversation_before_repeating():
    convs = [W.Conversation((f"m{i}",), "c", i, (i,)) for i in range(3)]
    out = W.build_conversations(convs, encode, np.arange(6.0),
                                W.FitOptions(context_limit=64, max_tokens=4, seed=5))
    picked = [c.conversation_index for c in out]
    assert sorted(picked[:3]) == [0, 1, 2] and sorted(picked[3:]) == [0, 1, 2]
    assert picked == W.sample_order(3, 6, seed=5).tolist()


# ----------------------------------------------------------------------------- per-turn metrics
def rec(cid, turn, arrival, first, finish, prompt, tokens=3, error=None):
    chunks = [] if error else [first, finish]
    return RequestRecord(f"conv-{cid}-turn-{turn}", arrival=arrival, prompt_tokens=prompt,
                         max_tokens=tokens, conversation_id=cid, turn=turn,
                         chunk_times=chunks, chunk_tokens=[1, tokens - 1] if chunks else [],
                         finish=None if error else finish, error=error)


def test_turn_metrics_math():
    records = [
        rec(0, 1, 0.0, 0.4, 1.0, 10), rec(0, 2, 1.0, 1.1, 2.0, 30), rec(0, 3, 2.0, 2.3, 3.0, 50),
        rec(1, 1, 0.5, 1.5, 2.5, 20), rec(1, 2, 2.5, 2.7, 3.5, 40),
        rec(2, 1, 1.0, 0, 0, 15, error="boom"),  # failed: counted, not in the statistics
        RequestRecord("req-0", 0.0, 5, 1, chunk_times=[9.0], chunk_tokens=[1], finish=9.0),
    ]
    m = turn_metrics(records)
    first, later = m["first"], m["later"]
    assert (first["num_requests"], first["num_finished"]) == (3, 2)
    assert first["ttft_s"]["count"] == 2
    assert first["ttft_s"]["p50"] == pytest.approx((0.4 + 1.0) / 2)
    assert first["ttft_s"]["p90"] == pytest.approx(0.4 + 0.9 * 0.6)
    assert later["num_requests"] == 3
    assert later["ttft_s"]["mean"] == pytest.approx((0.1 + 0.3 + 0.2) / 3)
    assert later["ttft_s"]["p50"] == pytest.approx(0.2)
    assert later["ttft_s"]["p90"] == pytest.approx(0.2 + 0.8 * 0.1)
    assert later["prompt_tokens"]["mean"] == pytest.approx(40)
    assert list(m["turns"]) == ["1", "2", "3"]
    assert m["turns"]["2"]["ttft_s"]["p50"] == pytest.approx(0.15)
    assert m["turns"]["3"]["e2e_s"]["p50"] == pytest.approx(1.0)
    assert m["turns"]["2"]["tpot_s"]["mean"] == pytest.approx((0.9 / 2 + 0.8 / 2) / 2)
    assert turn_metrics([records[-1]])["first"]["num_requests"] == 0  # not a conversation's
    d = json.loads(json.dumps(records[1].as_dict()))
    assert (d["conversation_id"], d["turn"]) == (0, 2)
    assert RequestRecord.from_dict(d) == records[1]


# ----------------------------------------------------------------------------- caching on / off
def test_prefix_caching_both_doubles_every_policy():
    from jspec.bench import serving

    args = parse_serving_args("--policy", "off", "static:gamma=2", "--elastic-memory",
                              "--prefix-caching", "both")
    policies = serving.parse_policies(args.policy, args.policy_option, 4)
    runs = serving.with_prefix_cache_runs(serving.with_elastic_runs(policies, args))
    assert [(r["label"], r["engine"]) for r in runs] == [
        ("off", {}), ("off -prefix-cache", {"enable_prefix_caching": False}),
        ("off +elastic", {"elastic_memory": True}),
        ("off +elastic -prefix-cache", {"elastic_memory": True, "enable_prefix_caching": False}),
        ("static γ=2", {}), ("static γ=2 -prefix-cache", {"enable_prefix_caching": False}),
        ("static γ=2 +elastic", {"elastic_memory": True}),
        ("static γ=2 +elastic -prefix-cache",
         {"elastic_memory": True, "enable_prefix_caching": False})]
    assert parse_serving_args().prefix_caching == "on"


def fake_run(label, tps, ttft, first=None, later=None, hit=None):
    by_turn = None if first is None else {"first": {"ttft_s": {"p50": first}},
                                          "later": {"ttft_s": {"p50": later}}}
    return {"label": label, "policy": label.split()[0], "metrics": {
        "output_tokens_per_s": tps, "ttft_s": {"p50": ttft, "p90": ttft},
        "tpot_s": {"p50": 0.01, "p90": 0.02}, "itl_s": {"p90": 0.02},
        "goodput_requests_per_s": 1.0, "slo_attainment": 1.0, "acceptance_rate": 0.5,
        "mean_accepted_length": 2.0, "mean_gamma": 2.0, "num_preemptions": 0,
        "by_turn": by_turn, "prefix_cache_hit_rate": hit}}


def test_prefix_cache_comparison_and_table():
    from jspec.bench import serving

    runs = [fake_run("static", 120.0, 0.05, first=0.08, later=0.02, hit=0.6),
            fake_run("static -prefix-cache", 100.0, 0.10, first=0.08, later=0.08, hit=0.0),
            fake_run("off", 90.0, 0.04, first=0.06, later=0.03, hit=0.5)]
    (row,) = serving.prefix_cache_comparison(runs)  # "off" has no run without caching
    assert (row["on"], row["off"]) == ("static", "static -prefix-cache")
    assert row["output_tokens_per_s_ratio"] == pytest.approx(1.2)
    assert row["ttft_p50_ratio"] == pytest.approx(0.5)
    assert row["ttft_p50_first_turn_ratio"] == pytest.approx(1.0)
    assert row["ttft_p50_later_turns_ratio"] == pytest.approx(0.25)
    assert row["prefix_cache_hit_rate"] == 0.6
    rows = serving.comparison(runs)
    assert [r["ttft_later_p50_vs_first"] for r in rows] == [
        1.0, pytest.approx(4.0), pytest.approx(1.5)]
    table = serving.format_table(runs, rows)
    head, _, on, off, _, _ = table.splitlines()
    assert "TTFT1 p50" in head and "TTFT2+ p50" in head and "hit%" in head
    assert on.split()[-4:] == ["80.0", "20.0", "1.000", "60.0"]
    assert off.split()[-4:] == ["80.0", "80.0", "4.000", "0.0"]
    text = serving.format_prefix_cache_comparison([row])
    assert "static: tok/s ×1.200" in text and "later turns ×0.250" in text
    # single requests and no cache counters: the table has none of these columns
    plain = [fake_run("off", 90.0, 0.04)]
    assert "TTFT1" not in serving.format_table(plain, serving.comparison(plain))
    assert "hit%" not in serving.format_table(plain, serving.comparison(plain))


@pytest.mark.parametrize("argv, match", [
    (["--workload", "multiturn", "--turns", "0"], "--turns must be >= 1"),
    (["--workload", "code", "--turns", "2"], "options of --workload multiturn"),
    (["--workload", "sharegpt", "--think-time", "1"], "options of --workload multiturn"),
    (["--workload", "multiturn", "--think-time", "-1"], "--think-time must be >= 0"),
])
def test_multiturn_bad_options_fail_before_loading(argv, match, capsys):
    from jspec.cli import main

    assert main(["bench", "serving", *argv]) == 2
    assert match in capsys.readouterr().err


# ----------------------------------------------------------------------------- end to end
def test_multiturn_end_to_end_with_and_without_prefix_caching(tiny_pair, tmp_path, monkeypatch,
                                                              capsys):
    """Two conversations (one short, one whose third prompt fits the 128-token context but not
    with its output budget), caching on and off: every turn's prompt = the previous prompt + the engine's output + the
    new message; the truncation is counted; the engines were built as labelled."""
    from jspec.bench import serving

    data = write_sharegpt(tmp_path / "conv.json", [
        [human("Hi there."), gpt("Hello!"), human("And how?"), gpt("Fine."), human("Bye.")],
        [human("the quick brown fox " * 3), gpt("ok"), human("jumps over the dog " * 3),
         gpt("ok"), human("and runs away again " * 3)]])
    seen = []
    drive = serving.drive_conversations

    async def spy(aengine, conversations, *a, **kw):
        records, runs = await drive(aengine, conversations, *a, **kw)
        seen.append((conversations, runs))
        return records, runs

    monkeypatch.setattr(serving, "drive_conversations", spy)
    out = tmp_path / "multiturn.json"
    args = tiny_serving_args(
        tiny_pair, "--policy", "off", "--workload", "multiturn", "--workload-file", str(data),
        "--turns", "3", "--think-time", "0.01", "--arrivals", "poisson", "--rate", "50",
        "--num-requests", "2", "--max-tokens", "4", "--max-prompt-tokens", "26",
        "--prefix-caching", "both",
        "--out", str(out), "--no-progress")
    assert serving.run(args) == 0
    res = json.loads(out.read_text())
    on, off = res["runs"]
    assert (on["label"], off["label"]) == ("off", "off -prefix-cache")
    assert (on["engine_options"], off["engine_options"]) == ({}, {"enable_prefix_caching": False})
    assert (on["prefix_caching"], off["prefix_caching"]) == (True, False)  # the built engines
    assert res["config"]["enable_prefix_caching"] is True
    assert res["config"]["prefix_caching"] == "both"
    limit = res["config"]["context_limit"]
    assert res["workload"]["num_conversations"] == 2 and res["workload"]["turns"] == 3

    assert len(seen) == 2
    for (convs, runs), run in zip(seen, (on, off)):
        for conv, cr in zip(convs, runs):
            assert cr.turns_planned == len(conv.turns) == 3
            assert cr.prompts[0] == conv.turns[0]
            for k in range(cr.turns_sent - 1):
                assert len(cr.outputs[k]) == 4  # ignore_eos: every budgeted token
                history = cr.prompts[k] + cr.outputs[k]
                assert cr.prompts[k + 1] == history + conv.turns[k + 1]
            assert all(len(p) + conv.max_tokens <= limit for p in cr.prompts)
            if cr.truncated:  # (what the test is built for: the next prompt itself would fit)
                nxt = len(cr.prompts[-1]) + 4 + len(conv.turns[cr.turns_sent])
                assert limit - 4 < nxt <= limit, (nxt, limit)
        sent = sorted(cr.turns_sent for cr in runs)
        assert sent[1] == 3 and sent[0] < 3  # the long conversation ends early
        assert [cr.truncated for cr in runs].count(True) == 1
        m = run["metrics"]
        assert m["conversations"]["num_truncated"] == 1
        assert m["conversations"]["turns_sent"] == sum(sent) == m["num_finished"]
        assert m["by_turn"]["first"]["num_finished"] == 2
        assert m["by_turn"]["later"]["num_finished"] == sum(sent) - 2
        assert m["by_turn"]["first"]["ttft_s"]["p50"] is not None
        assert list(m["by_turn"]["turns"]) == ["1", "2", "3"][:max(sent)]
        for key in serving.PREFIX_CACHE_KEYS:
            assert key in m
        # records: unique ids, conversation and turn, each turn due its think time after the
        # previous turn's last chunk
        reqs = run["requests"]
        assert len({r["request_id"] for r in reqs}) == len(reqs) == sum(sent)
        by_conv = {}
        for r in reqs:
            assert r["request_id"] == f"conv-{r['conversation_id']}-turn-{r['turn']}"
            by_conv.setdefault(r["conversation_id"], []).append(r)
        for turns in by_conv.values():
            assert [r["turn"] for r in turns] == list(range(1, len(turns) + 1))
            for a, b in zip(turns, turns[1:]):
                assert b["arrival"] == pytest.approx(a["finish"] + 0.01, abs=2e-6)
                assert b["prompt_tokens"] == a["prompt_tokens"] + 4 + len(
                    seen[0][0][a["conversation_id"]].turns[b["turn"] - 1])
    # both runs served the same conversations, with the same outputs (greedy, same seeds)
    assert [cr.outputs for cr in seen[0][1]] == [cr.outputs for cr in seen[1][1]]
    if off["metrics"]["prefix_cache_hits"] is not None:  # an engine that counts them
        assert off["metrics"]["prefix_cache_hits"] == 0
    (row,) = res["prefix_cache_comparison"]
    assert (row["on"], row["off"]) == ("off", "off -prefix-cache")
    assert row["ttft_p50_later_turns_ratio"] is not None
    printed = capsys.readouterr().out
    assert "TTFT1 p50" in printed and "TTFT2+ p50" in printed
    assert "prefix caching on / off" in printed
