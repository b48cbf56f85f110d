"""ConsoleClient: the small interface between the console and an engine."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Protocol, runtime_checkable

from lm_console.engine.metrics.stats import SchedulerStats
from lm_console.client.types import EngineInfo, GenParams, KVEventRecord, StreamChunk

ChatMessages = list[dict[str, Any]]


@runtime_checkable
class ConsoleClient(Protocol):
    """What the TUI, `lmc chat` and `lmc events` need from an engine (real or fake).

    Every method raises EngineUnavailable once the engine is dead; streams end or raise it.
    """

    info: EngineInfo

    async def start(self) -> EngineInfo:
        """Start (or attach to) the engine; raise EngineUnavailable if it cannot start."""
        ...

    def stats_stream(self) -> AsyncIterator[SchedulerStats]:
        """The engine's SchedulerStats, one per step (the block map at most a few times a second).

        Their `timestamp` is the time axis of the dashboard's rates: the engine's time.time(),
        or the client's clock where it has one of its own (the fake's hand-moved clock).
        """
        ...

    def kv_events_stream(self) -> AsyncIterator[list[KVEventRecord]]:
        """KV cache events, one list per engine batch."""
        ...

    def generate(self, prompt: str | list[int], params: GenParams,
                 request_id: str) -> AsyncIterator[StreamChunk]:
        """Stream one completion of a text prompt or a list of token ids."""
        ...

    def chat(self, messages: ChatMessages, params: GenParams,
             request_id: str) -> AsyncIterator[StreamChunk]:
        """Stream one reply to a conversation, through the model's chat template."""
        ...

    async def abort(self, request_id: str) -> None:
        """Stop a request; its stream ends with finish_reason 'abort'."""
        ...

    async def reset_prefix_cache(self) -> bool:
        """Drop every cached block; False when blocks are still in use."""
        ...

    async def shutdown(self) -> None:
        """Stop the engine and release its process."""
        ...
