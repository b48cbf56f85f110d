"""KV cache events and their ZMQ PUB transport, in vLLM's wire format.

On the wire (as vLLM's ZmqEventPublisher sends them) a message is three frames: (topic, seq as
8-byte big-endian, msgpack KVEventBatch). The batch is an array [ts, events, data_parallel_rank];
each event is a map tagged by its class name under "type", e.g. {"type": "BlockStored",
"block_hashes": [...], "parent_block_hash": ..., "token_ids": [...], "block_size": 16, "lora_id":
null, "medium": "GPU", "lora_name": null, "group_idx": 0, "kv_cache_spec_kind": "full_attention",
...}. We publish every field (no defaults omitted), so a consumer written against vLLM's own
structs, whose lora_id, medium and lora_name have no default, decodes ours.

Consumers meet more than one producer: vLLM before the map form sent each event as a tagged array
["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium], and later
releases add fields and event types. decode_kv_event_payload() reads both forms, ignores fields it
does not know and turns an event type it does not know (or an event it cannot read) into an
UnknownKVEvent instead of failing the whole batch: a monitoring stream must keep going.

The KV cache manager and the KV connectors produce the events and the engine core drains them each
step (take_events()) into one KVEventBatch. seq counts batches from 0 without gaps, so a subscriber
sees a missed batch as a jump.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Union

import msgspec
import zmq

logger = logging.getLogger(__name__)

DEFAULT_TOPIC = b"kv-events"
MEDIUM_GPU = "GPU"  # where the blocks live; the CPU backend reports the same name for uniformity
# A block hash as vLLM publishes it: the digest's bytes, or (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES) an int.
ExternalBlockHash = Union[bytes, int]


class KVCacheEventBase(msgspec.Struct, gc=False, tag=True):
    """Base of the tagged KV cache events (the tag, under "type", is the class name)."""


class BlockStored(KVCacheEventBase):
    """Full blocks entered the prefix cache as one chain segment (after vLLM's cache_full_blocks)."""

    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None  # None when the segment starts the chain
    token_ids: list[int]  # the tokens of all stored blocks, len == len(block_hashes) * block_size
    block_size: int
    lora_id: int | None = None
    medium: str | None = MEDIUM_GPU
    lora_name: str | None = None
    # Per block: what besides the tokens entered its hash (LoRA name, image ids, cache salt), untagged.
    extra_keys: list[list[Any] | None] | None = None
    group_idx: int | None = None  # the KV cache group (hybrid models have several)
    kv_cache_spec_kind: str | None = None  # vLLM's KVCacheSpecKind value: "full_attention", "sliding_window"
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None  # LOCAL or REMOTE relative to the publisher (KV transfer)
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(KVCacheEventBase):
    """Blocks left the prefix cache, evicted for reuse or explicitly."""

    block_hashes: list[ExternalBlockHash]
    medium: str | None = MEDIUM_GPU
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEventBase):
    """The whole prefix cache was reset (after vLLM's reset_prefix_cache)."""

    medium: str | None = MEDIUM_GPU


KVCacheEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared]


class UnknownKVEvent(msgspec.Struct, gc=False, tag=True):
    """An event a consumer could not read: a type it does not know, or a malformed one (never published).

    Tagged like the events, so that a record of either kind serialises (the console's recordings).
    """

    event_type: str  # the producer's tag, "?" when there was none
    reason: str


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """The events of one engine step: EventBatch{ts, events} with typed events."""

    ts: float
    events: list[KVCacheEvent]
    data_parallel_rank: int | None = None


@dataclass(slots=True)
class DecodedKVEventBatch:
    """A batch read leniently from another producer: its events, unreadable ones as UnknownKVEvent."""

    ts: float
    events: list[KVCacheEvent | UnknownKVEvent]
    data_parallel_rank: int | None = None

    @property
    def num_unknown(self) -> int:
        return sum(isinstance(event, UnknownKVEvent) for event in self.events)


# The array form of vLLM's releases before the map form (and of lm-console's console stream v1):
# fields by position after the tag; the oldest had no medium, so every field after block_size defaults.
class _LegacyBlockStored(msgspec.Struct, array_like=True, tag="BlockStored"):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None


class _LegacyBlockRemoved(msgspec.Struct, array_like=True, tag="BlockRemoved"):
    block_hashes: list[ExternalBlockHash]
    medium: str | None = None


class _LegacyAllBlocksCleared(msgspec.Struct, array_like=True, tag="AllBlocksCleared"):
    medium: str | None = None


_LegacyEvent = Union[_LegacyBlockStored, _LegacyBlockRemoved, _LegacyAllBlocksCleared]
_FROM_LEGACY: dict[type, type] = {_LegacyBlockStored: BlockStored, _LegacyBlockRemoved: BlockRemoved,
                                  _LegacyAllBlocksCleared: AllBlocksCleared}


class _RawBatch(msgspec.Struct, array_like=True, gc=False):  # the batch around events read one by one
    ts: float
    events: list[msgspec.Raw]
    data_parallel_rank: int | None = None


@dataclass(frozen=True, slots=True)
class _Codec:
    """The decoders of one serialisation (msgpack on the PUB socket, JSON on the console stream)."""

    batch: Any
    raw_batch: Any
    event: Any
    legacy: Any
    anything: Any


def _codec(module: Any) -> _Codec:
    return _Codec(module.Decoder(KVEventBatch), module.Decoder(_RawBatch), module.Decoder(KVCacheEvent),
                  module.Decoder(_LegacyEvent), module.Decoder())


MSGPACK, JSON = _codec(msgspec.msgpack), _codec(msgspec.json)
_encoder = msgspec.msgpack.Encoder()
_decoder = MSGPACK.batch


def encode_kv_event_batch(batch: KVEventBatch) -> bytes:
    """The msgpack payload frame of one batch."""
    return _encoder.encode(batch)


def _split_message(frames: list[Any]) -> tuple[bytes, int, bytes]:
    if len(frames) != 3:
        raise ValueError(f"a KV event message has 3 frames (topic, seq, payload), got {len(frames)}")
    topic, seq, payload = (bytes(frame) for frame in frames)
    if len(seq) != 8:
        raise ValueError(f"the seq frame must be 8 bytes, got {len(seq)}")
    return topic, int.from_bytes(seq, "big"), payload


def decode_kv_event_message(frames: list[Any]) -> tuple[bytes, int, KVEventBatch]:
    """(topic, seq, batch) of one message of our own publisher (strict: ValueError if it is not one)."""
    topic, seq, payload = _split_message(frames)
    return topic, seq, _decoder.decode(payload)


def decode_kv_event_message_lenient(frames: list[Any]) -> tuple[bytes, int, DecodedKVEventBatch]:
    """(topic, seq, batch) of a message of any producer (vLLM's current or older form, or ours).

    ValueError only when the frames or the batch around the events cannot be read; an event that
    cannot be read becomes an UnknownKVEvent in its place.
    """
    topic, seq, payload = _split_message(frames)
    return topic, seq, decode_kv_event_payload(payload)


def decode_kv_event_payload(payload: bytes | str, codec: _Codec = MSGPACK) -> DecodedKVEventBatch:
    """One serialised batch, read leniently (see the module docstring); ValueError for a malformed batch."""
    try:  # the common case, one typed pass: every event is one we know, in the map form
        batch = codec.batch.decode(payload)
        return DecodedKVEventBatch(batch.ts, list(batch.events), batch.data_parallel_rank)
    except msgspec.MsgspecError:
        pass
    try:
        raw = codec.raw_batch.decode(payload)
    except msgspec.MsgspecError as error:
        raise ValueError(f"not a KV event batch [ts, events, data_parallel_rank]: {error}") from error
    return DecodedKVEventBatch(raw.ts, [_decode_event(event, codec) for event in raw.events],
                               raw.data_parallel_rank)


def _decode_event(raw: msgspec.Raw, codec: _Codec) -> KVCacheEvent | UnknownKVEvent:
    try:
        return codec.event.decode(raw)  # type: ignore[no-any-return]
    except msgspec.MsgspecError as error:
        first_error = error
    try:
        legacy = codec.legacy.decode(raw)
        return _FROM_LEGACY[type(legacy)](**msgspec.structs.asdict(legacy))  # type: ignore[no-any-return]
    except msgspec.MsgspecError:
        pass
    try:
        value = codec.anything.decode(raw)
    except msgspec.MsgspecError as error:
        return UnknownKVEvent("?", f"undecodable: {error}")
    tag = value.get("type") if isinstance(value, dict) else (value[0] if isinstance(value, list) and value else None)
    if not isinstance(tag, str):
        return UnknownKVEvent("?", f"no type tag: {first_error}")
    if tag in ("BlockStored", "BlockRemoved", "AllBlocksCleared"):
        return UnknownKVEvent(tag, f"malformed: {first_error}")
    return UnknownKVEvent(tag, "an event type this console does not know")


class KVEventPublisher:
    """Binds a PUB socket and publishes one KVEventBatch per call, numbering them from 0."""

    def __init__(self, context: zmq.Context, endpoint: str, topic: bytes = DEFAULT_TOPIC,
                 curve_secret_key: bytes | None = None) -> None:
        self.topic = topic
        self.socket = context.socket(zmq.PUB)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.SNDHWM, 100_000)  # a slow subscriber loses batches, not the engine
        # CURVE (tcp): only subscribers given the server's public key can connect and read.
        self.curve = curve_secret_key is not None
        if curve_secret_key is not None:
            self.socket.curve_secretkey = curve_secret_key
            self.socket.curve_server = True
        self.socket.bind(endpoint)
        # With a wildcard port (tcp://127.0.0.1:*) the actual endpoint is known only now.
        self.endpoint: str = self.socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self.next_seq = 0

    def publish(self, events: list[KVCacheEvent], ts: float | None = None) -> KVEventBatch | None:
        """Publish the events as one batch (nothing when empty); returns the batch."""
        if not events:
            return None
        batch = KVEventBatch(ts=time.time() if ts is None else ts, events=events)
        self.publish_batch(batch)
        return batch

    def publish_batch(self, batch: KVEventBatch) -> None:
        """Send a prepared batch with the next sequence number."""
        seq = self.next_seq.to_bytes(8, "big")
        try:
            self.socket.send_multipart([self.topic, seq, encode_kv_event_batch(batch)], flags=zmq.NOBLOCK)
        except zmq.Again:
            logger.warning("KV event batch %d dropped: the PUB queue is full", self.next_seq)
        self.next_seq += 1

    def close(self) -> None:
        self.socket.close(linger=0)


def set_curve_subscriber(socket: zmq.Socket, server_key: str | bytes) -> None:
    """Make a SUB socket a CURVE client of the PUB with that z85 public key (before connect)."""
    public_key, secret_key = zmq.curve_keypair()
    socket.curve_serverkey = server_key.encode() if isinstance(server_key, str) else server_key
    socket.curve_publickey = public_key
    socket.curve_secretkey = secret_key


class KVEventSubscriber:
    """A blocking SUB client of a KVEventPublisher (tests, `lmc events`).

    server_key: the publisher's CURVE public key (z85), needed for a tcp endpoint.
    """

    def __init__(self, endpoint: str, topic: bytes = b"", context: zmq.Context | None = None,
                 server_key: str | bytes | None = None) -> None:
        self._own_context = context is None
        self.context = context or zmq.Context()
        self.socket = self.context.socket(zmq.SUB)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.SUBSCRIBE, topic)
        if server_key is not None:
            set_curve_subscriber(self.socket, server_key)
        self.socket.connect(endpoint)

    def receive(self, timeout_s: float | None = None) -> tuple[int, KVEventBatch] | None:
        """The next (seq, batch), or None when timeout_s passes first."""
        timeout_ms = None if timeout_s is None else int(timeout_s * 1000)
        if not self.socket.poll(timeout_ms):
            return None
        _, seq, batch = decode_kv_event_message(self.socket.recv_multipart())
        return seq, batch

    def close(self) -> None:
        self.socket.close(linger=0)
        if self._own_context:
            self.context.term()
