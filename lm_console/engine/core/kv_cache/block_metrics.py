"""KVCacheMetricsCollector: sampled KV block lifetimes (after vLLM's kv_cache_metrics).

A fraction `sample_rate` of block allocations is followed until the block is evicted, i.e. until
its content is dropped: the block is handed to new content (get_new_blocks) or the prefix cache
is reset. For each sampled block it records, in seconds:

- lifetime: allocation -> eviction;
- idle before eviction: the last access (allocation or prefix-cache hit) -> eviction;
- reuse gaps: the time between consecutive accesses (prefix-cache hits after the allocation).

The engine core drains the observations into SchedulerStats each step (take_stats); the
frontend turns them into vLLM's histograms (vllm:kv_block_lifetime_seconds,
vllm:kv_block_idle_before_evict_seconds, vllm:kv_block_reuse_gap_seconds) and the console's
panel. Sampling keeps the cost to a random draw per allocated block.
"""

from __future__ import annotations

import random
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from lm_console.engine.metrics.stats import KVBlockResidencyStats

# Accesses kept per block (reuse gaps come from consecutive pairs): bounded, as a hot block
# can be hit thousands of times.
_MAX_ACCESSES = 4
# Observations held between drains (a stalled consumer must not grow the core's memory).
_MAX_PENDING = 10_000


@dataclass(slots=True)
class _SampledBlock:
    born: float
    accesses: deque[float] = field(default_factory=lambda: deque(maxlen=_MAX_ACCESSES))


class KVCacheMetricsCollector:
    """Follows a sampled fraction of blocks from allocation to eviction (see the module doc)."""

    def __init__(self, sample_rate: float = 0.01, clock: Callable[[], float] = time.monotonic,
                 rng: random.Random | None = None) -> None:
        if not 0.0 < sample_rate <= 1.0:
            raise ValueError(f"kv_cache_metrics_sample={sample_rate!r} must be in (0, 1].")
        self.sample_rate = sample_rate
        self.clock = clock
        self.rng = rng or random.Random()
        self.sampled: dict[int, _SampledBlock] = {}  # block id -> its current life
        self._pending = KVBlockResidencyStats()

    def on_block_allocated(self, block_id: int) -> None:
        """A block starts a new life (its previous one, if sampled, ended just before)."""
        self.on_block_evicted(block_id)
        if self.sample_rate >= 1.0 or self.rng.random() < self.sample_rate:
            now = self.clock()
            sampled = _SampledBlock(now)
            sampled.accesses.append(now)
            self.sampled[block_id] = sampled

    def on_block_accessed(self, block_id: int) -> None:
        """A prefix-cache hit took a reference on the block."""
        sampled = self.sampled.get(block_id)
        if sampled is not None:
            sampled.accesses.append(self.clock())

    def on_block_evicted(self, block_id: int) -> None:
        """The block's content is dropped: record its life if it was sampled."""
        sampled = self.sampled.pop(block_id, None)
        if sampled is None:
            return
        now = self.clock()
        pending = self._pending
        if len(pending.lifetimes_s) >= _MAX_PENDING:
            return  # nobody drains: drop rather than grow
        pending.lifetimes_s.append(now - sampled.born)
        pending.idle_before_evict_s.append(now - sampled.accesses[-1])
        accesses = list(sampled.accesses)
        pending.reuse_gaps_s.extend(b - a for a, b in zip(accesses, accesses[1:]))

    def on_reset(self) -> None:
        """The prefix cache was reset: every sampled block's content is gone."""
        for block_id in list(self.sampled):
            self.on_block_evicted(block_id)

    def take_stats(self) -> KVBlockResidencyStats | None:
        """The observations since the last call (None when there are none)."""
        pending = self._pending
        if not (pending.lifetimes_s or pending.reuse_gaps_s):
            return None
        self._pending = KVBlockResidencyStats()
        return pending
