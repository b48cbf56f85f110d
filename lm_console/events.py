"""`lmc events`: the KV-event stream as JSON lines, from an engine of our own or a ZMQ endpoint."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from typing import TextIO

from lm_console.client.asyncllm import kv_records_of
from lm_console.client.protocol import ConsoleClient
from lm_console.client.types import UNAVAILABLE_KV_EVENTS, EngineUnavailable, KVEventRecord, KVEventStreamError
from lm_console.load_generator import LoadGenerator, LoadShape
from lm_console.request_book import RequestBook


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
    num_batches = 0

    async def pump() -> None:
        nonlocal printed, num_batches
        async for records in client.kv_events_stream():
            num_batches += 1
            for record in records:
                record.seq = record.seq or num_batches  # the client's own number, else ours
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
    except KVEventStreamError as error:  # the event source failed, not the engine
        out.flush()
        raise SystemExit(f"error: the KV event stream failed: {error}") from error
    finally:
        await generator.close()
        await client.shutdown()
    return printed


async def print_endpoint_events(endpoint: str, out: TextIO, *, count: int | None = None,
                                duration: float | None = None, topic: str = "",
                                server_key: str | None = None) -> int:
    """Subscribe to an engine's KV-event PUB socket (multipart: topic, seq, msgpack batch).

    server_key: the PUB's CURVE public key (z85), which a tcp endpoint of the engine needs.
    zmq.ZMQError when the endpoint or the key is malformed.
    """
    import zmq
    import zmq.asyncio

    context = zmq.asyncio.Context()
    socket = context.socket(zmq.SUB)
    try:
        if server_key:
            public_key, secret_key = zmq.curve_keypair()
            socket.curve_serverkey = server_key.encode()
            socket.curve_publickey = public_key
            socket.curve_secretkey = secret_key
        socket.connect(endpoint)
    except zmq.ZMQError:
        socket.close(linger=0)
        context.term()
        raise
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
            try:
                records = records_of_message(frames)
            except ValueError as error:  # one bad message: say so and keep reading the stream
                print(f"warning: skipped an undecodable KV event message: {error}", file=sys.stderr)
                continue
            for record in records[: None if count is None else count - printed]:
                out.write(json.dumps(record.to_json_dict()) + "\n")
                printed += 1
            out.flush()
    finally:
        socket.close(linger=0)
        context.term()
    return printed


def records_of_message(frames: list[bytes]) -> list[KVEventRecord]:
    """The rows of one PUB message of any producer (ours, vLLM's current map form or its older arrays).

    An event type this console does not know becomes a row of its own (KVEventRecord.is_unknown);
    ValueError only when the message itself is malformed (wrong frames, not a batch).
    """
    from lm_console.engine.metrics.kv_events import decode_kv_event_message_lenient

    _, seq, batch = decode_kv_event_message_lenient(frames)
    return kv_records_of(batch, seq)
