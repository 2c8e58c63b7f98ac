"""AsyncLLMEngine: the engine loop on a background thread, streamed to asyncio callers.

Model steps block for milliseconds to seconds, so they run on their own thread and never on the
event loop; requests and aborts cross over through a lock-protected inbox, and outputs come back
through ``loop.call_soon_threadsafe`` into one asyncio queue per request.

An exception on the engine thread (a step, adding or aborting a request) ends the loop for
good: the engine's state is not known to be consistent after it (a step may have died with a
donated KV pool already consumed), so nothing is retried. It is logged with its traceback on
``jspec.engine``, every request in flight gets an ``EngineFailedError``, the engine's queues
and KV blocks are released so that ``stats()`` tells the truth, later requests are refused
with the same error, and the failure listeners run (the server exits non-zero on it, as vLLM's
API server does on an engine-core failure, so that a supervisor restarts it).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
from typing import AsyncIterator, Callable

from jspec.engine import LLMEngine
from jspec.engine_info import EngineLimits, EngineStats
from jspec.outputs import RequestOutput
from jspec.sampling_params import SamplingParams
from jspec.step_record import StepRecord

logger = logging.getLogger("jspec.engine")


class EngineFailedError(RuntimeError):
    """The engine loop failed (its cause is ``__cause__``): the request cannot complete, and
    the engine takes no new ones."""

    def __init__(self, error: BaseException):
        super().__init__(f"the engine failed: {error!r}")
        self.__cause__ = error


class AsyncLLMEngine:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._new: list[tuple[str, object, SamplingParams, str | None]] = []
        self._aborts: list[str] = []
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stopped = False
        self.error: BaseException | None = None  # what ended the engine loop, once it failed
        self._failure_listeners: list[Callable[[BaseException], None]] = []
        self._failure_handled = False  # the failure listeners ran (or were never needed)
        self._thread = threading.Thread(target=self._loop, name="jspec-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_pretrained(cls, target=None, draft=None, **kwargs) -> "AsyncLLMEngine":
        from jspec.llm import build_engine

        return cls(build_engine(target, draft, **kwargs))

    # ------------------------------------------------------------------ public API
    async def generate(self, prompt: str | list[int], sampling_params: SamplingParams | None,
                       request_id: str, *, cache_salt: str | None = None
                       ) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs (each with the cumulative text and this step's delta).

        Invalid input raises ValueError here, before anything is queued. Cancelling the
        consumer (e.g. a client disconnect) aborts the request and frees its KV blocks.
        ``cache_salt``: see ``LLMEngine.add_request``.
        """
        sampling_params = sampling_params or SamplingParams()
        self.engine.validate_request(prompt, sampling_params, cache_salt)
        if self.error is not None:
            raise EngineFailedError(self.error)
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        with self._lock:
            if request_id in self._streams:
                raise ValueError(f"request id {request_id!r} is already in use")
            if self._stopped:
                if self.error is not None:
                    raise EngineFailedError(self.error)
                raise RuntimeError("the engine is stopped")
            self._streams[request_id] = (loop, queue)
            self._new.append((request_id, prompt, sampling_params, cache_salt))
            self._wake.notify()
        finished = False
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._aborts.append(request_id)
            self._wake.notify()

    @property
    def num_unfinished(self) -> int:
        return self.engine.num_unfinished_requests + len(self._new)

    # ------------------------------------------------------------------ what the server reads
    # The engine's read-only surface (LLMEngine's accessors), so callers never touch
    # ``self.engine``'s internals. Safe from any thread: each is a read of fixed or whole values.
    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def limits(self) -> EngineLimits:
        return self.engine.limits

    def stats(self) -> EngineStats:
        """``LLMEngine.stats()``, with the requests handed to the engine thread but not yet
        added to its queue counted as waiting. Once the engine failed nothing runs or waits
        (every request was failed), whatever its queues held when it died."""
        stats = self.engine.stats()
        if self.error is not None:
            return dataclasses.replace(stats, num_running=0, num_waiting=0)
        pending = len(self._new)
        return dataclasses.replace(stats, num_waiting=stats.num_waiting + pending) \
            if pending else stats

    def validate_request(self, prompt: str | list[int], sampling_params: SamplingParams
                         ) -> list[int]:
        """Tokenize and check a request as ``generate`` would (ValueError names the problem)."""
        return self.engine.validate_request(prompt, sampling_params)

    def save_policy_state(self, path: str) -> None:
        """Write the policy's learned state; call it once the engine is shut down (or idle)."""
        self.engine.save_policy_state(path)

    def add_step_listener(self, fn: Callable[[StepRecord], None]) -> None:
        """Call ``fn(outcome)`` after every engine step, on the engine thread: it must be quick
        and thread-safe, and an exception from it fails the engine loop."""
        self.engine.add_step_listener(fn)

    def remove_step_listener(self, fn: Callable[[StepRecord], None]) -> None:
        self.engine.remove_step_listener(fn)

    def add_failure_listener(self, fn: Callable[[BaseException], None]) -> None:
        """Call ``fn(error)`` once the engine loop has failed and released the requests in
        flight (their errors are sent first): on the engine thread, or at once if that has
        already happened."""
        with self._lock:
            if not self._failure_handled:
                self._failure_listeners.append(fn)
                return
            error = self.error
        if error is not None:
            fn(error)

    def shutdown(self, timeout: float | None = 10.0) -> None:
        with self._lock:
            self._stopped = True
            self._wake.notify()
        self._thread.join(timeout)

    # ------------------------------------------------------------------ engine thread
    def _deliver(self, out: RequestOutput | BaseException, request_id: str) -> None:
        entry = self._streams.get(request_id)
        if entry is None:
            return
        loop, queue = entry
        try:
            loop.call_soon_threadsafe(queue.put_nowait, out)
        except RuntimeError:  # the caller's loop is closed
            pass
        if isinstance(out, BaseException) or out.finished:
            with self._lock:
                self._streams.pop(request_id, None)

    def _loop(self) -> None:
        try:
            self._run()
        except BaseException as e:  # noqa: BLE001 - whatever ended the loop fails the engine
            self._fail(e)
        else:
            with self._lock:
                self._failure_handled = True
                self._failure_listeners = []

    def _run(self) -> None:
        engine = self.engine
        while True:
            with self._lock:
                while not (self._new or self._aborts or self._stopped
                           or engine.has_unfinished_requests()):
                    self._wake.wait()
                if self._stopped:
                    pending = list(self._streams)
                    new, aborts = self._new, self._aborts
                    self._new, self._aborts = [], []
                else:
                    pending = None
                    new, aborts = self._new, self._aborts
                    self._new, self._aborts = [], []
            for request_id, prompt, sp, salt in new:
                try:
                    engine.add_request(request_id, prompt, sp, cache_salt=salt)
                except ValueError as e:
                    self._deliver(e, request_id)
            if aborts:
                engine.abort_request(aborts)
            if pending is not None:
                engine.abort_request(pending)
                for out in engine.step() if engine.has_unfinished_requests() else []:
                    self._deliver(out, out.request_id)
                for request_id in pending:
                    self._deliver(RuntimeError("the engine was shut down"), request_id)
                return
            for out in engine.step():
                self._deliver(out, out.request_id)

    def _fail(self, error: BaseException) -> None:
        """The loop raised ``error``: log it, release what the engine holds for the requests in
        flight, fail them, then tell the failure listeners. Released and marked failed first,
        so a caller that sees its error sees the engine empty and failed."""
        with self._lock:
            self.error = error  # from now on generate() refuses new requests
            self._stopped = True
            self._new, self._aborts = [], []
            failed = list(self._streams)
        logger.error("the engine failed; failing the requests in flight (%d)", len(failed),
                     exc_info=error)
        try:
            self.engine.drop_requests()  # their KV blocks back to the pool, the queues empty
        except Exception:
            logger.exception("releasing the failed requests' KV blocks failed too: the KV "
                             "gauges keep the blocks they held")
        with self._lock:  # a listener added from now on is called at once
            self._failure_handled = True
            listeners, self._failure_listeners = self._failure_listeners, []
        for request_id in failed:
            self._deliver(EngineFailedError(error), request_id)
        for fn in listeners:
            try:
                fn(error)
            except Exception:
                logger.exception("a failure listener raised")
