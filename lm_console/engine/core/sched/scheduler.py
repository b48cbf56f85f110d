"""Scheduler: continuous batching under one token budget (after vLLM's Scheduler).

The class is assembled from one module per concept, each building on the one before:
scheduler_base.py (state, requests in and out, finishing and freeing), preemption.py (victims,
priority), step_scheduling.py (schedule(): RUNNING, then WAITING, then the SchedulerOutput;
step_state.py holds its per-step records), output_update.py (update_from_output, stop checks);
the stats snapshot is here. AsyncScheduler (async_scheduler.py) overrides a few of their hooks.
"""

from __future__ import annotations

import time

from lm_console.engine.core.sched.output_update import OutputUpdate
from lm_console.engine.core.sched.step_scheduling import StepScheduling
from lm_console.engine.metrics.stats import PrefixCacheStatsSnapshot, SchedulerStats


class Scheduler(StepScheduling, OutputUpdate):
    """Decides, each step, how many tokens every request computes (after vLLM's Scheduler).

    There are no prefill and decode phases: a request's progress is num_computed_tokens, and
    each step gives RUNNING requests their share of the token budget first, then admits
    WAITING ones. When allocate_slots fails, the latest-arrived running request is preempted
    (its blocks freed, to be recomputed later). Two composed objects carry the optional
    features, each with a do-nothing default: `encoder_scheduler` (the encoder budget and cache
    of multimodal models) and `kv_transfer` (the KV connector's admission and delayed frees).
    Invariant: every request in `running` holds KV blocks; in `waiting` only those parked for
    (or back from) a KV connector load do (see kv_connector_scheduling.py).
    """

    # -- stats ----------------------------------------------------------------------------
    def make_stats(self, drain: bool = True) -> SchedulerStats:
        """Snapshot for the console; drains the prefix-cache counters unless drain=False."""
        kv = self.kv_cache_manager
        prefix = kv.make_prefix_cache_stats() if drain else kv.prefix_cache_stats
        pool = kv.block_pool
        return SchedulerStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting),
            num_preempted_reqs=self._num_preempted_last_step,
            num_scheduled_tokens=self._last_num_scheduled_tokens,
            token_budget=self.max_num_scheduled_tokens,
            kv_cache_usage=kv.usage,
            num_free_blocks=pool.get_num_free_blocks(),
            num_total_blocks=pool.num_gpu_blocks - 1,
            prefix_cache=PrefixCacheStatsSnapshot(
                requests=prefix.requests, queries=prefix.queries, hits=prefix.hits
            ) if prefix is not None else PrefixCacheStatsSnapshot(),
            num_prompt_tokens=self._last_num_prompt_tokens,
            num_generation_tokens=self._last_num_generation_tokens,
            num_preemptions_total=self.num_preemptions_total,
            timestamp=time.time(),
            encoder_cache=self.encoder_scheduler.make_stats(),
            kv_tiers=self.kv_transfer.kv_tier_stats,
            kv_block_residency=(pool.metrics_collector.take_stats()
                                if drain and pool.metrics_collector is not None else None),
        )
