"""The console stream: `/lmc/v1/...` routes that let operator consoles attach to a server.

build_console_router(engine) returns a FastAPI APIRouter; the server includes it behind its
API-key dependency. Its ConsoleHub (console_hub.py) reads the engine's own streams once and fans
them out; each attached console gets a server-sent-events response fed by its bounded queue.
Call `router.console_hub.close()` when the server shuts down, so the consoles' streams end.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from lm_console.engine.entrypoints.console_hub import ConsoleHub, ConsoleSubscriber, TooManySubscribers
from lm_console.engine.entrypoints.console_protocol import (
    INFO_PATH, RESET_PATH, SERVER_KIND, STREAM_PATH, STREAM_VERSION, SUBSCRIBERS_PATH, TOPICS,
)

__all__ = ["ConsoleHub", "build_console_router", "engine_info"]


def engine_info(engine: Any) -> dict[str, Any]:
    """GET /lmc/v1/info: what the console's header shows, and what this stream can carry."""
    summary = dict(getattr(engine, "model_config_summary", None) or {})
    summary.pop("model_dir", None)  # a server-side path says nothing to a remote console
    config = engine.config
    summary["dtype"] = str(summary.get("dtype", "?")).replace("torch.", "")
    return {"server": SERVER_KIND, "stream_version": STREAM_VERSION, **summary,
            "kv_events": bool(config.cache_config.enable_kv_cache_events),
            "log_stats": bool(config.scheduler_config.log_stats), "topics": list(TOPICS)}


def _error(status: int, message: str, error_type: str, param: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": error_type, "param": param, "code": status}},
                        status_code=status)


class _SubscriberResponse(StreamingResponse):
    """The SSE response of one console; closes the connection when the hub drops the console.

    A console that never reads leaves the send blocked on the socket's flow control, so the
    drop cancels the send instead of waiting for it.
    """

    def __init__(self, content: AsyncIterator[bytes], subscriber: ConsoleSubscriber,
                 on_close: Callable[[ConsoleSubscriber], None]) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.subscriber = subscriber
        self.on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        sender = asyncio.ensure_future(super().__call__(scope, receive, send))
        kicked = asyncio.ensure_future(self.subscriber.kicked.wait())
        try:
            await asyncio.wait({sender, kicked}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (sender, kicked):
                task.cancel()
            await asyncio.gather(sender, kicked, return_exceptions=True)
            self.on_close(self.subscriber)


def build_console_router(engine: Any, **hub_options: Any) -> APIRouter:
    """The /lmc/v1 routes over `engine` (an AsyncLLM); `router.console_hub` is its ConsoleHub.

    GET  /lmc/v1/info                 engine facts and stream capabilities (JSON)
    GET  /lmc/v1/stream?topics=stats,kv,requests&queue=N   the console stream (SSE)
    GET  /lmc/v1/subscribers          attached consoles, frames dropped, consoles dropped
    POST /lmc/v1/reset_prefix_cache   {"reset": bool}
    """
    hub = ConsoleHub(engine, **hub_options)
    router = APIRouter()
    router.console_hub = hub  # type: ignore[attr-defined]

    @router.get(INFO_PATH)
    async def info() -> JSONResponse:
        if getattr(engine, "errored", False):
            return _error(503, f"The engine is dead: {getattr(engine, 'dead_error', '')}", "EngineDeadError")
        return JSONResponse(engine_info(engine))

    @router.get(STREAM_PATH)
    async def stream(request: Request, topics: str = ",".join(TOPICS), queue: int | None = None):  # noqa: ANN202
        wanted = frozenset(t.strip() for t in topics.split(",") if t.strip())
        unknown = sorted(wanted - set(TOPICS))
        if unknown or not wanted:
            return _error(400, f"topics must be a comma-separated subset of {','.join(TOPICS)}, got {topics!r}",
                          "BadRequestError", "topics")
        if "kv" in wanted and not hub.kv_events_enabled:
            return _error(400, "KV events are off on this server (start it with KV cache events enabled).",
                          "BadRequestError", "topics")
        if queue is not None and queue < 1:
            return _error(400, f"queue must be >= 1, got {queue}", "BadRequestError", "queue")
        if getattr(engine, "errored", False):
            return _error(503, f"The engine is dead: {getattr(engine, 'dead_error', '')}", "EngineDeadError")
        try:
            subscriber = hub.subscribe(wanted, queue)
        except TooManySubscribers as error:
            return _error(503, str(error), "ServiceUnavailableError")
        return _SubscriberResponse(hub.frames(subscriber), subscriber, hub.unsubscribe)

    @router.get(SUBSCRIBERS_PATH)
    async def subscribers() -> JSONResponse:
        return JSONResponse(hub.status())

    @router.post(RESET_PATH)
    async def reset_prefix_cache() -> JSONResponse:
        try:
            return JSONResponse({"reset": bool(await engine.reset_prefix_cache())})
        except Exception as error:  # noqa: BLE001 - a dead engine
            return _error(503, f"The engine is dead: {error}", type(error).__name__)

    return router
