"""Data parallelism end to end: N engine-core processes behind one frontend (lm_console/engine/frontend/dp_client.py)."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from lm_console.engine import LLM, SamplingParams
from lm_console.engine.errors import EngineDeadError, InvalidEngineArgsError
from lm_console.engine.frontend.async_llm import AsyncLLM
from lm_console.engine.frontend.dp_client import SyncDPClient
from lm_console.engine.metrics.loggers import StatLoggerBase
from lm_console.engine.metrics.stats import SchedulerStats
from broken_variants import rank1_attention_zeroed
from llm_helpers import assert_all_equal, random_prompts, sigkill_during_generate, text_prompts

pytestmark = pytest.mark.slow

TINY_ARGS = dict(dtype="float32", max_model_len=256, num_gpu_blocks_override=96, block_size=16)


def _greedy(llm: LLM, prompts: list[list[int]], max_tokens: int = 12):
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=2)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.num_cached_tokens, [sorted(d) for d in o.outputs[0].logprobs])
            for o in outputs]


def _assert_no_leaks(llm: LLM) -> None:
    states = llm.engine_core.get_block_pool_state_per_core()
    assert [state.all_free for state in states] == [True] * len(states)
    assert llm.get_block_pool_state().all_free


@pytest.fixture(scope="module")
def dp_llm(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), data_parallel_size=2, data_parallel_routing="prefix", **TINY_ARGS)
    yield llm
    llm.shutdown()


def test_dp2_greedy_equals_dp1_with_both_cores_used_and_no_leaks(dp_llm, tiny_llama_dir) -> None:
    single = LLM(str(tiny_llama_dir), multiprocess=False, **TINY_ARGS)
    prompts = random_prompts(single.config.model_config.vocab_size, 8, 5, 70, seed=3)
    # The second pass runs on prefix-cache hits: prefix routing sends each prompt back to its core.
    expected = [_greedy(single, prompts) for _ in range(2)]
    single.shutdown()
    assert isinstance(dp_llm.engine_core, SyncDPClient)
    # The module's engine: other tests (in any order) may have routed requests before this one.
    before = [core["num_routed"] for core in dp_llm.engine_core.router.snapshot()]
    assert_all_equal([_greedy(dp_llm, prompts) for _ in range(2)], expected, "DP=2 vs DP=1 (pass 1, pass 2)")
    routed = [core["num_routed"] - n for core, n in zip(dp_llm.engine_core.router.snapshot(), before)]
    assert routed == [8, 8]  # the first pass spread 4 and 4 over the idle cores
    _assert_no_leaks(dp_llm)
    assert dp_llm.get_request_blocks().requests == []  # one merged answer over both cores
    per_core = dp_llm.engine_core.get_stats_per_core()
    assert [stats.engine_index for stats in per_core] == [0, 1]
    assert all(stats.num_steps > 0 for stats in per_core)
    assert dp_llm.get_stats().num_steps == sum(stats.num_steps for stats in per_core)


def test_negative_control_a_broken_core_fails_the_dp_check(tiny_llama_dir) -> None:
    """The DP check (both passes equal to DP=1) when core 1's model lost the attention of half its
    heads (tests/broken_variants.py; emulated in-process: the prompts core 1 would serve, every
    other one, come from the broken engine) must fail."""
    single = LLM(str(tiny_llama_dir), multiprocess=False, **TINY_ARGS)
    prompts = random_prompts(single.config.model_config.vocab_size, 8, 5, 70, seed=3)
    expected = [_greedy(single, prompts) for _ in range(2)]
    single.shutdown()
    with rank1_attention_zeroed():
        single = LLM(str(tiny_llama_dir), multiprocess=False, **TINY_ARGS)
        broken = [_greedy(single, prompts) for _ in range(2)]
        single.shutdown()
    mixed = [[good if i % 2 == 0 else bad for i, (good, bad) in enumerate(zip(g, b))]
             for g, b in zip(expected, broken)]
    with pytest.raises(AssertionError, match="exactly equal"):
        assert_all_equal(mixed, expected, "DP=2 vs DP=1 (pass 1, pass 2)")
    assert sum(a != b for a, b in zip(mixed[0], expected[0])) >= 3  # 3 of core 1's 4 prompts at least


def test_prefix_routing_follows_the_cached_prefix(dp_llm) -> None:
    vocab = dp_llm.config.model_config.vocab_size
    first, second = random_prompts(vocab, 2, 48, 48, seed=11)
    dp_llm.generate([{"prompt_token_ids": p} for p in (first, second)],
                    SamplingParams(max_tokens=2), use_tqdm=False)  # first -> core 0, second -> core 1
    # Reversed: least-loaded routing would send each to the other core (a miss); prefix routing hits.
    outputs = dp_llm.generate([{"prompt_token_ids": p + [7, 8, 9]} for p in (second, first)],
                              SamplingParams(max_tokens=2), use_tqdm=False)
    assert [o.num_cached_tokens for o in outputs] == [48, 48]
    _assert_no_leaks(dp_llm)


def test_killing_one_core_fails_every_caller_within_2s_and_stops_the_other(tiny_llama_dir) -> None:
    llm = LLM(str(tiny_llama_dir), data_parallel_size=2, **TINY_ARGS)
    pids = llm.engine_core.core_pids
    error, waited = sigkill_during_generate(
        llm, lambda: all(core["in_flight"] for core in llm.engine_core.router.snapshot()), pids[1],
        num_requests=6, join_s=5)  # once both cores hold requests
    assert isinstance(error, EngineDeadError)
    assert "core 1" in str(error) and waited < 2.0
    with pytest.raises(EngineDeadError):
        llm.get_stats()
    with pytest.raises(EngineDeadError):
        llm.generate("again", use_tqdm=False)
    llm.shutdown()
    assert not any(core.proc.is_alive() for core in llm.engine_core.cores)  # no orphan core
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


class _Recorder(StatLoggerBase):
    interval_s = 3600.0

    def __init__(self) -> None:
        self.stats: list[SchedulerStats] = []

    def record(self, scheduler_stats, iteration_stats) -> None:  # noqa: ANN001
        if scheduler_stats is not None:
            self.stats.append(scheduler_stats)

    def log(self) -> None:
        pass


def test_async_llm_streams_tagged_stats_and_events_and_dies_with_a_core(tiny_llama_dir) -> None:
    async def main() -> None:
        recorder = _Recorder()
        llm = AsyncLLM(str(tiny_llama_dir), data_parallel_size=2, distributed_executor_backend="fake",
                       enable_kv_cache_events=True, stat_loggers=[recorder], **TINY_ARGS)
        try:
            stats_seen: set[int] = set()
            event_ranks: set[int | None] = set()

            async def watch_stats() -> None:
                async for stats in llm.stats_stream():
                    stats_seen.add(stats.engine_index)

            async def watch_events() -> None:
                async for batch in llm.kv_events_stream():
                    event_ranks.add(batch.data_parallel_rank)

            watchers = [asyncio.ensure_future(watch_stats()), asyncio.ensure_future(watch_events())]
            await asyncio.sleep(0)

            async def run(i: int) -> int:
                params = SamplingParams(max_tokens=4, ignore_eos=True)
                async for out in llm.generate({"prompt_token_ids": list(range(10 + i, 50 + i))}, params, f"r{i}"):
                    last = out
                return len(last.outputs[0].token_ids)

            assert await asyncio.gather(*(run(i) for i in range(4))) == [4] * 4
            assert stats_seen == {0, 1} and event_ranks == {0, 1}
            assert (await llm.get_block_pool_state()).all_free
            # Stat loggers see one engine: both cores' blocks, every core's latest gauges.
            per_core_blocks = llm.config.cache_config.num_blocks - 1
            assert recorder.stats and recorder.stats[-1].num_total_blocks == 2 * per_core_blocks

            started = asyncio.Event()

            async def long_request() -> None:
                params = SamplingParams(max_tokens=230, ignore_eos=True)
                async for _ in llm.generate({"prompt_token_ids": [5] * 20}, params, "long"):
                    started.set()

            task = asyncio.ensure_future(long_request())
            # Bounded: the fake engine is fast, and a request that already finished has no owner.
            await asyncio.wait_for(started.wait(), 30)
            assert llm.engine_core.router.owner_of("long") is not None
            os.kill(llm.engine_core.core_pids[0], signal.SIGKILL)
            with pytest.raises(EngineDeadError):
                await asyncio.wait_for(task, 2.0)
            with pytest.raises(EngineDeadError):
                await llm.get_stats()
            for watcher in watchers:
                with pytest.raises(EngineDeadError):
                    await asyncio.wait_for(watcher, 2.0)
            assert llm.errored
        finally:
            llm.shutdown()
        assert not any(core.proc.is_alive() for core in llm.engine_core.cores)

    asyncio.run(main())


@pytest.mark.parametrize(("args", "match"), [
    (dict(data_parallel_size=2, multiprocess=False), "multiprocess=True"),
    (dict(data_parallel_size=2, data_parallel_backend="ray", multiprocess=False), "multiprocess=True"),
    (dict(data_parallel_routing="prefix", enable_prefix_caching=False), "enable_prefix_caching"),
    (dict(data_parallel_routing="random"), "'least_loaded', 'prefix'"),
    (dict(data_parallel_size=0), ">= 1 and <= 64"),
    (dict(data_parallel_size=2, data_parallel_rank=2), "data_parallel_rank"),
    (dict(data_parallel_size=2, kv_events_endpoint="tcp://127.0.0.1:5557"), "cannot be shared"),
])
def test_data_parallel_arguments_are_checked(args, match) -> None:
    with pytest.raises(InvalidEngineArgsError, match=match):
        LLM(None, **args)


@pytest.mark.slow
def test_dp2_equals_dp1_on_the_embedded_model(embedded_model_dir) -> None:
    args = dict(dtype="float32", max_model_len=512, num_gpu_blocks_override=128)
    single = LLM(None, **args)
    prompts = text_prompts(single.get_tokenizer(), 4, 5, 100)
    expected = _greedy(single, prompts, 12)
    single.shutdown()
    llm = LLM(None, data_parallel_size=2, **args)
    try:
        assert _greedy(llm, prompts, 12) == expected
        _assert_no_leaks(llm)
    finally:
        llm.shutdown()


def test_merged_answers_count_every_core() -> None:
    from lm_console.engine.frontend.dp_client import merge_results
    from lm_console.engine.metrics.stats import BlockPoolState

    stats = [SchedulerStats(num_running_reqs=2, num_waiting_reqs=1, kv_cache_usage=0.5, num_total_blocks=10,
                            num_free_blocks=5, num_preemptions_total=3, engine_index=0),
             SchedulerStats(num_running_reqs=1, kv_cache_usage=0.0, num_total_blocks=30, num_free_blocks=30,
                            engine_index=1)]
    merged = merge_results("get_stats", stats)
    assert (merged.num_running_reqs, merged.num_waiting_reqs, merged.num_total_blocks) == (3, 1, 40)
    assert merged.kv_cache_usage == pytest.approx(5 / 40) and merged.num_preemptions_total == 3
    pools = [BlockPoolState(num_blocks=11, num_free_blocks=10, num_cached_blocks=2, num_running_reqs=0,
                            num_waiting_reqs=0, block_states=b"\x03" + b"\x00" * 10, block_ref_counts=b"\x00" * 11)] * 2
    assert merge_results("get_block_pool_state", pools).all_free
    leaky = [pools[0], BlockPoolState(11, 9, 0, 1, 0, b"\x03" + b"\x01" + b"\x00" * 9, b"\x00" * 11)]
    assert not merge_results("get_block_pool_state", leaky).all_free
    assert merge_results("reset_prefix_cache", [True, False]) is False
    assert merge_results("get_prefix_cache_hashes", [[b"a"], [b"b", b"c"]]) == [b"a", b"b", b"c"]
    # The inspector's poll: one RequestBlocksState with every core's requests (not a list per core).
    from lm_console.engine.metrics.stats import RequestBlocks, RequestBlocksState

    rows = [RequestBlocks("a", "RUNNING", 0, 16, 16, 0, [[1]]), RequestBlocks("b", "WAITING", 1, 8, 0, -1, [[]]),
            RequestBlocks("c", "RUNNING", 0, 32, 32, 16, [[1, 2]])]
    blocks = merge_results("get_request_blocks", [RequestBlocksState(rows[:2], {1: b"h0"}),
                                                  RequestBlocksState(rows[2:], {1: b"h1", 2: b"h2"})])
    assert isinstance(blocks, RequestBlocksState) and blocks.requests == rows
    assert blocks.block_hashes == {1: b"h0", 2: b"h2"}  # block ids are per core: the lowest rank's on a clash


def test_engine_wide_stats_keep_the_reporting_steps_block_residency() -> None:
    """The loggers' merged view of several cores carries the reporting step's own observations,
    the KV block residency samples included (the /metrics histograms read them)."""
    from types import SimpleNamespace

    from lm_console.engine.frontend.dp_client import DPClient
    from lm_console.engine.metrics.stats import KVBlockResidencyStats

    residency = KVBlockResidencyStats(lifetimes_s=[0.5], idle_before_evict_s=[0.1], reuse_gaps_s=[0.2])
    client = SimpleNamespace(_latest_stats={0: SchedulerStats(num_running_reqs=2, engine_index=0)})
    step = SchedulerStats(num_running_reqs=1, num_generation_tokens=3, engine_index=1, kv_block_residency=residency)
    merged = DPClient.engine_wide_stats(client, step)  # type: ignore[arg-type]
    assert merged.num_running_reqs == 3 and merged.num_generation_tokens == 3
    assert merged.kv_block_residency == residency
