"""Liveness (issue 18 item 4): a stopped engine core is declared unresponsive, never waited on forever.

On main every stream, utility call and new request hung after SIGSTOP of the core. The core now
sends heartbeats; the frontend's reader declares EngineUnresponsiveError after
liveness_timeout_s without one. A short timeout here keeps the tests quick; each await has a
hang guard, and no assertion is about how long anything took.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading

import pytest

from lm_console.engine import AsyncLLM, LLM, RequestOutputKind, SamplingParams
from lm_console.engine.errors import EngineDeadError, EngineUnresponsiveError

ENGINE_ARGS = dict(dtype="float32", max_model_len=256, num_gpu_blocks_override=256, liveness_timeout_s=1.5)
pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def _stop(pid: int) -> None:
    os.kill(pid, signal.SIGSTOP)


def _resume(pid: int) -> None:
    os.kill(pid, signal.SIGCONT)


def test_a_stopped_core_fails_every_async_caller_and_check_health(tiny_llama_dir) -> None:
    async def main():
        llm = AsyncLLM(str(tiny_llama_dir), stat_loggers=[], **ENGINE_ARGS)
        pid = llm.engine_core.proc.pid
        try:
            # Busy and idle both send heartbeats: a long request runs without a false alarm.
            params = SamplingParams(max_tokens=200, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
            outputs = [o async for o in llm.generate("warm up", params)]
            assert outputs[-1].finished and not llm.errored
            await llm.check_health()
            started = asyncio.Event()

            async def consume(i: int) -> None:
                async for _ in llm.generate(f"long {i}", SamplingParams(max_tokens=240, ignore_eos=True,
                                                                        output_kind=RequestOutputKind.DELTA)):
                    started.set()

            async def watch() -> None:
                async for _ in llm.stats_stream():
                    pass

            tasks = [asyncio.create_task(consume(i)) for i in range(4)] + [asyncio.create_task(watch())]
            await started.wait()
            _stop(pid)
            utility = asyncio.create_task(llm.get_stats())
            results = await asyncio.wait_for(asyncio.gather(*tasks, utility, return_exceptions=True), 60)
            assert all(isinstance(r, EngineUnresponsiveError) for r in results), results
            assert "unresponsive" in str(results[0]) and llm.errored
            with pytest.raises(EngineUnresponsiveError):
                await llm.check_health()
            with pytest.raises(EngineDeadError):
                async for _ in llm.generate("after", SamplingParams(max_tokens=2)):
                    pass
        finally:
            _resume(pid)
            llm.shutdown()
        assert not llm.engine_core.proc.is_alive()

    asyncio.run(asyncio.wait_for(main(), 120))


def test_a_stopped_idle_core_fails_llm_calls(tiny_llama_dir) -> None:
    llm = LLM(str(tiny_llama_dir), **ENGINE_ARGS)
    pid = llm.engine_core.proc.pid
    try:
        llm.generate("hi", SamplingParams(max_tokens=3), use_tqdm=False)
        _stop(pid)
        errors: list[BaseException] = []

        def call() -> None:
            try:
                llm.get_stats()
            except BaseException as error:  # noqa: BLE001
                errors.append(error)

        thread = threading.Thread(target=call)
        thread.start()
        thread.join(60)
        assert not thread.is_alive() and isinstance(errors[0], EngineUnresponsiveError)
        with pytest.raises(EngineUnresponsiveError):
            llm.generate("again", use_tqdm=False)
        with pytest.raises(EngineUnresponsiveError):
            llm.check_health()
    finally:
        _resume(pid)
        llm.shutdown()


def test_a_core_stopped_mid_batch_ends_llm_generate(tiny_llama_dir) -> None:
    llm = LLM(str(tiny_llama_dir), **ENGINE_ARGS)
    pid = llm.engine_core.proc.pid
    errors: list[BaseException] = []

    def generate() -> None:
        try:
            llm.generate(["long"] * 4, SamplingParams(max_tokens=240, ignore_eos=True), use_tqdm=False)
        except BaseException as error:  # noqa: BLE001
            errors.append(error)

    try:
        thread = threading.Thread(target=generate)
        thread.start()
        while not llm.output_processor.request_states:
            thread.join(0.01)  # wait until the batch is in the engine
        _stop(pid)
        thread.join(60)
        assert not thread.is_alive() and isinstance(errors[0], EngineUnresponsiveError)
    finally:
        _resume(pid)
        llm.shutdown()
