"""The server's life cycle: listen, load and warm up, serve, drain.

1. Bind the port first (a port in use fails at once), answering ``/health`` with 503
   ``{"status": "loading"}`` while the models load and every shape bucket compiles on a
   background thread (so ready means no request will ever wait for a compile).
2. Serve until stopped (SIGTERM / SIGINT with ``handle_signals``, or ``stop``).
3. Drain: stop listening, answer requests on kept-alive connections with 503, give the requests
   in flight ``grace_period`` seconds to finish (a second signal cuts it short), abort the rest
   (their clients get an error saying so), close the connections and stop the engine thread.

An engine failure (an exception on the engine thread) is not recovered from: the engine has
logged it with its traceback and failed every request in flight; from then on ``/health``
answers 503 ``{"status": "failed"}`` and generation routes 503 ``engine_failed``, and the server
drains at once, giving the failed requests' handlers a few seconds to send their errors, and
ends with ``exit_code`` 1 (so `jspec serve` exits 1 and a supervisor restarts it: vLLM's
behaviour). With ``keep_alive_on_engine_failure`` it answers 503 until stopped instead; a
stop after a failure ends with ``exit_code`` 1 all the same.

``BackgroundServer`` runs the same thing on its own event-loop thread, for tests, notebooks and
in-process benchmarks.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
from typing import Callable

from aiohttp import web

from jspec.serve.app import OpenAIApp, ServerOptions

logger = logging.getLogger("jspec.serve")

# Seconds the handlers of aborted requests get to send their error before connections are cut.
ABORT_ANSWER_TIMEOUT = 5.0


class Server:
    """``await Server(options, load_engine).run()`` serves until stopped.

    ``load_engine(cancelled)`` is called on a background thread and returns a warmed-up
    AsyncLLMEngine. It may raise ValueError for bad input (the server then stops and ``run``
    re-raises it). ``cancelled`` is a threading.Event set when the server is stopped before the
    engine is ready: a loader should check it between long steps (shape buckets) and raise to
    end early. The server waits for the loader to return before it exits, because the process
    must not end under a running XLA compilation (XLA aborts the interpreter).
    """

    def __init__(self, options: ServerOptions,
                 load_engine: Callable[[threading.Event], object], *,
                 host: str = "127.0.0.1", port: int = 8000):
        self.options = options
        self.load_engine = load_engine
        self.host, self.port = host, port
        self.app = OpenAIApp(options)
        self.stop_event: asyncio.Event | None = None
        self._force: asyncio.Event | None = None
        self._cancel_load = threading.Event()
        self.failure: BaseException | None = None  # what the engine failed with, if it did

    @property
    def exit_code(self) -> int:
        """The process's exit status once ``run`` returned: 1 after an engine failure, else 0."""
        return 0 if self.failure is None else 1

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def request_stop(self) -> None:
        """Begin the graceful shutdown (call on the server's loop); a second call skips what is
        left of the grace period."""
        if self.stop_event.is_set():
            self._force.set()
        self.stop_event.set()

    async def run(self, *, handle_signals: bool = False,
                  on_listening: Callable[["Server"], None] | None = None):
        """Serve until stopped; returns the AsyncLLMEngine (stopped) or None if it never
        loaded, so the caller can save what it learned (policy state)."""
        loop = asyncio.get_running_loop()
        self.stop_event, self._force = asyncio.Event(), asyncio.Event()
        # handler_cancellation: a client that disconnects cancels its handler, which aborts its
        # engine requests even when it is not streaming (nothing would be written to notice)
        runner = web.AppRunner(self.app.app, handler_cancellation=True, access_log=None,
                               shutdown_timeout=ABORT_ANSWER_TIMEOUT)
        await runner.setup()
        site = web.TCPSite(runner, self.host, self.port)
        try:
            await site.start()
        except OSError as e:
            await runner.cleanup()
            raise ValueError(f"cannot listen on {self.host}:{self.port}: "
                             f"{e.strerror or e}") from None
        self.port = runner.addresses[0][1]  # the real one when port 0 was asked for
        if handle_signals:
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, self._on_signal, sig)
        logger.info("listening on %s (not ready yet: loading the models and compiling)",
                    self.url)
        if on_listening is not None:
            on_listening(self)
        loading = _in_thread(lambda: self.load_engine(self._cancel_load))
        stopping = asyncio.ensure_future(self.stop_event.wait())
        forcing = asyncio.ensure_future(self._force.wait())
        engine = None
        try:
            await asyncio.wait([loading, stopping], return_when=asyncio.FIRST_COMPLETED)
            if loading.done():
                try:
                    engine = loading.result()
                except BaseException as e:
                    self.app.set_load_error(str(e))
                    raise
                self.app.set_engine(engine)
                engine.add_failure_listener(lambda error: _call_soon(
                    loop, self._on_engine_failure, error))
                logger.info("ready: serving %r at %s", self.options.model_name, self.url)
                await stopping
            else:
                self._cancel_load.set()
                logger.info("stopping while the models load: waiting for the compilation in "
                            "progress to end")
                await asyncio.wait([loading, forcing], return_when=asyncio.FIRST_COMPLETED)
                if loading.done() and loading.exception() is None:
                    engine = loading.result()  # it finished anyway: stop it properly below
        finally:
            stopping.cancel()
            forcing.cancel()
            await self._drain(runner, site)
            if handle_signals:
                for sig in (signal.SIGTERM, signal.SIGINT):
                    loop.remove_signal_handler(sig)
            if engine is not None:
                await asyncio.to_thread(engine.shutdown)  # joins the engine thread
                self.app.release_engine()
        return engine

    def _on_engine_failure(self, error: BaseException) -> None:
        self.failure = error
        if self.options.keep_alive_on_engine_failure:
            logger.error("the engine failed (%r): answering 503 until stopped, then exiting "
                         "with code 1", error)
            return
        logger.error("the engine failed (%r): the requests in flight got the error; exiting "
                     "with code 1", error)
        self.stop_event.set()

    def _on_signal(self, sig: signal.Signals) -> None:
        if self.stop_event.is_set():
            logger.info("%s again: aborting what is still running", sig.name)
        else:
            logger.info("%s: no new requests; %d in flight get up to %g s to finish",
                        sig.name, self.app.num_in_flight, self.options.grace_period)
        self.request_stop()

    async def _drain(self, runner: web.AppRunner, site: web.TCPSite) -> None:
        self.app.start_draining()
        await site.stop()  # close the listening socket: new connections are refused
        if self.app.engine is not None and self.app.num_in_flight:
            # after a failure the requests in flight have their error: only its answer is left
            grace = self.options.grace_period if self.failure is None \
                else min(self.options.grace_period, ABORT_ANSWER_TIMEOUT)
            if not await self.app.wait_idle(grace, self._force):
                n = self.app.abort_all()
                logger.info("grace period over: aborted %d requests", n)
                await self.app.wait_idle(ABORT_ANSWER_TIMEOUT)
        await runner.cleanup()  # closes kept-alive connections
        logger.info("stopped")


def _call_soon(loop: asyncio.AbstractEventLoop, fn: Callable, *args) -> None:
    """``fn(*args)`` on ``loop`` from another thread; nothing once the loop is closed."""
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # the loop is closed: the server has already stopped
        pass


def _in_thread(fn: Callable[[], object]) -> asyncio.Future:
    """Run ``fn`` on a daemon thread; the future gets its result. A daemon thread, not the
    loop's executor: a server stopped while loading must not wait for the load to finish."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def settle(result=None, error=None):
        if future.cancelled():
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)

    def target():
        try:
            result = fn()
        except BaseException as e:
            outcome = (None, e)
        else:
            outcome = (result, None)
        _call_soon(loop, settle, *outcome)  # nothing if the server stopped while loading

    threading.Thread(target=target, name="jspec-load", daemon=True).start()
    return future


class BackgroundServer:
    """A ``Server`` on its own event-loop thread.

    >>> with BackgroundServer(ServerOptions("tiny"), lambda cancelled: engine) as server:
    ...     server.wait_ready()
    ...     requests.post(server.url + "/v1/completions", json={...})
    """

    def __init__(self, options: ServerOptions,
                 load_engine: Callable[[threading.Event], object], *,
                 host: str = "127.0.0.1", port: int = 0):
        self.server = Server(options, load_engine, host=host, port=port)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._listening = threading.Event()
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self.engine = None  # the stopped engine, after stop()

    @property
    def url(self) -> str:
        return self.server.url

    @property
    def app(self) -> OpenAIApp:
        return self.server.app

    def start(self, timeout: float = 60.0) -> "BackgroundServer":
        """Start and return once the port is bound (not yet ready: see ``wait_ready``)."""
        self._thread = threading.Thread(target=self._main, name="jspec-server", daemon=True)
        self._thread.start()
        if not self._listening.wait(timeout) and self.error is None:
            raise TimeoutError(f"the server did not start listening within {timeout} s")
        if self.error is not None:
            raise self.error
        return self

    def _main(self) -> None:
        async def main():
            self._loop = asyncio.get_running_loop()
            return await self.server.run(on_listening=lambda _: self._listening.set())

        try:
            self.engine = asyncio.run(main())
        except BaseException as e:
            self.error = e
        finally:
            self._listening.set()

    def wait_ready(self, timeout: float = 600.0) -> None:
        """Block until the engine is loaded and warmed up (or raise what stopped it)."""
        import time

        deadline = time.monotonic() + timeout
        while self.app.status == "loading":
            if self.error is not None:
                raise self.error
            if time.monotonic() > deadline:
                raise TimeoutError(f"the server was not ready within {timeout} s")
            time.sleep(0.02)
        if self.app.status != "ready":
            raise RuntimeError(f"the server did not become ready: {self.app.status} "
                               f"({self.app.load_error})")

    def stop(self, timeout: float = 120.0) -> None:
        """Graceful shutdown, as on SIGTERM; returns once the server thread has ended."""
        if self._thread is None:
            return
        if self._loop is not None and self._thread.is_alive():
            try:
                self._loop.call_soon_threadsafe(self.server.request_stop)
            except RuntimeError:  # the loop already ended
                pass
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError(f"the server did not stop within {timeout} s")
        self._thread = None

    def __enter__(self) -> "BackgroundServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
