"""FakeConsoleClient: a scripted engine for tests, screenshots and `lmc tui --fake`."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from lm_console.client.fake_sim import FakeEngineSim, SimRequest, tokenize
from lm_console.client.types import (
    EngineInfo, EngineUnavailable, GenParams, KVEventRecord, StatsSample, StreamChunk,
)

_DEAD = object()  # queue sentinel: the engine died


def default_reply(messages: list[dict[str, Any]]) -> str:
    """The fake model's answer: it says what it is and echoes the question."""
    question = next((m["content"] for m in reversed(messages) if m.get("role") == "user"), "")
    if isinstance(question, list):  # content parts: the text parts
        question = " ".join(p.get("text", "") for p in question if isinstance(p, dict))
    return (f"This is the **fake engine** (no model is loaded). You asked: *{question.strip()}*. "
            "A real reply streams here token by token, with TTFT and tok/s in the footer.")


class FakeConsoleClient:
    """A ConsoleClient over FakeEngineSim; tests can also push stats and events by hand.

    With auto_step the simulator steps every step_interval seconds while it has requests;
    without it, tests call step() (or push_stats / push_events) themselves.
    """

    def __init__(self, *, num_blocks: int = 512, block_size: int = 16, token_budget: int = 256,
                 max_num_seqs: int = 16, auto_step: bool = True, step_interval: float = 0.05,
                 clock: Callable[[], float] = time.time, fail_start: str | None = None,
                 start_delay: float = 0.0, reply: Callable[[list[dict[str, Any]]], str] = default_reply,
                 seed: int = 0) -> None:
        self.sim = FakeEngineSim(num_blocks, block_size, token_budget, max_num_seqs, seed)
        self.info = EngineInfo(
            model="fake-engine", device="cpu", dtype="none", block_size=block_size,
            num_blocks=num_blocks, max_model_len=4096, max_num_batched_tokens=token_budget,
            max_num_seqs=max_num_seqs, vocab_size=1 << 16,
        )
        self.auto_step = auto_step
        self.step_interval = step_interval
        self.clock = clock
        self.fail_start = fail_start
        self.start_delay = start_delay
        self.reply = reply
        self.dead_error: EngineUnavailable | None = None
        self.submitted: list[str] = []
        self._stats_queues: list[asyncio.Queue[Any]] = []
        self._event_queues: list[asyncio.Queue[Any]] = []
        self._request_queues: dict[str, asyncio.Queue[Any]] = {}
        self._ticker: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()

    # -- ConsoleClient --------------------------------------------------------------------
    async def start(self) -> EngineInfo:
        if self.start_delay:
            await asyncio.sleep(self.start_delay)
        if self.fail_start:
            raise EngineUnavailable(self.fail_start, "Check the model path with `lmc models`.",
                                    during_start=True)
        if self.auto_step and self._ticker is None:
            self._ticker = asyncio.get_running_loop().create_task(self._tick())
        return self.info

    async def stats_stream(self) -> AsyncIterator[StatsSample]:
        async for item in self._subscribe(self._stats_queues):
            yield item

    async def kv_events_stream(self) -> AsyncIterator[list[KVEventRecord]]:
        async for item in self._subscribe(self._event_queues):
            yield item

    async def generate(self, prompt: str | list[int], params: GenParams,
                       request_id: str) -> AsyncIterator[StreamChunk]:
        token_ids = prompt if isinstance(prompt, list) else tokenize(prompt)
        async for chunk in self._run(SimRequest(request_id, list(token_ids), params.max_tokens, self.clock())):
            yield chunk

    async def chat(self, messages: list[dict[str, Any]], params: GenParams,
                   request_id: str) -> AsyncIterator[StreamChunk]:
        rendered = " ".join(f"<|{m['role']}|> {m['content']}" for m in messages)
        script = self.reply(messages).split(" ")[: params.max_tokens]
        request = SimRequest(request_id, tokenize(rendered), params.max_tokens, self.clock(), script=script)
        async for chunk in self._run(request):
            yield chunk

    async def abort(self, request_id: str) -> None:
        chunk = self.sim.abort(request_id, self.clock())
        if chunk is not None:
            self._deliver([chunk])

    async def reset_prefix_cache(self) -> bool:
        self._raise_if_dead()
        return self.sim.reset_prefix_cache(self.clock())

    async def shutdown(self) -> None:
        if self._ticker is not None:
            self._ticker.cancel()
            self._ticker = None

    # -- test hooks -----------------------------------------------------------------------
    def step(self) -> None:
        """Run one simulator step and publish what it produced."""
        stats, events, chunks = self.sim.step(self.clock())
        self.push_stats(stats)
        if events:
            self.push_events(events)
        self._deliver(chunks)

    def push_stats(self, stats: StatsSample) -> None:
        for queue in self._stats_queues:
            queue.put_nowait(stats)

    def push_events(self, events: list[KVEventRecord]) -> None:
        for queue in self._event_queues:
            queue.put_nowait(events)

    def kill(self, message: str = "The engine core process died unexpectedly.") -> None:
        """Make the engine dead: every stream raises EngineUnavailable."""
        self.dead_error = EngineUnavailable(message, "Restart `lmc tui`; the log above the "
                                            "traceback in the engine's stderr says why it died.")
        for queue in [*self._stats_queues, *self._event_queues, *self._request_queues.values()]:
            queue.put_nowait(_DEAD)

    # -- internals ------------------------------------------------------------------------
    async def _subscribe(self, queues: list[asyncio.Queue[Any]]) -> AsyncIterator[Any]:
        self._raise_if_dead()
        queue: asyncio.Queue[Any] = asyncio.Queue()
        queues.append(queue)
        try:
            while True:
                item = await queue.get()
                if item is _DEAD:
                    self._raise_if_dead()
                yield item
        finally:
            queues.remove(queue)

    async def _run(self, request: SimRequest) -> AsyncIterator[StreamChunk]:
        self._raise_if_dead()
        queue: asyncio.Queue[Any] = asyncio.Queue()
        self._request_queues[request.request_id] = queue
        self.submitted.append(request.request_id)
        self.sim.add_request(request)
        self._wake.set()
        try:
            while True:
                chunk = await queue.get()
                if chunk is _DEAD:
                    self._raise_if_dead()
                yield chunk
                if chunk.finished:
                    return
        finally:
            del self._request_queues[request.request_id]
            self.sim.abort(request.request_id, self.clock())  # no-op once it finished

    def _deliver(self, chunks: list[StreamChunk]) -> None:
        for chunk in chunks:
            queue = self._request_queues.get(chunk.request_id)
            if queue is not None:
                queue.put_nowait(chunk)

    def _raise_if_dead(self) -> None:
        if self.dead_error is not None:
            raise self.dead_error

    async def _tick(self) -> None:
        while self.dead_error is None:
            if not self.sim.has_unfinished_requests():
                self._wake.clear()
                await self._wake.wait()
            self.step()
            await asyncio.sleep(self.step_interval)
