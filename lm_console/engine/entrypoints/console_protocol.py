"""The console stream's wire types: SSE events whose data is msgspec JSON.

`GET /lmc/v1/stream` (lm_console/engine/entrypoints/console_stream.py) sends, as server-sent events:

    event: hello     StreamHello            first, once
    event: stats     SchedulerStats         one per engine step (the engine's own struct)
    event: snapshot  SchedulerStats         on connect and ~1/s while the engine is idle; always
                                            has the block map; its per-step counters are zero
    event: kv        KVEventsFrame          one per KV event batch, numbered from 1 without gaps
    event: requests  RequestsFrame          the server's unfinished requests, a few times a second
    event: lag       LagFrame               before the next frame, when this console lost frames
    event: error     {"error": {...}}       OpenAI's error shape; the stream ends after it

Torch-free and FastAPI-free: the console's RemoteConsoleClient decodes with the same types.
SchedulerStats and KVEventBatch are array_like, so a field appended later decodes as its default
in an older console and is ignored by an older server's console (msgspec reads arrays by position).
The events inside a batch are maps tagged by "type" (vLLM's current form) since stream version 2;
a console reads a version-1 server's array events too (kv_events.decode_kv_event_payload).
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from lm_console.engine.metrics.kv_events import JSON, DecodedKVEventBatch, KVEventBatch, decode_kv_event_payload
from lm_console.engine.metrics.stats import SchedulerStats

STREAM_VERSION = 2  # 2: KV events as tagged maps (vLLM's current wire format)
TOPICS = ("stats", "kv", "requests")  # what a console may subscribe to (?topics=stats,kv)
STREAM_PATH = "/lmc/v1/stream"
INFO_PATH = "/lmc/v1/info"
RESET_PATH = "/lmc/v1/reset_prefix_cache"
SUBSCRIBERS_PATH = "/lmc/v1/subscribers"
SERVER_KIND = "lm-console"  # the "server" field of /lmc/v1/info


class StreamHello(msgspec.Struct, gc=False):
    """The first event: protocol version, this subscription and its queue bound."""

    version: int
    subscriber_id: int
    topics: list[str]
    queue_size: int
    max_lag: int  # frames lost in a row (never read) before the server drops this console


class KVEventsFrame(msgspec.Struct, array_like=True, gc=False):
    """One KV event batch with its sequence number (a gap means batches were lost)."""

    seq: int
    batch: KVEventBatch


@dataclass(slots=True)
class DecodedKVEventsFrame:
    """A `kv` frame as the console reads it: events it cannot read are UnknownKVEvent rows."""

    seq: int
    batch: DecodedKVEventBatch


class _RawKVEventsFrame(msgspec.Struct, array_like=True, gc=False):
    seq: int
    batch: msgspec.Raw


_RAW_KV_FRAME = msgspec.json.Decoder(_RawKVEventsFrame)


def decode_kv_frame(data: bytes | str) -> DecodedKVEventsFrame:
    """A `kv` event's payload, its events read leniently (another server version's); ValueError if malformed."""
    try:
        frame = _RAW_KV_FRAME.decode(data)
    except msgspec.MsgspecError as error:
        raise ValueError(f"not a KV events frame: {error}") from error
    return DecodedKVEventsFrame(frame.seq, decode_kv_event_payload(bytes(frame.batch), JSON))


class RequestRow(msgspec.Struct, array_like=True, gc=False):
    """One unfinished request as the server's frontend sees it (times: seconds since the epoch)."""

    request_id: str
    state: str  # WAITING (not scheduled yet) | RUNNING
    num_prompt_tokens: int
    num_generated_tokens: int
    num_cached_tokens: int
    arrival_time: float
    first_token_time: float | None = None
    priority: int = 0  # scheduling_policy="priority": a lower value first
    lora_name: str | None = None  # the LoRA adapter it runs with (None: the base model)


class RequestsFrame(msgspec.Struct, array_like=True, gc=False):
    """The server's unfinished requests (oldest first, at most a few dozen rows)."""

    ts: float
    num_requests: int  # all unfinished requests; rows may be fewer
    rows: list[RequestRow]


class LagFrame(msgspec.Struct, gc=False):
    """This console lost frames: its queue was full (the server keeps the newest)."""

    num_dropped: int  # since the previous lag frame
    num_dropped_total: int


_encoder = msgspec.json.Encoder()
DECODERS: dict[str, msgspec.json.Decoder] = {
    "hello": msgspec.json.Decoder(StreamHello),
    "stats": msgspec.json.Decoder(SchedulerStats),
    "snapshot": msgspec.json.Decoder(SchedulerStats),
    "requests": msgspec.json.Decoder(RequestsFrame),
    "lag": msgspec.json.Decoder(LagFrame),
}


def sse_frame(event: str, payload: object) -> bytes:
    """One server-sent event: `event: NAME`, `data: JSON`, blank line."""
    return b"event: " + event.encode() + b"\ndata: " + _encoder.encode(payload) + b"\n\n"


def decode_event(event: str, data: bytes | str) -> object:
    """The typed payload of one stream event; a dict for `error`; ValueError for an unknown event."""
    if event == "kv":
        return decode_kv_frame(data)
    decoder = DECODERS.get(event)
    if decoder is not None:
        return decoder.decode(data)
    if event == "error":
        return msgspec.json.decode(data)
    raise ValueError(f"unknown console stream event {event!r}")
