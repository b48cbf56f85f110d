"""ApiServer: one app under uvicorn, with the drain on SIGINT / SIGTERM and the exit on engine death.

- Start-up: on_ready(url) runs once uvicorn listens (the engine was ready before the app).
- Drain (first signal, or drain() from the owner): new requests get 503 (ServerGate), requests
  in flight get shutdown_timeout_s, then whatever still runs is aborted (streams end with
  finish_reason "abort"); then the console streams are closed and uvicorn stops. Exit code 0.
  A second signal aborts at once. Attached consoles watch the drain until the server stops.
- Engine death (the app's watchdog calls on_engine_dead): 503 for dead_exit_delay_s so probes
  see it, then uvicorn stops. Exit code 1, so that a supervisor restarts the server.
The caller owns the engine and shuts it down after run() returns.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import sys
import threading
from collections.abc import Callable
from typing import Any

import uvicorn
from fastapi import FastAPI

from lm_console.engine.entrypoints.openai.gate import ServerState
from lm_console.engine.entrypoints.openai.http_guard import guarded_protocol
from lm_console.engine.entrypoints.openai.settings import ServerSettings

logger = logging.getLogger(__name__)

ABORT_GRACE_S = 2.0  # after aborting, how long the aborted streams get to send their last event


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket (port 0: an ephemeral port)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.setblocking(False)
    return sock


def server_url(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


class ApiServer:
    """A built app, its listening socket and its uvicorn server; run() serves until stopped."""

    def __init__(self, app: FastAPI, settings: ServerSettings, sock: socket.socket | None = None) -> None:
        self.app = app
        self.settings = settings
        self.state: ServerState = app.state.server_state
        self.sock = sock if sock is not None else bind_socket(settings.host, settings.port)
        self.url = server_url(self.sock)
        # The guarded h11 protocol: read deadlines on headers and bodies (http_guard.py).
        config = uvicorn.Config(app, log_level=settings.log_level, access_log=False, lifespan="on",
                                timeout_graceful_shutdown=max(int(settings.shutdown_timeout_s), 1),
                                http=guarded_protocol(settings.header_timeout_s, settings.body_timeout_s))
        self.server = _UvicornServer(config, self)
        self.exit_code = 0
        self.loop: asyncio.AbstractEventLoop | None = None
        self._tasks: set[asyncio.Task] = set()
        app.state.on_engine_dead = self.on_engine_dead

    async def run(self, on_ready: Callable[[str], None] | None = None) -> int:
        """Serve until drained or the engine died; returns the exit code."""
        self.loop = asyncio.get_running_loop()

        async def announce() -> None:
            while not self.server.started:
                await asyncio.sleep(0.02)
            if on_ready is not None:
                on_ready(self.url)

        announcer = asyncio.create_task(announce())
        try:
            await self.server.serve(sockets=[self.sock])
        finally:
            announcer.cancel()
        if self.app.state.engine.errored:
            self.exit_code = 1
        return self.exit_code

    # -- stopping ---------------------------------------------------------------------------
    def on_signal(self, signum: int) -> None:
        name = signal.Signals(signum).name
        if self.state.draining:
            logger.warning("Second %s: aborting every request now.", name)
            self._spawn(self.abort_all_and_stop())
            return
        logger.info("%s: draining (in-flight requests get %.1f s).", name, self.settings.shutdown_timeout_s)
        self._spawn(self.drain())

    async def drain(self) -> None:
        """Refuse new requests, give the ones in flight their grace period, then stop."""
        self.state.draining = True
        if await self.state.wait_idle(self.settings.shutdown_timeout_s):
            self.stop()
            return
        logger.warning("Shutdown timeout: aborting %d request(s).", len(self.state.request_ids))
        await self.abort_all_and_stop()

    async def abort_all_and_stop(self) -> None:
        self.state.draining = True
        engine = self.app.state.engine
        request_ids = list(self.state.request_ids)
        if request_ids and not engine.errored:
            with contextlib.suppress(Exception):
                await engine.abort(request_ids)
        await self.state.wait_idle(ABORT_GRACE_S)
        self.stop()

    def stop(self) -> None:
        """End the console streams (they would hold uvicorn's graceful shutdown open), stop uvicorn."""
        hub = getattr(self.app.state, "console_hub", None)
        if hub is not None:
            hub.close()
        self.server.should_exit = True

    def on_engine_dead(self) -> None:
        self.exit_code = 1
        self._spawn(self._exit_after_death())

    async def _exit_after_death(self) -> None:
        await asyncio.sleep(self.settings.dead_exit_delay_s)
        self.stop()

    def request_drain(self) -> None:
        """Start a drain from any thread (what a signal does)."""
        assert self.loop is not None, "run() first"
        self.loop.call_soon_threadsafe(lambda: self._spawn(self.drain()))

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


class _UvicornServer(uvicorn.Server):
    """uvicorn's server with our signal handling: a drain, not uvicorn's re-raised signal."""

    def __init__(self, config: uvicorn.Config, owner: ApiServer) -> None:
        super().__init__(config)
        self.owner = owner

    @contextlib.contextmanager
    def capture_signals(self) -> Any:
        if threading.current_thread() is not threading.main_thread() or sys.platform == "win32":
            yield  # signals reach only the main thread; a server in a thread is stopped by its owner
            return
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, self.owner.on_signal, signum)
        try:
            yield
        finally:
            for signum in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(signum)
