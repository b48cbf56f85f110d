"""Read deadlines at the HTTP layer: a client that is slow to send its headers or its body is cut off.

uvicorn waits for a request's headers without limit (its keep-alive timer stops at the first
byte), and once a response went out early (401, 413) it discards the rest of the body for as
long as the client trickles it. So one connection per slow client stays open for ever. Here a
connection waiting for a request's headers is closed after header_timeout_s, and one still
sending a request's body body_timeout_s (plus a little, so that ServerGate's 408 goes out first)
after its headers is closed too. A connection whose request has fully arrived is never cut: the
response may take as long as generation takes.
"""

from __future__ import annotations

import asyncio
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

BODY_GRACE_S = 2.0  # past the gate's own body deadline: room for its 408 to be sent


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a header deadline and a body deadline per request."""

    header_timeout_s: float = 10.0
    body_timeout_s: float = 60.0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._guard: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm(self.header_timeout_s)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        # Bytes of a next request on a kept-alive connection: uvicorn's keep-alive timer stops here,
        # so the header deadline starts (at the first byte of the request, not per byte).
        if self._guard is None and self.conn.their_state is h11.IDLE:
            self._arm(self.header_timeout_s)
        before = self.cycle
        super().data_received(data)
        self._after_events(before)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self._guard is None and self.conn.their_state is h11.SEND_BODY:
            self._arm(self.body_timeout_s + BODY_GRACE_S)  # answered early: the body still trickles

    def _after_events(self, before: Any) -> None:
        their_state = self.conn.their_state
        if self.cycle is not before and their_state is h11.SEND_BODY:
            self._arm(self.body_timeout_s + BODY_GRACE_S)  # headers in: now the body's deadline
        elif their_state in (h11.DONE, h11.MUST_CLOSE, h11.CLOSED):
            self._disarm()  # the request is in: the response may take its time

    def _arm(self, timeout_s: float) -> None:
        self._disarm()
        self._guard = self.loop.call_later(timeout_s, self._on_deadline)

    def _disarm(self) -> None:
        if self._guard is not None:
            self._guard.cancel()
            self._guard = None

    def _on_deadline(self) -> None:
        self._guard = None
        if self.conn.their_state in (h11.DONE, h11.MUST_CLOSE, h11.CLOSED):
            return  # the request arrived meanwhile
        if not self.transport.is_closing():
            self.transport.close()


def guarded_protocol(header_timeout_s: float, body_timeout_s: float) -> type[GuardedH11Protocol]:
    """The protocol class uvicorn instantiates per connection, with these deadlines."""
    return type("GuardedH11Protocol", (GuardedH11Protocol,),
                {"header_timeout_s": header_timeout_s, "body_timeout_s": body_timeout_s})
