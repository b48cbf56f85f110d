"""Preemption: free a running request's blocks for others (FCFS: latest arrival; priority: lowest)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from lm_console.engine.core.sched.scheduler_base import SchedulerBase
from lm_console.engine.core.sched.step_state import _StepSchedule
from lm_console.engine.protocol import EngineCoreEventType
from lm_console.engine.request import Request, RequestStatus

if TYPE_CHECKING:
    from lm_console.engine.core.kv_cache.manager import KVCacheBlocks


class SchedulerPreemption(SchedulerBase):
    """Picks and preempts victims when the KV cache is full or a higher-priority request waits."""

    def _allocate_or_preempt(self, request: Request, num_new_tokens: int,
                             step: _StepSchedule) -> KVCacheBlocks | None:
        """allocate_slots for a running request, preempting victims (_pick_victim) until the
        blocks fit; None when the request itself had to be preempted."""
        while True:
            new_blocks = self.kv_cache_manager.allocate_slots(request, num_new_tokens)
            if new_blocks is not None:
                return new_blocks
            victim = self._pick_victim()
            self._preempt_running(victim, step)
            if victim is request:
                return None

    def _pick_victim(self) -> Request:
        """The running request to preempt: FCFS the latest arrived (the back of `running`);
        priority the lowest priority (the highest value), the latest arrival among equals."""
        if self.policy == "priority":
            return max(self.running, key=lambda r: (r.priority, r.arrival_time))
        return self.running[-1]

    def _preempt_running(self, victim: Request, step: _StepSchedule) -> None:
        """Preempt a running request; if it was scheduled earlier in this step, unschedule it
        (its tokens go back to the budget, and the worker only hears that it was preempted)."""
        self.running.remove(victim)
        num_tokens = step.num_scheduled_tokens.pop(victim.request_id, None)
        if num_tokens is not None:
            step.token_budget += num_tokens
            step.cached_reqs.remove(victim)
            step.new_block_ids.pop(victim.request_id, None)
        self._preempt(victim)
        step.preempted.append(victim)

    def _preempt_for(self, request: Request, step: _StepSchedule) -> bool:
        """Priority policy: preempt one running request of lower priority than the waiting
        `request` (the lowest, latest first) to make room for it; False when there is none."""
        if self.policy != "priority" or not self.running:
            return False
        victim = self._pick_victim()
        if victim.priority <= request.priority:
            return False  # equals keep their places: only a strictly higher priority preempts
        self._preempt_running(victim, step)
        return True

    def _preempt(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        self.encoder_scheduler.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions_total += 1
        if self.log_stats:
            request.record_event(EngineCoreEventType.PREEMPTED)
        self.waiting.prepend_request(request)
