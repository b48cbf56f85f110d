"""Prefix-cache statistics, counted in tokens and drained by make_prefix_cache_stats().

KVCacheManager.get_computed_blocks records each lookup, as in vLLM's kv_cache_manager.py.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class PrefixCacheStats:
    """Prefix-cache lookups since the last drain.

    Invariants: hits <= queries; preempted_* <= the matching totals. Requests resumed after a
    preemption are counted separately too, because their hits are recomputation savings rather
    than prompt sharing.
    """

    reset: bool = False  # the prefix cache was reset since the last drain
    requests: int = 0  # lookups
    queries: int = 0  # tokens looked up (request.num_tokens per lookup)
    hits: int = 0  # tokens found in the cache
    preempted_requests: int = 0
    preempted_queries: int = 0
    preempted_hits: int = 0

    def record(self, num_tokens: int, num_hits: int, preempted: bool) -> None:
        """Count one lookup of num_tokens tokens that hit num_hits of them."""
        self.requests += 1
        self.queries += num_tokens
        self.hits += num_hits
        if preempted:
            self.preempted_requests += 1
            self.preempted_queries += num_tokens
            self.preempted_hits += num_hits

    @property
    def hit_rate(self) -> float:
        """hits / queries, 0.0 before any query."""
        return self.hits / self.queries if self.queries else 0.0
