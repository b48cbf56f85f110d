"""HTTP test helpers: a uvicorn server thread on 127.0.0.1 and the real `lmc serve` app over an engine (lmc_app)."""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Awaitable, Callable
from typing import Any

import uvicorn
from fastapi import FastAPI

API_KEY = "test-key"


class ServerThread:
    """Serves an ASGI app on a free 127.0.0.1 port from a thread with its own event loop."""

    def __init__(self, app: Any, sndbuf: int | None = None, port: int = 0) -> None:
        self.app = app
        self.sndbuf = sndbuf  # accepted sockets inherit it: a small one makes a non-reading client block sends
        self.loop: asyncio.AbstractEventLoop | None = None
        self.server: uvicorn.Server | None = None
        self.thread: threading.Thread | None = None
        self.port = port  # 0: a free one; a given one serves a replacement on a stopped server's URL

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> ServerThread:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if self.sndbuf:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self.sndbuf)
        sock.bind(("127.0.0.1", self.port))
        self.port = sock.getsockname()[1]
        # lifespan on: the real app's watchdog runs, and its shutdown closes the console hub.
        config = uvicorn.Config(self.app, log_level="warning", lifespan="on", timeout_graceful_shutdown=2)
        self.server = uvicorn.Server(config)
        started = threading.Event()

        def serve() -> None:
            async def main() -> None:
                self.loop = asyncio.get_running_loop()
                started.set()
                await self.server.serve(sockets=[sock])  # type: ignore[union-attr]

            asyncio.run(main())

        self.thread = threading.Thread(target=serve, name="test-server", daemon=True)
        self.thread.start()
        started.wait(30)
        for _ in range(600):  # until uvicorn listens
            if self.server.started:
                break
            threading.Event().wait(0.05)
        assert self.server.started, "the test server did not start"
        return self

    def call(self, make: Callable[[], Awaitable[Any]], timeout: float = 120) -> Any:
        """Run a coroutine on the server's loop (where the engine's output handler lives)."""
        assert self.loop is not None
        return asyncio.run_coroutine_threadsafe(make(), self.loop).result(timeout)

    def stop(self) -> None:
        hub = getattr(getattr(self.app, "state", None), "console_hub", None)
        if hub is not None and self.loop is not None and self.loop.is_running():
            self.loop.call_soon_threadsafe(hub.close)  # as ApiServer.stop: open console streams end first
        if self.server is not None:
            self.server.should_exit = True
        if self.thread is not None:
            self.thread.join(15)

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc_info: Any) -> None:
        self.stop()


def lmc_app(engine: Any, api_key: str | None = API_KEY, **hub_options: Any) -> FastAPI:
    """The real `lmc serve` app (build_app) over a started AsyncLLM; hub_options tune its console hub.

    hub_options set ConsoleHub attributes (idle_snapshot_s, requests_interval_s, queue_size, max_lag)
    that lmc serve leaves at their defaults, so tests need not wait a second for an idle snapshot.
    """
    from lm_console.engine.entrypoints.openai.api_server import build_app
    from lm_console.engine.entrypoints.openai.settings import ServerSettings

    app = build_app(engine, ServerSettings(api_key=api_key))
    hub = app.state.console_hub
    for name, value in hub_options.items():
        if not hasattr(hub, name):
            raise AttributeError(f"ConsoleHub has no option {name!r}")
        setattr(hub, name, value)
    return app
