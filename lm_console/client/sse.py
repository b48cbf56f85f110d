"""A server-sent events reader over an async stream of text lines (the console stream, OpenAI SSE)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass


@dataclass(slots=True)
class SSEEvent:
    """One dispatched event: its name ("message" when unnamed) and its data lines joined by newlines."""

    event: str
    data: str


async def iter_sse(lines: AsyncIterator[str]) -> AsyncIterator[SSEEvent]:
    """Parse lines (without their line endings) into events, per the HTML SSE rules.

    `event:` names the event, `data:` lines accumulate, a blank line dispatches, `:` starts a
    comment; `id:` and `retry:` are ignored (the console reconnects by restarting).
    """
    event = ""
    data: list[str] = []
    async for raw in lines:
        line = raw.rstrip("\r\n")
        if not line:
            if data:
                yield SSEEvent(event or "message", "\n".join(data))
            event, data = "", []
            continue
        if line.startswith(":"):
            continue
        name, _, value = line.partition(":")
        if value.startswith(" "):
            value = value[1:]
        if name == "event":
            event = value
        elif name == "data":
            data.append(value)
    if data:  # a stream that ends without the final blank line still delivers its last event
        yield SSEEvent(event or "message", "\n".join(data))
