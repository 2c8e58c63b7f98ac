"""An HTTP load driver for a live OpenAI-compatible server (jspec's or any other).

``run_requests`` sends each request at its arrival time (seconds after the run's start),
streams the answer and records, per request: when it was scheduled and sent, time to first
token, the gaps between streamed chunks, end-to-end latency, prompt and completion token counts
(from the server's usage), the finish reason, or the HTTP status and error of a refusal (e.g. 503
when the server's queue is full). ``summarize`` turns a run into percentiles and throughput.
It knows nothing about how arrivals were generated, so any benchmark harness can drive it.

    import asyncio
    from jspec.serve.client import RequestSpec, run_requests, summarize

    specs = [RequestSpec(prompt="def fib(n):", max_tokens=32, arrival_time=0.1 * i)
             for i in range(100)]
    results = asyncio.run(run_requests("http://127.0.0.1:8000", specs, max_concurrency=32))
    print(summarize(results))

Timing notes: every request streams (``stream: true`` with ``stream_options.include_usage``), so
TTFT is the arrival of the first chunk with a choice: jspec's server sends one chunk per engine
step that produced tokens for the request, even when their text is still held back or empty.
A chunk may carry several tokens (a speculative step emits up to γ+1 at once), so ``itl`` holds
gaps between chunks, as vLLM's benchmark measures them; ``tpot`` is
(latency - ttft) / (completion_tokens - 1) per request.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import time
from typing import Any, Sequence


@dataclasses.dataclass
class RequestSpec:
    """One request: a completion ``prompt`` (text or token ids) or chat ``messages``."""

    prompt: str | list[int] | None = None
    messages: list[dict] | None = None
    max_tokens: int = 16
    arrival_time: float = 0.0  # seconds after the start of the run
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)  # more body fields
    # (temperature, seed, ignore_eos, stop, ...); the driver sets model, stream and max_tokens

    def __post_init__(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("a RequestSpec needs exactly one of prompt and messages")
        if self.arrival_time < 0:
            raise ValueError(f"arrival_time must be >= 0, got {self.arrival_time}")


@dataclasses.dataclass
class RequestResult:
    index: int  # position in the specs given to run_requests
    ok: bool  # a complete answer (finish reason stop or length)
    status: int  # HTTP status; 0 if no response came (connection refused, timeout)
    scheduled_time: float  # arrival time asked for, seconds after the start
    start_time: float  # when it was sent (later than scheduled under max_concurrency)
    ttft: float | None = None  # seconds from sending to the first chunk
    itl: list[float] = dataclasses.field(default_factory=list)  # gaps between chunks
    latency: float | None = None  # seconds from sending to the end of the answer
    prompt_tokens: int = 0
    completion_tokens: int = 0
    text: str = ""
    finish_reason: str | None = None
    error: str | None = None
    retry_after: str | None = None  # the Retry-After header of a 503

    @property
    def tpot(self) -> float | None:
        if self.latency is None or self.ttft is None or self.completion_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.completion_tokens - 1)


async def fetch_model_name(session, base_url: str, headers: dict[str, str]) -> str:
    """The first model the server lists (GET /v1/models)."""
    async with session.get(f"{base_url}/v1/models", headers=headers) as resp:
        body = await resp.json(content_type=None)
        if resp.status != 200:
            raise RuntimeError(f"GET /v1/models answered {resp.status}: {body}")
        return body["data"][0]["id"]


async def run_requests(base_url: str, specs: Sequence[RequestSpec], *, model: str | None = None,
                       api_key: str | None = None, max_concurrency: int | None = None,
                       timeout: float = 600.0) -> list[RequestResult]:
    """Send every spec at its arrival time; results in spec order.

    ``max_concurrency`` caps the requests open at once (a request past its arrival time waits
    for a slot: ``start_time`` records when it was actually sent). ``model`` defaults to the
    first one the server lists. ``timeout`` bounds each request, so a run always ends.
    """
    import aiohttp

    base_url = base_url.rstrip("/")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    connector = aiohttp.TCPConnector(limit=max_concurrency or 0)  # 0: no connection cap
    async with aiohttp.ClientSession(connector=connector) as session:
        if model is None:
            model = await fetch_model_name(session, base_url, headers)
        slots = asyncio.Semaphore(max_concurrency) if max_concurrency else None
        start = time.perf_counter()

        async def one(index: int, spec: RequestSpec) -> RequestResult:
            delay = spec.arrival_time - (time.perf_counter() - start)
            if delay > 0:
                await asyncio.sleep(delay)
            if slots is None:
                return await _send(session, base_url, headers, model, index, spec, start,
                                   timeout)
            async with slots:
                return await _send(session, base_url, headers, model, index, spec, start,
                                   timeout)

        return list(await asyncio.gather(*(one(i, s) for i, s in enumerate(specs))))


async def _send(session, base_url: str, headers: dict[str, str], model: str, index: int,
                spec: RequestSpec, start: float, timeout: float) -> RequestResult:
    import aiohttp

    chat = spec.messages is not None
    body = dict(spec.extra)
    body.update(model=model, max_tokens=spec.max_tokens, stream=True,
                stream_options={"include_usage": True})
    body["messages" if chat else "prompt"] = spec.messages if chat else spec.prompt
    url = f"{base_url}/v1/chat/completions" if chat else f"{base_url}/v1/completions"
    sent = time.perf_counter()
    result = RequestResult(index=index, ok=False, status=0, scheduled_time=spec.arrival_time,
                           start_time=sent - start)
    texts: list[str] = []
    last_chunk = None
    try:
        async with session.post(url, json=body, headers=headers,
                                timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
            result.status = resp.status
            if resp.status != 200:
                result.retry_after = resp.headers.get("Retry-After")
                result.error = _error_message(await resp.read())
                return result
            async for raw in resp.content:  # one SSE line at a time
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue  # blank separators
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = chunk["error"].get("message", str(chunk["error"]))
                    break
                if chunk.get("usage"):
                    result.prompt_tokens = chunk["usage"]["prompt_tokens"]
                    result.completion_tokens = chunk["usage"]["completion_tokens"]
                choices = chunk.get("choices") or []
                if choices:  # the usage-only last chunk has none
                    now = time.perf_counter()
                    if last_chunk is None:
                        result.ttft = now - sent
                    else:
                        result.itl.append(now - last_chunk)
                    last_chunk = now
                for choice in choices:
                    text = choice["delta"].get("content") if chat else choice.get("text")
                    if text:
                        texts.append(text)
                    if choice.get("finish_reason"):
                        result.finish_reason = choice["finish_reason"]
    except asyncio.TimeoutError:
        result.error = f"no complete answer within {timeout} s"
    except aiohttp.ClientError as e:
        result.error = f"{type(e).__name__}: {e}"
    result.latency = time.perf_counter() - sent
    result.text = "".join(texts)
    result.ok = result.error is None and result.finish_reason in ("stop", "length")
    if result.error is None and not result.ok:
        result.error = "the stream ended without a finish reason"
    return result


def _error_message(raw: bytes) -> str:
    try:
        return json.loads(raw)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return raw.decode("utf-8", "replace")[:500]


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100) with linear interpolation; NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    low = math.floor(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def summarize(results: Sequence[RequestResult], percentiles: Sequence[float] = (50, 90, 99)
              ) -> dict[str, Any]:
    """Counts, throughput over the run (first send to last answer) and percentiles of
    latency, TTFT, TPOT and ITL over the completed requests (seconds)."""
    done = [r for r in results if r.ok]
    out: dict[str, Any] = {
        "requests": len(results), "completed": len(done),
        "rejected_503": sum(r.status == 503 for r in results),
        "failed": sum(not r.ok and r.status != 503 for r in results),
    }
    if results:
        first = min(r.start_time for r in results)
        last = max(r.start_time + (r.latency or 0.0) for r in results)
        duration = max(last - first, 1e-9)
        tokens = sum(r.completion_tokens for r in done)
        out.update(duration=duration, output_tokens=tokens,
                   request_throughput=len(done) / duration, token_throughput=tokens / duration)
    series = {"latency": [r.latency for r in done],
              "ttft": [r.ttft for r in done if r.ttft is not None],
              "tpot": [r.tpot for r in done if r.tpot is not None],
              "itl": [gap for r in done for gap in r.itl]}
    for name, values in series.items():
        out[f"mean_{name}"] = sum(values) / len(values) if values else math.nan
        for q in percentiles:
            out[f"p{q:g}_{name}"] = percentile(values, q)
    return out
