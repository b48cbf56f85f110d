"""The console stream: the hub's fan-out and back-pressure (fake engine), then /lmc/v1 in the real
`lmc serve` app (build_app) over a real AsyncLLM."""

from __future__ import annotations

import asyncio
import socket
import time
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from http_helpers import API_KEY, ServerThread, lmc_app

from lm_console.engine.entrypoints.console_protocol import decode_event
from lm_console.engine.entrypoints.console_hub import ConsoleHub
from lm_console.engine.errors import EngineDeadError
from lm_console.engine.metrics.stats import BlockPoolState, SchedulerStats
from lm_console.client.sse import iter_sse

pytestmark = pytest.mark.slow

STATS = frozenset({"stats"})


class FakeEngine:
    """Just the AsyncLLM surface the hub reads: a stats stream fed by the test, gauges, a pool state."""

    def __init__(self) -> None:
        self.items: asyncio.Queue[Any] = asyncio.Queue()
        self.config = SimpleNamespace(cache_config=SimpleNamespace(enable_kv_cache_events=False))
        self.errored = False

    async def _stats(self):  # noqa: ANN202
        while True:
            item = await self.items.get()
            if item is None:
                return
            if isinstance(item, BaseException):
                raise item
            yield item

    def stats_stream(self):  # noqa: ANN201
        return self._stats()

    async def get_stats(self) -> SchedulerStats:
        return SchedulerStats(num_running_reqs=1, num_total_blocks=4, num_steps=99)

    async def get_block_pool_state(self) -> BlockPoolState:
        return BlockPoolState(5, 3, 0, 1, 2, bytes([3, 1, 0, 0, 0]), bytes([0, 1, 0, 0, 0]))


def events_of(frames: list[bytes]) -> list[tuple[str, Any]]:
    """Decode SSE frames as the console does."""
    async def lines():  # noqa: ANN202
        for frame in frames:
            for line in frame.decode().split("\n"):
                yield line

    async def collect() -> list[tuple[str, Any]]:
        return [(e.event, decode_event(e.event, e.data)) async for e in iter_sse(lines())]

    loop = asyncio.new_event_loop()
    try:
        return loop.run_until_complete(collect())
    finally:
        loop.close()


async def _settle(hub: ConsoleHub, engine: FakeEngine) -> None:
    """Let the pump drain the engine's stream."""
    while not engine.items.empty():
        await asyncio.sleep(0)
    for _ in range(5):
        await asyncio.sleep(0)


def test_a_console_that_reads_gets_every_step_and_a_silent_one_is_dropped() -> None:
    async def scenario() -> tuple[list[bytes], dict[str, Any], int]:
        engine = FakeEngine()
        hub = ConsoleHub(engine, queue_size=4, max_lag=8, idle_snapshot_s=3600, requests_interval_s=3600)
        reader, silent = hub.subscribe(STATS), hub.subscribe(STATS)
        received: list[bytes] = []

        async def read() -> None:
            async for frame in hub.frames(reader):
                received.append(frame)

        task = asyncio.create_task(read())
        for step in range(40):
            engine.items.put_nowait(SchedulerStats(num_steps=step + 1))
            await _settle(hub, engine)
        assert silent.kicked.is_set() and silent.num_dropped >= 8
        hub.unsubscribe(silent)  # what the silent console's response does once kicked
        status = hub.status()
        engine.items.put_nowait(None)  # the engine shut down: the reader drains and ends
        await asyncio.wait_for(task, 30)
        return received, status, silent.num_delivered

    received, status, silent_delivered = asyncio.run(scenario())
    events = events_of(received)
    steps = [payload.num_steps for event, payload in events if event == "stats"]
    assert steps == list(range(1, 41))  # nothing lost for the console that keeps up
    assert events[0][0] == "hello" and any(event == "snapshot" for event, _ in events)
    assert silent_delivered == 0
    assert status["num_kicked"] == 1 and status["num_subscribers"] == 1 and status["num_stats"] == 40


def test_a_slow_console_is_sampled_and_told_how_much_it_lost() -> None:
    async def scenario() -> list[bytes]:
        engine = FakeEngine()
        hub = ConsoleHub(engine, queue_size=4, max_lag=1000, idle_snapshot_s=3600, requests_interval_s=3600)
        slow = hub.subscribe(STATS)
        frames: list[bytes] = []
        for burst in range(5):  # 10 steps arrive between two reads
            for step in range(10):
                engine.items.put_nowait(SchedulerStats(num_steps=burst * 10 + step + 1))
            await _settle(hub, engine)
            while (frame := slow.take()) is not None:
                frames.append(frame)
        return frames

    events = events_of(asyncio.run(scenario()))
    steps = [p.num_steps for e, p in events if e == "stats"]
    lost = sum(p.num_dropped for e, p in events if e == "lag")
    assert steps == sorted(steps) and steps[-1] == 50  # the newest frames are kept
    assert lost > 0 and len(steps) + lost == 50 + 2 - sum(1 for e, _ in events if e in ("hello", "snapshot"))


def test_a_console_queue_is_bounded_in_bytes_too() -> None:
    from lm_console.engine.entrypoints.console_hub import ConsoleSubscriber

    subscriber = ConsoleSubscriber(1, STATS, queue_size=100, max_lag=1000, max_queued_bytes=350)
    for i in range(10):
        assert subscriber.put(bytes([i]) * 100)
    assert len(subscriber.frames) == 3 and subscriber.num_queued_bytes == 300 and subscriber.num_dropped == 7
    assert subscriber.take().startswith(b"event: lag\ndata: ")  # the console is told first
    assert [frame[0] for frame in iter(subscriber.take, None)] == [7, 8, 9] and subscriber.num_queued_bytes == 0


def test_a_dead_engine_ends_every_stream_with_an_error_event() -> None:
    async def scenario() -> list[bytes]:
        engine = FakeEngine()
        hub = ConsoleHub(engine, idle_snapshot_s=3600, requests_interval_s=3600)
        sub = hub.subscribe(STATS)
        engine.items.put_nowait(SchedulerStats(num_steps=1))
        engine.items.put_nowait(EngineDeadError("engine core process died (exit code -9)"))
        return [frame async for frame in hub.frames(sub)]

    events = events_of(asyncio.run(asyncio.wait_for(scenario(), 30)))
    assert events[-1][0] == "error"
    assert "exit code -9" in events[-1][1]["error"]["message"] and events[-1][1]["error"]["code"] == 503


# -- /lmc/v1 in the server's app over a real AsyncLLM ----------------------------------------
# 4096 blocks: block maps of ~11 KB, so a console that never reads fills its socket buffers in seconds.
ENGINE_ARGS = dict(dtype="float32", max_model_len=256, num_gpu_blocks_override=4096, max_num_seqs=2,
                   enable_kv_cache_events=True, stat_loggers=[])
HEADERS = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def served(tiny_llama_dir):  # noqa: ANN001, ANN201
    from lm_console.engine import AsyncLLM

    llm = AsyncLLM(str(tiny_llama_dir), **ENGINE_ARGS)
    app = lmc_app(llm, queue_size=64, max_lag=32, idle_snapshot_s=0.2)
    server = ServerThread(app, sndbuf=4096).start()
    yield SimpleNamespace(llm=llm, server=server, hub=server.app.state.console_hub, tasks=[])
    server.stop()
    llm.shutdown()


def submit(served, num: int, max_tokens: int, tag: str) -> None:  # noqa: ANN001
    """Start `num` requests on the server's loop (they run while the test reads streams)."""
    from lm_console.engine import RequestOutputKind, SamplingParams

    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=max_tokens,
                            output_kind=RequestOutputKind.FINAL_ONLY)

    async def start() -> None:
        async def one(i: int) -> None:
            async for _ in served.llm.generate(f"request {tag} {i} about the history of", params, f"{tag}-{i}"):
                pass

        served.tasks.extend(asyncio.get_running_loop().create_task(one(i)) for i in range(num))

    served.server.call(start)


def wait_requests_done(served) -> None:  # noqa: ANN001
    async def wait() -> None:
        await asyncio.gather(*served.tasks)
        served.tasks.clear()

    served.server.call(wait)


async def read_stream(url: str, until, topics: str = "stats,kv,requests",  # noqa: ANN001
                      deadline_s: float = 120, subscribed: asyncio.Event | None = None) -> list[tuple[str, Any]]:
    """Read the console stream until `until(events)` holds (or the deadline passes). `subscribed`
    is set once this reader's own hello arrives: the hub has registered it, so nothing the test
    starts afterwards can be missed (a count of subscribers races with earlier tests' consoles
    leaving)."""
    events: list[tuple[str, Any]] = []
    end = time.monotonic() + deadline_s
    async with httpx.AsyncClient(timeout=httpx.Timeout(30, read=None), headers=HEADERS) as http:
        async with http.stream("GET", url + "/lmc/v1/stream", params={"topics": topics}) as response:
            assert response.status_code == 200, await response.aread()
            async for sse in iter_sse(response.aiter_lines()):
                events.append((sse.event, decode_event(sse.event, sse.data)))
                if subscribed is not None and sse.event == "hello":
                    subscribed.set()
                if until(events) or time.monotonic() > end:
                    break
    return events


async def _until_subscribed(reader: asyncio.Task, subscribed: asyncio.Event) -> None:
    """Wait for the reader's hello; a reader that ended first (refused, say) shows its error."""
    waiter = asyncio.create_task(subscribed.wait())
    await asyncio.wait({reader, waiter}, timeout=60, return_when=asyncio.FIRST_COMPLETED)
    waiter.cancel()
    if reader.done():
        reader.result()  # raises what ended it
    assert subscribed.is_set(), "the console stream sent no hello within 60 s"


def test_info_and_auth(served) -> None:  # noqa: ANN001
    url = served.server.url
    for method, path in (("GET", "/lmc/v1/info"), ("GET", "/lmc/v1/stream"), ("GET", "/lmc/v1/subscribers"),
                         ("POST", "/lmc/v1/reset_prefix_cache")):
        for headers in ({}, {"Authorization": "Bearer wrong"}):  # the server's own require_api_key
            refused = httpx.request(method, url + path, headers=headers)
            assert refused.status_code == 401, (path, refused.text)
            assert refused.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(url + "/metrics").status_code == 200  # open, as in vLLM
    info = httpx.get(url + "/lmc/v1/info", headers=HEADERS).json()
    assert info["server"] == "lm-console" and info["stream_version"] == 2
    assert info["num_blocks"] == 4096 and info["block_size"] == 16 and info["max_num_seqs"] == 2
    assert info["kv_events"] is True and info["dtype"] == "float32" and "model_dir" not in info
    bad = httpx.get(url + "/lmc/v1/stream", params={"topics": "stats,gossip"}, headers=HEADERS)
    assert bad.status_code == 400 and "gossip" in bad.json()["error"]["message"]


def test_stats_events_and_requests_arrive_and_match_the_engine(served) -> None:  # noqa: ANN001
    def done(events: list[tuple[str, Any]]) -> bool:
        kinds = {e for e, _ in events}
        running = any(e == "stats" and p.num_running_reqs == 2 and p.num_waiting_reqs >= 1 for e, p in events)
        rows = any(e == "requests" and p.num_requests >= 3 for e, p in events)
        stored = any(e == "kv" and any(type(ev).__name__ == "BlockStored" for ev in p.batch.events)
                     for e, p in events)
        return {"hello", "snapshot"} <= kinds and running and rows and stored

    async def listen_then_submit() -> list[tuple[str, Any]]:
        # Subscribe first: on a fast machine the requests could finish before a late console listens.
        subscribed = asyncio.Event()
        reader = asyncio.create_task(read_stream(served.server.url, done, subscribed=subscribed))
        await _until_subscribed(reader, subscribed)
        submit(served, 4, 48, "a")
        return await reader

    events = asyncio.run(listen_then_submit())
    wait_requests_done(served)
    assert done(events), [e for e, _ in events][:40]
    snapshot = next(p for e, p in events if e == "snapshot")
    assert snapshot.block_states is not None and len(snapshot.block_states) == 4096  # the null block included
    seqs = [p.seq for e, p in events if e == "kv"]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))  # no gap for a console that keeps up
    rows = next(p for e, p in events if e == "requests" and p.num_requests >= 3).rows
    assert {r.state for r in rows} <= {"WAITING", "RUNNING"} and all(r.num_prompt_tokens > 0 for r in rows)
    steps = [p.num_steps for e, p in events if e == "stats"]
    assert steps == sorted(steps) and len(set(steps)) == len(steps)

    # Idle now: a fresh snapshot agrees with the engine's own pool state.
    state = served.server.call(served.llm.get_block_pool_state)
    idle = asyncio.run(read_stream(served.server.url, lambda ev: any(e == "snapshot" for e, _ in ev), "stats"))
    latest = [p for e, p in idle if e == "snapshot"][-1]
    assert latest.block_states == state.block_states and latest.num_running_reqs == 0


def test_two_consoles_at_once_see_the_same_steps(served) -> None:  # noqa: ANN001
    async def both() -> tuple[list, list]:
        enough = lambda ev: sum(1 for e, _ in ev if e == "stats") >= 30  # noqa: E731
        ready = asyncio.Event(), asyncio.Event()
        first = asyncio.create_task(read_stream(served.server.url, enough, "stats", subscribed=ready[0]))
        second = asyncio.create_task(read_stream(served.server.url, enough, "stats", subscribed=ready[1]))
        await _until_subscribed(first, ready[0])
        await _until_subscribed(second, ready[1])
        submit(served, 2, 64, "b")
        return await first, await second

    first, second = asyncio.run(both())
    wait_requests_done(served)
    steps = [{p.num_steps for e, p in events if e == "stats"} for events in (first, second)]
    assert len(steps[0]) >= 30 and len(steps[0] & steps[1]) >= 20


def test_a_console_that_never_reads_is_dropped_while_the_engine_keeps_stepping(served) -> None:  # noqa: ANN001
    hub = served.hub
    kicked_before = hub.status()["num_kicked"]
    silent = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    silent.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # fills at once: the server's send blocks
    silent.connect(("127.0.0.1", served.server.port))
    silent.sendall(f"GET /lmc/v1/stream?topics=stats,kv&queue=4 HTTP/1.1\r\nHost: x\r\n"
                   f"Authorization: Bearer {API_KEY}\r\n\r\n".encode())
    try:
        submit(served, 2, 220, "c")  # long enough to keep stepping after the drop, even on a busy machine

        def dropped(events: list[tuple[str, Any]]) -> bool:
            return hub.status()["num_kicked"] > kicked_before

        events = asyncio.run(read_stream(served.server.url, dropped, "stats"))
        steps_when_dropped = max(p.num_steps for e, p in events if e == "stats")

        wait_requests_done(served)
        submit(served, 1, 32, "d")  # the engine serves on after the drop: 32 more steps at least
        wait_requests_done(served)
    finally:
        silent.close()
    status = hub.status()
    assert status["num_kicked"] == kicked_before + 1 and status["num_dropped_frames"] > 0
    stats = served.server.call(served.llm.get_stats)
    assert stats.num_steps > steps_when_dropped + 5  # the engine went on


def test_reset_prefix_cache_clears_and_the_stream_says_so(served) -> None:  # noqa: ANN001
    async def scenario() -> tuple[dict, list]:
        cleared = lambda ev: any(e == "kv" and any(type(x).__name__ == "AllBlocksCleared" for x in p.batch.events)  # noqa: E731
                                 for e, p in ev)
        subscribed = asyncio.Event()
        reader = asyncio.create_task(read_stream(served.server.url, cleared, "kv", subscribed=subscribed))
        await _until_subscribed(reader, subscribed)
        async with httpx.AsyncClient(headers=HEADERS) as http:
            response = await http.post(served.server.url + "/lmc/v1/reset_prefix_cache")
        return response.json(), await reader

    result, events = asyncio.run(scenario())
    assert result == {"reset": True}
    assert any(e == "kv" for e, _ in events)
