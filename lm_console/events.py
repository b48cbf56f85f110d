"""`lmc events`: the KV-event stream as JSON lines, from an engine of our own or a ZMQ endpoint."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any, TextIO

from lm_console.client.asyncllm import hash_hex, kv_records_of
from lm_console.client.protocol import ConsoleClient
from lm_console.client.types import UNAVAILABLE_KV_EVENTS, EngineUnavailable, KVEventRecord
from lm_console.load_generator import LoadGenerator, LoadShape
from lm_console.request_book import RequestBook

_FIELDS = {  # positional fields of array-encoded events, after the tag
    "BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size"),
    "BlockRemoved": ("block_hashes",),
    "AllBlocksCleared": (),
}


async def print_client_events(client: ConsoleClient, out: TextIO, *, count: int | None = None,
                              duration: float | None = None, load: bool = True,
                              shape: LoadShape | None = None) -> int:
    """Start the engine, optionally drive the built-in load, print events until a limit."""
    try:
        info = await client.start()
    except EngineUnavailable as error:
        raise SystemExit(f"error: the engine failed to start: {error}\n{error.hint}") from error
    if UNAVAILABLE_KV_EVENTS in info.unavailable:  # an attached server that publishes none
        await client.shutdown()
        raise SystemExit(f"error: {info.unavailable[UNAVAILABLE_KV_EVENTS]}")
    generator = LoadGenerator(client, RequestBook(), shape or LoadShape(rate=4.0), info.vocab_size)
    if load:
        generator.start()
    printed = 0
    seq = 0

    async def pump() -> None:
        nonlocal printed, seq
        async for records in client.kv_events_stream():
            for record in records:
                seq += 1
                record.seq = record.seq or seq
                out.write(json.dumps(record.to_json_dict()) + "\n")
                printed += 1
                if count is not None and printed >= count:
                    out.flush()
                    return
            out.flush()

    try:
        await asyncio.wait_for(pump(), timeout=duration)
    except asyncio.TimeoutError:
        pass
    except EngineUnavailable as error:
        out.flush()
        raise SystemExit(f"error: the engine stopped: {error}") from error
    finally:
        await generator.close()
        await client.shutdown()
    return printed


async def print_endpoint_events(endpoint: str, out: TextIO, *, count: int | None = None,
                                duration: float | None = None, topic: str = "") -> int:
    """Subscribe to an engine's KV-event PUB socket (multipart: topic, seq, msgpack batch)."""
    import msgspec
    import zmq
    import zmq.asyncio

    context = zmq.asyncio.Context()
    socket = context.socket(zmq.SUB)
    socket.connect(endpoint)
    socket.setsockopt_string(zmq.SUBSCRIBE, topic)
    printed = 0
    deadline = None if duration is None else time.monotonic() + duration
    try:
        while count is None or printed < count:
            timeout = None if deadline is None else max(deadline - time.monotonic(), 0.0)
            if timeout == 0.0:
                break
            if not await socket.poll(None if timeout is None else int(timeout * 1000)):
                break
            frames = await socket.recv_multipart()
            for record in records_of_message(frames, msgspec)[: None if count is None else count - printed]:
                out.write(json.dumps(record.to_json_dict()) + "\n")
                printed += 1
            out.flush()
    finally:
        socket.close(linger=0)
        context.term()
    return printed


def records_of_message(frames: list[bytes], msgspec: Any) -> list[KVEventRecord]:
    """Decode one PUB message with the engine's typed decoder, or generically without it."""
    try:
        from engine.metrics.kv_events import decode_kv_event_message

        _, seq, batch = decode_kv_event_message(frames)
        records = kv_records_of(batch)
        for record in records:
            record.seq = seq
        return records
    except ImportError:
        seq = int.from_bytes(frames[1], "big") if len(frames) >= 3 else 0
        return records_of_wire_batch(msgspec.msgpack.decode(frames[-1]), seq)


def records_of_wire_batch(batch: Any, seq: int) -> list[KVEventRecord]:
    """Flatten a decoded EventBatch (array- or map-encoded) into records."""
    if isinstance(batch, dict):
        ts, events = batch.get("ts", time.time()), batch.get("events", [])
    else:
        ts, events = batch[0], batch[1]
    records = []
    for event in events:
        if isinstance(event, dict):
            kind = str(event.get("type") or event.get("kind") or "?")
            fields = event
        else:
            kind = str(event[0])
            fields = dict(zip(_FIELDS.get(kind, ()), event[1:]))
        parent = fields.get("parent_block_hash")
        records.append(KVEventRecord(
            ts=float(ts), kind=kind, block_hashes=[hash_hex(h) for h in fields.get("block_hashes") or []],
            parent_block_hash=None if parent is None else hash_hex(parent),
            num_tokens=len(fields.get("token_ids") or []), block_size=int(fields.get("block_size") or 0),
            seq=seq,
        ))
    return records
