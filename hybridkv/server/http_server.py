"""`serve_http`: uvicorn serving the app until SIGTERM or SIGINT, then a clean stop.

    code = serve_http(create_app(engine, "my-model"), "127.0.0.1", 8000, drain_timeout=10.0)
    engine.close()   # the caller stops the engine, its replicas and ranks, and exits with `code`

uvicorn runs its event loop on a thread of its own, so it leaves the process's signals alone
(it handles them only on the main thread, and re-raises them after its shutdown, which would
kill the process before the engine stopped). Here the main thread takes them. The first
SIGTERM or SIGINT: the listening socket closes, new requests on open connections get a 503, and
the requests already running have `drain_timeout` seconds to finish; any still running then
end with finish_reason "abort" (their clients get that final chunk, or the JSON answer with it).
A second signal ends the drain at once. `serve_http` returns once every connection has closed.
"""
from __future__ import annotations

import asyncio
import logging
import signal
import threading
from typing import Optional

log = logging.getLogger("hybridkv.server")
_SIGNALS = (signal.SIGTERM, signal.SIGINT)
_CLOSE_GRACE_S = 5.0  # after the drain, what uvicorn waits for connections before cancelling them


class _Stopper:
    """The signals seen, handed to the server's event loop once it runs."""

    def __init__(self):
        self.loop: Optional[asyncio.AbstractEventLoop] = None
        self.stop: Optional[asyncio.Event] = None   # first signal: drain
        self.hurry: Optional[asyncio.Event] = None  # second: abort now
        self.count = 0
        self._lock = threading.Lock()

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        with self._lock:
            self.loop, self.stop, self.hurry = loop, asyncio.Event(), asyncio.Event()
            for _ in range(self.count):
                self._wake()

    def on_signal(self, sig: int, _frame=None) -> None:
        with self._lock:
            self.count += 1
            log.warning("%s received: %s", signal.Signals(sig).name,
                        "stopping (new requests refused, running ones drain)" if self.count == 1
                        else "aborting the requests still running")
            if self.loop is not None:
                self.loop.call_soon_threadsafe(self._wake)

    def _wake(self) -> None:
        (self.stop if not self.stop.is_set() else self.hurry).set()


async def _uvicorn(server) -> Optional[str]:
    """Run uvicorn; why it could not start, or None."""
    try:
        await server.serve()
    except SystemExit as e:  # uvicorn's way to say it cannot bind (it logged why)
        return f"uvicorn exited with code {e.code}"
    return None if server.started else "it did not start"


async def _serve(server, serving, stopper: _Stopper, drain_timeout: float) -> Optional[str]:
    stopper.attach(asyncio.get_running_loop())
    task = asyncio.create_task(_uvicorn(server))
    stop = asyncio.create_task(stopper.stop.wait())
    await asyncio.wait({task, stop}, return_when=asyncio.FIRST_COMPLETED)
    if not task.done():
        server.should_exit = True  # uvicorn closes the socket, then waits for open connections
        await serving.drain(drain_timeout, stopper.hurry)
    stop.cancel()
    return await task


def serve_http(app, host: str, port: int, drain_timeout: float = 10.0) -> int:
    """Serve `app` (create_app's: its `state.serving` drains) on host:port until SIGTERM / SIGINT;
    0 once stopped cleanly, 1 when the server could not start (the port is taken, say)."""
    import uvicorn

    config = uvicorn.Config(app, host=host, port=port, log_level="warning",
                            timeout_graceful_shutdown=drain_timeout + _CLOSE_GRACE_S)
    server = uvicorn.Server(config)
    stopper = _Stopper()
    failed: list[str] = []

    def run() -> None:
        try:
            why = asyncio.run(_serve(server, app.state.serving, stopper, drain_timeout))
        except BaseException as e:  # noqa: BLE001 - reported below, the caller still closes the engine
            why = repr(e)
        if why is not None:
            failed.append(why)

    before = {sig: signal.signal(sig, stopper.on_signal) for sig in _SIGNALS}
    try:
        thread = threading.Thread(target=run, name="hybridkv-http")
        thread.start()
        while thread.is_alive():
            thread.join(0.5)  # wakes for signals
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)
    if failed:
        log.error("the HTTP server on %s:%d could not run: %s", host, port, failed[0])
        return 1
    log.info("HTTP server stopped")
    return 0
