"""Engine faults: an exception injected into a real tiny engine at each stage of a step
(schedule, draft, verify, commit) while a streaming and a plain request are in flight, one in
the server's own request handling, and `jspec serve` in a subprocess whose engine fails.

What must hold after an engine fault: the traceback is logged on ``jspec.engine`` at once; both
requests in flight fail (an in-stream error event, a 500); later requests get 503 naming the
failure; ``/health`` answers 503 ``failed``; the load gauges say nothing runs and no KV block is
held; the server exits with code 1 by itself, or when stopped if it was kept alive.

A fault blocks on a gate until both requests are in flight, so every test sees the same order
of events without timing anything. No timing assertions: timeouts only guard against hangs."""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import textwrap
import threading

import pytest

from serve_helpers import (MODEL, SMALL_SERVE_ARGS, TIMEOUT, ServeProcess, http, metrics,
                           start_server, wait_idle, wait_until)

# ignore_eos and a long max_tokens keep both requests running until the fault
LONG = {"max_tokens": 100, "ignore_eos": True, "temperature": 0}


class InjectedFault(RuntimeError):
    pass


def _delete_target_pool(engine) -> None:
    """What a device step that dies after its launch leaves: the KV pool it was donated is
    gone."""
    import jax

    for array in jax.tree_util.tree_leaves(engine.runner.target_kv):
        array.delete()


# stage -> (the real engine's objects and method names that run it, what the fault does first)
STAGES = {
    "schedule": (lambda e: [(e.scheduler, "schedule")], None),
    "draft": (lambda e: [(e.runner, "run_draft")], None),
    "verify": (lambda e: [(e.runner, "run_verify_forward"), (e.runner, "run_verify_accept")],
               _delete_target_pool),
    # inside the commit, after the sequence's counters moved and its first token was appended
    "commit": (lambda e: [(e.outputs, "check_stop")], None),
}


def inject(monkeypatch, engine, stage: str, gate: threading.Event) -> None:
    targets, before = STAGES[stage]

    def fault(*args, **kwargs):
        assert gate.wait(TIMEOUT), "the test never opened the gate"
        if before is not None:
            before(engine)
        raise InjectedFault(f"injected into the {stage} stage")

    for obj, name in targets(engine):
        monkeypatch.setattr(obj, name, fault)


def health(url: str) -> tuple[int, dict]:
    status, _, raw = http("GET", url + "/health", timeout=30)
    return status, json.loads(raw)


async def _two_requests_then_open(url: str, gate: threading.Event):
    """A streaming and a plain completion; once both are in flight, open the gate. Returns the
    stream's events (JSON objects, then the last line) and the plain answer (status, body)."""
    import aiohttp

    async with aiohttp.ClientSession() as session:
        async def stream():
            resp = await session.post(url + "/v1/completions", json={
                "model": MODEL, "prompt": "def f(x):", "stream": True, **LONG})
            assert resp.status == 200, await resp.text()
            lines = [e for e in (await resp.content.read()).decode().split("\n\n") if e]
            return [json.loads(e[len("data: "):]) for e in lines[:-1]], lines[-1]

        async def plain():
            resp = await session.post(url + "/v1/completions", json={
                "model": MODEL, "prompt": ["Hello, world!"], **LONG})
            return resp.status, await resp.json()

        tasks = asyncio.create_task(stream()), asyncio.create_task(plain())
        await asyncio.to_thread(wait_until, lambda: health(url)[1].get("in_flight") == 2,
                                TIMEOUT, "both requests to be in flight")
        gate.set()
        return await tasks[0], await tasks[1]


def check_failure_logged(caplog, stage: str) -> None:
    records = [r for r in caplog.records if r.name == "jspec.engine"
               and r.levelno == logging.ERROR]
    assert len(records) == 1, caplog.text
    (record,) = records
    assert isinstance(record.exc_info[1], InjectedFault)
    assert "failing the requests in flight (2)" in record.getMessage()
    assert "Traceback" in caplog.text and f"InjectedFault: injected into the {stage} stage" \
        in caplog.text and "in step" in caplog.text, caplog.text


@pytest.mark.parametrize("stage", list(STAGES))
def test_a_fault_in_a_step_fails_the_requests_and_the_server(tiny_pair, monkeypatch, caplog,
                                                             stage):
    server = start_server(tiny_pair, keep_alive_on_engine_failure=True)
    try:
        engine = server.app.engine.engine
        before = wait_idle(server.url)
        gate = threading.Event()
        inject(monkeypatch, engine, stage, gate)
        with caplog.at_level(logging.ERROR, logger="jspec.engine"):
            (events, last), (status, body) = asyncio.run(
                _two_requests_then_open(server.url, gate))
        fault = f"InjectedFault('injected into the {stage} stage')"
        # the requests in flight: an error event ending the stream, a 500
        assert last == "data: [DONE]"
        error = events[-1]["error"]
        assert error["code"] == "engine_failed" and fault in error["message"], error
        assert not any(e.get("choices", [{}])[0].get("finish_reason") for e in events[:-1])
        assert status == 500 and body["error"]["code"] == "engine_failed"
        assert fault in body["error"]["message"]
        check_failure_logged(caplog, stage)
        # later requests: 503 naming the failure; /health says it failed and what happens now
        status, _, raw = http("POST", server.url + "/v1/completions",
                              {"model": MODEL, "prompt": "later", "max_tokens": 2})
        error = json.loads(raw)["error"]
        assert status == 503 and error["code"] == "engine_failed" and fault in error["message"]
        status, answer = health(server.url)
        assert status == 503 and answer["status"] == "failed"
        assert answer["message"].startswith(f"the engine failed: {fault}")
        assert "503 until it is stopped" in answer["message"]
        # the gauges: nothing runs or waits, no KV block is held, not ready
        m = metrics(server.url)
        for name in ("jspec_num_requests_running", "jspec_num_requests_waiting",
                     "jspec_kv_blocks_used", "jspec_server_requests_in_flight",
                     "jspec_server_ready", 'vllm:kv_cache_usage_perc{engine="0",'
                     f'model_name="{MODEL}"}}'):
            assert m[name] == 0, name
        assert m["jspec_kv_blocks_free"] == m["jspec_kv_blocks_total"] > 0
        key = 'jspec_request_finished_total{reason="error"}'
        assert m[key] == before.get(key, 0) + 2
        assert (answer["running"], answer["waiting"], answer["in_flight"]) == (0, 0, 0)
        assert engine.block_manager.num_used_blocks == 0 and not engine.has_unfinished_requests()
        engine.block_manager.check_invariants()
    finally:
        server.stop()
    assert server.server.exit_code == 1  # stopped after a failure: not a clean exit


def test_a_failed_async_engine_refuses_requests_and_reports_its_failure(tiny_pair, monkeypatch,
                                                                       caplog):
    """AsyncLLMEngine alone: the request in flight gets EngineFailedError (its cause the
    fault), a new one is refused with it before anything is queued, stats() say nothing runs,
    and a failure listener added after the failure is called at once."""
    from conftest import LLM_KW
    from jspec.async_engine import AsyncLLMEngine, EngineFailedError
    from jspec.sampling_params import SamplingParams

    target, draft = tiny_pair
    engine = AsyncLLMEngine.from_pretrained(target, draft, **LLM_KW)
    try:
        gate = threading.Event()
        gate.set()
        inject(monkeypatch, engine.engine, "schedule", gate)
        params = SamplingParams(max_tokens=8)

        async def generate(request_id):
            return [out async for out in engine.generate("def f(x):", params, request_id)]

        with caplog.at_level(logging.ERROR, logger="jspec.engine"):
            with pytest.raises(EngineFailedError, match="injected into the schedule stage") as e:
                asyncio.run(generate("in-flight"))
        assert isinstance(e.value.__cause__, InjectedFault) and engine.error is e.value.__cause__
        assert "failing the requests in flight (1)" in caplog.text
        with pytest.raises(EngineFailedError, match="injected into the schedule stage"):
            asyncio.run(generate("later"))
        stats = engine.stats()
        assert (stats.num_running, stats.num_waiting, stats.kv_blocks_used) == (0, 0, 0)
        assert engine.num_unfinished == 0
        heard = []
        engine.add_failure_listener(heard.append)
        assert heard == [engine.error]
    finally:
        engine.shutdown()


def test_a_failed_engine_stops_the_server_with_exit_code_1(tiny_pair, monkeypatch, caplog):
    """Without keep-alive the server drains and stops by itself once the failed request has its
    answer (`jspec serve` then exits with the server's exit code)."""
    import aiohttp

    server = start_server(tiny_pair)
    try:
        gate = threading.Event()
        gate.set()
        inject(monkeypatch, server.app.engine.engine, "commit", gate)
        with caplog.at_level(logging.INFO, logger="jspec.serve"):
            status, _, raw = http("POST", server.url + "/v1/completions",
                                  {"model": MODEL, "prompt": "def f(x):", **LONG})
            error = json.loads(raw)["error"]
            assert status == 500 and error["code"] == "engine_failed"
            assert "the server is exiting" in error["message"], error

            def stopped():
                # a connection the kernel queued just before the listening socket closed
                # may get no answer at all: only a refused connection says "stopped"
                try:
                    http("GET", server.url + "/health", timeout=5)
                except aiohttp.ClientConnectionError:
                    return True
                except asyncio.TimeoutError:
                    pass
                return False

            wait_until(stopped, TIMEOUT, "the server to stop by itself")
            server.stop()  # joins the stopped server's thread
    finally:
        server.stop()
    assert server.server.exit_code == 1
    assert isinstance(server.server.failure, InjectedFault)
    assert "exiting with code 1" in caplog.text and "stopped" in caplog.text, caplog.text


def test_a_fault_in_the_server_fails_only_its_request(tiny_pair, monkeypatch, caplog):
    """An exception in the server's own handling of one request (here while it records the
    request's first output) is a 500 for that request alone: its engine request is aborted,
    its blocks freed, and the server keeps serving."""

    class ServerFault(Exception):
        pass

    server = start_server(tiny_pair)
    try:
        def fault(rid, out):
            raise ServerFault("injected into the request handler")

        body = {"model": MODEL, "prompt": "def f(x):", **LONG}
        before = wait_idle(server.url)
        with monkeypatch.context() as patch:
            patch.setattr(server.app, "_observe", fault)
            with caplog.at_level(logging.ERROR, logger="jspec.serve"):
                status, _, raw = http("POST", server.url + "/v1/completions", body)
        error = json.loads(raw)["error"]
        assert status == 500 and error["code"] == "internal_error"
        assert "ServerFault('injected into the request handler')" in error["message"]
        assert "Traceback" in caplog.text and "in fault" in caplog.text, caplog.text
        m = wait_idle(server.url)
        aborted = "jspec_engine_requests_aborted_total"
        assert m[aborted] == before[aborted] + 1
        assert health(server.url) == (200, {"status": "ready", "model": MODEL, "running": 0,
                                             "waiting": 0, "in_flight": 0})
        status, _, raw = http("POST", server.url + "/v1/completions", {**body, "max_tokens": 4})
        assert status == 200 and json.loads(raw)["usage"]["completion_tokens"] == 4
    finally:
        server.stop()
    assert server.server.exit_code == 0


# A `jspec serve` process (the real command line, `jspec.cli.main`) whose engine fails in the
# commit of its first step: the fault is the only change, made in that process before it serves.
FAILING_SERVE = textwrap.dedent("""
    import sys
    from jspec import cli
    from jspec.commit import Committer

    class InjectedFault(RuntimeError):
        pass

    def fault(self, *args, **kwargs):
        raise InjectedFault("injected into the commit stage")

    Committer.commit = fault
    sys.exit(cli.main(sys.argv[1:]))  # argv: "serve" and its flags
""")


@pytest.mark.parametrize("keep_alive", [False, True], ids=["exits", "keep-alive+SIGTERM"])
def test_jspec_serve_exits_1_with_the_traceback_in_its_log(tiny_pair, keep_alive):
    target, draft = tiny_pair
    # no warm-up: the first request compiles the few executables its steps need
    argv = ["--target", target, "--draft", draft, *SMALL_SERVE_ARGS, "--no-warmup"]
    if keep_alive:
        argv.append("--keep-alive-on-engine-failure")
    with ServeProcess(["-c", FAILING_SERVE], argv) as proc:
        url = proc.url(r"ready: serving .* at (http://\S+)", "the server to be ready")
        status, _, raw = http("POST", url + "/v1/completions",
                              {"model": MODEL, "prompt": "def f(x):", "max_tokens": 8})
        error = json.loads(raw)["error"]
        assert status == 500 and "InjectedFault('injected into the commit stage')" \
            in error["message"], error
        if keep_alive:
            status, answer = health(url)
            assert status == 503 and answer["status"] == "failed", answer
            proc.proc.send_signal(signal.SIGTERM)
        assert proc.wait() == 1, proc.log()
        log = proc.log()
        assert "jspec serve: the engine failed; failing the requests in flight (1)" in log, log
        assert "Traceback" in log and "in complete" in log and "in fault" in log, log
        assert "InjectedFault: injected into the commit stage" in log, log
        assert "exiting with code 1" in log, log
