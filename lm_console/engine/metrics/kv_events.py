"""KV cache events and their ZMQ PUB transport, in vLLM's wire shape.

The events are msgspec Structs, array_like and tagged,
so one encodes as ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size,
lora_id, medium]. The KV cache manager and the KV connectors produce them and the engine core
drains them each step (take_events()) into one KVEventBatch.

On the PUB socket (as vLLM's ZmqEventPublisher sends them) a message is three frames: (topic, seq as
8-byte big-endian, msgpack KVEventBatch). seq counts batches from 0 without gaps, so a
subscriber sees a missed batch as a jump.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Union

import msgspec
import zmq

from lm_console.engine.kv_cache_hashing import BlockHash

logger = logging.getLogger(__name__)

DEFAULT_TOPIC = b"kv-events"
MEDIUM_GPU = "GPU"  # where the blocks live; the CPU backend reports the same name for uniformity


class KVCacheEventBase(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Base of the tagged KV cache events (the tag is the class name)."""


class BlockStored(KVCacheEventBase):
    """Full blocks entered the prefix cache as one chain segment (after vLLM's cache_full_blocks)."""

    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None  # None when the segment starts the chain
    token_ids: list[int]  # the tokens of all stored blocks, len == len(block_hashes) * block_size
    block_size: int
    lora_id: int | None = None
    medium: str | None = MEDIUM_GPU
    lora_name: str | None = None  # the adapter's name (vLLM's field, after medium on the wire)


class BlockRemoved(KVCacheEventBase):
    """Blocks left the prefix cache, evicted for reuse or explicitly."""

    block_hashes: list[BlockHash]
    medium: str | None = MEDIUM_GPU


class AllBlocksCleared(KVCacheEventBase):
    """The whole prefix cache was reset (after vLLM's reset_prefix_cache)."""

    medium: str | None = MEDIUM_GPU


KVCacheEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared]


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """The events of one engine step: EventBatch{ts, events} with typed events."""

    ts: float
    events: list[KVCacheEvent]
    data_parallel_rank: int | None = None


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(KVEventBatch)


def encode_kv_event_batch(batch: KVEventBatch) -> bytes:
    """The msgpack payload frame of one batch."""
    return _encoder.encode(batch)


def decode_kv_event_message(frames: list[Any]) -> tuple[bytes, int, KVEventBatch]:
    """(topic, seq, batch) of one published message; ValueError if it is not one."""
    if len(frames) != 3:
        raise ValueError(f"a KV event message has 3 frames (topic, seq, payload), got {len(frames)}")
    topic, seq, payload = (bytes(frame) for frame in frames)
    if len(seq) != 8:
        raise ValueError(f"the seq frame must be 8 bytes, got {len(seq)}")
    return topic, int.from_bytes(seq, "big"), _decoder.decode(payload)


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
