"""FakeConsoleClient: the ConsoleClient over the real engine core and the FakeExecutor, on a hand-moved clock."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from typing import Any

import pytest

from lm_console.engine.errors import InvalidPromptError
from lm_console.engine.metrics.kv_events import AllBlocksCleared, BlockStored
from lm_console.engine.metrics.stats import BLOCK_STATE_IN_USE, BLOCK_STATE_NULL, SchedulerStats
from lm_console.client.fake import FakeConsoleClient
from lm_console.client.fake_tokenizer import WORDS
from lm_console.client.types import EngineUnavailable, GenParams, KVEventRecord, StreamChunk

STEP_S = 0.05


async def settle() -> None:
    for _ in range(3):
        await asyncio.sleep(0)


class Harness:
    """A manual-step fake client with its stats and events collected, and a clock moved per step."""

    def __init__(self, clock: Any, **kwargs: Any) -> None:
        self.clock = clock
        self.client = FakeConsoleClient(auto_step=False, clock=clock, **kwargs)
        self.stats: list[SchedulerStats] = []
        self.events: list[KVEventRecord] = []
        self.chunks: dict[str, list[StreamChunk]] = {}
        self._tasks: list[asyncio.Task[None]] = []

    async def __aenter__(self) -> Harness:
        await self.client.start()
        self._tasks.append(asyncio.create_task(self._collect(self.client.stats_stream(), self.stats.append)))
        self._tasks.append(asyncio.create_task(self._collect(self.client.kv_events_stream(), self.events.extend)))
        await settle()
        return self

    async def __aexit__(self, *exc: object) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.client.shutdown()

    @staticmethod
    async def _collect(stream: Any, sink: Any) -> None:
        async for item in stream:
            sink(item)

    def submit(self, request_id: str, prompt: str | list[int], max_tokens: int = 8, **params: Any) -> None:
        params.setdefault("ignore_eos", True)
        stream = self.client.generate(prompt, GenParams(max_tokens=max_tokens, **params), request_id)
        self._tasks.append(asyncio.create_task(self._collect(stream, self.chunks.setdefault(request_id, []).append)))

    async def run(self, max_steps: int = 1000) -> None:
        await settle()
        for _ in range(max_steps):
            if not self.client.has_unfinished_requests():
                await settle()
                return
            self.client.step()
            self.clock.advance(STEP_S)
            await settle()
        raise AssertionError("the fake engine did not finish")

    def text(self, request_id: str) -> str:
        return "".join(c.text for c in self.chunks[request_id])


def test_tokens_stats_and_events_come_from_the_engine(clock) -> None:  # noqa: ANN001
    async def scenario() -> Harness:
        async with Harness(clock, num_blocks=64, block_size=4, token_budget=16) as h:
            start = clock()
            h.submit("a", list(range(100, 130)), max_tokens=5)
            await h.run()
            assert [s.timestamp for s in h.stats] == pytest.approx([start + i * STEP_S for i in range(len(h.stats))])
            return h

    h = asyncio.run(scenario())
    chunks = h.chunks["a"]
    assert sum(c.num_new_tokens for c in chunks) == 5 and chunks[-1].finish_reason == "length"
    assert all(word in WORDS for word in h.text("a").split()) and len(h.text("a").split()) == 5
    # 30 prompt tokens at 16 a step: the first token comes out of the second step, at its end.
    model = h.client.executor.model
    assert chunks[0].ttft_s == pytest.approx(STEP_S + model.step_time_s + 14 * model.step_time_per_token_s)
    assert [s.num_scheduled_tokens for s in h.stats[:3]] == [16, 14, 1]  # chunked prefill, then decode
    assert h.stats[0].step_time_s == pytest.approx(model.step_time_s + 16 * model.step_time_per_token_s)
    states = h.stats[0].block_states
    assert states is not None and len(states) == 64 and states[0] == BLOCK_STATE_NULL
    assert states.count(BLOCK_STATE_IN_USE) == 4  # 16 tokens in blocks of 4
    assert all(s.block_states is not None for s in h.stats)  # the fake sends the map every step
    stored = [r for r in h.events if isinstance(r.event, BlockStored)]
    assert stored and stored[0].seq == 1
    assert stored[0].block_hashes == [block_hash.hex() for block_hash in stored[0].event.block_hashes]
    assert sorted({r.seq for r in h.events}) == list(range(1, max(r.seq for r in h.events) + 1))  # gap-free
    assert h.client.core.get_block_pool_state().all_free


def test_same_prompt_same_reply_and_prefix_hits(clock) -> None:  # noqa: ANN001
    async def scenario() -> Harness:
        async with Harness(clock, num_blocks=64, block_size=4) as h:
            h.submit("first", "the paged cache keeps every block of the shared prompt here", max_tokens=6)
            await h.run()
            h.submit("second", "the paged cache keeps every block of the shared prompt here", max_tokens=6)
            await h.run()
            return h

    h = asyncio.run(scenario())
    assert h.text("first") == h.text("second")  # reproducible: no seed, so the prompt decides
    assert h.chunks["first"][-1].num_cached_tokens == 0
    assert h.chunks["second"][-1].num_cached_tokens == 8  # 11 words: two full blocks of 4 hit
    assert sum(s.prefix_cache.hits for s in h.stats) == 8


def test_request_blocks_merges_every_data_parallel_core(clock) -> None:  # noqa: ANN001
    async def scenario() -> None:
        async with Harness(clock, num_blocks=64, block_size=4, data_parallel_size=2) as h:
            for i in range(4):
                h.submit(f"r{i}", [i * 100 + j for j in range(10)], max_tokens=30)
            await settle()
            h.client.step()
            await settle()
            per_core = [core.get_request_blocks() for core in h.client.cores]
            owners = [[r.request_id for r in state.requests] for state in per_core]
            assert owners[0] and owners[1]  # the load landed on both cores
            state = await h.client.request_blocks()
            assert [r.request_id for r in state.requests] == owners[0] + owners[1]  # rank order
            for row in state.requests:
                assert row.status == "RUNNING" and row.num_computed_tokens == 10 and len(row.block_ids[0]) == 3
            assert len(per_core[1].block_hashes) == 2 * 2  # two full blocks of prompt each, hashed
            assert state.block_hashes == per_core[1].block_hashes | per_core[0].block_hashes
            await h.run()
            assert (await h.client.request_blocks()).requests == []

    asyncio.run(scenario())


def test_small_pool_preempts_and_every_stream_ends(clock) -> None:  # noqa: ANN001
    async def scenario() -> Harness:
        async with Harness(clock, num_blocks=24, block_size=4, token_budget=64, max_num_seqs=8) as h:
            for i in range(6):
                h.submit(f"r{i}", [i * 100 + j for j in range(12)], max_tokens=20, seed=i)
            await h.run()
            return h

    h = asyncio.run(scenario())
    assert h.stats[-1].num_preemptions_total > 0 and any(s.num_preempted_reqs for s in h.stats)
    assert all(h.chunks[f"r{i}"][-1].finish_reason == "length" for i in range(6))
    assert all(sum(c.num_new_tokens for c in h.chunks[f"r{i}"]) == 20 for i in range(6))
    assert h.client.core.get_block_pool_state().all_free


def test_abort_reset_and_refusals(clock) -> None:  # noqa: ANN001
    async def scenario() -> Harness:
        async with Harness(clock, num_blocks=64, block_size=4) as h:
            h.submit("long", list(range(200, 220)), max_tokens=100)
            await settle()
            for _ in range(3):
                h.client.step()
            await h.client.abort("long")
            await h.client.abort("long")  # twice: one final chunk
            await settle()
            assert h.chunks["long"][-1].finish_reason == "abort" and sum(c.finished for c in h.chunks["long"]) == 1
            assert not h.client.has_unfinished_requests()
            assert h.client.core.get_block_pool_state().all_free
            assert await h.client.reset_prefix_cache()
            await settle()
            assert isinstance(h.events[-1].event, AllBlocksCleared)  # published at once, not at the next step
            with pytest.raises(InvalidPromptError, match="empty"):
                async for _ in h.client.generate("", GenParams(), "empty"):
                    pass
            with pytest.raises(InvalidPromptError, match=r"\[0, 65536\)"):
                async for _ in h.client.generate([1 << 20], GenParams(), "big"):
                    pass
            return h

    h = asyncio.run(scenario())
    assert h.client.submitted == ["long"]


def test_chat_streams_the_script_and_stops(clock) -> None:  # noqa: ANN001
    async def scenario() -> tuple[list[StreamChunk], list[StreamChunk]]:
        client = FakeConsoleClient(clock=clock, step_interval=0.001, reply=lambda messages: "one two three")
        await client.start()
        messages = [{"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "image", "image": "x"}]}]
        whole = [c async for c in client.chat(messages, GenParams(), "c1")]
        cut = [c async for c in client.chat(messages, GenParams(max_tokens=2), "c2")]
        await client.shutdown()
        with pytest.raises(EngineUnavailable, match="shut down"):
            async for _ in client.generate("again", GenParams(), "c3"):
                pass
        return whole, cut

    whole, cut = asyncio.run(scenario())
    assert "".join(c.text for c in whole) == "one two three" and whole[-1].finish_reason == "stop"
    assert "".join(c.text for c in cut) == "one two" and cut[-1].finish_reason == "stop"  # the cut script ends


def test_running_the_fake_engine_imports_no_torch() -> None:
    code = """
import asyncio, sys
from lm_console.client.fake import FakeConsoleClient
from lm_console.client.types import GenParams

async def main():
    client = FakeConsoleClient(step_interval=0.001)
    await client.start()
    chunks = [c async for c in client.generate("a prompt of a few words", GenParams(max_tokens=4), "r")]
    await client.shutdown()
    assert chunks[-1].finished, chunks

asyncio.run(main())
print(','.join(m for m in ('torch', 'transformers', 'triton', 'numpy') if m in sys.modules))
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == ""
