"""Scene recordings: what a SteppedEngineClient gave the console, step by step, and its replay.

A screenshot scene drives the console over the real engine (SteppedEngineClient) with `record`
on: every step's stream chunks, stats and KV events, every poll of the core's requests and every
prompt decode are kept, in order. ReplayClient plays them back to the same scene, step by step,
with no engine: the console renders the same picture, so a test can tell when a committed
screenshot no longer matches what the app renders, in a second (tests/lm_console/test_screenshots.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec

from lm_console.engine.metrics.stats import RequestBlocksState, SchedulerStats
from lm_console.client.fake import FakeConsoleClient, _Stream
from lm_console.client.types import EngineInfo, GenParams, KVEventRecord, StreamChunk


class Frame(msgspec.Struct):
    """One engine step as the console received it: chunks, then stats, then KV events."""

    chunks: list[StreamChunk] = msgspec.field(default_factory=list)
    stats: list[SchedulerStats] = msgspec.field(default_factory=list)
    events: list[list[KVEventRecord]] = msgspec.field(default_factory=list)
    busy: bool = False  # the engine had unfinished requests after the step


class Recording(msgspec.Struct):
    """A scene's engine side: the header info, the steps, the core polls and the decodes (in call order)."""

    info: EngineInfo
    frames: list[Frame] = msgspec.field(default_factory=list)
    polls: list[RequestBlocksState] = msgspec.field(default_factory=list)
    decodes: list[str] = msgspec.field(default_factory=list)

    def save(self, path: Path) -> None:
        path.write_bytes(msgspec.json.encode(self) + b"\n")

    @classmethod
    def load(cls, path: Path) -> Recording:
        return msgspec.json.decode(path.read_bytes(), type=cls)


class ReplayClient(FakeConsoleClient):
    """Plays a Recording back: step() delivers the next recorded step; no engine, no model."""

    def __init__(self, recording: Recording, *, clock: Any) -> None:
        self.recording = recording
        self.info = recording.info
        self.core = None
        self._init_client_state(clock=clock, auto_step=False, step_interval=0.05)
        self._next_frame = 0
        self._next_poll = 0
        self._next_decode = 0

    def has_unfinished_requests(self) -> bool:
        """As the engine answered after the last replayed step (before the first: True if any)."""
        frames = self.recording.frames
        if self._next_frame == 0:
            return bool(frames)
        return self._next_frame < len(frames) and frames[self._next_frame - 1].busy

    def step(self) -> None:
        if not self.has_unfinished_requests():
            return
        frame = self.recording.frames[self._next_frame]
        self._next_frame += 1
        for chunk in frame.chunks:
            stream = self._streams.get(chunk.request_id)
            if stream is not None and not stream.finished:
                stream.finished = chunk.finished
                stream.queue.put_nowait(chunk)
        for stats in frame.stats:
            self.push_stats(stats)
        for records in frame.events:
            self.push_events(records)

    async def chat(self, messages: list[dict[str, Any]], params: GenParams, request_id: str) -> AsyncIterator[StreamChunk]:
        async for chunk in self._run(request_id, None, params, script=None):
            yield chunk

    async def _run(self, request_id: str, prompt: Any, params: GenParams,
                   script: list[str] | None) -> AsyncIterator[StreamChunk]:
        stream = _Stream(asyncio.Queue(), self.clock(), 0, None)
        self._streams[request_id] = stream
        self.submitted.append(request_id)
        try:
            while True:
                chunk = await stream.queue.get()
                yield chunk
                if chunk.finished:
                    return
        finally:
            del self._streams[request_id]

    async def abort(self, request_id: str) -> None:
        stream = self._streams.get(request_id)
        if stream is not None and not stream.finished:
            stream.finished = True
            stream.queue.put_nowait(StreamChunk(request_id, finished=True, finish_reason="abort"))

    async def request_blocks(self, block_ids: list[int] | None = None) -> RequestBlocksState:
        polls = self.recording.polls
        index = min(self._next_poll, len(polls) - 1)
        self._next_poll += 1
        return polls[index] if polls else RequestBlocksState([], {})

    def decode_prompt(self, token_ids: list[int]) -> str:
        decodes = self.recording.decodes
        index = self._next_decode
        self._next_decode += 1
        return decodes[index] if index < len(decodes) else ""

    async def reset_prefix_cache(self) -> bool:
        return False

    async def shutdown(self) -> None:
        self._is_shut_down = True
