"""KVCacheMetricsCollector: sampled block lifetime, idle before eviction, reuse gaps; its hooks
in the BlockPool and the KV cache manager; the drain into SchedulerStats."""

from __future__ import annotations

import random

import pytest

from lm_console.engine.core.kv_cache import KVCacheManager
from lm_console.engine.core.kv_cache.block_metrics import KVCacheMetricsCollector
from lm_console.engine.core.sched.scheduler import Scheduler
from lm_console.engine.model_runner_output import ModelRunnerOutput
from kv_helpers import build_request

BLOCK_SIZE = 4


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_lifetime_idle_and_reuse_gaps_of_one_block() -> None:
    clock = FakeClock()
    collector = KVCacheMetricsCollector(1.0, clock=clock)
    collector.on_block_allocated(7)  # t=100
    clock.now = 101.0
    collector.on_block_accessed(7)
    clock.now = 104.0
    collector.on_block_accessed(7)
    collector.on_block_accessed(8)  # never sampled: ignored
    clock.now = 110.0
    collector.on_block_evicted(7)
    collector.on_block_evicted(7)  # already ended: nothing more
    stats = collector.take_stats()
    assert stats is not None
    assert stats.lifetimes_s == [10.0] and stats.idle_before_evict_s == [6.0] and stats.reuse_gaps_s == [1.0, 3.0]
    assert collector.take_stats() is None  # drained


def test_idle_before_eviction_is_the_time_since_the_last_access() -> None:
    """A clock near its start (a monotonic clock counts from boot): accessed at 3 s, evicted at
    10 s, the block sat idle 7 s."""
    clock = FakeClock()
    clock.now = 2.0
    collector = KVCacheMetricsCollector(1.0, clock=clock)
    collector.on_block_allocated(5)
    clock.now = 3.0
    collector.on_block_accessed(5)
    clock.now = 10.0
    collector.on_block_evicted(5)
    stats = collector.take_stats()
    assert stats is not None
    assert stats.lifetimes_s == [8.0] and stats.idle_before_evict_s == [7.0] and stats.reuse_gaps_s == [1.0]


def test_a_new_allocation_ends_the_previous_life() -> None:
    clock = FakeClock()
    collector = KVCacheMetricsCollector(1.0, clock=clock)
    collector.on_block_allocated(3)
    clock.now = 102.5
    collector.on_block_allocated(3)  # the block was freed (never cached) and handed out again
    clock.now = 103.0
    collector.on_reset()
    stats = collector.take_stats()
    assert stats is not None and stats.lifetimes_s == [2.5, 0.5] and stats.reuse_gaps_s == []


def test_sampling_fraction() -> None:
    collector = KVCacheMetricsCollector(0.25, rng=random.Random(0))
    for block_id in range(4000):
        collector.on_block_allocated(block_id)
    assert 900 < len(collector.sampled) < 1100
    with pytest.raises(ValueError, match="kv_cache_metrics_sample"):
        KVCacheMetricsCollector(0.0)


def test_pool_hooks_through_the_manager() -> None:
    """Allocation, a prefix-cache hit (touch), then eviction when the blocks are handed out again."""
    clock = FakeClock()
    kv = KVCacheManager(num_blocks=5, block_size=BLOCK_SIZE, max_model_len=64, enable_caching=True)
    kv.block_pool.metrics_collector = KVCacheMetricsCollector(1.0, clock=clock)
    first = build_request("a", list(range(8)), BLOCK_SIZE)
    assert kv.allocate_slots(first, 8) is not None  # 2 blocks, t=100
    kv.free(first)
    clock.now = 102.0
    second = build_request("b", list(range(8)) + [99], BLOCK_SIZE)
    computed, num_hit = kv.get_computed_blocks(second)
    assert num_hit == 8
    kv.allocate_slots(second, 1, num_new_computed_tokens=8, new_computed_blocks=computed)  # hit at t=102
    kv.free(second)
    clock.now = 105.0
    third = build_request("c", list(range(50, 66)), BLOCK_SIZE)
    assert kv.allocate_slots(third, 16) is not None  # 4 blocks: every earlier block is evicted
    stats = kv.block_pool.metrics_collector.take_stats()
    assert stats is not None
    assert sorted(stats.lifetimes_s) == [3.0, 5.0, 5.0]  # the hit blocks lived 5 s, b's own block 3 s
    assert sorted(stats.idle_before_evict_s) == [3.0, 3.0, 3.0] and stats.reuse_gaps_s == [2.0, 2.0]


def test_scheduler_stats_carry_the_observations_once() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=BLOCK_SIZE, max_model_len=64, enable_caching=True)
    kv.block_pool.metrics_collector = KVCacheMetricsCollector(1.0)
    scheduler = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64)
    for request_id, first in (("a", 0), ("b", 100)):  # b needs a's blocks: they are evicted
        scheduler.add_request(build_request(request_id, list(range(first, first + 12)), BLOCK_SIZE))
        output = scheduler.schedule()
        scheduler.update_from_output(output, ModelRunnerOutput([request_id], {request_id: 0}, [[1]]))
        scheduler.finish_requests(request_id, scheduler.requests[request_id].status.FINISHED_STOPPED)
    stats = scheduler.make_stats()
    assert stats.kv_block_residency is not None and len(stats.kv_block_residency.lifetimes_s) == 3
    assert scheduler.make_stats().kv_block_residency is None  # drained
    assert scheduler.make_stats(drain=False).kv_block_residency is None
