"""The serving-benchmark harness: arrival generators against their specifications, Azure trace
parsing (the real CSVs and hand-made ones), metric math on hand-made timelines, workload loaders,
and one tiny end-to-end `jspec bench serving` run on the tiny pair. No timing assertions."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np
import pytest

from conftest import parse_serving_args, tiny_serving_args
from jspec.bench import arrivals as A
from jspec.bench import workloads as W
from jspec.bench.serving_metrics import (RequestRecord, StepRecords, compute_metrics,
                                         gamma_by_batch, summarize, time_series)

DATA = W.data_dir()
needs_data = pytest.mark.skipif(
    not (DATA / "AzureLLMInferenceTrace_conv.csv").exists(),
    reason=f"shared data files not found in {DATA} (set JSPEC_DATA_DIR)")


# ----------------------------------------------------------------------------- arrivals
def test_poisson_mean_gap_matches_rate():
    rate, n = 5.0, 20_000
    a = A.poisson(rate, num_requests=n, seed=3)
    gaps = np.diff(np.concatenate([[0.0], a.times]))
    assert len(a) == n and np.all(gaps > 0)
    # the sample mean of n Exp(rate) gaps has standard deviation (1/rate)/sqrt(n)
    assert abs(gaps.mean() - 1 / rate) < 5 * (1 / rate) / math.sqrt(n)
    # exponential gaps: standard deviation = mean (the Poisson process, not a regular one).
    # The sample s.d. of Exp gaps has s.d. about σ·sqrt(8/n)/2 = 0.01σ here: 5 of those
    assert abs(gaps.std() - 1 / rate) < 5 * math.sqrt(8 / n) / 2 / rate


def test_poisson_counts_duration_and_seed():
    rate, duration = 20.0, 500.0
    a = A.poisson(rate, duration=duration, seed=1)
    assert np.all(a.times < duration) and np.all(np.diff(a.times) >= 0)
    lam = rate * duration  # Poisson count: mean = variance = λ
    assert abs(len(a) - lam) < 5 * math.sqrt(lam)
    np.testing.assert_array_equal(a.times, A.poisson(rate, duration=duration, seed=1).times)
    assert not np.array_equal(a.times[:10], A.poisson(rate, duration=duration, seed=2).times[:10])
    both = A.poisson(rate, duration=1.0, num_requests=5, seed=1)
    assert len(both) <= 5 and np.all(both.times < 1.0)


def test_regular_process_and_batch():
    r = A.poisson(4.0, num_requests=8, process="regular")
    np.testing.assert_allclose(r.times, np.arange(8) / 4.0)
    b = A.batch(7)
    assert len(b) == 7 and np.all(b.times == 0)
    assert b.describe()["num_requests"] == 7


def counts(times, edges):
    return np.histogram(times, bins=edges)[0].tolist()


def test_step_pattern_counts_per_interval():
    segments = [(0, 2.0), (10, 5.0), (20, 0.0), (25, 1.0)]
    reg = A.step(segments, duration=30, process="regular")
    assert counts(reg.times, [0, 10, 20, 25, 30]) == [20, 50, 0, 5]
    np.testing.assert_allclose(reg.times[20:23], [10, 10.2, 10.4])
    poi = A.step([(0, 2.0), (100, 20.0), (200, 0.0), (250, 5.0)], duration=400, seed=0)
    for got, lam in zip(counts(poi.times, [0, 100, 200, 250, 400]), [200, 2000, 0, 750]):
        assert abs(got - lam) <= 5 * math.sqrt(lam)
    capped = A.step(segments, num_requests=25, process="regular")
    assert len(capped) == 25 and capped.times[-1] == pytest.approx(10.8)


def test_burst_pattern_counts_per_period():
    b = A.burst(5.0, 4, duration=20)
    assert counts(b.times, [0, 5, 10, 15, 20]) == [4, 4, 4, 4]
    assert set(b.times.tolist()) == {0.0, 5.0, 10.0, 15.0}
    with_base = A.burst(5.0, 4, duration=20, background=A.Background(1.0, "regular"))
    assert counts(with_base.times, [0, 5, 10, 15, 20]) == [9, 9, 9, 9]
    assert len(A.burst(2.0, 3, num_requests=7)) == 7


@pytest.mark.parametrize("call, match", [
    (lambda: A.poisson(0, num_requests=3), "rate"),
    (lambda: A.poisson(1.0), "duration or a number of requests"),
    (lambda: A.poisson(1.0, num_requests=3, process="uniform"), "process"),
    (lambda: A.step([(1, 2.0)], duration=5), "start at 0"),
    (lambda: A.step([(0, 2.0), (0, 1.0)], duration=5), "increase"),
    (lambda: A.step([(0, 1.0), (3, 0.0)], num_requests=5), "last step rate is 0"),
    (lambda: A.burst(0, 3, duration=5), "period"),
    (lambda: A.parse_segments("0:1,30"), "START:RATE"),
])
def test_arrival_errors(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_parse_segments():
    assert A.parse_segments("0:1,30:4.5,60:0") == [(0, 1), (30, 4.5), (60, 0)]


# ----------------------------------------------------------------------------- Azure traces
@needs_data
@pytest.mark.parametrize("name, rows, first, second, last", [
    ("code", 8819, (0.0, 4808, 10), (0.052, 3180, 8), None),
    ("conv", 19366, (0.0, 374, 44), (4.314579, 396, 109), (197, 183)),
])
def test_real_azure_traces(name, rows, first, second, last):
    path = A.trace_path(name)
    raw = path.read_bytes()
    assert b"\r\n" in raw and not raw.endswith(b"\n")  # the layout this parser must handle
    t = A.read_azure_trace(path)
    assert len(t) == rows and t.name == name
    for i, (ts, ctx, gen) in enumerate((first, second)):
        assert t.timestamps[i] == pytest.approx(ts, abs=1e-9)
        assert (t.context_tokens[i], t.generated_tokens[i]) == (ctx, gen)
    if last is not None:  # the row after which the file ends without a newline
        assert (t.context_tokens[-1], t.generated_tokens[-1]) == last
    assert np.all(np.diff(t.timestamps) >= 0)
    assert 3400 < t.timestamps[-1] < 3600  # about an hour (README: ~57-58 min)


@needs_data
def test_trace_time_and_rate_scale_on_the_real_conv_trace():
    t = A.read_azure_trace(A.trace_path("conv"))
    window = A.trace_arrivals(t, window_start=60, window_duration=120)
    inside = (t.timestamps >= 60) & (t.timestamps < 180)
    assert len(window) == inside.sum()
    np.testing.assert_allclose(window.times, t.timestamps[inside] - 60)
    np.testing.assert_array_equal(window.context_tokens, t.context_tokens[inside])
    n = len(window)
    # time scale stretches every time, keeps every request
    slow = A.trace_arrivals(t, window_start=60, window_duration=120, time_scale=4)
    np.testing.assert_allclose(slow.times, 4 * window.times)
    # rate scale thins / replicates on the trace's own time axis
    half = A.trace_arrivals(t, window_start=60, window_duration=120, rate_scale=0.5)
    assert len(half) == n // 2
    np.testing.assert_array_equal(half.times, window.times[1::2])
    double = A.trace_arrivals(t, window_start=60, window_duration=120, rate_scale=2)
    assert len(double) == 2 * n
    np.testing.assert_array_equal(double.times[0::2], window.times)
    assert np.all(np.diff(double.times) >= 0)
    np.testing.assert_array_equal(double.generated_tokens[1::2], window.generated_tokens)
    assert half.describe()["mean_rate"] == pytest.approx(
        0.5 * window.describe()["mean_rate"], rel=0.1)
    assert len(A.trace_arrivals(t, max_requests=10)) == 10


def write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


HAND = (b"TIMESTAMP,ContextTokens,GeneratedTokens\r\n"
        b"2023-11-16 23:59:59.9999999,100,5\r\n"
        b"2023-11-17 00:00:00.0000001,200,6\r\n"
        b"2023-11-17 00:00:02.5000000,300,7")  # CRLF, no final newline, across midnight


def test_hand_made_trace_crlf_no_final_newline(tmp_path):
    t = A.read_azure_trace(write(tmp_path / "t.csv", HAND))
    assert len(t) == 3 and t.start == "2023-11-16 23:59:59.9999999"
    # all 7 fractional digits count (datetime would keep only 6)
    np.testing.assert_allclose(t.timestamps, [0.0, 2e-7, 2.5000001], atol=1e-12)
    assert t.context_tokens.tolist() == [100, 200, 300]
    assert t.generated_tokens.tolist() == [5, 6, 7]
    lf = A.read_azure_trace(write(tmp_path / "lf.csv", HAND.replace(b"\r\n", b"\n") + b"\n"))
    np.testing.assert_array_equal(lf.timestamps, t.timestamps)
    # replication spaces the copies of a row evenly up to the next row
    tri = A.trace_arrivals(t, rate_scale=3, time_scale=2)
    assert len(tri) == 9
    np.testing.assert_allclose(tri.times[3:6], 2 * (2e-7 + np.arange(3) * (2.5 - 2e-7 + 1e-7) / 3))
    np.testing.assert_allclose(tri.times[6:], [5.0000002] * 3)


@pytest.mark.parametrize("data, match", [
    (b"", "header"),
    (b"time,ctx,gen\r\n2023-11-16 00:00:00.1,1,2", "header"),
    (b"TIMESTAMP,ContextTokens,GeneratedTokens\r\n2023-11-16 00:00:00.1,1", "3 fields"),
    (b"TIMESTAMP,ContextTokens,GeneratedTokens\r\n16/11/2023 00:00,1,2", "timestamp"),
    (b"TIMESTAMP,ContextTokens,GeneratedTokens\r\n2023-11-16 00:00:00.1,x,2", "integers"),
    (b"TIMESTAMP,ContextTokens,GeneratedTokens\r\n2023-11-16 00:00:01,1,2\r\n"
     b"2023-11-16 00:00:00,1,2", "decrease"),
    (b"TIMESTAMP,ContextTokens,GeneratedTokens\r\n", "no requests"),
])
def test_bad_traces(tmp_path, data, match):
    path = write(tmp_path / "bad.csv", data)
    with pytest.raises(ValueError, match=match) as e:
        A.read_azure_trace(path)
    assert "bad.csv" in str(e.value)


def test_trace_errors(tmp_path):
    with pytest.raises(ValueError, match="not found"):
        A.read_azure_trace(tmp_path / "missing.csv")
    t = A.read_azure_trace(write(tmp_path / "t.csv", HAND))
    with pytest.raises(ValueError, match="holds no requests"):
        A.trace_arrivals(t, window_start=100)
    with pytest.raises(ValueError, match="keeps none"):
        A.trace_arrivals(t, rate_scale=0.1)
    with pytest.raises(ValueError, match="time_scale"):
        A.trace_arrivals(t, time_scale=0)


def test_trace_option_takes_any_azure_format_csv(tmp_path, monkeypatch):
    """`jspec bench serving --trace PATH` replays any CSV in the Azure format, not only the
    shipped names; a name that is neither fails with what is accepted."""
    from jspec.bench import serving

    own = write(tmp_path / "kept_back.csv", HAND)
    args = parse_serving_args("--arrivals", "trace", "--trace", str(own), "--time-scale", "2")
    arrivals = serving.build_arrivals(args)
    np.testing.assert_allclose(arrivals.times, [0.0, 4e-7, 5.0000002])
    assert arrivals.context_tokens.tolist() == [100, 200, 300]
    monkeypatch.setenv("JSPEC_DATA_DIR", str(tmp_path))
    assert A.trace_path("conv") == tmp_path / A.TRACE_FILES["conv"]
    with pytest.raises(ValueError, match="shipped trace .*code, conv"):
        A.trace_path("azure-2024")
    with pytest.raises(ValueError, match="not found"):
        serving.build_arrivals(parse_serving_args("--arrivals", "trace", "--trace",
                                                  str(tmp_path / "missing.csv")))


def test_a_schedule_option_implies_its_schedule_and_refuses_another(tmp_path):
    """`--trace PATH` alone replays the trace (it used to run the default Poisson schedule and
    ignore the file); an option of one schedule given with another is an error, not dropped."""
    from jspec.bench import serving

    own = write(tmp_path / "kept_back.csv", HAND)
    arrivals = serving.build_arrivals(parse_serving_args("--trace", str(own)))
    assert arrivals.kind == "trace" and len(arrivals) == 3
    assert serving.arrival_schedule(parse_serving_args("--steps", "0:1,5:2")) == "step"
    assert serving.arrival_schedule(parse_serving_args("--arrivals", "trace")) == "trace"
    assert serving.arrival_schedule(parse_serving_args()) == "poisson"
    assert serving.arrival_schedule(parse_serving_args("--rate", "9")) == "poisson"
    assert serving.arrival_schedule(parse_serving_args("--burst-size", "4")) == "burst"
    assert serving.arrival_schedule(parse_serving_args("--time-scale", "2")) == "trace"
    for argv, match in [
        (("--arrivals", "poisson", "--trace", str(own)), "--trace shapes --arrivals trace, "
                                                         "not --arrivals poisson"),
        (("--arrivals", "poisson", "--time-scale", "2", "--rate-scale", "0.5"),
         "--time-scale, --rate-scale shape --arrivals trace, not --arrivals poisson"),
        (("--trace", str(own), "--rate", "3"), "--rate shapes --arrivals poisson"),
        (("--arrivals", "burst", "--steps", "0:1"), "--steps shapes --arrivals step"),
        (("--trace", str(own), "--steps", "0:1"), "the trace and step arrival schedules"),
    ]:
        with pytest.raises(ValueError, match=match):
            serving.build_arrivals(parse_serving_args(*argv))


# ----------------------------------------------------------------------------- metric math
def timeline() -> list[RequestRecord]:
    a = RequestRecord("a", arrival=0.0, prompt_tokens=10, max_tokens=4,
                      chunk_times=[0.5, 0.7, 1.0], chunk_tokens=[1, 2, 1], finish=1.0,
                      num_drafted=6, num_accepted=3, num_spec_steps=2)
    b = RequestRecord("b", arrival=1.0, prompt_tokens=20, max_tokens=1,
                      chunk_times=[1.2], chunk_tokens=[1], finish=1.2)
    c = RequestRecord("c", arrival=0.5, prompt_tokens=30, max_tokens=2,
                      chunk_times=[1.5, 2.5], chunk_tokens=[1, 1], finish=2.5,
                      num_drafted=2, num_accepted=0, num_spec_steps=1)
    return [a, b, c]


def test_per_request_latencies():
    a, b, c = timeline()
    assert (a.ttft(), a.e2e(), a.num_output_tokens) == (0.5, 1.0, 4)
    assert a.tpot() == pytest.approx((1.0 - 0.5) / 3)  # (finish - first token) / (n - 1)
    assert a.itls() == pytest.approx([0.2, 0.3])
    assert b.tpot() is None and b.itls() == []  # one token: no TPOT
    assert c.tpot() == pytest.approx(1.0)
    failed = RequestRecord("d", 0.0, 1, 1, error="boom")
    assert not failed.ok and failed.ttft() is None


def test_summary_statistics():
    s = summarize([0.2, 0.5, 1.0, None])
    assert s["count"] == 3 and s["mean"] == pytest.approx(1.7 / 3)
    assert s["p50"] == pytest.approx(0.5)
    assert s["p90"] == pytest.approx(0.5 + 0.8 * 0.5)  # linear interpolation between ranks
    assert s["p99"] == pytest.approx(0.5 + 0.98 * 0.5)
    assert summarize([]) == {"count": 0, "mean": None, "p50": None, "p90": None, "p99": None}


def test_run_metrics_slo_and_goodput():
    recs = timeline()
    m = compute_metrics(recs, tpot_slo=0.5)
    assert m["duration_s"] == 2.5 and m["total_output_tokens"] == 7
    assert m["output_tokens_per_s"] == pytest.approx(7 / 2.5)
    assert m["requests_per_s"] == pytest.approx(3 / 2.5)
    # a meets (TPOT 1/6 s), b has no TPOT (meets), c misses (TPOT 1 s)
    assert m["slo_attainment"] == pytest.approx(2 / 3)
    assert m["goodput_requests_per_s"] == pytest.approx(2 / 2.5)
    assert m["goodput_tokens_per_s"] == pytest.approx(5 / 2.5)
    assert m["ttft_s"]["p50"] == pytest.approx(0.5) and m["ttft_s"]["p90"] == pytest.approx(0.9)
    assert m["tpot_s"]["count"] == 2 and m["tpot_s"]["mean"] == pytest.approx((1 / 6 + 1) / 2)
    assert m["itl_s"]["count"] == 3 and m["itl_s"]["mean"] == pytest.approx(1.5 / 3)
    assert m["e2e_s"]["mean"] == pytest.approx((1.0 + 0.2 + 2.0) / 3)
    assert m["tokens_per_chunk"] == pytest.approx(7 / 6)
    assert m["acceptance_rate"] == pytest.approx(3 / 8)
    assert m["mean_accepted_length"] == pytest.approx((3 + 3) / 3)
    ttft = compute_metrics(recs, tpot_slo=0.5, ttft_slo=0.3)  # only b answers within 0.3 s
    assert ttft["slo_attainment"] == pytest.approx(1 / 3)
    recs.append(RequestRecord("d", 0.0, 1, 1, error="boom"))
    with_failure = compute_metrics(recs, tpot_slo=0.5)
    assert with_failure["num_failed"] == 1 and with_failure["slo_attainment"] == m["slo_attainment"]
    assert compute_metrics([])["output_tokens_per_s"] == 0.0


def test_time_series_bins():
    steps = StepRecords()
    for t, batch, dec, gsum, ver, acc in [(0.2, 2, 2, 6, 6, 3), (0.8, 2, 1, 0, 0, 0),
                                          (1.1, 3, 3, 3, 3, 1)]:
        steps.append(time=t, step_time=0.1, draft_time=0.01, catch_up_time=0.0,
                     batch_size=batch, num_decode=dec, gamma_sum=gsum, gamma_max=3,
                     num_verified=ver, num_accepted=acc, num_emitted=dec, num_prefill_tokens=0,
                     num_tokens=dec + ver, num_padded_tokens=batch * 4, num_running=batch,
                     num_waiting=0)
    s = time_series(timeline(), steps, bin_seconds=1.0)
    assert s["t"] == [0.0, 1.0, 2.0]
    assert s["output_tokens_per_s"] == [3.0, 3.0, 1.0]
    assert s["arrivals_per_s"] == [2.0, 1.0, 0.0]
    assert s["finished_per_s"] == [0.0, 2.0, 1.0]  # a finishes at 1.0: the second bin
    assert s["steps"] == [2, 1, 0]
    assert s["batch_size_mean"] == [2.0, 3.0, None]
    assert s["gamma_mean"] == [2.0, 1.0, None]  # γ summed over decoding sequences
    assert s["acceptance"] == [0.5, pytest.approx(1 / 3), None]
    half = time_series(timeline(), None, bin_seconds=0.5, end=3.0)
    assert len(half["t"]) == 6 and sum(half["output_tokens_per_s"]) * 0.5 == 7
    with pytest.raises(ValueError, match="bin_seconds"):
        time_series(timeline(), None, bin_seconds=0)


def test_gamma_by_batch():
    g = gamma_by_batch({"4": [1, 0, 3], "1": [2, 0, 0], "2": [0, 0, 0]})
    assert list(g) == ["1", "2", "4"]
    assert g["4"] == {"sequence_steps": 4, "mean_gamma": 1.5, "histogram": [1, 0, 3]}
    assert g["1"]["mean_gamma"] == 0.0 and g["2"]["mean_gamma"] is None


def test_record_round_trip():
    a = timeline()[0]
    d = json.loads(json.dumps(a.as_dict()))
    assert d["tpot"] == pytest.approx(a.tpot()) and d["num_output_tokens"] == 4
    assert RequestRecord.from_dict(d) == a


# ----------------------------------------------------------------------------- workloads
@needs_data
def test_real_workloads():
    sb = W.load_workload("spec-bench")
    assert len(sb) == 480 and sb[0].category == "writing"
    assert sb[0].text.startswith("Compose an engaging travel blog post about a recent trip to "
                                 "Hawaii")
    assert {p.category for p in sb} >= {"coding", "translation", "summarization", "qa",
                                        "math_reasoning", "rag"}
    al = W.load_workload("alpaca")
    assert len(al) == 1000
    assert al[0].text == ("Re-write the following sentence, making it more concise:\n \nThe two "
                          "were walking together, and they were going to a nearby store.")
    assert al[1].text == ("Rewrite the following sentence to use a passive voice instead.\n\n"
                          "The president delivered a speech yesterday.")
    sg = W.load_workload("sharegpt")
    assert len(sg) == 500
    assert sg[0].text == "How to stop automatic updates from the WSUS Server to a target machine"


@needs_data
def test_spec_bench_categories():
    from jspec.bench import workloads as wl

    prompts = wl.load_workload("spec-bench")
    grounded = wl.of_categories(prompts, ["summarization", "rag"])
    assert len(grounded) == 160 and {p.category for p in grounded} == {"summarization", "rag"}
    with pytest.raises(ValueError, match="no prompts of category 'sumarization'; the "
                                         "workload's categories: coding, extraction"):
        wl.of_categories(prompts, ["sumarization"])


def test_code_workload_and_default_dir(monkeypatch):
    code = W.load_code(3)
    assert len(code) == 3 and all(p.text.startswith("def ") for p in code)
    monkeypatch.delenv("JSPEC_DATA_DIR", raising=False)
    repo = Path(W.__file__).resolve().parents[2]
    assert W.data_dir() == repo.parent / "shared" / "data"
    with pytest.raises(ValueError, match="not a file"):
        W.load_workload("code", "x.json")


@pytest.mark.parametrize("name, file, content, match", [
    ("spec-bench", "q.jsonl", '{"turns": ["a"]}\n{not json\n', "line 2: not JSON"),
    ("spec-bench", "q.jsonl", '{"question_id": 1, "turns": []}\n', "line 1"),
    ("alpaca", "a.json", '{"instruction": "x"}', "JSON array"),
    ("alpaca", "a.json", '[{"instruction": ""}]', "record 0: instruction"),
    ("alpaca", "a.json", '[{"instruction": "x", "input": 3}]', "input must be a string"),
    ("sharegpt", "s.json", "[{\"id\": 1}]", "conversations"),
    ("sharegpt", "s.json", '[{"conversations": [{"from": "gpt", "value": "x"}]}]',
     "no human turns"),
    ("sharegpt", "s.json", '[{"conversations": [', "not JSON"),
])
def test_malformed_workload_files(tmp_path, name, file, content, match):
    path = tmp_path / file
    path.write_text(content)
    with pytest.raises(ValueError, match=match) as e:
        W.load_workload(name, path)
    assert file in str(e.value)


def test_missing_workload_file_names_it(tmp_path, monkeypatch):
    monkeypatch.setenv("JSPEC_DATA_DIR", str(tmp_path))
    with pytest.raises(ValueError, match="not found") as e:
        W.load_workload("sharegpt")
    assert str(tmp_path / "ShareGPT_V3_filtered_500.json") in str(e.value)
    with pytest.raises(ValueError, match="unknown workload"):
        W.load_workload("wiki")


def test_sampling_and_length_fitting():
    order = W.sample_order(5, 12, seed=4)
    assert sorted(order[:5].tolist()) == list(range(5))  # every prompt before any repeat
    assert sorted(order[5:10].tolist()) == list(range(5))
    np.testing.assert_array_equal(order, W.sample_order(5, 12, seed=4))
    assert W.fit_lengths(50, 20, max_model_len=128, max_tokens=32) == (50, 20)
    assert W.fit_lengths(500, 20, max_model_len=128, max_tokens=32) == (108, 20)
    assert W.fit_lengths(500, 900, max_model_len=128, max_tokens=1000) == (1, 127)
    assert W.fit_lengths(500, 20, 128, 32, max_prompt_tokens=40) == (40, 20)
    assert W.fit_lengths(0, 0, 128, 32) == (1, 1)
    with pytest.raises(ValueError, match="max_tokens"):
        W.fit_lengths(5, 5, 128, 0)


def test_build_requests():
    prompts = [W.Prompt("abcdef", "x", "t", 0), W.Prompt("ghi", "y", "t", 1)]
    encode = lambda text: [ord(ch) for ch in text]  # noqa: E731
    reqs = W.build_requests(prompts, encode, np.array([0.0, 1.0, 2.0]),
                            W.FitOptions(context_limit=8, max_tokens=3, seed=0))
    assert [r.arrival for r in reqs] == [0.0, 1.0, 2.0]
    assert all(r.max_tokens == 3 and len(r.prompt_token_ids) <= 5 for r in reqs)
    first = prompts[reqs[0].prompt_index]
    assert reqs[0].prompt_token_ids == encode(first.text)[:5]
    # a trace's context longer than the prompt continues with the next sampled prompts
    trace = W.build_requests(prompts, encode, np.array([0.0, 0.5]),
                             W.FitOptions(context_limit=64, max_tokens=10, seed=1),
                             W.TraceLengths(context_tokens=np.array([7, 2]),
                                            generated_tokens=np.array([4, 50]),
                                            context_scale=1.0))
    assert [len(r.prompt_token_ids) for r in trace] == [7, 2]
    assert [r.max_tokens for r in trace] == [4, 10]
    order = [r.prompt_index for r in trace]
    assert trace[0].prompt_token_ids == (encode(prompts[order[0]].text)
                                         + encode(prompts[order[1]].text))[:7]
    halved = W.build_requests(prompts, encode, np.array([0.0]),
                              W.FitOptions(context_limit=64, max_tokens=10),
                              W.TraceLengths(context_tokens=np.array([8]),
                                             generated_tokens=np.array([2]), context_scale=0.5))
    assert len(halved[0].prompt_token_ids) == 4


# ----------------------------------------------------------------------------- end to end
@pytest.fixture(scope="module")
def serving_run(tiny_pair, tmp_path_factory):
    """One tiny `jspec bench serving` run: two policies on the tiny pair (LLM_KW shapes)."""
    from jspec.bench import serving

    out = tmp_path_factory.mktemp("serving") / "run.json"
    args = tiny_serving_args(
        tiny_pair, "--policy", "off", "static", "--workload", "code", "--arrivals", "poisson",
        "--rate", "40", "--num-requests", "5", "--max-tokens", "6", "--seed", "3",
        "--out", str(out), "--no-progress")
    assert serving.run(args) == 0
    return out, json.loads(out.read_text())


def test_serving_end_to_end_json(serving_run, capsys):
    _, res = serving_run
    assert res["format"] == "jspec-serving-bench-v1"
    assert res["arrivals"]["kind"] == "poisson" and res["arrivals"]["num_requests"] == 5
    assert res["workload"]["name"] == "code" and res["config"]["max_model_len"] == 128
    assert [r["label"] for r in res["runs"]] == ["off", "static"]
    for run in res["runs"]:
        m = run["metrics"]
        assert m["num_finished"] == 5 and m["num_failed"] == 0
        assert m["total_output_tokens"] == 5 * 6
        for key in ("output_tokens_per_s", "requests_per_s", "goodput_requests_per_s",
                    "goodput_tokens_per_s", "slo_attainment", "acceptance_rate",
                    "mean_accepted_length", "mean_gamma", "duration_s"):
            assert isinstance(m[key], float) and m[key] >= 0, key
        for key in ("ttft_s", "tpot_s", "itl_s", "e2e_s"):
            assert set(m[key]) == {"count", "mean", "p50", "p90", "p99"}
            assert m[key]["count"] > 0 and m[key]["p50"] <= m[key]["p99"]
        assert len(run["requests"]) == 5
        for rec in run["requests"]:
            assert sum(rec["chunk_tokens"]) == rec["num_output_tokens"] == 6
            assert rec["arrival"] <= rec["first_token"] <= rec["finish"]
            assert rec["finish_reason"] == "length"
        assert len(run["steps"]["time"]) == m["num_engine_steps"]
        ts = run["time_series"]
        assert sum(ts["output_tokens_per_s"]) * ts["bin_seconds"] == pytest.approx(30)
        assert run["gamma_by_batch"]
    off, static = res["runs"]
    assert off["metrics"]["num_drafted"] == 0 and off["metrics"]["mean_gamma"] == 0
    assert static["metrics"]["num_drafted"] > 0 and static["metrics"]["mean_gamma"] > 0
    # both policies saw exactly the same requests at the same times
    assert [(r["arrival"], r["prompt_tokens"]) for r in off["requests"]] == \
        [(r["arrival"], r["prompt_tokens"]) for r in static["requests"]]
    assert res["comparison"][0]["vs_first"] == 1.0
    assert res["comparison"][1]["best_fixed"] in ("off", "static")


def test_serving_bad_input_fails_before_loading(capsys):
    from jspec.cli import main

    assert main(["bench", "serving", "--policy", "nope"]) == 2
    assert "unknown policy" in capsys.readouterr().err
    assert main(["bench", "serving", "--arrivals", "step"]) == 2
    assert "--steps" in capsys.readouterr().err
    assert main(["bench", "serving", "--policy", "static:gamma=9"]) == 2
    assert "gamma" in capsys.readouterr().err


def test_plots(serving_run, tmp_path):
    pytest.importorskip("matplotlib")
    from jspec.bench import plots
    from jspec.cli import main

    path, _ = serving_run
    assert main(["bench", "plot", str(path), "--out", str(tmp_path / "png"),
                 "--bin-seconds", "0.05"]) == 0
    names = sorted(p.name for p in (tmp_path / "png").iterdir())
    assert names == ["run_gamma_batch.png", "run_throughput.png", "summary.png"]
    for name in names:
        assert (tmp_path / "png" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    with pytest.raises(ValueError, match="not a `jspec bench serving` results file"):
        plots.load_results(str(bad))


# ----------------------------------------------------------------------------- headline report
def _fake_results(tps: dict[str, float], tpot90: dict[str, float], kind="poisson"):
    runs = []
    for label, v in tps.items():
        policy = label.split(":")[0].split(" ")[0]
        runs.append({"label": label, "policy": policy, "metrics": {
            "output_tokens_per_s": v, "tpot_s": {"p90": tpot90[label]}, "mean_gamma": 1.0}})
    best = max((r for r in runs if r["policy"] in ("off", "static")),
               key=lambda r: r["metrics"]["output_tokens_per_s"])
    comparison = [{"label": r["label"], "vs_best_fixed": r["metrics"]["output_tokens_per_s"]
                   / best["metrics"]["output_tokens_per_s"]} for r in runs]
    return {"runs": runs, "comparison": comparison,
            "arrivals": {"label": kind, "num_requests": 10},
            "config": {"target": "t", "draft": "d", "device": {"kind": "cpu", "platform": "cpu"},
                       "max_num_seqs": 8, "num_speculative_tokens": 5}}


def test_headline_goal_checks_and_report():
    from jspec.bench.headline import LOADS, PRESETS, goal_checks, headline_report, serving_args

    fixed = _fake_results({"off": 100.0, "static γ=2": 120.0, "nightjar": 117.0},
                          {"off": 0.010, "static γ=2": 0.008, "nightjar": 0.0081})
    checks = goal_checks("low", fixed)
    assert [(g, met) for g, met, _ in checks] == [
        ("nightjar >= 0.97 x best fixed", True), ("nightjar p90 TPOT <= lowest fixed", True)]
    assert "0.975 x static γ=2" in checks[0][2] and "(static γ=2), ratio 1.012" in checks[1][2]
    slow = _fake_results({"off": 100.0, "static γ=2": 120.0, "nightjar": 110.0},
                         {"off": 0.010, "static γ=2": 0.008, "nightjar": 0.009})
    assert [met for _, met, _ in goal_checks("high", slow)] == [False, False]
    trace = _fake_results({"off": 100.0, "static γ=1": 104.0, "static γ=3": 106.0,
                           "nightjar": 112.0},
                          {"off": 0.01, "static γ=1": 0.01, "static γ=3": 0.01, "nightjar": 0.01})
    checks = goal_checks("trace", trace)
    assert [(g, met) for g, met, _ in checks][:2] == [
        ("nightjar >= 1.05 x every static", True), ("nightjar >= 1.10 x off", True)]
    assert "1.057 x the best static (static γ=3)" in checks[0][2]
    report = headline_report({"low": fixed, "trace": trace},
                             {"low": "jspec bench serving A", "trace": "jspec bench serving B"})
    assert "| nightjar | 117.0 (0.975), 8.10, 1.00 | 112.0 (1.057), 10.00, 1.00 |" in report
    assert "| static γ=2 | 120.0 (1.000), 8.00, 1.00 | - |" in report
    assert "`jspec bench serving B`" in report and "MISSED" not in report
    # every preset parses as `jspec bench serving` arguments
    from jspec.bench import serving

    ns = argparse.Namespace(policies=["off", "nightjar"], synthetic=None,
                            synthetic_acceptance=None, extra="--seed 2")
    for mode in PRESETS:
        for load in LOADS:
            parsed = parse_serving_args(*serving_args(mode, load, ns))
            assert parsed.policy == ["off", "nightjar"] and parsed.seed == 2
            if load != "trace":  # (the trace needs ../shared/data; tested where it is found)
                assert len(serving.build_arrivals(parsed)) >= 8
    ns.rounds = 3  # `jspec bench headline --rounds 3` passes it on
    assert parse_serving_args(*serving_args("real", "low", ns)).rounds == 3
    # the loads that change are judged like the trace
    assert [g for g, _, _ in goal_checks("step", trace)] == [g for g, _, _ in checks]


def _with_rounds(results: dict, by_round: dict[str, tuple[list, list]]) -> dict:
    """``results`` as `jspec bench serving --rounds` writes them: a summary row per policy with
    its per-round throughputs and p90 TPOTs (the means are the rows' metrics)."""
    summary = []
    for run in results["runs"]:
        tps, tpot = by_round[run["label"]]
        summary.append({**run, "rounds": len(tps), "output_tokens_per_s_by_round": tps,
                        "tpot_p90_s_by_round": tpot})
    return {**results, "summary": summary}


def test_headline_judges_the_worst_round():
    """With rounds the report judges each adaptive policy's worst round against the best fixed
    choice's mean: throughput at saturation, p90 TPOT below it."""
    from jspec.bench.headline import headline_report, worst_run_checks

    rounds = {"off": ([100.0, 100.0, 100.0], [0.010] * 3),
              "static γ=2": ([120.0, 118.0, 122.0], [0.008] * 3),
              "nightjar": ([121.0, 119.0, 117.0], [0.0080, 0.0083, 0.0086]),
              "auto": ([122.0, 110.0, 121.0], [0.0080, 0.0081, 0.0082])}
    res = _with_rounds(_fake_results({k: sum(v[0]) / 3 for k, v in rounds.items()},
                                     {k: sum(v[1]) / 3 for k, v in rounds.items()}), rounds)
    (goal, met, numbers), same_round = worst_run_checks("high", res, "nightjar")
    assert met and "0.975" in numbers and "nightjar worst of 3 rounds" in goal  # 117 / 120
    # against each round's best fixed (120, 118, 122): 121/120, 119/118, 117/122 = 0.959
    assert same_round[0] == "nightjar worst of 3 rounds >= 0.97 x the same round's best fixed"
    assert not same_round[1] and "1.008, 1.008, 0.959" in same_round[2]
    assert not worst_run_checks("high", res, "auto")[0][1]  # 110 / 120 = 0.917
    # below saturation: the worst p90 TPOT against the lowest fixed mean (8 ms), and per round
    assert worst_run_checks("low", res, "nightjar")[0][1] is False  # 8.6 / 8.0 = 1.075
    assert worst_run_checks("low", res, "auto")[0][1] is True  # 8.2 / 8.0 = 1.025
    assert worst_run_checks("low", res, "auto")[1][1] is True  # 8.2 / 8.0 in the third round
    assert worst_run_checks("step", res, "nightjar") == []  # changing loads: on the means
    assert worst_run_checks("high", {**res, "summary": None}, "nightjar") == []
    report = headline_report({"high": res}, {"high": "jspec bench serving A"})
    assert "Goals (auto, on the means over the rounds)" in report
    assert "high: auto worst of 3 rounds >= 0.97 x best fixed: MISSED (0.917" in report
    assert "; worst of 3: 110.0, 8.20 |" in report


def test_serving_warmup_requests(tiny_pair, tmp_path):
    """--warmup-requests N: adaptive policies serve the first N requests unmeasured first (and
    keep what they learned); off / static are measured as they are."""
    from jspec.bench import serving

    out = tmp_path / "warm.json"
    args = tiny_serving_args(
        # prior=false: no step-time profile to measure first (what is tested is the warm-up)
        tiny_pair, "--policy", "off", "nightjar:prior=false", "--arrivals", "poisson", "--rate",
        "50", "--num-requests", "4", "--max-tokens", "5", "--warmup-requests", "3",
        "--out", str(out), "--no-progress")
    assert serving.run(args) == 0
    off, nightjar = json.loads(out.read_text())["runs"]
    assert off["warmup_requests"] == 0 and nightjar["warmup_requests"] == 3
    for run in (off, nightjar):
        # the measured counters and records are the 4 measured requests' only
        assert run["metrics"]["num_finished"] == 4
        assert run["engine_metrics"]["num_generated_tokens"] == 4 * 5
        assert len(run["steps"]["time"]) == run["metrics"]["num_engine_steps"]
    assert nightjar["warmup_s"] > 0
    # what the policy learned, and from which steps, are in the records
    assert nightjar["policy_state"]["policy"] == "nightjar" and "warmup_steps" not in off
    # (decode emissions: each request's first token comes from its prefill)
    assert sum(nightjar["warmup_steps"]["num_emitted"]) == 3 * (5 - 1)
    from jspec.cli import main

    assert main(["bench", "serving", "--warmup-requests", "-1"]) == 2


def test_serving_async_scheduling_both(tiny_pair, tmp_path):
    """--async-scheduling both: every policy runs with it, then on an engine without it; the
    runs say which, and only the first overlaps steps."""
    from jspec.bench import serving

    out = tmp_path / "async.json"
    args = tiny_serving_args(
        tiny_pair, "--policy", "off", "--arrivals", "batch", "--num-requests", "3",
        "--max-tokens", "12", "--async-scheduling", "both", "--out", str(out), "--no-progress")
    assert serving.run(args) == 0
    res = json.loads(out.read_text())
    on, off = res["runs"]
    assert (on["label"], off["label"]) == ("off", "off" + serving.NO_ASYNC_SUFFIX)
    assert (on["engine_options"], off["engine_options"]) == ({}, {"async_scheduling": False})
    assert on["metrics"]["num_async_steps"] > 0 and off["metrics"]["num_async_steps"] == 0
    assert on["metrics"]["total_output_tokens"] == off["metrics"]["total_output_tokens"] == 36
    assert res["config"]["async_scheduling"] is True


def test_serving_compares_the_draft_model_with_prompt_lookup(tiny_pair, tmp_path):
    """drafter=ngram in a policy spec: that run's engine drafts by lookup, with no draft."""
    from jspec.bench import serving

    out = tmp_path / "ngram.json"
    args = tiny_serving_args(
        tiny_pair, "--policy", "static:gamma=3", "static:gamma=3,drafter=ngram",
        "--arrivals", "batch", "--num-requests", "3", "--max-tokens", "12", "--out", str(out),
        "--no-progress")
    assert serving.run(args) == 0
    model, lookup = json.loads(out.read_text())["runs"]
    assert (model["label"], lookup["label"]) == ("static γ=3", "static γ=3 ngram")
    assert lookup["engine_options"] == {"speculative_method": "ngram"}
    assert model["metrics"]["total_output_tokens"] == lookup["metrics"]["total_output_tokens"]
    with pytest.raises(ValueError, match="drafter: speculative_method names 'x'; each "
                                         "drafter must be one of"):
        serving.parse_policies(["static:drafter=x"], [], 4)


def test_serving_rounds_palindrome_and_means(tiny_pair, tmp_path, capsys):
    """--rounds 2: the policies run A B, then B A; the comparison is on the means."""
    from jspec.bench import headline, serving

    out = tmp_path / "rounds.json"
    args = tiny_serving_args(
        tiny_pair, "--policy", "off", "static", "--arrivals", "poisson", "--rate", "50",
        "--num-requests", "3", "--max-tokens", "4", "--rounds", "2", "--no-requests",
        "--out", str(out), "--no-progress")
    assert serving.run(args) == 0
    res = json.loads(out.read_text())
    assert [(r["label"], r["round"]) for r in res["runs"]] == [
        ("off r1", 1), ("static r1", 1), ("static r2", 2), ("off r2", 2)]
    assert res["rounds"] == 2 and [r["label"] for r in res["summary"]] == ["off", "static"]
    for row in res["summary"]:
        mine = [r for r in res["runs"] if r["policy_label"] == row["label"]]
        tps = [r["metrics"]["output_tokens_per_s"] for r in mine]
        assert row["output_tokens_per_s_by_round"] == tps
        assert row["metrics"]["output_tokens_per_s"] == pytest.approx(sum(tps) / 2)
        assert row["metrics"]["tpot_s"]["p90"] == pytest.approx(
            sum(r["metrics"]["tpot_s"]["p90"] for r in mine) / 2)
        assert row["metrics"]["num_finished"] == 3
    assert [c["label"] for c in res["comparison"]] == ["off", "static"]
    assert max(c["vs_best_fixed"] for c in res["comparison"]) == 1.0
    assert "means over 2 rounds" in capsys.readouterr().out
    # the headline judges a load by its means
    assert set(headline._runs(res)) == {"off", "static"}
    with pytest.raises(ValueError, match="--rounds must be >= 1"):
        serving.run(parse_serving_args("--rounds", "0"))


def test_serving_elastic_memory_runs_each_policy_with_and_without(tiny_pair, tmp_path, capsys):
    """--elastic-memory: every policy runs on a plain engine and on an elastic one, side by
    side; the elastic run's expansions, contractions and preemptions are in its results."""
    from jspec.bench import serving

    out = tmp_path / "elastic.json"
    args = tiny_serving_args(
        tiny_pair, "--policy", "off", "--elastic-memory", "--elastic-persist-steps", "1",
        "--elastic-low-watermark", "0.5", "--num-kv-blocks", "12", "--arrivals", "poisson",
        "--rate", "200", "--num-requests", "8", "--max-tokens", "24", "--no-requests",
        "--out", str(out), "--no-progress")
    assert serving.run(args) == 0
    plain, elastic = json.loads(out.read_text())["runs"]
    assert (plain["label"], elastic["label"]) == ("off", "off +elastic")
    assert plain["engine_options"] == {}
    assert elastic["engine_options"] == {"elastic_memory": True, "elastic_persist_steps": 1,
                                         "elastic_low_watermark": 0.5}
    assert plain["metrics"]["num_pool_expansions"] == 0
    assert elastic["metrics"]["num_pool_expansions"] >= 1
    assert elastic["engine_metrics"]["num_pool_contractions"] >= 1  # the load fell at the end
    assert "expansions" in capsys.readouterr().err
