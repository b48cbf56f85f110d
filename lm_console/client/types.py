"""The console's own data: engine info for the header, KV event rows, sampling settings, stream chunks.

Stats and KV events are the engine's own torch-free types (lm_console/engine/metrics/stats.py: SchedulerStats,
lm_console/engine/metrics/kv_events.py: the event Structs), so a renamed engine field breaks the console's
tests instead of showing as a zero; the types here only add what is the console's concern
(StatsSnapshot: a SchedulerStats that is not one engine step).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgspec

from lm_console.engine.metrics.kv_events import AllBlocksCleared, BlockStored, KVCacheEvent, UnknownKVEvent
from lm_console.engine.metrics.stats import SchedulerStats


class EngineUnavailable(Exception):
    """The engine failed to start or died; `hint` says what the user can do about it."""

    def __init__(self, message: str, hint: str = "", *, during_start: bool = False) -> None:
        super().__init__(message)
        self.hint = hint
        self.during_start = during_start


@dataclass(slots=True)
class EngineInfo:
    """What the header shows about the running engine."""

    model: str = "?"
    device: str = "cpu"
    dtype: str = "?"
    kv_cache_dtype: str | None = None  # the KV cache's element type; None: unknown (or the model's)
    block_size: int = 16
    num_blocks: int = 0
    max_model_len: int = 0
    max_num_batched_tokens: int = 0
    max_num_seqs: int = 0
    vocab_size: int = 32000
    multimodal: bool = False
    notice: str | None = None  # shown beside the model name (e.g. the demo VLM's caveat)
    url: str | None = None  # the server the console is attached to (lmc tui --url)
    # Panels whose data this engine does not publish -> what the panel says instead of zeros.
    # Keys: UNAVAILABLE_* below.
    unavailable: dict[str, str] = field(default_factory=dict)
    block_map_source: str = ""  # where the block map comes from when not the engine's own pool


# Keys of EngineInfo.unavailable: the panels a remote server may have no source for.
UNAVAILABLE_BLOCK_MAP = "block_map"
UNAVAILABLE_STEPS = "steps"  # per-step scheduler stats: token budget, tokens/step, step time
UNAVAILABLE_KV_EVENTS = "kv_events"
UNAVAILABLE_REQUESTS = "requests"  # the server's own request table
UNAVAILABLE_LATENCY = "latency"  # a latency histogram the server does not export (TTFT, TPOT, ITL)


class KVEventStreamError(Exception):
    """A KV-event source failed (bad endpoint, socket error): that panel stops, the engine is fine."""


class ServerFigures(msgspec.Struct, gc=False):
    """An attached server's cumulative figures from its /metrics at one poll (lm_console/client/vllm_metrics.py).

    The quantiles are Prometheus' histogram_quantile() over everything the server observed since it
    started (None: no observation, or the histogram is not exported: see `missing`).
    """

    num_finished: int = 0  # request_success_total over every finished_reason but abort and error
    num_failed: int = 0  # ... with reason abort or error
    prefix_queries: int = 0  # prefix_cache_queries_total (tokens looked up)
    prefix_hits: int = 0
    ttft_p50: float | None = None
    ttft_p95: float | None = None
    tpot_p50: float | None = None  # per request: (e2e - TTFT) / (output tokens - 1)
    tpot_p95: float | None = None
    itl_p50: float | None = None  # between two consecutive tokens of a request
    itl_p95: float | None = None
    missing: list[str] = msgspec.field(default_factory=list)  # histogram names the server does not export


class StatsSnapshot(SchedulerStats):
    """A SchedulerStats that is not one engine step: the gauges at one moment.

    An attached lm-console server sends one on connect and about once a second while its engine
    is idle (the stream's `snapshot` event: block map, zero per-step counters); a vLLM server's
    /metrics poll becomes one (its counters as deltas since the previous poll). Its counters
    still count towards the rates; it does not count as a step (steps/s, tokens per step).
    Console-side: the engine never sends this type.

    server: a vLLM-compatible server's cumulative figures (its /metrics), None otherwise.
    block_map_from_events: the block map was drawn from the server's KV events (which blocks its
    prefix cache holds, by hash, in slots of our own): the usage gauge, not the map, counts blocks in use.
    """

    server: ServerFigures | None = None
    block_map_from_events: bool = False


@dataclass(slots=True)
class KVEventRecord:
    """One of the engine's KV cache events with its batch's time: a row of the event log and of `lmc events`.

    seq: the number of the engine batch the event came in, where the source numbers its batches
    (the fake engine from 1, the PUB socket from 0); the events of one batch share it.
    """

    ts: float
    # BlockStored | BlockRemoved | AllBlocksCleared; UnknownKVEvent: a type this console does not
    # know or an event it could not read (another producer's), counted and shown, never fatal.
    event: KVCacheEvent | UnknownKVEvent
    seq: int = 0

    @property
    def kind(self) -> str:
        event = self.event
        return event.event_type if isinstance(event, UnknownKVEvent) else type(event).__name__

    @property
    def is_unknown(self) -> bool:
        return isinstance(self.event, UnknownKVEvent)

    @property
    def block_hashes(self) -> list[str]:
        """The event's block hashes as hex (none for AllBlocksCleared or an unknown event)."""
        event = self.event
        if isinstance(event, (AllBlocksCleared, UnknownKVEvent)):
            return []
        return [hash_hex(h) for h in event.block_hashes]

    @property
    def parent_block_hash(self) -> str | None:
        event = self.event
        if isinstance(event, BlockStored) and event.parent_block_hash is not None:
            return hash_hex(event.parent_block_hash)
        return None

    @property
    def num_tokens(self) -> int:
        return len(self.event.token_ids) if isinstance(self.event, BlockStored) else 0

    def to_json_dict(self) -> dict[str, Any]:
        """The record as `lmc events` prints it."""
        event = self.event
        if isinstance(event, UnknownKVEvent):
            return {"ts": self.ts, "seq": self.seq, "type": event.event_type, "unknown": event.reason}
        row: dict[str, Any] = {
            "ts": self.ts, "seq": self.seq, "type": self.kind, "block_hashes": self.block_hashes,
            "parent_block_hash": self.parent_block_hash, "num_tokens": self.num_tokens,
            "block_size": event.block_size if isinstance(event, BlockStored) else 0, "medium": event.medium,
        }
        group_idx = getattr(event, "group_idx", None)
        if group_idx is not None:
            row["group_idx"] = group_idx
        if isinstance(event, BlockStored) and event.lora_name is not None:
            row["lora_name"] = event.lora_name
        return row


def hash_hex(block_hash: Any) -> str:
    """A block hash (bytes or int) as hex."""
    if isinstance(block_hash, (bytes, bytearray, memoryview)):
        return bytes(block_hash).hex()
    if isinstance(block_hash, int):
        return format(block_hash & (2**64 - 1), "016x")
    return str(block_hash)


@dataclass(slots=True)
class GenParams:
    """The sampling settings the console exposes (a subset of SamplingParams)."""

    temperature: float = 0.7
    top_p: float = 0.95
    max_tokens: int = 256
    seed: int | None = None
    ignore_eos: bool = False


@dataclass(slots=True)
class StreamChunk:
    """What one request produced since its previous chunk."""

    request_id: str
    text: str = ""
    num_new_tokens: int = 0
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    finished: bool = False
    finish_reason: str | None = None
    ttft_s: float | None = None  # engine-measured, when known
    tpot_s: float | None = None
    e2e_s: float | None = None
    timeline: RequestTimeline | None = None  # the engine's own timestamps, when the client has them


@dataclass(slots=True)
class RequestTimeline:
    """A request's lifecycle in the engine's clock (time.time()): the request inspector's bar."""

    arrival: float
    queued: float | None = None
    scheduled: float | None = None  # first scheduled
    first_token: float | None = None
    preempted: list[float] = field(default_factory=list)
    finished: float | None = None
    last_token: float | None = None  # the decode phase ends here (finished may come later: a stop string)
