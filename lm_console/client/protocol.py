"""ConsoleClient: the small interface between the console and an engine."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from lm_console.client.types import EngineInfo, GenParams, KVEventRecord, StreamChunk
from lm_console.engine.metrics.stats import SchedulerStats

if TYPE_CHECKING:
    from lm_console.engine.metrics.stats import RequestBlocksState
    from lm_console.server_requests import ServerRequests

ChatMessages = list[dict[str, Any]]


@dataclass(frozen=True, slots=True)
class ClientCapabilities:
    """What a client can do beyond streams, generation and chat; widgets ask this, never probe.

    A member whose ability is False still exists on the client: it raises
    NotImplementedError (request_blocks) or returns its empty answer (decode_prompt: "").
    """

    # request_blocks(): the engine core's requests and their blocks, polled by the request
    # table's states, the inspector and the block details (an engine the console runs itself).
    request_blocks: bool = False
    # decode_prompt(): token ids as text, for the inspector's prompt (the client has the tokenizer).
    decode_prompt: bool = False
    # server_requests: an attached lm-console server's own request table.
    server_requests: bool = False


@runtime_checkable
class ConsoleClient(Protocol):
    """What the TUI, `lmc chat` and `lmc events` need from an engine (real or fake).

    Every method raises EngineUnavailable once the engine is dead; streams end or raise it.
    """

    info: EngineInfo
    # Frames an attached server dropped for this console because it read too slowly (0 elsewhere).
    num_dropped_frames: int
    # KV event messages from another producer that could not be read at all, skipped (0 elsewhere).
    num_kv_undecodable: int
    # An attached lm-console server's request table, once the client knows it has one.
    server_requests: ServerRequests | None

    @property
    def capabilities(self) -> ClientCapabilities:
        """What this client can do (see ClientCapabilities)."""
        ...

    @property
    def kv_events_endpoint(self) -> str | None:
        """Where the KV events come from (a ZMQ endpoint or a stream URL), for the panel's subtitle."""
        ...

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

    async def request_blocks(self, block_ids: list[int] | None = None) -> RequestBlocksState:
        """The engine core's unfinished requests with their states and block ids (and the
        details of `block_ids`); NotImplementedError unless capabilities.request_blocks."""
        ...

    def decode_prompt(self, token_ids: list[int]) -> str:
        """Token ids as text ("" unless capabilities.decode_prompt)."""
        ...
