"""SchedulerConfig: the scheduler's per-step budget and policy."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SchedulerConfig:
    """The per-step budget of the scheduler."""

    max_num_batched_tokens: int = 2048  # tokens per step (>= max_model_len without chunked prefill)
    max_num_seqs: int = 128  # requests per step
    enable_chunked_prefill: bool = True
    log_stats: bool = True  # SchedulerStats on every step's outputs
    # Schedule step N+1 while step N runs (AsyncScheduler: placeholders for the tokens in flight;
    # the executor then keeps max_concurrent_batches = 2 batches in EngineCore's batch queue).
    async_scheduling: bool = False
    policy: str = "fcfs"  # "fcfs" | "priority" (lower Request.priority first, ties by arrival)
