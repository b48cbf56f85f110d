"""SchedulerStats: the per-step snapshot the engine core attaches to EngineCoreOutputs."""

from __future__ import annotations

import msgspec


class PrefixCacheStatsSnapshot(msgspec.Struct, array_like=True, gc=False):
    """Prefix-cache lookups since the last snapshot, counted in tokens."""

    requests: int = 0
    queries: int = 0
    hits: int = 0


class SchedulerStats(msgspec.Struct, array_like=True, gc=False):
    """Scheduler and KV cache state after one step (the console's main feed)."""

    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    num_preempted_reqs: int = 0  # preemptions during this step
    num_scheduled_tokens: int = 0
    token_budget: int = 0
    kv_cache_usage: float = 0.0
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    prefix_cache: PrefixCacheStatsSnapshot = msgspec.field(default_factory=PrefixCacheStatsSnapshot)
    step_time_s: float = 0.0
    num_steps: int = 0
