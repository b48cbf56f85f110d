"""SchedulerConfig: the scheduler's per-step budget and policy."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from lm_console.engine.config.fields import DeclaredConfig, knob

SchedulingPolicy = Literal["fcfs", "priority"]


@dataclass(frozen=True)
class SchedulerConfig(DeclaredConfig):
    """The per-step budget of the scheduler."""

    # Without chunked prefill EngineArgs raises it to max_model_len (a prompt is one step's work).
    max_num_batched_tokens: int = knob(2048, ge=1, help="Token budget of one step.")
    max_num_seqs: int = knob(128, ge=1, help="Most requests in one step.")
    enable_chunked_prefill: bool = knob(True, cli=None, help="Split long prompts over steps.")
    log_stats: bool = knob(True, cli=None, help="SchedulerStats on every step's outputs.")
    # The executor then keeps max_concurrent_batches = 2 batches in EngineCore's batch queue.
    async_scheduling: bool = knob(
        False, help="Schedule step N+1 while step N runs (placeholders for the tokens in flight).")
    policy: SchedulingPolicy = knob(
        "fcfs", arg="scheduling_policy",
        help="fcfs | priority (requests' `priority`: a lower value first, ties by arrival; it preempts lower ones).")
