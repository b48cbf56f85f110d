"""Block residency histograms for the console: the engine's sampled KV block lifetimes,
idle times before eviction and reuse gaps (SchedulerStats.kv_block_residency, issue 15),
accumulated since the console started in vLLM's buckets (KV_BLOCK_RESIDENCY_BUCKETS)."""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from lm_console.engine.metrics.stats import KV_BLOCK_RESIDENCY_BUCKETS, KVBlockResidencyStats

SERIES = ("life", "idle", "reuse")  # lifetime, idle before eviction, reuse gap


@dataclass
class Histogram:
    """Counts per bucket (the last bucket: above the largest bound) and a running sum."""

    bounds: list[float] = field(default_factory=lambda: list(KV_BLOCK_RESIDENCY_BUCKETS))
    counts: list[int] = field(default_factory=lambda: [0] * (len(KV_BLOCK_RESIDENCY_BUCKETS) + 1))
    total: int = 0
    sum: float = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += 1
        self.sum += value

    def quantile(self, q: float) -> float | None:
        """The upper bound of the bucket holding the q-quantile (None before any observation)."""
        if not self.total:
            return None
        target, seen = q * self.total, 0
        for index, count in enumerate(self.counts):
            seen += count
            if seen >= target and count:
                return self.bounds[index] if index < len(self.bounds) else float("inf")
        return float("inf")


@dataclass
class BlockResidency:
    """The three histograms, fed with every SchedulerStats that carries observations."""

    lifetime: Histogram = field(default_factory=Histogram)
    idle: Histogram = field(default_factory=Histogram)
    reuse_gap: Histogram = field(default_factory=Histogram)

    def add(self, stats: KVBlockResidencyStats) -> None:
        for value in stats.lifetimes_s:
            self.lifetime.observe(value)
        for value in stats.idle_before_evict_s:
            self.idle.observe(value)
        for value in stats.reuse_gaps_s:
            self.reuse_gap.observe(value)

    def series(self) -> list[tuple[str, Histogram]]:
        return list(zip(SERIES, (self.lifetime, self.idle, self.reuse_gap)))
