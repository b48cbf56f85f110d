"""LoggingStatLogger: one vLLM-style line per interval, throughput from IterationStats."""

from __future__ import annotations

import logging

from lm_console.engine.metrics.loggers import LoggingStatLogger, PrefixCacheHitRate, StatLoggerBase
from lm_console.engine.metrics.stats import IterationStats, PrefixCacheStatsSnapshot, SchedulerStats


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_one_line_with_throughput_queues_usage_and_hit_rate(caplog) -> None:
    clock = FakeClock()
    stat_logger = LoggingStatLogger(interval_s=5.0, clock=clock)
    assert isinstance(stat_logger, StatLoggerBase)
    for _ in range(5):
        stat_logger.record(
            SchedulerStats(num_running_reqs=3, num_waiting_reqs=2, kv_cache_usage=0.25,
                           prefix_cache=PrefixCacheStatsSnapshot(requests=1, queries=100, hits=40)),
            IterationStats(num_prompt_tokens=100, num_generation_tokens=10))
    clock.now += 5.0
    with caplog.at_level(logging.INFO, logger="lm_console.engine.metrics"):
        stat_logger.log()
    (record,) = caplog.records
    assert record.getMessage() == (
        "Avg prompt throughput: 100.0 tokens/s, Avg generation throughput: 10.0 tokens/s, "
        "Running: 3 reqs, Waiting: 2 reqs, KV cache usage: 25.0%, Prefix cache hit rate: 40.0%")


def test_idle_engine_logs_one_line_then_stays_quiet(caplog) -> None:
    clock = FakeClock()
    stat_logger = LoggingStatLogger(clock=clock)
    with caplog.at_level(logging.INFO, logger="lm_console.engine.metrics"):
        for _ in range(3):
            clock.now += 5.0
            stat_logger.log()
        stat_logger.record(SchedulerStats(num_running_reqs=1), IterationStats(num_generation_tokens=5))
        clock.now += 5.0
        stat_logger.log()
    assert len(caplog.records) == 2
    assert "Avg generation throughput: 1.0 tokens/s, Running: 1 reqs" in caplog.records[1].getMessage()


def test_prefix_hit_rate_covers_the_most_recent_requests() -> None:
    rate = PrefixCacheHitRate(max_recent_requests=10)
    rate.observe(requests=10, queries=100, hits=0)
    rate.observe(requests=10, queries=100, hits=100)  # the old window drops out
    assert rate.hit_rate == 1.0
    rate.observe(requests=5, queries=100, hits=0)
    assert rate.hit_rate == 0.5
    rate.reset()
    assert rate.hit_rate == 0.0
