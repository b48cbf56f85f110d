"""ServerState and ServerGate: the body limit, the drain and the dead-engine answer, in one place.

ServerGate is a plain ASGI middleware (not BaseHTTPMiddleware, which would buffer streams):
- while the server drains or after the engine died, a new request gets 503 at once
  (/metrics and /version stay open; /health says 503 too);
- with an API key, every path but /health, /metrics and /version (so /docs, /openapi.json and
  /redoc too) gets 401 before a byte of its body is read: a client without the key holds no memory;
- a body over max_request_body gets 413 before it is read into memory: a Content-Length over
  the limit is refused unread, and a chunked body is refused as soon as it passes the limit;
- a body that does not arrive within body_timeout_s gets 408 and the connection is closed (a slow
  client cannot hold a connection and its partial body; http_guard.py bounds the headers);
- it counts requests in flight, which the drain waits for (not the `uncounted` paths: long-lived
  streams that hold no engine request, such as the console stream).
The body (at most the limit) is handed to the app in one message; later receive() calls reach
the server again, so the app still hears a client's disconnect.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any, Awaitable, Callable

from lm_console.engine.entrypoints.openai import errors
from lm_console.engine.entrypoints.openai.auth import unauthorized
from lm_console.engine.entrypoints.openai.errors import OpenAIError

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

OPEN_WHEN_DOWN = frozenset({"/metrics", "/version"})
OPEN_WITHOUT_KEY = frozenset({"/health", "/metrics", "/version"})  # probes and Prometheus need no secret


@dataclass(slots=True)
class ServerState:
    """What every request of one server shares: drain and death flags, requests in flight.

    request_ids: the engine requests now running (what a drain that runs out of time aborts).
    """

    draining: bool = False
    engine_dead: bool = False
    dead_reason: str = ""
    num_inflight: int = 0
    request_ids: set[str] = field(default_factory=set)
    _idle: asyncio.Event | None = None

    def enter(self) -> None:
        self.num_inflight += 1
        if self._idle is not None:
            self._idle.clear()

    def leave(self) -> None:
        self.num_inflight -= 1
        if self.num_inflight == 0 and self._idle is not None:
            self._idle.set()

    async def wait_idle(self, timeout_s: float) -> bool:
        """Wait until no request is in flight; False when timeout_s passed first."""
        if self._idle is None:
            self._idle = asyncio.Event()
        if self.num_inflight == 0:
            self._idle.set()
            return True
        self._idle.clear()
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except asyncio.TimeoutError:
            return self.num_inflight == 0
        return True

    def refusal(self) -> OpenAIError | None:
        """The 503 a new request gets now, or None while the server serves."""
        if self.engine_dead:
            return errors.engine_dead(self.dead_reason)
        if self.draining:
            return errors.draining()
        return None


class ServerGate:
    """ASGI middleware: refuse when down, check the key, cap and time the body, count requests in flight."""

    def __init__(self, app: Any, state: ServerState, max_body: int, uncounted: frozenset[str] = frozenset(),
                 api_key: str | None = None, body_timeout_s: float = 60.0) -> None:
        self.app = app
        self.state = state
        self.max_body = max_body
        self.uncounted = uncounted
        self.api_key = api_key
        self.body_timeout_s = body_timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        refusal = self.state.refusal()
        if refusal is not None and scope["path"] not in OPEN_WHEN_DOWN:
            await send_error(send, refusal)
            return
        if self.api_key is not None and scope["path"] not in OPEN_WITHOUT_KEY:
            refused = unauthorized(self.api_key, _header(scope, b"authorization"))
            if refused is not None:  # before the body: like the 413 below, the rest is discarded unread
                await send_error(send, refused)
                return
        declared = _content_length(scope)
        if declared == -1:
            await send_error(send, errors.bad_request("Content-Length is not a number.", code="invalid_header"))
            return
        # A refused body is not read into memory, but the connection stays open: the HTTP layer
        # discards the rest as it arrives, so the client can finish sending and read the 413
        # (closing with unread data would reset the connection under the client's feet).
        if declared is not None and declared > self.max_body:
            await send_error(send, self._too_large(declared))
            return
        try:
            body = await asyncio.wait_for(self._read_body(receive), self.body_timeout_s)
        except asyncio.TimeoutError:
            # Closed, not kept alive: the rest of a body that trickles in must not hold the connection.
            await send_error(send, OpenAIError(
                HTTPStatus.REQUEST_TIMEOUT, f"The request body did not arrive within {self.body_timeout_s:g} s "
                "(--body-timeout).", code="request_timeout"), close=True)
            return
        if body is None:
            return  # the client left before sending its body
        if isinstance(body, OpenAIError):
            await send_error(send, body)
            return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        if scope["path"] in self.uncounted:
            await self.app(scope, replay, send)
            return
        self.state.enter()
        try:
            await self.app(scope, replay, send)
        finally:
            self.state.leave()

    async def _read_body(self, receive: Receive) -> bytes | OpenAIError | None:
        chunks: list[bytes] = []
        total = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            total += len(chunk)
            if total > self.max_body:
                return self._too_large(None)
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    def _too_large(self, declared: int | None) -> OpenAIError:
        size = f" ({declared} bytes)" if declared is not None else ""
        return OpenAIError(HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                           f"The request body{size} is larger than the server's limit of {self.max_body} bytes "
                           "(--max-request-body).", code="request_too_large")


def _content_length(scope: Scope) -> int | None:
    """The declared body size; None when not declared, -1 when malformed."""
    value = _header(scope, b"content-length")
    if value is None:
        return None
    # At most 19 digits: a 5,000-digit Content-Length is malformed, not a huge int to convert.
    return int(value) if value.isdigit() and len(value) <= 19 else -1


def _header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope.get("headers", ()):
        if key == name:
            return value
    return None


async def send_error(send: Send, error: OpenAIError, close: bool = False) -> None:
    """Send an OpenAI-shaped error response directly on the ASGI channel (close: end the connection)."""
    body = json.dumps(error.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if close:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})
