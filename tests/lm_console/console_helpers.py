"""Helpers the console tests share: driving a ConsoleApp under Pilot, and a KV event publisher."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lm_console.engine.metrics.kv_events import KVCacheEvent, KVEventPublisher
    from lm_console.tui.app import ConsoleApp

SIZE = (120, 36)  # the terminal the Pilot tests run in
DEADLINE_S = 120  # a liveness bound for polling loops, not a performance assertion


def text_of(widget: Any) -> str:
    """What a static widget shows, as plain text."""
    return str(widget.render())


async def until(pilot: Any, app: ConsoleApp, condition: Callable[[], bool], what: str = "the expected state", *,
                poke: Callable[[], object] | None = None, tick: bool = True) -> None:
    """Let the app run (and tick it, for apps made with tick_hz=0) until `condition()` holds.

    `poke` runs before each pause (e.g. publish again until a subscriber has joined). Fails,
    naming `what`, after DEADLINE_S.
    """
    end = time.monotonic() + DEADLINE_S
    while not condition():
        assert time.monotonic() < end, f"the console never showed {what} (dead: {app.dead_error!r})"
        if poke is not None:
            poke()
        await pilot.pause(0.05)
        if tick:
            app.tick()


@contextmanager
def kv_event_publisher(endpoint: str = "tcp://127.0.0.1:*") -> Iterator[KVEventPublisher]:
    """A KVEventPublisher bound to `endpoint` on its own zmq context, both closed on exit."""
    import zmq

    from lm_console.engine.metrics.kv_events import KVEventPublisher

    context = zmq.Context()
    publisher = KVEventPublisher(context, endpoint)
    try:
        yield publisher
    finally:
        publisher.close()
        context.term()


@contextmanager
def publishing(publisher: KVEventPublisher, events: list[KVCacheEvent], interval_s: float) -> Iterator[None]:
    """Publish `events` every interval_s from a thread while the block runs: PUB/SUB drops what is
    sent before a subscriber joins, so a reader started inside the block still gets them."""
    stop = threading.Event()

    def publish() -> None:
        while not stop.is_set():
            publisher.publish(events)
            stop.wait(interval_s)

    thread = threading.Thread(target=publish, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
