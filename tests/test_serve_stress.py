"""The server under stress, on 127.0.0.1: a bounded loopback load test through the HTTP driver
(serve/client.py), client disconnects, the queue limit (503 + Retry-After), /health while the
engine is saturated, the grace period running out, and SIGTERM on a `jspec serve` subprocess.

No timing assertions: the timeouts only keep a broken server from hanging the suite."""

from __future__ import annotations

import asyncio
import json
import signal
import time

import pytest

from jspec.serve.client import RequestResult, RequestSpec, percentile, run_requests, summarize
from serve_helpers import (MODEL, SMALL_SERVE_ARGS, TIMEOUT, ServeProcess, http, start_server,
                           wait_idle, wait_until)

# ignore_eos and a long max_tokens keep a request running for many steps (max_model_len is 128)
LONG = {"max_tokens": 110, "ignore_eos": True, "temperature": 0}


@pytest.fixture(scope="module")
def server(tiny_pair):
    server = start_server(tiny_pair, max_queue=64)
    yield server
    server.stop()


def health(url: str) -> dict:
    status, _, raw = http("GET", url + "/health", timeout=30)
    body = json.loads(raw)
    assert status == (200 if body["status"] == "ready" else 503)
    return body


async def _open_stream(session, url: str, body: dict):
    """POST a streaming request and return the response once its first data line arrived."""
    resp = await session.post(url + "/v1/completions", json={"model": MODEL, "stream": True,
                                                             **body})
    assert resp.status == 200, await resp.text()
    while not (await resp.content.readline()).startswith(b"data: "):
        pass
    return resp


# ----------------------------------------------------------------------------- load
def test_loopback_load_200_requests_at_concurrency_32(server):
    prompts = ["def fibonacci(n):", "Hello, world!", "The quick brown fox", "x = 1\n", "class A:"]
    specs = [RequestSpec(prompt=prompts[i % len(prompts)], max_tokens=2 + i % 7,
                         extra={"temperature": 0.8, "seed": i} if i % 2 else {"temperature": 0})
             for i in range(200)]
    specs += [RequestSpec(messages=[{"role": "user", "content": "Hi there"}], max_tokens=4)
              for _ in range(8)]
    start = time.perf_counter()
    results = asyncio.run(run_requests(server.url, specs, max_concurrency=32, timeout=TIMEOUT))
    seconds = time.perf_counter() - start
    for r in results:
        # every request completes, or is refused cleanly with a 503 that says when to retry
        assert r.ok or (r.status == 503 and r.retry_after is not None), r
        if r.ok:
            spec = specs[r.index]
            assert r.completion_tokens >= 1 and r.ttft is not None
            assert r.completion_tokens == spec.max_tokens or r.finish_reason == "stop"
    summary = summarize(results)
    assert summary["completed"] + summary["rejected_503"] == len(specs)
    assert summary["completed"] > 0 and summary["failed"] == 0
    print(f"\nload: {summary['completed']} completed, {summary['rejected_503']} refused (503) "
          f"of {len(specs)} in {seconds:.1f} s; latency p50 {summary['p50_latency'] * 1e3:.0f} ms"
          f", p99 {summary['p99_latency'] * 1e3:.0f} ms; TTFT p50 "
          f"{summary['p50_ttft'] * 1e3:.0f} ms; {summary['token_throughput']:.0f} tokens/s")
    m = wait_idle(server.url)  # no KV block leaked, nothing left waiting or running
    assert m["jspec_kv_blocks_free"] == server.app.engine.engine.block_manager.num_usable_blocks
    server.app.engine.engine.block_manager.check_invariants()


def test_summary_percentiles():
    assert percentile([], 50) != percentile([], 50)  # NaN
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0 and percentile([1.0, 2.0], 99) == 1.99
    results = [RequestResult(index=i, ok=True, status=200, scheduled_time=0.0, start_time=0.0,
                             ttft=0.1, itl=[0.01, 0.03], latency=1.0 + i, completion_tokens=10)
               for i in range(3)]
    results.append(RequestResult(index=3, ok=False, status=503, scheduled_time=0.0,
                                 start_time=0.0, retry_after="1"))
    s = summarize(results)
    assert (s["requests"], s["completed"], s["rejected_503"], s["failed"]) == (4, 3, 1, 0)
    assert s["p50_latency"] == 2.0 and s["mean_itl"] == pytest.approx(0.02)
    assert s["p50_tpot"] == pytest.approx((2.0 - 0.1) / 9)
    assert s["duration"] == 3.0 and s["output_tokens"] == 30


# ----------------------------------------------------------------------------- disconnects
@pytest.mark.parametrize("stream", [True, False])
def test_client_disconnect_aborts_and_frees_blocks(server, stream):
    import aiohttp

    before = wait_idle(server.url)

    async def disconnect():
        async with aiohttp.ClientSession() as session:
            body = {"model": MODEL, "prompt": "The engine serves", "stream": stream, **LONG}
            if stream:
                resp = await _open_stream(session, server.url, body)
                resp.close()  # drop the connection mid-stream
            else:
                task = asyncio.create_task(session.post(server.url + "/v1/completions",
                                                        json=body))
                await asyncio.to_thread(wait_until, lambda: health(server.url)["running"] == 1,
                                        TIMEOUT, "the request to run")
                task.cancel()  # the client gives up before the answer: connection closed
                with pytest.raises(asyncio.CancelledError):
                    await task

    asyncio.run(disconnect())
    after = wait_idle(server.url)
    key = 'jspec_request_finished_total{reason="disconnect"}'
    assert after.get(key, 0) == before.get(key, 0) + 1
    assert (after["jspec_engine_requests_aborted_total"]
            == before["jspec_engine_requests_aborted_total"] + 1)
    server.app.engine.engine.block_manager.check_invariants()


def test_health_answers_while_the_engine_is_saturated(server):
    import aiohttp

    wait_idle(server.url)
    max_num_seqs = server.app.engine.engine.config.max_num_seqs

    async def saturate():
        async with aiohttp.ClientSession() as session:
            streams = await asyncio.gather(*(
                _open_stream(session, server.url, {"prompt": f"request {i}", **LONG})
                for i in range(max_num_seqs)))
            # the batch is full and two more wait for a slot: the engine steps non-stop
            waiting = [asyncio.create_task(session.post(server.url + "/v1/completions", json={
                "model": MODEL, "prompt": "waiting", **LONG})) for _ in range(2)]
            answers = []
            for _ in range(5):
                answers.append(await asyncio.to_thread(health, server.url))
            for resp in streams:
                resp.close()
            for task in waiting:
                task.cancel()
            await asyncio.gather(*waiting, return_exceptions=True)
            return answers

    answers = asyncio.run(saturate())
    assert all(a["status"] == "ready" for a in answers)
    assert any(a["running"] == max_num_seqs for a in answers), answers
    wait_idle(server.url)


# ----------------------------------------------------------------------------- queue limit
def test_queue_limit_answers_503_with_retry_after(tiny_pair):
    import aiohttp

    server = start_server(tiny_pair, max_queue=2)
    try:
        capacity = server.app.engine.engine.config.max_num_seqs + 2

        async def overload():
            async with aiohttp.ClientSession() as session:
                held = [asyncio.create_task(session.post(server.url + "/v1/completions", json={
                    "model": MODEL, "prompt": f"request {i}", **LONG}))
                    for i in range(capacity)]
                await asyncio.to_thread(
                    wait_until, lambda: health(server.url)["in_flight"] == capacity, TIMEOUT,
                    "the server to hold max_num_seqs running + max_queue waiting requests")
                refused = []
                for _ in range(3):
                    async with session.post(server.url + "/v1/completions", json={
                            "model": MODEL, "prompt": "one too many", "max_tokens": 2}) as r:
                        refused.append((r.status, r.headers.get("Retry-After"), await r.json()))
                for task in held:
                    task.cancel()
                await asyncio.gather(*held, return_exceptions=True)
                return refused

        refused = asyncio.run(overload())
        for status, retry_after, body in refused:
            assert status == 503 and retry_after == "1"
            assert body["error"]["code"] == "queue_full"
            assert "at capacity" in body["error"]["message"]
        m = wait_idle(server.url)
        assert m["jspec_requests_rejected_queue_full_total"] == 3
        # the queue drained: requests are admitted again
        status, _, _ = http("POST", server.url + "/v1/completions",
                            {"model": MODEL, "prompt": "again", "max_tokens": 2})
        assert status == 200
    finally:
        server.stop()


# ----------------------------------------------------------------------------- shutdown
def test_grace_period_over_aborts_the_rest(tiny_pair):
    import aiohttp

    server = start_server(tiny_pair, grace_period=0.0)

    async def shut_down_under_load():
        async with aiohttp.ClientSession() as session:
            stream = await _open_stream(session, server.url, {"prompt": "streaming", **LONG})
            plain = asyncio.create_task(session.post(server.url + "/v1/completions", json={
                "model": MODEL, "prompt": "not streaming", **LONG}))
            await asyncio.to_thread(wait_until, lambda: health(server.url)["in_flight"] == 2,
                                    TIMEOUT, "both requests to be in flight")
            stopping = asyncio.create_task(asyncio.to_thread(server.stop))
            rest = (await stream.content.read()).decode()
            resp = await plain
            answer = (resp.status, await resp.json())
            await stopping
            return rest, answer

    rest, (status, body) = asyncio.run(shut_down_under_load())
    events = [e for e in rest.split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    error = json.loads(events[-2][len("data: "):])["error"]
    assert error["code"] == "shutting_down" and "grace period" in error["message"]
    assert status == 503 and body["error"]["code"] == "shutting_down"
    engine = server.engine.engine  # the stopped engine: the aborted requests' blocks are free
    assert engine.block_manager.num_used_blocks == 0 and not engine.has_unfinished_requests()
    with pytest.raises(aiohttp.ClientConnectionError):  # nobody listens any more
        http("GET", server.url + "/health", timeout=5)


def test_sigterm_lets_in_flight_requests_finish_and_exits_0(tiny_pair):
    """`jspec serve` in a subprocess: not ready while it compiles, then SIGTERM mid-request. It
    cannot share this process's compiled executables, so it uses the smallest engine shapes (a
    handful of buckets) to keep its warm-up short."""
    import aiohttp

    target, draft = tiny_pair
    with ServeProcess(["-m", "jspec.cli"], ["--target", target, "--draft", draft,
                                            *SMALL_SERVE_ARGS, "--grace-period", "120"]) as proc:
        url = proc.url(r"listening on (http://\S+)", "the server to listen")
        # bound before loading: not ready (and no generation) until every bucket is compiled
        assert health(url)["status"] == "loading"
        status, headers, raw = http("POST", url + "/v1/completions",
                                    {"model": MODEL, "prompt": "early", "max_tokens": 2})
        assert status == 503 and json.loads(raw)["error"]["code"] == "not_ready"
        assert headers["Retry-After"] == "5"

        def ready():
            try:
                return health(url)["status"] == "ready"
            except Exception:  # noqa: BLE001 - not up yet is fine here
                assert proc.proc.poll() is None, proc.log()
                return False

        wait_until(ready, 600, "the subprocess server to be ready")

        async def request_then_sigterm():
            async with aiohttp.ClientSession() as session:
                body = {"prompt": "def f(x):", "max_tokens": 50, "ignore_eos": True,
                        "temperature": 0, "stream_options": {"include_usage": True}}
                resp = await _open_stream(session, url, body)
                proc.proc.send_signal(signal.SIGTERM)
                return (await resp.content.read()).decode()

        rest = asyncio.run(request_then_sigterm())
        events = [json.loads(e[len("data: "):]) for e in rest.split("\n\n")
                  if e.startswith("data: {")]
        assert rest.rstrip().endswith("data: [DONE]")
        assert events[-1]["usage"]["completion_tokens"] == 50  # it finished, not aborted
        assert events[-2]["choices"][0]["finish_reason"] == "length"
        assert proc.wait() == 0, proc.log()
        log = proc.log()
        assert "SIGTERM: no new requests; 1 in flight" in log and "stopped" in log, log
        assert "aborted" not in log
