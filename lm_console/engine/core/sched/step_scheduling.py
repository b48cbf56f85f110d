"""schedule(): RUNNING requests first, then WAITING ones, then the step's SchedulerOutput."""

from __future__ import annotations

from lm_console.engine.core.sched.preemption import SchedulerPreemption
from lm_console.engine.core.sched.step_state import _Admission, _StepSchedule
from lm_console.engine.protocol import EngineCoreEventType
from lm_console.engine.request import Request, RequestStatus
from lm_console.engine.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput


class StepScheduling(SchedulerPreemption):
    """One schedule() call: phase 1 (RUNNING), phase 2 (WAITING), phase 3 (the output)."""

    # -- schedule -------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """Phase 1: RUNNING requests; phase 2: WAITING requests; phase 3: build the output."""
        step = _StepSchedule(token_budget=self.max_num_scheduled_tokens)
        self.encoder_scheduler.begin_step()
        self._schedule_running(step)
        # Admit waiting requests only when nothing was preempted: a preemption means memory is
        # short, and admitting more would just preempt again.
        if not step.preempted:
            self._schedule_waiting(step)
        scheduler_output = self._make_scheduler_output(step)
        self._update_after_schedule(scheduler_output, len(step.preempted))
        return scheduler_output

    def _schedule_running(self, step: _StepSchedule) -> None:
        """Phase 1: each RUNNING request in turn gets the tokens it still needs (one to decode, a
        prefill chunk up to the budget); when the KV cache is full, the latest-arrived running
        request is preempted, possibly this one (then the phase ends)."""
        req_index = 0
        while req_index < len(self.running) and step.token_budget > 0:
            request = self.running[req_index]
            req_index += 1
            num_new_tokens = min(
                self._num_tokens_to_compute(request) - request.num_computed_tokens,
                step.token_budget,
                self.max_model_len - request.num_computed_tokens,
            )
            if num_new_tokens <= 0:
                continue
            plan = self.encoder_scheduler.try_schedule(request, request.num_computed_tokens, num_new_tokens)
            if plan is not None:
                num_new_tokens = plan.num_new_tokens
                if num_new_tokens <= 0:
                    continue  # an image it reached cannot be encoded this step
            num_preempted = len(step.preempted)
            new_blocks = self._allocate_or_preempt(request, num_new_tokens, step)
            if new_blocks is None:
                break
            if len(step.preempted) != num_preempted:  # a victim may have sat before this request
                req_index = self.running.index(request) + 1
            self.encoder_scheduler.commit(request, plan)
            step.cached_reqs.append(request)
            step.new_block_ids[request.request_id] = new_blocks.get_block_ids() if new_blocks.blocks[0] else None
            step.add(request, num_new_tokens)

    def _num_tokens_to_compute(self, request: Request) -> int:
        """The tokens a running request's KV should cover after its next step (the async
        scheduler adds the tokens still in flight)."""
        return request.num_tokens

    def _schedule_waiting(self, step: _StepSchedule) -> None:
        """Phase 2: admit WAITING requests in queue order while the budget, the seats
        (max_num_seqs) and the KV cache last. Requests a KV connector is not ready for, or that
        park for an async load, keep their place at the queue's front."""
        skipped: list[Request] = []
        unparked = False
        while self.waiting and step.token_budget > 0:
            request = self.waiting.peek_request()
            if request.status == RequestStatus.WAITING_FOR_FSM:
                so_request = request.structured_output_request
                assert so_request is not None
                if not so_request.is_grammar_ready():
                    skipped.append(self.waiting.pop_request())  # still compiling: ask next step
                    continue
                if so_request.error is not None:
                    self._fail_request(self.waiting.pop_request(), so_request.error)
                    continue
                request.status = RequestStatus.WAITING
            if len(self.running) >= self.max_num_running_reqs and not self._preempt_for(request, step):
                break  # no seat, and none a lower-priority request could give up
            admission = self._get_computed_tokens(request)
            if admission is None:
                skipped.append(self.waiting.pop_request())
                continue
            if not self._plan_new_tokens(request, admission, step.token_budget):
                break
            new_blocks = self.kv_cache_manager.allocate_slots(
                request, admission.num_new_tokens, num_new_computed_tokens=admission.num_local_tokens,
                new_computed_blocks=admission.computed_blocks,
                num_external_computed_tokens=admission.num_external_tokens,
                delay_cache_blocks=admission.num_external_tokens > 0,
            )
            if new_blocks is None:
                if not self.running and not unparked and self.kv_transfer.unpark_ready_requests(self.waiting):
                    unparked = True  # retry the head once, now that parked blocks are free
                    continue
                if self._preempt_for(request, step):
                    continue  # a lower-priority request gave its blocks back: retry
                break
            self.encoder_scheduler.commit(request, admission.encoder_plan)
            self.waiting.pop_request()
            if self.kv_transfer.update_state_after_alloc(request, admission.num_local_tokens,
                                                         admission.num_external_tokens, admission.load_async):
                skipped.append(request)  # parked in WAITING_FOR_REMOTE_KVS until its load ends
                continue
            self._admit(request, admission, step)
        for request in reversed(skipped):
            self.waiting.prepend_request(request)

    def _get_computed_tokens(self, request: Request) -> _Admission | None:
        """A waiting request's computed tokens: the loaded blocks it holds already, or its
        prefix-cache hit plus the KV connector's external hit. None: not ready (ask next step)."""
        kv_transfer = self.kv_transfer
        if (request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
                and not kv_transfer.update_waiting_for_remote_kv(request)):
            return None  # its async load is still running
        if kv_transfer.holds_loaded_blocks(request):  # its num_computed_tokens are loaded
            return _Admission(self.kv_cache_manager.empty_kv_cache_blocks, 0, 0, False,
                              request.num_computed_tokens)
        computed_blocks, num_local = self.kv_cache_manager.get_computed_blocks(request)
        num_external, load_async = kv_transfer.get_num_new_matched_tokens(request, num_local)
        if num_external is None:
            return None  # the connector cannot tell yet
        num_computed_tokens = request.num_computed_tokens + num_local + num_external
        return _Admission(computed_blocks, num_local, num_external, load_async, num_computed_tokens)

    def _plan_new_tokens(self, request: Request, admission: _Admission, token_budget: int) -> bool:
        """Set the admission's new tokens (and encoder plan); False when the request does not
        fit this step (no chunked prefill, or an image that cannot run), which ends phase 2."""
        if admission.load_async:
            return True  # it only allocates now: its tokens arrive through the connector
        num_new_tokens = request.num_tokens - admission.num_computed_tokens
        if not self.enable_chunked_prefill and num_new_tokens > token_budget:
            return False
        num_new_tokens = min(num_new_tokens, token_budget)
        plan = self.encoder_scheduler.try_schedule(request, admission.num_computed_tokens, num_new_tokens)
        if plan is not None:
            num_new_tokens = plan.num_new_tokens
            if num_new_tokens <= 0:
                return False
        admission.num_new_tokens, admission.encoder_plan = num_new_tokens, plan
        return True

    def _admit(self, request: Request, admission: _Admission, step: _StepSchedule) -> None:
        """WAITING -> RUNNING with its computed tokens; it is a new request for the worker."""
        self.running.append(request)
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = admission.num_computed_tokens
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = admission.num_computed_tokens
        if self.log_stats:
            request.record_event(EngineCoreEventType.SCHEDULED)
        step.new_reqs.append(request)
        step.add(request, admission.num_new_tokens)

    def _make_scheduler_output(self, step: _StepSchedule) -> SchedulerOutput:
        """Phase 3: the step's new and cached requests, encoder work and connector metadata."""
        kv = self.kv_cache_manager
        cached_reqs = step.cached_reqs
        scheduler_output = SchedulerOutput(
            scheduled_new_reqs=[
                NewRequestData.from_request(r, kv.get_block_ids(r.request_id)) for r in step.new_reqs
            ],
            scheduled_cached_reqs=CachedRequestData(
                req_ids=[r.request_id for r in cached_reqs],
                new_block_ids=[step.new_block_ids[r.request_id] for r in cached_reqs],
                num_computed_tokens=[r.num_computed_tokens for r in cached_reqs],
            ),
            num_scheduled_tokens=step.num_scheduled_tokens,
            total_num_scheduled_tokens=self.max_num_scheduled_tokens - step.token_budget,
            finished_req_ids=self.finished_req_ids,
            preempted_req_ids={r.request_id for r in step.preempted} | self.kv_transfer.take_recompute_req_ids(),
        )
        manager = self.structured_output_manager
        if manager is not None and manager.has_structured_requests():  # no scan of the batch otherwise
            manager.add_grammar_bitmask(scheduler_output, self.requests)
        self.encoder_scheduler.finish_step(scheduler_output)
        # Before _update_after_schedule: the connector plans from the progress before this step.
        scheduler_output.kv_connector_metadata = self.kv_transfer.build_connector_meta(scheduler_output)
        return scheduler_output

    def _update_after_schedule(self, scheduler_output: SchedulerOutput, num_preempted: int) -> None:
        """The worker advances by what was scheduled; so does the scheduler, before the step
        runs (after vLLM's _update_after_schedule), so the next schedule() sees the new progress."""
        num_prompt_tokens = 0
        for request_id, num_tokens in scheduler_output.num_scheduled_tokens.items():
            request = self.requests[request_id]
            num_prompt_tokens += max(0, min(num_tokens, request.num_prompt_tokens - request.num_computed_tokens))
            request.num_computed_tokens += num_tokens
        self._last_num_prompt_tokens = num_prompt_tokens
        self.finished_req_ids = set()
        self._num_preempted_last_step = num_preempted
        self._last_num_scheduled_tokens = scheduler_output.total_num_scheduled_tokens
