"""ConsoleHub: one reader of the engine's stats, KV events and request table, many consoles.

The hub reads AsyncLLM.stats_stream and kv_events_stream once, encodes each item once
(console_protocol.py) and fans the bytes out to every attached console (console_stream.py's
SSE responses). Back-pressure: each console has a bounded queue. A full queue loses its oldest
frame (the console is *sampled*; counted, and told with a `lag` event); a console that takes
nothing while `max_lag` frames are lost is *dropped* (its connection is closed; counted).
Publishing never awaits, so no console can slow the engine's output handler.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from lm_console.engine.entrypoints.console_protocol import (
    STREAM_VERSION, KVEventsFrame, LagFrame, RequestRow, RequestsFrame, StreamHello, sse_frame,
)
from lm_console.engine.metrics.stats import PrefixCacheStatsSnapshot, SchedulerStats

logger = logging.getLogger(__name__)

KEEPALIVE_S = 10.0  # an SSE comment this often on every stream; consoles time out after a few missed


class TooManySubscribers(Exception):
    """Every console slot of the hub is taken."""


@dataclass(slots=True)
class ConsoleSubscriber:
    """One attached console: its topics and a bounded drop-oldest queue of encoded frames.

    Invariants: len(frames) <= queue_size and num_queued_bytes <= max_queued_bytes (unless one
    frame is larger); num_lagging counts frames lost since the consumer last took one, and
    reaching max_lag sets `kicked`.
    """

    subscriber_id: int
    topics: frozenset[str]
    queue_size: int
    max_lag: int
    max_queued_bytes: int = 8 << 20  # block maps of a large pool are big: bound bytes, not only frames
    frames: deque[bytes] = field(default_factory=deque)
    num_queued_bytes: int = 0
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    kicked: asyncio.Event = field(default_factory=asyncio.Event)
    connected_at: float = field(default_factory=time.time)
    num_delivered: int = 0
    num_dropped: int = 0
    num_lagging: int = 0  # lost since the last take
    num_unreported: int = 0  # lost since the last lag frame
    ended: bool = False  # the engine's streams ended: drain, then stop

    def put(self, frame: bytes) -> bool:
        """Queue a frame, dropping the oldest when full; False once kicked or ended."""
        if self.kicked.is_set() or self.ended:
            return False
        while self.frames and (len(self.frames) >= self.queue_size
                               or self.num_queued_bytes + len(frame) > self.max_queued_bytes):
            self.num_queued_bytes -= len(self.frames.popleft())
            self.num_dropped += 1
            self.num_lagging += 1
            self.num_unreported += 1
            if self.num_lagging >= self.max_lag:
                self.kicked.set()
                return False
        self.frames.append(frame)
        self.num_queued_bytes += len(frame)
        self.ready.set()
        return True

    def take(self) -> bytes | None:
        """The next frame to send (a lag frame first when frames were lost), or None."""
        if not self.frames:
            self.ready.clear()
            return None
        self.num_lagging = 0
        if self.num_unreported:
            lag = sse_frame("lag", LagFrame(self.num_unreported, self.num_dropped))
            self.num_unreported = 0
            return lag
        self.num_delivered += 1
        frame = self.frames.popleft()
        self.num_queued_bytes -= len(frame)
        return frame

    def describe(self) -> dict[str, Any]:
        return {"id": self.subscriber_id, "topics": sorted(self.topics), "queued": len(self.frames),
                "queued_bytes": self.num_queued_bytes,
                "delivered": self.num_delivered, "dropped": self.num_dropped,
                "connected_at": self.connected_at}


class ConsoleHub:
    """Reads the engine's stats, KV events and request table once; fans them out to consoles."""

    def __init__(self, engine: Any, *, queue_size: int = 256, max_lag: int | None = None,
                 max_subscribers: int = 16, idle_snapshot_s: float = 1.0, requests_interval_s: float = 0.5,
                 max_request_rows: int = 64, max_queued_bytes: int = 8 << 20) -> None:
        self.engine = engine
        self.max_queued_bytes = max_queued_bytes  # per console
        self.queue_size = queue_size
        self.max_lag = max_lag if max_lag is not None else 4 * queue_size
        self.max_subscribers = max_subscribers
        self.idle_snapshot_s = idle_snapshot_s
        self.requests_interval_s = requests_interval_s
        self.max_request_rows = max_request_rows
        self.subscribers: dict[int, ConsoleSubscriber] = {}
        self.num_kicked = 0  # consoles dropped for lagging
        self.num_dropped_frames = 0  # frames lost by consoles that have left
        self.num_stats = 0
        self.num_kv_batches = 0
        self.last_stats_time = 0.0  # monotonic
        self.end_frame: bytes | None = None  # set when the engine's streams end
        self._ids = itertools.count(1)
        self._tasks: list[asyncio.Task[None]] = []
        self._kv_seq = 1  # KV batches numbered from 1: a console reads seq 0 as "not numbered"

    # -- subscriptions --------------------------------------------------------------------
    def subscribe(self, topics: frozenset[str], queue_size: int | None = None) -> ConsoleSubscriber:
        """Attach one console; raises TooManySubscribers when every slot is taken."""
        if len(self.subscribers) >= self.max_subscribers:
            raise TooManySubscribers(f"{self.max_subscribers} consoles are attached already (the most this "
                                     "server allows); detach one and retry.")
        size = min(max(queue_size or self.queue_size, 1), 4096)
        subscriber = ConsoleSubscriber(next(self._ids), topics, size, min(self.max_lag, 4 * size),
                                       self.max_queued_bytes)
        hello = StreamHello(STREAM_VERSION, subscriber.subscriber_id, sorted(topics), size, subscriber.max_lag)
        subscriber.put(sse_frame("hello", hello))
        if self.end_frame is not None:
            subscriber.put(self.end_frame)
            subscriber.ended = True
            return subscriber
        self.subscribers[subscriber.subscriber_id] = subscriber
        self._ensure_tasks()
        if "stats" in topics:
            # The block map at once, even when the engine is idle and sends no step stats.
            self._spawn(self._send_snapshot([subscriber]))
        return subscriber

    def unsubscribe(self, subscriber: ConsoleSubscriber) -> None:
        if self.subscribers.pop(subscriber.subscriber_id, None) is not None:
            self.num_dropped_frames += subscriber.num_dropped
            if subscriber.kicked.is_set():
                self.num_kicked += 1
                logger.warning("console %d dropped: it read nothing while %d frames were lost",
                               subscriber.subscriber_id, subscriber.max_lag)

    def publish(self, topic: str, frame: bytes) -> None:
        """Queue one encoded frame for every subscriber of `topic` (never awaits)."""
        for subscriber in list(self.subscribers.values()):
            if topic in subscriber.topics:
                subscriber.put(frame)

    def wants(self, topic: str) -> bool:
        return any(topic in s.topics for s in self.subscribers.values())

    async def frames(self, subscriber: ConsoleSubscriber) -> AsyncIterator[bytes]:
        """The subscriber's frames as they come; ends when the engine's streams end."""
        while not subscriber.kicked.is_set():
            frame = subscriber.take()
            if frame is not None:
                yield frame
            elif subscriber.ended:
                return
            else:
                await subscriber.ready.wait()

    def status(self) -> dict[str, Any]:
        """Counters for GET /lmc/v1/subscribers (and tests)."""
        live = list(self.subscribers.values())
        return {"num_subscribers": len(live), "max_subscribers": self.max_subscribers,
                "num_kicked": self.num_kicked,
                "num_dropped_frames": self.num_dropped_frames + sum(s.num_dropped for s in live),
                "num_stats": self.num_stats, "num_kv_batches": self.num_kv_batches,
                "subscribers": [s.describe() for s in live]}

    # -- the readers ----------------------------------------------------------------------
    def _ensure_tasks(self) -> None:
        if self._tasks:
            return
        self._tasks = [self._spawn(self._pump_stats()), self._spawn(self._tick())]
        if self.kv_events_enabled:
            self._tasks.append(self._spawn(self._pump_kv()))

    def _spawn(self, coro: Any) -> asyncio.Task[None]:
        return asyncio.get_running_loop().create_task(coro)

    @property
    def kv_events_enabled(self) -> bool:
        """Whether the engine publishes KV cache events (its cache_config says)."""
        return bool(self.engine.config.cache_config.enable_kv_cache_events)

    async def _pump_stats(self) -> None:
        try:
            async for stats in self.engine.stats_stream():
                self.num_stats += 1
                self.last_stats_time = time.monotonic()
                if self.wants("stats"):
                    self.publish("stats", sse_frame("stats", stats))
        except Exception as error:  # noqa: BLE001 - the engine died: tell every console
            self._end(error)
        else:
            self._end(None)

    async def _pump_kv(self) -> None:
        try:
            async for batch in self.engine.kv_events_stream():
                self.num_kv_batches += 1
                if self.wants("kv"):
                    self.publish("kv", sse_frame("kv", KVEventsFrame(self._kv_seq, batch)))
                self._kv_seq += 1
        except Exception as error:  # noqa: BLE001
            self._end(error)

    async def _tick(self) -> None:
        """Idle snapshots (the engine sends no stats between steps), the request table, keep-alives."""
        next_requests = 0.0
        next_keepalive = time.monotonic() + KEEPALIVE_S
        while self.end_frame is None:
            await asyncio.sleep(min(self.idle_snapshot_s, self.requests_interval_s) / 2)
            now = time.monotonic()
            if now >= next_keepalive:  # lets a console tell a quiet stream from a frozen server
                next_keepalive = now + KEEPALIVE_S
                for subscriber in list(self.subscribers.values()):
                    subscriber.put(b": keep-alive\n\n")
            try:
                if now - self.last_stats_time >= self.idle_snapshot_s and self.wants("stats"):
                    self.last_stats_time = now
                    await self._send_snapshot([s for s in self.subscribers.values() if "stats" in s.topics])
                if now >= next_requests and self.wants("requests"):
                    next_requests = now + self.requests_interval_s
                    self.publish("requests", sse_frame("requests", requests_frame(self.engine, self.max_request_rows)))
            except Exception as error:  # noqa: BLE001 - a dead engine ends the streams via the pumps
                if getattr(self.engine, "errored", False):
                    return
                logger.warning("console stream tick failed: %s", error)

    async def _send_snapshot(self, subscribers: list[ConsoleSubscriber]) -> None:
        if not subscribers:
            return
        try:
            frame = sse_frame("snapshot", await snapshot_stats(self.engine))
        except Exception:  # noqa: BLE001 - the engine is dying; the stats pump reports it
            return
        for subscriber in subscribers:
            subscriber.put(frame)

    def close(self) -> None:
        """End every console's stream (the server is shutting down); idempotent."""
        self._end(None)

    def _end(self, error: BaseException | None) -> None:
        """The engine's streams ended: send the error (if any) and let every console drain."""
        if self.end_frame is not None:
            return
        if error is not None:
            message = str(error) or type(error).__name__
            self.end_frame = sse_frame("error", {"error": {
                "message": f"The engine stopped: {message}", "type": type(error).__name__, "param": None,
                "code": 503}})
        else:
            self.end_frame = b": the server is shutting down\n\n"
        for subscriber in list(self.subscribers.values()):
            subscriber.put(self.end_frame)
            subscriber.ended = True
            subscriber.ready.set()
        try:
            current = asyncio.current_task()
        except RuntimeError:  # close() from outside the loop
            current = None
        for task in self._tasks:
            if task is not current:
                task.cancel()


async def snapshot_stats(engine: Any) -> SchedulerStats:
    """The engine's gauges and block map now, as a SchedulerStats with zero per-step counters."""
    stats = await engine.get_stats()
    pool = await engine.get_block_pool_state()
    stats.prefix_cache = PrefixCacheStatsSnapshot()
    stats.num_scheduled_tokens = stats.num_preempted_reqs = 0
    stats.num_prompt_tokens = stats.num_generation_tokens = 0
    stats.step_time_s = 0.0
    stats.num_running_reqs, stats.num_waiting_reqs = pool.num_running_reqs, pool.num_waiting_reqs
    stats.block_states, stats.block_ref_counts = pool.block_states, pool.block_ref_counts
    stats.timestamp = time.time()
    return stats


def requests_frame(engine: Any, max_rows: int) -> RequestsFrame:
    """The frontend's unfinished requests (its OutputProcessor's states), oldest first."""
    states = list(getattr(getattr(engine, "output_processor", None), "request_states", {}).values())
    states.sort(key=lambda s: s.metrics.arrival_time)
    rows = []
    for state in states[:max_rows]:
        metrics = state.metrics
        started = metrics.first_scheduled_time is not None or metrics.first_token_time is not None
        rows.append(RequestRow(state.request_id, "RUNNING" if started else "WAITING",
                               len(state.prompt_token_ids or ()), metrics.num_generation_tokens,
                               state.num_cached_tokens, metrics.arrival_time, metrics.first_token_time,
                               getattr(state, "priority", 0), getattr(state, "lora_name", None)))
    return RequestsFrame(time.time(), len(states), rows)
