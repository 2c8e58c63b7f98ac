"""The aiohttp application: OpenAI-compatible routes over an ``AsyncLLMEngine``.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both with ``stream: true`` as
server-sent events ending in ``data: [DONE]``), ``GET /v1/models``, ``GET /health``,
``GET /metrics``. ``OpenAIApp`` holds the serving state: the engine (None while it loads),
the requests in flight, readiness and draining; ``jspec.serve.server`` drives its life cycle.

The event loop only parses, tokenizes (milliseconds) and writes; model steps run on the
engine's own thread. Admission is bounded: at most ``max_num_seqs`` requests run and
``max_queue`` wait, counted here on the event loop (so the bound is exact and needs no lock);
beyond that a request gets 503 with ``Retry-After`` instead of growing an unbounded queue.
A client that goes away (connection closed, which cancels its handler, or a failed write)
aborts its engine requests, which frees their KV blocks on the engine's next iteration.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import logging
import time
import uuid
from contextlib import aclosing
from typing import AsyncIterator

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from jspec.serve.metrics import ServerMetrics
from jspec.serve.protocol import (APIError, GenerationRequest, chat_logprobs, chunk_choice,
                            choice_body, completion_logprobs, created_now, error_body, invalid,
                            parse_chat_request, parse_completion_request, parse_json_body,
                            response_body, sampling_params, usage_body)

logger = logging.getLogger("jspec.serve")

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


@dataclasses.dataclass(frozen=True)
class ServerOptions:
    model_name: str  # the only name /v1/models lists and requests may ask for
    api_key: str | None = None  # when set, /v1/* needs "Authorization: Bearer <key>"
    max_queue: int = 256  # requests that may wait beyond the max_num_seqs running ones
    grace_period: float = 30.0  # seconds in-flight requests get to finish on shutdown
    retry_after: int = 1  # seconds, sent with 503 when the queue is full
    # after an engine failure, answer 503 until stopped instead of exiting (for debugging;
    # vLLM's VLLM_KEEP_ALIVE_ON_ENGINE_DEATH)
    keep_alive_on_engine_failure: bool = False

    def __post_init__(self):
        if not self.model_name:
            raise ValueError("the served model name must not be empty")
        if not isinstance(self.max_queue, int) or self.max_queue < 0:
            raise ValueError(f"--max-queue must be an integer >= 0, got {self.max_queue!r}")
        if not self.grace_period >= 0:
            raise ValueError(f"--grace-period must be >= 0 seconds, got {self.grace_period!r}")
        if self.api_key is not None and not self.api_key:
            raise ValueError("--api-key must not be empty (omit it to serve without a key)")


class _Tracker:
    """One engine request's timings, for the latency histograms and finish counts."""

    __slots__ = ("start", "submitted", "first_token", "tokens", "done")

    def __init__(self, start: float):
        self.start = start
        self.submitted = False  # handed to the engine (validation passed)
        self.first_token: float | None = None
        self.tokens = 0
        self.done = False


class OpenAIApp:
    def __init__(self, options: ServerOptions):
        self.options = options
        self.engine = None  # AsyncLLMEngine once loaded and warmed up
        self._status = "loading"  # loading -> ready -> draining; or error (the load failed)
        self.load_error: str | None = None
        self.created = created_now()
        self._in_flight: dict[str, _Tracker] = {}  # engine request id -> tracker
        self._idle = asyncio.Event()
        self._idle.set()
        self._shutdown_abort = False
        self.metrics = ServerMetrics(engine=lambda: self.engine,
                                     in_flight=lambda: len(self._in_flight),
                                     ready=lambda: self.status == "ready",
                                     model_name=options.model_name)
        self.app = web.Application(middlewares=[self._middleware])
        self.app.add_routes([
            web.post("/v1/completions", self.completions),
            web.post("/v1/chat/completions", self.chat_completions),
            web.get("/v1/models", self.models),
            web.get("/v1/models/{model}", self.model),
            web.get("/health", self.health),
            web.get("/metrics", self.prometheus),
        ])

    # ------------------------------------------------------------------ life cycle
    @property
    def status(self) -> str:
        """loading -> ready -> draining; ``error`` when the load failed, ``failed`` from the
        moment the engine loop failed (read from the engine, so no request slips in between)."""
        if self.engine is not None and self.engine.error is not None:
            return "failed"
        return self._status

    def engine_failure(self) -> str:
        """What the failed engine's clients are told: the error, and what the server does."""
        then = ("the server answers 503 until it is stopped (--keep-alive-on-engine-failure)"
                if self.options.keep_alive_on_engine_failure else
                "the server is exiting so that its supervisor restarts it")
        return (f"the engine failed: {self.engine.error!r}; every request in flight was failed "
                f"and {then}")

    def set_engine(self, engine) -> None:
        self.metrics.attach(engine)  # before ready: no request has run a step yet
        self.engine = engine
        self._status = "ready"

    def release_engine(self) -> None:
        """The engine has stopped: stop recording its steps (it stays readable for /metrics)."""
        self.metrics.detach()

    def set_load_error(self, message: str) -> None:
        self._status, self.load_error = "error", message

    def start_draining(self) -> None:
        """Refuse new requests from now on (their clients get 503 and a closed connection)."""
        if self._status in ("loading", "ready"):
            self._status = "draining"

    @property
    def num_in_flight(self) -> int:
        return len(self._in_flight)

    def abort_all(self) -> int:
        """Abort every request still in flight (the grace period is over); their handlers answer
        with an error saying so. Returns how many were aborted."""
        self._shutdown_abort = True
        ids = list(self._in_flight)
        for rid in ids:
            self.engine.abort(rid)
        return len(ids)

    async def wait_idle(self, timeout: float, interrupt: asyncio.Event | None = None) -> bool:
        """Wait until no request is in flight, at most ``timeout`` seconds (or until
        ``interrupt`` is set). Returns whether it is idle."""
        waiters = [asyncio.ensure_future(self._idle.wait())]
        if interrupt is not None:
            waiters.append(asyncio.ensure_future(interrupt.wait()))
        try:
            await asyncio.wait(waiters, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waiters:
                w.cancel()
        return not self._in_flight

    # ------------------------------------------------------------------ middleware
    @web.middleware
    async def _middleware(self, request: web.Request, handler) -> web.StreamResponse:
        resource = request.match_info.route.resource
        endpoint = resource.canonical if resource is not None else "unmatched"
        try:
            if request.path.startswith("/v1/"):
                self._authorize(request)
            response = await handler(request)
        except APIError as e:
            response = _error_response(e)
        except web.HTTPException as e:  # routing and body-size errors, as JSON bodies
            kind = "invalid_request_error" if e.status < 500 else "server_error"
            code = {404: "not_found", 405: "method_not_allowed",
                    413: "request_too_large"}.get(e.status)
            message = {404: f"no route for {request.method} {request.path}",
                       405: f"{request.method} is not allowed on {request.path}"}.get(
                e.status, e.reason)
            response = _error_response(APIError(e.status, message, type=kind, code=code))
        except asyncio.CancelledError:  # the client went away while we worked
            self.metrics.requests.labels(endpoint, "499").inc()  # nginx's "client closed"
            raise
        except Exception as e:
            logger.exception("error while handling %s %s", request.method, request.path)
            response = _error_response(APIError(500, f"internal server error: {e!r}",
                                                type="server_error", code="internal_error"))
        self.metrics.requests.labels(endpoint, str(response.status)).inc()
        return response

    def _authorize(self, request: web.Request) -> None:
        key = self.options.api_key
        if key is None:
            return
        header = request.headers.get("Authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(),
                                                                 key.encode()):
            raise APIError(401, "missing or invalid API key: send the header "
                                "'Authorization: Bearer <key>' with the key given to --api-key",
                           type="authentication_error", code="invalid_api_key",
                           headers={"WWW-Authenticate": "Bearer"})

    # ------------------------------------------------------------------ simple routes
    async def health(self, request: web.Request) -> web.Response:
        body: dict = {"status": self.status, "model": self.options.model_name}
        if body["status"] == "failed":
            body["message"] = self.engine_failure()
        elif body["status"] == "error":
            body["message"] = self.load_error
        if self.engine is not None:
            stats = self.engine.stats()
            body.update(running=stats.num_running, waiting=stats.num_waiting,
                        in_flight=len(self._in_flight))
        return web.json_response(body, status=200 if body["status"] == "ready" else 503)

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [self._model_card()]})

    async def model(self, request: web.Request) -> web.Response:
        name = request.match_info["model"]
        if name != self.options.model_name:
            raise APIError(404, f"model {name!r} does not exist; this server serves "
                                f"{self.options.model_name!r}", code="model_not_found",
                           param="model")
        return web.json_response(self._model_card())

    def _model_card(self) -> dict:
        card = {"id": self.options.model_name, "object": "model", "created": self.created,
                "owned_by": "jspec"}
        if self.engine is not None:
            card["max_model_len"] = self._context_limit()
        return card

    async def prometheus(self, request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.metrics.registry),
                            headers={"Content-Type": CONTENT_TYPE_LATEST})

    # ------------------------------------------------------------------ generation routes
    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, parse_completion_request, "cmpl")

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, parse_chat_request, "chatcmpl")

    async def _generate(self, request: web.Request, parse, prefix: str) -> web.StreamResponse:
        start = time.perf_counter()
        engine = self._engine_for_requests()
        req = parse(parse_json_body(await request.read()))
        if req.model != self.options.model_name:
            raise invalid("model", f"model {req.model!r} does not exist; this server serves "
                                   f"{self.options.model_name!r} (see GET /v1/models)",
                          "model_not_found")
        self._check_logprobs(req)
        request_id = f"{prefix}-{uuid.uuid4().hex}"
        # admission before tokenizing: under overload a refusal should cost next to nothing
        ids = self._admit(request_id, len(req.prompts), start)
        try:
            inputs = [self._prompt_ids(engine, req, p) for p in req.prompts]
            params = [self._sampling_params(req, len(prompt_ids)) for prompt_ids in inputs]
            if req.stream:
                return await self._stream(request, req, request_id, inputs, params, ids)
            return await self._complete(req, request_id, inputs, params, ids)
        finally:
            self._release(ids)

    def _engine_for_requests(self):
        status = self.status
        if status == "failed":
            raise APIError(503, self.engine_failure(), type="service_unavailable",
                           code="engine_failed")
        if status == "draining":
            raise APIError(503, "the server is shutting down and takes no new requests",
                           type="service_unavailable", code="shutting_down",
                           headers={"Connection": "close"})
        if status == "error":
            raise APIError(503, f"the server failed to start: {self.load_error}",
                           type="service_unavailable", code="not_ready")
        if self.engine is None:
            raise APIError(503, "the server is still loading the models and compiling; retry "
                                "when GET /health reports ready", type="service_unavailable",
                           code="not_ready", headers={"Retry-After": "5"})
        return self.engine

    def _context_limit(self) -> int:
        """Tokens one sequence may hold: the context length, or the whole KV pool if smaller
        (the same limits ``LLMEngine.validate_request`` and ``add_request`` apply)."""
        return self.engine.limits.context_limit

    def _prompt_ids(self, engine, req: GenerationRequest, prompt) -> list[int]:
        tokenizer = engine.tokenizer
        if req.kind == "chat":
            field = "messages"
            from jspec.request_checks import RequestError, render_chat

            try:  # rendered as LLM.chat renders it
                ids = render_chat(tokenizer, prompt)
            except RequestError as e:
                raise invalid(e.param, str(e), e.code) from None
        else:
            field = "prompt"
            if isinstance(prompt, str):
                if tokenizer is None:
                    raise invalid(field, "this server has no tokenizer; send the prompt as "
                                         "token ids")
                ids = list(tokenizer.encode(prompt))
            else:
                ids = list(prompt)
        what = "the conversation rendered with the chat template" if field == "messages" \
            else "prompt"
        try:  # the engine's own check and words
            engine.limits.check_prompt_length(len(ids), what)
        except ValueError as e:
            raise invalid(field, str(e), "context_length_exceeded") from None
        try:  # the remaining checks (empty prompt, token ids outside the vocabulary)
            engine.validate_request(ids, sampling_params(req, 1))
        except ValueError as e:
            raise invalid(field, str(e)) from None
        return ids

    def _check_logprobs(self, req: GenerationRequest) -> None:
        k = req.sampling.get("logprobs")
        if k is None or k < 0:  # a negative k: SamplingParams says why
            return
        param = "logprobs" if req.kind == "completion" else "top_logprobs"
        try:
            self.engine.limits.check_logprobs(k, param)
        except ValueError as e:
            raise invalid(param, str(e)) from None

    def _sampling_params(self, req: GenerationRequest, prompt_len: int):
        available = self._context_limit() - prompt_len
        if req.max_tokens is None:
            # OpenAI's defaults: 16 for completions, the rest of the context for chat
            max_tokens = min(COMPLETION_DEFAULT_MAX_TOKENS, available) \
                if req.kind == "completion" else available
        else:
            name = req.max_tokens_param
            try:  # the engine's own check and words
                self.engine.limits.check_max_tokens(prompt_len, req.max_tokens, name)
            except ValueError as e:
                raise invalid(name, str(e), "context_length_exceeded") from None
            max_tokens = req.max_tokens
        return sampling_params(req, max_tokens)

    def _admit(self, request_id: str, n: int, start: float) -> list[str]:
        max_running = self.engine.limits.max_num_seqs
        capacity = max_running + self.options.max_queue
        if n > capacity:
            raise invalid("prompt", f"a batch of {n} prompts exceeds what this server holds at "
                                    f"once ({capacity} requests: {max_running} running + "
                                    f"{self.options.max_queue} waiting)")
        if len(self._in_flight) + n > capacity:
            self.metrics.rejected.inc()
            raise APIError(503, f"the server is at capacity ({len(self._in_flight)} requests in "
                                f"flight: {max_running} run at once and at most "
                                f"{self.options.max_queue} wait); retry after "
                                f"{self.options.retry_after} s", type="service_unavailable",
                           code="queue_full",
                           headers={"Retry-After": str(self.options.retry_after)})
        ids = [request_id] if n == 1 else [f"{request_id}-{i}" for i in range(n)]
        for rid in ids:
            self._in_flight[rid] = _Tracker(start)
        self._idle.clear()
        return ids

    def _release(self, ids: list[str]) -> None:
        for rid in ids:
            tracker = self._in_flight.pop(rid, None)
            if tracker is not None and tracker.submitted and not tracker.done:
                # the handler ended while the engine was generating: the client went away
                self.metrics.finished("disconnect")
        if not self._in_flight:
            self._idle.set()

    def _observe(self, rid: str, out) -> None:
        """Per-request metrics from one streamed output."""
        tracker = self._in_flight.get(rid)
        if tracker is None:
            return
        now = time.perf_counter()
        new_tokens = out.num_tokens - tracker.tokens
        if new_tokens > 0:
            self.metrics.generated(new_tokens)
            tracker.tokens = out.num_tokens
            if tracker.first_token is None:
                tracker.first_token = now
                self.metrics.first_token(now - tracker.start, len(out.prompt_token_ids))
        if out.finished:
            tracker.done = True
            aborted = out.finish_reason == "abort"
            tpot = None
            if not aborted and tracker.first_token is not None and out.num_tokens > 1:
                tpot = (now - tracker.first_token) / (out.num_tokens - 1)
            self.metrics.finished(out.finish_reason, len(out.prompt_token_ids), out.num_tokens,
                                  e2e=None if aborted else now - tracker.start, tpot=tpot)

    async def _outputs(self, inputs, params, ids, cache_salt: str | None
                       ) -> AsyncIterator[tuple[int, object]]:
        """(prompt index, RequestOutput) from every prompt's stream, as they come. Closing this
        generator (the handler ends or is cancelled) aborts whatever has not finished."""
        engine = self.engine
        for rid in ids:
            self._in_flight[rid].submitted = True
        if len(ids) == 1:
            async with aclosing(engine.generate(inputs[0], params[0], ids[0],
                                                cache_salt=cache_salt)) as stream:
                async for out in stream:
                    self._observe(ids[0], out)
                    yield 0, out
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int) -> None:
            try:
                async with aclosing(engine.generate(inputs[i], params[i], ids[i],
                                                    cache_salt=cache_salt)) as stream:
                    async for out in stream:
                        queue.put_nowait((i, out))
            except Exception as e:  # delivered to the consumer; cancellation is not an error
                queue.put_nowait((i, e))

        tasks = [asyncio.create_task(pump(i)) for i in range(len(ids))]
        try:
            remaining = len(ids)
            while remaining:
                i, item = await queue.get()
                if isinstance(item, Exception):
                    raise item
                self._observe(ids[i], item)
                yield i, item
                if item.finished:
                    remaining -= 1
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def _aborted_error(self) -> APIError:
        if self._shutdown_abort:
            return APIError(503, "the server shut down before this request finished (its "
                                 "grace period ran out)", type="service_unavailable",
                            code="shutting_down")
        return APIError(503, "the request was aborted", type="service_unavailable",
                        code="aborted")

    async def _complete(self, req: GenerationRequest, request_id: str, inputs, params, ids
                        ) -> web.Response:
        finals: list = [None] * len(ids)
        try:
            async with aclosing(self._outputs(inputs, params, ids, req.cache_salt)) as outputs:
                async for i, out in outputs:
                    if out.finished:
                        finals[i] = out
        except RuntimeError as e:  # the engine loop failed or was shut down
            raise APIError(500, self._generation_failed(ids, e), type="server_error",
                           code="engine_failed") from None
        if any(out.finish_reason == "abort" for out in finals):
            raise self._aborted_error()
        choices = [choice_body(req.kind, i, out.text, out.finish_reason,
                               _logprobs(req, out, 0, 0)) for i, out in enumerate(finals)]
        usage = usage_body(sum(map(len, inputs)), sum(out.num_tokens for out in finals),
                           sum(out.num_cached_tokens for out in finals))
        return web.json_response(response_body(req.kind, request_id, created_now(),
                                               self.options.model_name, choices, usage))

    async def _stream(self, request: web.Request, req: GenerationRequest, request_id: str,
                      inputs, params, ids) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                               "Cache-Control": "no-cache"})
        await response.prepare(request)
        created = created_now()
        model = self.options.model_name

        async def send(data: dict | str) -> None:
            payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
            await response.write(f"data: {payload}\n\n".encode())

        def chunk(choices: list[dict], usage: dict | None = None) -> dict:
            return response_body(req.kind, request_id, created, model, choices, usage,
                                 chunk=True)

        started = [False] * len(ids)
        sent = [0] * len(ids)  # tokens whose logprobs each choice has sent
        offsets = [0] * len(ids)  # and the length of their texts (completions' text_offset)
        completion_tokens = cached_tokens = 0
        try:
            try:
                outputs = self._outputs(inputs, params, ids, req.cache_salt)
                async with aclosing(outputs):
                    async for i, out in outputs:
                        if out.finish_reason == "abort":
                            await send(self._aborted_error().body())
                            break
                        # One chunk per engine output, i.e. per step that produced tokens,
                        # even when their text is held back (an incomplete UTF-8 sequence, a
                        # possible stop string) or empty (special tokens): clients time the
                        # first token and the steps by the chunks.
                        first = not started[i]
                        started[i] = True
                        text = out.delta_text if out.delta_text or req.kind == "completion" \
                            or first else None
                        logprobs = _logprobs(req, out, sent[i], offsets[i])
                        if logprobs is not None and req.kind == "completion":
                            offsets[i] += sum(map(len, logprobs["tokens"]))
                        sent[i] = out.num_tokens
                        await send(chunk([chunk_choice(req.kind, i, text, out.finish_reason,
                                                       first=first, logprobs=logprobs)]))
                        if out.finished:
                            completion_tokens += out.num_tokens
                            cached_tokens += out.num_cached_tokens
                    else:
                        if req.include_usage:
                            await send(chunk([], usage_body(sum(map(len, inputs)),
                                                            completion_tokens, cached_tokens)))
            except RuntimeError as e:  # the engine loop failed: tell the client in-stream
                await send(error_body(self._generation_failed(ids, e), "server_error", None,
                                      "engine_failed"))
            await send("[DONE]")
            await response.write_eof()
        except ConnectionResetError:
            # the client closed the connection: closing the outputs above aborted the engine
            # requests; there is nobody left to answer
            pass
        return response

    def _generation_failed(self, ids: list[str], error: RuntimeError) -> str:
        """Count ``ids`` as ended by an error (the engine failed or was shut down); the message
        for their client."""
        for rid in ids:
            tracker = self._in_flight.get(rid)
            if tracker is not None and not tracker.done:
                tracker.done = True
                self.metrics.finished("error")
        if self.status == "failed":
            return f"generation failed: {self.engine_failure()}"
        return f"generation failed: {error}"


def _logprobs(req: GenerationRequest, out, start: int, offset: int) -> dict | None:
    """The OpenAI logprobs object of ``out``'s tokens from ``start`` on (None unless the
    request asked); ``offset``: the text length of the tokens before ``start``."""
    k = req.sampling.get("logprobs")
    if k is None:
        return None
    ids, entries = out.token_ids[start:], out.logprobs[start:]
    if req.kind == "completion":
        return completion_logprobs(ids, entries, k, offset)
    return chat_logprobs(ids, entries, k)


def _error_response(error: APIError) -> web.Response:
    return web.json_response(error.body(), status=error.status, headers=error.headers)
