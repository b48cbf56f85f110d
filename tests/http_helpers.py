"""HTTP test helpers: a uvicorn server thread on 127.0.0.1 and a minimal app with the console stream."""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Awaitable, Callable
from typing import Any

import uvicorn
from fastapi import Depends, FastAPI, HTTPException, Request

API_KEY = "test-key"


class ServerThread:
    """Serves an ASGI app on a free 127.0.0.1 port from a thread with its own event loop."""

    def __init__(self, app: Any, sndbuf: int | None = None) -> None:
        self.app = app
        self.sndbuf = sndbuf  # accepted sockets inherit it: a small one makes a non-reading client block sends
        self.loop: asyncio.AbstractEventLoop | None = None
        self.server: uvicorn.Server | None = None
        self.thread: threading.Thread | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> ServerThread:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if self.sndbuf:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self.sndbuf)
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(self.app, log_level="warning", lifespan="off", timeout_graceful_shutdown=2)
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
        if self.server is not None:
            self.server.should_exit = True
        if self.thread is not None:
            self.thread.join(15)

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc_info: Any) -> None:
        self.stop()


def require_test_key(api_key: str) -> Callable[[Request], None]:
    """A trivial stand-in for the server's require_api_key dependency."""

    def check(request: Request) -> None:
        if request.headers.get("authorization") != f"Bearer {api_key}":
            raise HTTPException(status_code=401, detail="invalid or missing API key")

    return check


def console_app(engine: Any, api_key: str | None = API_KEY, **hub_options: Any) -> FastAPI:
    """A FastAPI app with only the console stream router, behind a key check (as the server mounts it)."""
    from engine.entrypoints.console_stream import build_console_router

    app = FastAPI()
    dependencies = [Depends(require_test_key(api_key))] if api_key else []
    router = build_console_router(engine, **hub_options)
    app.include_router(router, dependencies=dependencies)
    app.state.console_hub = router.console_hub  # type: ignore[attr-defined]
    return app
