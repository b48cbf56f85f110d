"""AsyncLLM: streaming output kinds, stop strings, n > 1, metrics, aborts, stats, dead engine."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from lm_console.engine import AsyncLLM, LLM, RequestOutputKind, SamplingParams
from lm_console.engine.errors import DuplicateRequestError, EngineDeadError, InvalidPromptError
from llm_helpers import assert_no_leaked_blocks

pytestmark = pytest.mark.slow

ENGINE_ARGS = dict(dtype="float32", max_model_len=256, num_gpu_blocks_override=512, stat_loggers=[])


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, timeout=60))


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    engine = AsyncLLM(str(tiny_llama_dir), **ENGINE_ARGS)
    yield engine
    engine.shutdown()


def _params(kind: RequestOutputKind, **kwargs) -> SamplingParams:
    kwargs.setdefault("max_tokens", 24)
    return SamplingParams(temperature=0.0, ignore_eos=True, output_kind=kind, **kwargs)


async def _collect(llm, prompt, params, request_id=None):
    return [out async for out in llm.generate(prompt, params, request_id)]


async def _state(llm):
    return await llm.get_block_pool_state()


def test_delta_concatenates_to_cumulative_and_final_only_yields_once(llm) -> None:
    async def main():
        delta = await _collect(llm, "The history of", _params(RequestOutputKind.DELTA))
        cumulative = await _collect(llm, "The history of", _params(RequestOutputKind.CUMULATIVE))
        final = await _collect(llm, "The history of", _params(RequestOutputKind.FINAL_ONLY))
        assert_no_leaked_blocks(await _state(llm))
        return delta, cumulative, final

    delta, cumulative, final = run(main())
    assert len(final) == 1 and final[0].finished
    assert "".join(o.outputs[0].text for o in delta) == cumulative[-1].outputs[0].text == final[0].outputs[0].text
    assert sum((o.outputs[0].token_ids for o in delta), []) == final[0].outputs[0].token_ids
    assert len(final[0].outputs[0].token_ids) == 24 and len(cumulative) > 1
    assert [o.finished for o in cumulative] == [False] * (len(cumulative) - 1) + [True]


def test_prompt_forms_and_duplicate_ids(llm) -> None:
    tokenizer = llm.get_tokenizer()
    ids = tokenizer.encode("Hello there", add_special_tokens=True)

    async def main():
        params = _params(RequestOutputKind.FINAL_ONLY, max_tokens=4)
        outs = [(await _collect(llm, prompt, params))[0] for prompt in
                ("Hello there", {"prompt": "Hello there"}, {"prompt_token_ids": ids})]
        with pytest.raises(InvalidPromptError):
            await _collect(llm, "", params)
        running = llm.generate("x", _params(RequestOutputKind.DELTA, max_tokens=200), "dup")
        await running.__anext__()
        with pytest.raises(DuplicateRequestError):
            await _collect(llm, "y", params, "dup")
        await running.aclose()
        return outs

    outs = run(main())
    assert outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids == outs[2].outputs[0].token_ids
    assert outs[0].prompt_token_ids == ids


def _spanning_stop_string(tokenizer, token_ids: list[int], text: str) -> tuple[str, int] | None:
    """A 4-character stop string whose first occurrence straddles a token boundary."""
    bounds = [len(tokenizer.decode(token_ids[:k], skip_special_tokens=True)) for k in range(1, len(token_ids))]
    for b in bounds:
        candidate = text[b - 2:b + 2]
        if len(candidate) < 4 or not candidate.strip():
            continue
        start = text.index(candidate)
        if any(start < other < start + len(candidate) for other in bounds):
            return candidate, start
    return None


def test_stop_string_split_across_tokens_is_caught_and_truncated(llm) -> None:
    async def main():
        base = (await _collect(llm, "Count:", _params(RequestOutputKind.FINAL_ONLY)))[0].outputs[0]
        found = _spanning_stop_string(llm.get_tokenizer(), base.token_ids, base.text)
        assert found is not None, base.text
        stop, start = found
        delta = await _collect(llm, "Count:", _params(RequestOutputKind.DELTA, stop=stop))
        cumulative = await _collect(llm, "Count:", _params(RequestOutputKind.CUMULATIVE, stop=stop))
        kept = await _collect(llm, "Count:", _params(RequestOutputKind.FINAL_ONLY, stop=stop,
                                                      include_stop_str_in_output=True))
        assert_no_leaked_blocks(await _state(llm))
        return base.text, stop, start, delta, cumulative, kept

    text, stop, start, delta, cumulative, kept = run(main())
    assert "".join(o.outputs[0].text for o in delta) == text[:start]
    assert cumulative[-1].outputs[0].text == text[:start]
    assert all(stop not in o.outputs[0].text for o in cumulative)
    last = cumulative[-1].outputs[0]
    assert last.finish_reason == "stop" and last.stop_reason == stop
    assert kept[0].outputs[0].text == text[:start + len(stop)]


@pytest.mark.slow
def test_n_greater_than_one_streams_like_the_offline_llm(llm, tiny_llama_dir) -> None:
    params = dict(n=3, temperature=1.0, seed=7, max_tokens=10, ignore_eos=True)

    async def main():
        delta = await _collect(llm, "The sky is", SamplingParams(**params, output_kind=RequestOutputKind.DELTA))
        final = await _collect(llm, "The sky is", SamplingParams(**params, output_kind=RequestOutputKind.FINAL_ONLY))
        return delta, final

    delta, final = run(main())
    streamed: dict[int, list[int]] = {}
    for out in delta:
        for completion in out.outputs:
            streamed.setdefault(completion.index, []).extend(completion.token_ids)
    assert len(final) == 1 and [c.index for c in final[0].outputs] == [0, 1, 2]
    assert streamed == {c.index: c.token_ids for c in final[0].outputs}
    assert delta[-1].finished and not any(o.finished for o in delta[:-1])
    offline = LLM(str(tiny_llama_dir), dtype="float32", max_model_len=256, multiprocess=False)
    reference = offline.generate("The sky is", SamplingParams(**params), use_tqdm=False)[0]
    assert [c.token_ids for c in reference.outputs] == [c.token_ids for c in final[0].outputs]


def test_request_metrics(llm) -> None:
    out = run(_collect(llm, "Timing", _params(RequestOutputKind.FINAL_ONLY, max_tokens=12)))[0]
    m = out.metrics
    assert m.arrival_time <= m.queued_time <= m.first_scheduled_time <= m.first_token_time
    assert m.first_token_time <= m.last_token_time <= m.finished_time
    assert m.num_generation_tokens == 12 and len(m.inter_token_latencies) == 11
    assert 0 <= m.queue_time < m.time_to_first_token <= m.e2e_latency
    assert m.time_per_output_token == pytest.approx(sum(m.inter_token_latencies) / 11)
    assert m.scheduled_time == m.first_scheduled_time


def test_abort_ends_the_stream_and_frees_blocks(llm) -> None:
    async def main():
        outs = []
        async for out in llm.generate("abort me", _params(RequestOutputKind.DELTA, max_tokens=200), "ab"):
            outs.append(out)
            if len(outs) == 3:
                await llm.abort("ab")
        assert_no_leaked_blocks(await _state(llm))
        return outs

    outs = run(main())
    assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "abort" and len(outs) == 4


def test_500_concurrent_requests_with_30_percent_aborted(llm) -> None:
    num_requests, num_break, num_cancel = 500, 75, 75

    async def consume(i: int) -> str:
        kind = "break" if i < num_break else "cancel" if i < num_break + num_cancel else "finish"
        # The aborted ones ask for many tokens and leave at their first output: DELTA outputs
        # merge whatever piled up while the consumer waited, so a fast engine can deliver a short
        # request whole in one output (a break at the second output then never happens).
        params = _params(RequestOutputKind.DELTA, max_tokens=8 if kind == "finish" else 64)
        num_outputs = 0
        async for out in llm.generate(f"request {i}", params, f"req-{i}"):
            num_outputs += 1
            if kind == "break":
                return "aborted"
            if kind == "cancel" and num_outputs == 1:
                # Cancelled while it holds the open generator (closing it must abort). Cancelling
                # at generate()'s next await alone is a race: when the engine has already produced
                # the rest, that await returns at once and the request finishes.
                asyncio.current_task().cancel()
                await asyncio.sleep(0)
        assert out.finished and len(out.outputs[0].token_ids) >= 0
        return "finished"

    async def main():
        tasks = [asyncio.create_task(consume(i)) for i in range(num_requests)]
        results = await asyncio.gather(*tasks, return_exceptions=True)
        deadline = time.monotonic() + 2.0
        while not (state := await _state(llm)).all_free and time.monotonic() < deadline:
            await asyncio.sleep(0.01)  # generators closed by GC abort on the next loop turn
        return results, state

    start = time.monotonic()
    results, state = run(main())
    elapsed = time.monotonic() - start
    outcomes = ["aborted" if isinstance(r, asyncio.CancelledError) else r for r in results]
    assert all(o in ("aborted", "finished") for o in outcomes), [r for r in results if isinstance(r, Exception)]
    assert outcomes.count("aborted") == num_break + num_cancel
    assert outcomes[num_break + num_cancel:] == ["finished"] * (num_requests - num_break - num_cancel)
    assert_no_leaked_blocks(state)
    print(f"500 requests in {elapsed:.1f} s")


def test_stats_stream_and_utility_calls(llm) -> None:
    async def main():
        received = []

        async def watch():
            async for stats in llm.stats_stream():
                received.append(stats)

        watcher = asyncio.create_task(watch())
        # The engine is shared by the module's tests (in random order): the stats of an earlier
        # test's last steps may still be on their way. Let them arrive (0.2 s without a new one),
        # then count only this test's steps.
        seen, quiet_since = -1, asyncio.get_running_loop().time()
        while asyncio.get_running_loop().time() - quiet_since < 0.2:
            if len(received) != seen:
                seen, quiet_since = len(received), asyncio.get_running_loop().time()
            await asyncio.sleep(0.02)
        received.clear()
        await _collect(llm, "stats please", _params(RequestOutputKind.FINAL_ONLY, max_tokens=8))
        await asyncio.sleep(0.1)  # the idle snapshot after the last step
        watcher.cancel()
        stats = await llm.get_stats()
        assert await llm.reset_prefix_cache() is True
        assert await llm.sleep() and await llm.is_sleeping()
        assert await llm.wake_up() and not await llm.is_sleeping()
        return received, stats

    received, stats = run(main())
    assert len(received) >= 8 and received[-1].num_running_reqs == 0
    assert received[-1].block_states is not None and len(received[-1].block_states) == 512
    assert any(s.num_generation_tokens for s in received) and any(s.num_prompt_tokens for s in received)
    assert sum(s.num_generation_tokens for s in received) == 8
    assert stats.num_total_blocks == 511 and stats.num_steps >= 8 and stats.token_budget == 2048
    summary = llm.model_config_summary
    assert summary["num_blocks"] == 512 and summary["dtype"] == "float32" and summary["device"] == "cpu"
    assert summary["kv_cache_dtype"] == "float32"  # resolved: float32 weights keep a float32 cache
    assert summary["max_model_len"] == 256 and llm.kv_events_endpoint is None


def test_killing_the_core_fails_every_caller_within_2s(tiny_llama_dir) -> None:
    async def main():
        async with AsyncLLM(str(tiny_llama_dir), **ENGINE_ARGS) as llm:
            first_outputs = asyncio.Event()

            async def consume(i):
                async for _ in llm.generate(f"long {i}", _params(RequestOutputKind.DELTA, max_tokens=230)):
                    first_outputs.set()

            async def watch():
                async for _ in llm.stats_stream():
                    pass

            tasks = [asyncio.create_task(consume(i)) for i in range(8)] + [asyncio.create_task(watch())]
            await first_outputs.wait()
            utility = asyncio.create_task(llm.get_block_pool_state())
            await asyncio.sleep(0)
            os.kill(llm.engine_core.proc.pid, signal.SIGKILL)
            killed = time.monotonic()
            results = await asyncio.wait_for(asyncio.gather(*tasks, utility, return_exceptions=True), 5)
            elapsed = time.monotonic() - killed
            assert llm.errored and isinstance(llm.dead_error, EngineDeadError)
            later = []
            for call in (lambda: _collect(llm, "again", _params(RequestOutputKind.DELTA)),
                         lambda: llm.abort("x"), lambda: llm.get_stats()):
                try:
                    await call()
                except EngineDeadError as error:
                    later.append(error)
            return results, elapsed, later

    results, elapsed, later = run(main())
    assert all(isinstance(r, EngineDeadError) for r in results), results
    assert elapsed < 2.0 and len(later) == 3
