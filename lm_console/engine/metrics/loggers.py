"""Stat loggers: consumers of SchedulerStats (core) and IterationStats (frontend).

AsyncLLM feeds every logger on each batch of outputs (record) and asks it to report every
`interval_s` (log). LoggingStatLogger prints one vLLM-style line per interval.
"""

from __future__ import annotations

import collections
import logging
import time
from abc import ABC, abstractmethod
from typing import Callable

from lm_console.engine.metrics.stats import IterationStats, SchedulerStats

logger = logging.getLogger("lm_console.engine.metrics")


class StatLoggerBase(ABC):
    """Interface of a stats consumer (a logger, a Prometheus exporter, the console, ...)."""

    interval_s: float = 5.0

    @abstractmethod
    def record(self, scheduler_stats: SchedulerStats | None,
               iteration_stats: IterationStats | None) -> None:
        """Take in one batch of outputs' stats (called from the output handler)."""

    @abstractmethod
    def log(self) -> None:
        """Report what was recorded since the last call (called every interval_s)."""

    def log_engine_initialized(self) -> None:
        """Called once the engine core is ready."""


class PrefixCacheHitRate:
    """Hit rate (tokens) over the most recent lookups, at least max_recent_requests of them."""

    def __init__(self, max_recent_requests: int = 1000) -> None:
        self.max_recent_requests = max_recent_requests
        self._window: collections.deque[tuple[int, int, int]] = collections.deque()
        self._requests = self._queries = self._hits = 0

    def observe(self, requests: int, queries: int, hits: int) -> None:
        if not requests:
            return
        self._window.append((requests, queries, hits))
        self._requests += requests
        self._queries += queries
        self._hits += hits
        while self._window and self._requests - self._window[0][0] >= self.max_recent_requests:
            old_requests, old_queries, old_hits = self._window.popleft()
            self._requests -= old_requests
            self._queries -= old_queries
            self._hits -= old_hits

    def reset(self) -> None:
        self._window.clear()
        self._requests = self._queries = self._hits = 0

    @property
    def hit_rate(self) -> float:
        return self._hits / self._queries if self._queries else 0.0


class LoggingStatLogger(StatLoggerBase):
    """Logs throughput, queue sizes, KV usage and prefix hit rate, one line per interval."""

    def __init__(self, interval_s: float = 5.0, clock: Callable[[], float] = time.monotonic,
                 log: logging.Logger | None = None) -> None:
        self.interval_s = interval_s
        self.clock = clock
        self.logger = log or logger
        self.prefix_cache = PrefixCacheHitRate()
        self.last_scheduler_stats = SchedulerStats()
        self.last_log_time = clock()
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self._last_line_idle = False

    def record(self, scheduler_stats: SchedulerStats | None,
               iteration_stats: IterationStats | None) -> None:
        if iteration_stats is not None:
            self.num_prompt_tokens += iteration_stats.num_prompt_tokens
            self.num_generation_tokens += iteration_stats.num_generation_tokens
        if scheduler_stats is not None:
            self.last_scheduler_stats = scheduler_stats
            prefix = scheduler_stats.prefix_cache
            self.prefix_cache.observe(prefix.requests, prefix.queries, prefix.hits)

    def log(self) -> None:
        now = self.clock()
        elapsed = max(now - self.last_log_time, 1e-9)
        prompt_throughput = self.num_prompt_tokens / elapsed
        generation_throughput = self.num_generation_tokens / elapsed
        self.num_prompt_tokens = self.num_generation_tokens = 0
        self.last_log_time = now
        stats = self.last_scheduler_stats
        idle = (not prompt_throughput and not generation_throughput
                and not stats.num_running_reqs and not stats.num_waiting_reqs)
        if idle and self._last_line_idle:
            return  # one idle line, then silence until something happens
        self._last_line_idle = idle
        self.logger.info(
            "Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, "
            "Running: %d reqs, Waiting: %d reqs, KV cache usage: %.1f%%, "
            "Prefix cache hit rate: %.1f%%",
            prompt_throughput, generation_throughput, stats.num_running_reqs,
            stats.num_waiting_reqs, stats.kv_cache_usage * 100, self.prefix_cache.hit_rate * 100)
