"""Helpers for the server tests: an in-process server over the tiny pair (the shared LLM_KW
engine shapes, so its executables are the ones the other tests compiled), a `jspec serve`
subprocess, raw HTTP through aiohttp, and reading /metrics."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
import threading
import time

from conftest import LLM_KW

TIMEOUT = 120.0  # seconds; only guards against hangs
MODEL = "tiny-pair"


def start_server(tiny_pair, **options):
    """A ready BackgroundServer on a free port of 127.0.0.1 (stop it with ``.stop()``)."""
    from jspec.async_engine import AsyncLLMEngine
    from jspec.serve.app import ServerOptions
    from jspec.serve.server import BackgroundServer

    target, draft = tiny_pair

    def load_engine(cancelled):  # the tests never stop a server while it loads
        return AsyncLLMEngine.from_pretrained(target, draft, **LLM_KW)

    server = BackgroundServer(ServerOptions(model_name=MODEL, **options), load_engine)
    server.start()
    try:
        server.wait_ready(timeout=600)
    except BaseException:
        server.stop()
        raise
    return server


# `jspec serve` flags for the smallest engine shapes (a handful of buckets): a subprocess cannot
# share this process's compiled executables
SMALL_SERVE_ARGS = ["--dtype", "float32", "--max-num-seqs", "2", "--max-model-len", "64",
                    "--max-num-batched-tokens", "16", "--min-token-bucket", "16",
                    "--num-speculative-tokens", "2", "--served-model-name", MODEL, "--port", "0",
                    "--no-progress"]


class ServeProcess:
    """``python *python_args serve *argv`` (``["-m", "jspec.cli"]`` for `jspec serve`), its
    stderr lines gathered as they come; a context manager that kills it if it still runs."""

    def __init__(self, python_args: list[str], argv: list[str]):
        self.proc = subprocess.Popen([sys.executable, *python_args, "serve", *argv],
                                     stderr=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                     text=True, env=dict(os.environ))
        self.lines: list[str] = []
        self._reader = threading.Thread(target=lambda: self.lines.extend(self.proc.stderr),
                                        daemon=True)
        self._reader.start()

    def url(self, pattern: str, what: str) -> str:
        """The server's URL, once a log line matches ``pattern`` (its group 1 is the URL)."""
        regex = re.compile(pattern)
        return wait_until(lambda: next((m.group(1) for m in map(regex.search, list(self.lines))
                                        if m), None), TIMEOUT, what)

    def log(self) -> str:
        """What it wrote to stderr so far (all of it once it has exited)."""
        if self.proc.poll() is not None:
            self._reader.join(10)
        return "".join(self.lines)

    def wait(self) -> int:
        return self.proc.wait(timeout=TIMEOUT)

    def __enter__(self) -> "ServeProcess":
        return self

    def __exit__(self, *exc) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


async def _request(method: str, url: str, body=None, headers=None, timeout: float = TIMEOUT):
    import aiohttp

    data = body if isinstance(body, (bytes, str)) or body is None else None
    json_body = None if data is not None or body is None else body
    async with aiohttp.ClientSession() as session:
        async with session.request(method, url, data=data, json=json_body, headers=headers,
                                   timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
            raw = await resp.read()
            return resp.status, dict(resp.headers), raw


def http(method: str, url: str, body=None, headers=None, timeout: float = TIMEOUT):
    """(status, headers, body bytes) of one raw HTTP request (``body``: bytes sent as they are,
    or a JSON-serialisable object)."""
    return asyncio.run(_request(method, url, body, headers, timeout))


def metrics(url: str) -> dict[str, float]:
    """GET /metrics as {'name{label="v",...}': value} (labels sorted, as written)."""
    from prometheus_client.parser import text_string_to_metric_families

    status, _, raw = http("GET", url + "/metrics")
    assert status == 200
    values = {}
    for family in text_string_to_metric_families(raw.decode()):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            values[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return values


def wait_until(predicate, timeout: float = TIMEOUT, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def wait_idle(url: str) -> dict[str, float]:
    """Until the server holds no request and the engine no KV block; returns /metrics."""
    def idle():
        m = metrics(url)
        done = (m["jspec_server_requests_in_flight"] == 0 and m["jspec_kv_blocks_used"] == 0
                and m["jspec_num_requests_running"] == 0
                and m["jspec_num_requests_waiting"] == 0)
        return m if done else None

    return wait_until(idle, what="the server to become idle with every KV block free")
