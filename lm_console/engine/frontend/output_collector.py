"""Per-request and per-subscriber queues of AsyncLLM (after vLLM's RequestOutputCollector).

RequestOutputCollector holds at most one pending RequestOutput: a later DELTA output merges
into it and any other kind replaces it, so a slow consumer never makes a queue grow.
Broadcast fans one stream (SchedulerStats, KV event batches) out to subscribers, each with
its own bounded asyncio.Queue that drops its oldest item when full.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from lm_console.engine.errors import fresh_error
from lm_console.engine.outputs import RequestOutput
from lm_console.engine.sampling_params import RequestOutputKind

_END = object()  # ends a Broadcast subscription without an error


class RequestOutputCollector:
    """One request's pending output, filled by the output handler, drained by generate()."""

    def __init__(self, output_kind: RequestOutputKind) -> None:
        self.aggregate = output_kind == RequestOutputKind.DELTA
        self.output: RequestOutput | BaseException | None = None
        self.ready = asyncio.Event()

    def put(self, output: RequestOutput | BaseException) -> None:
        """Add an output (or the error that ends the request)."""
        pending = self.output
        if pending is None or isinstance(output, BaseException):
            self.output = output
            self.ready.set()
        elif isinstance(pending, RequestOutput):
            if self.aggregate:
                pending.add(output)
            else:
                self.output = output

    async def get(self) -> RequestOutput:
        """Wait for the next output; raises the error put in its place."""
        while self.output is None:
            await self.ready.wait()
        return self._take()

    def get_nowait(self) -> RequestOutput | None:
        return None if self.output is None else self._take()

    def _take(self) -> RequestOutput:
        output, self.output = self.output, None
        self.ready.clear()
        if isinstance(output, BaseException):
            raise output
        assert output is not None
        return output


class Broadcast:
    """One producer, many subscribers, each with a bounded drop-oldest queue."""

    def __init__(self) -> None:
        self.queues: set[asyncio.Queue] = set()
        self.end: Any = None  # _END or an exception once closed

    def publish(self, item: Any) -> None:
        for queue in self.queues:
            _put_dropping_oldest(queue, item)

    def close(self, error: BaseException | None = None) -> None:
        """End every subscription: with `error` raised, or as a plain end of iteration."""
        self.end = error if error is not None else _END
        self.publish(self.end)

    async def subscribe(self, maxsize: int) -> AsyncIterator[Any]:
        if self.end is not None:
            if self.end is not _END:
                raise fresh_error(self.end)
            return
        queue: asyncio.Queue = asyncio.Queue(maxsize=max(maxsize, 1))
        self.queues.add(queue)
        try:
            while True:
                item = await queue.get()
                if item is _END:
                    return
                if isinstance(item, BaseException):
                    raise fresh_error(item)
                yield item
        finally:
            self.queues.discard(queue)


def _put_dropping_oldest(queue: asyncio.Queue, item: Any) -> None:
    if queue.full():
        queue.get_nowait()
    queue.put_nowait(item)
