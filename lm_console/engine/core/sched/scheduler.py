"""The Scheduler: continuous batching under one token budget, in one class, top to bottom.

Like vLLM's `vllm/v1/core/sched/scheduler.py`, there are no prefill and decode phases: a
request's progress is its `num_computed_tokens`, and each `schedule()` call gives every request
the tokens it still needs within the step's token budget. The class reads in the order a step
runs: state and requests in and out; `schedule()` (RUNNING requests first, then WAITING ones,
then the step's SchedulerOutput); preemption; `update_from_output()` (sampled tokens appended,
stop checks); finishing and freeing; the stats snapshot.

Its collaborators are composed, each with a do-nothing default: the WAITING queue
(request_queue.py: fcfs or priority), the encoder budget and cache of multimodal models
(encoder_scheduling.py), the KV connector's admission and delayed frees
(kv_connector_scheduling.py) and the structured-output manager (the grammar gate and bitmask).
`AsyncScheduler` (async_scheduler.py) schedules step N+1 before step N's tokens are known.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from lm_console.engine.core.kv_cache.manager import KVCacheManager
from lm_console.engine.core.sched.encoder_scheduling import NoEncoderScheduler
from lm_console.engine.core.sched.kv_connector_scheduling import KVConnectorScheduling, NoKVConnector
from lm_console.engine.core.sched.request_queue import create_request_queue
from lm_console.engine.metrics.stats import LoRAStats, PrefixCacheStatsSnapshot, SchedulerStats, SpecDecodingStats
from lm_console.engine.protocol import (
    EngineCoreEventType,
    EngineCoreOutput,
    EngineCoreOutputs,
    FinishReason,
    LogprobsLists,
    RequestError,
)
from lm_console.engine.request import Request, RequestStatus
from lm_console.engine.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput

if TYPE_CHECKING:
    from lm_console.engine.core.spec_decode.proposers import Proposer
    from lm_console.engine.config.speculative import SpeculativeConfig
    from lm_console.engine.core.kv_cache.manager import KVCacheBlocks
    from lm_console.engine.core.sched.encoder_scheduling import EncoderPlan, EncoderScheduler
    from lm_console.engine.distributed.kv_transfer.base import KVConnectorBase
    from lm_console.engine.model_runner_output import ModelRunnerOutput
    from lm_console.engine.structured_output import StructuredOutputManager

_FINISH_REASON = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH_CAPPED: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
    RequestStatus.FINISHED_IGNORED: FinishReason.LENGTH,
}


@dataclass(slots=True)
class _StepSchedule:
    """What one schedule() call has decided so far; its phases fill it in turn."""

    token_budget: int
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    new_reqs: list[Request] = field(default_factory=list)  # admitted from WAITING this step
    cached_reqs: list[Request] = field(default_factory=list)  # RUNNING ones the worker holds
    new_block_ids: dict[str, tuple[list[int], ...] | None] = field(default_factory=dict)
    preempted: list[Request] = field(default_factory=list)
    spec_tokens: dict[str, list[int]] = field(default_factory=dict)  # drafts each request verifies

    def add(self, request: Request, num_new_tokens: int) -> None:
        self.num_scheduled_tokens[request.request_id] = num_new_tokens
        self.token_budget -= num_new_tokens


@dataclass(slots=True)
class _Admission:
    """How a WAITING request would be admitted: its computed tokens, then what it schedules."""

    computed_blocks: KVCacheBlocks  # its prefix-cache hit
    num_local_tokens: int  # tokens of that hit
    num_external_tokens: int  # tokens a KV connector loads
    load_async: bool  # the load runs across steps: the request parks until it ends
    num_computed_tokens: int
    num_new_tokens: int = 0
    encoder_plan: EncoderPlan | None = None


class Scheduler:
    """Decides, each step, how many tokens every request computes and turns the sampled tokens into outputs.

    There are no prefill and decode phases: a request's progress is num_computed_tokens, and
    each step gives RUNNING requests their share of the token budget first, then admits
    WAITING ones. When allocate_slots fails, the latest-arrived running request is preempted
    (its blocks freed, to be recomputed later). Two composed objects carry the optional
    features, each with a do-nothing default: `encoder_scheduler` (the encoder budget and cache
    of multimodal models) and `kv_transfer` (the KV connector's admission and delayed frees).
    Invariant: every request in `running` holds KV blocks; in `waiting` only those parked for
    (or back from) a KV connector load do (see kv_connector_scheduling.py).
    """

    # -- state, requests in and out ---------------------------------------------------------
    def __init__(
        self,
        kv_cache_manager: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        enable_chunked_prefill: bool = True,
        log_stats: bool = True,
        encoder_scheduler: EncoderScheduler | None = None,
        connector: KVConnectorBase | None = None,
        structured_output_manager: StructuredOutputManager | None = None,
        policy: str = "fcfs",
        max_loras: int | None = None,
        speculative_config: SpeculativeConfig | None = None,
    ) -> None:
        self.kv_cache_manager = kv_cache_manager
        # enable_lora: at most this many distinct adapters among the running requests (the
        # worker's resident slots); None: LoRA off.
        self.max_loras = max_loras
        self.max_num_running_reqs = max_num_seqs
        self.max_num_scheduled_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.enable_chunked_prefill = enable_chunked_prefill
        self.log_stats = log_stats  # record request events (queue time) and step counts
        # Multimodal models: encoder budget, encoder cache, ECConnector (encoder_scheduling.py).
        self.encoder_scheduler: EncoderScheduler | NoEncoderScheduler = encoder_scheduler or NoEncoderScheduler()
        self.requests: dict[str, Request] = {}
        # "fcfs" | "priority": the WAITING queue's order, and who is preempted (_pick_victim).
        self.policy = policy
        self.waiting = create_request_queue(policy)
        self.running: list[Request] = []
        # Finished since the last schedule(): the worker drops their state.
        self.finished_req_ids: set[str] = set()
        self._num_preempted_last_step = 0
        self.num_preemptions_total = 0
        self._last_num_scheduled_tokens = 0
        self._last_num_prompt_tokens = 0
        self._last_num_generation_tokens = 0
        self.kv_transfer: KVConnectorScheduling | NoKVConnector = NoKVConnector()
        self._init_kv_connector_state(connector)
        # Structured outputs: fills the step's grammar bitmask (None: no structured requests).
        self.structured_output_manager = structured_output_manager
        # (client, output) of requests failed since the last update (a grammar that did not compile).
        self._failed_outputs: list[tuple[int, EngineCoreOutput]] = []
        # Speculative decoding: the proposer (None: off) and the acceptance counters.
        self.speculative_config = speculative_config
        self.proposer: Proposer | None = None
        self.spec_decoding_stats: SpecDecodingStats | None = None
        if speculative_config is not None:
            # numpy's import stays off the core's path until speculation is asked for
            from lm_console.engine.core.spec_decode.proposers import create_proposer

            self.proposer = create_proposer(speculative_config)
            self.spec_decoding_stats = SpecDecodingStats.new(speculative_config.num_speculative_tokens)

    def _init_kv_connector_state(self, connector: KVConnectorBase | None) -> None:
        """Use `connector` for KV transfer (None: no connector)."""
        self.kv_transfer = (NoKVConnector() if connector is None
                            else KVConnectorScheduling(connector, self.kv_cache_manager))

    def add_request(self, request: Request) -> None:
        self.waiting.add_request(request)
        self.requests[request.request_id] = request
        if self.structured_output_manager is not None:
            self.structured_output_manager.add_request(request)
        if self.log_stats:
            request.record_event(EngineCoreEventType.QUEUED)

    def finish_requests(self, request_ids: str | Iterable[str], finished_status: RequestStatus) -> None:
        """Finish (typically abort) requests wherever they are; unknown ids are ignored."""
        assert RequestStatus.is_finished(finished_status)
        if isinstance(request_ids, str):
            request_ids = (request_ids,)
        running_to_remove: set[Request] = set()
        waiting_to_remove: set[Request] = set()
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None or request.is_finished():
                continue
            if request.status == RequestStatus.RUNNING:
                running_to_remove.add(request)
            else:
                waiting_to_remove.add(request)
            request.status = finished_status
            self._free_request(request)
        if running_to_remove:
            self.running = [r for r in self.running if r not in running_to_remove]
        if waiting_to_remove:
            self.waiting.remove_requests(waiting_to_remove)

    def get_num_unfinished_requests(self) -> int:
        return len(self.waiting) + len(self.running)

    def has_unfinished_requests(self) -> bool:
        return self.get_num_unfinished_requests() > 0 or self.kv_transfer.has_pending_transfers()

    # -- schedule ---------------------------------------------------------------------------
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
            spec_tokens = self._propose(request) if self.proposer is not None else None
            num_new_tokens = min(
                self._num_tokens_to_compute(request) + (len(spec_tokens) if spec_tokens else 0)
                - request.num_computed_tokens,
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
            if spec_tokens:
                # The budget may have cut the drafts: those scheduled follow the one real token.
                num_drafts = num_new_tokens - (request.num_tokens - request.num_computed_tokens)
                if num_drafts > 0:
                    step.spec_tokens[request.request_id] = spec_tokens[:num_drafts]

    def _propose(self, request: Request) -> list[int] | None:
        """Draft tokens for a decoding request (vLLM's spec_token_ids), or None.

        Only requests whose next step samples from logits that do not depend on earlier
        samples in a way the worker cannot replay get drafts: no penalties; none while
        min_tokens masks stop tokens. A structured request's drafts are cut at the first token
        its grammar refuses (the verification rows then carry the grammar's bitmask after each
        draft). Drafts never run past max_tokens or max_model_len, and none are made while
        disable_by_batch_size requests or more run.
        """
        config, proposer = self.speculative_config, self.proposer
        assert config is not None and proposer is not None
        if request.num_computed_tokens != request.num_tokens - 1:
            return None  # a prefill (or a preempted request's recomputation)
        limit = config.batch_limit
        if limit is not None and len(self.running) >= limit:
            return None
        params = request.sampling_params
        so_request = request.structured_output_request
        if ((so_request is not None and so_request.grammar is None) or params.frequency_penalty != 0.0
                or params.presence_penalty != 0.0 or params.repetition_penalty != 1.0
                or request.num_output_tokens < params.min_tokens):
            return None
        num_drafts = min(config.num_speculative_tokens, self.max_model_len - request.num_tokens)
        if request.max_tokens is not None:
            # The step emits num_drafts + 1 tokens at most: the last one is the target's own.
            num_drafts = min(num_drafts, request.max_tokens - request.num_output_tokens - 1)
        if num_drafts <= 0:
            return None
        drafts = proposer.propose(request.request_id, request.all_token_ids, num_drafts)
        if drafts and so_request is not None and so_request.grammar is not None:
            drafts = so_request.grammar.valid_prefix(drafts)
        return drafts or None

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
        running_loras = ({r.lora_request.lora_int_id for r in self.running if r.lora_request is not None}
                         if self.max_loras is not None else set())
        while self.waiting and step.token_budget > 0:
            request = self.waiting.peek_request()
            lora = request.lora_request
            if (lora is not None and self.max_loras is not None and lora.lora_int_id not in running_loras
                    and len(running_loras) >= self.max_loras):
                skipped.append(self.waiting.pop_request())  # its adapter has no slot: wait for one
                continue
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
            if lora is not None:
                running_loras.add(lora.lora_int_id)
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
            scheduled_spec_decode_tokens=step.spec_tokens,
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
        runs, so the next schedule() sees the new progress (vLLM: _update_after_schedule)."""
        num_prompt_tokens = 0
        for request_id, num_tokens in scheduler_output.num_scheduled_tokens.items():
            request = self.requests[request_id]
            num_prompt_tokens += max(0, min(num_tokens, request.num_prompt_tokens - request.num_computed_tokens))
            request.num_computed_tokens += num_tokens
        self._last_num_prompt_tokens = num_prompt_tokens
        self.finished_req_ids = set()
        self._num_preempted_last_step = num_preempted
        self._last_num_scheduled_tokens = scheduler_output.total_num_scheduled_tokens

    # -- preemption -------------------------------------------------------------------------
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
            step.spec_tokens.pop(victim.request_id, None)
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

    # -- update -----------------------------------------------------------------------------
    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> dict[int, EngineCoreOutputs]:
        """Append sampled tokens, run the stop checks, free finished requests' blocks."""
        outputs: dict[int, list[EngineCoreOutput]] = {}
        sampled = model_runner_output.sampled_token_ids
        logprobs = model_runner_output.logprobs
        prompt_logprobs = model_runner_output.prompt_logprobs
        # Insertion-ordered (not a set of objects hashed by address): finished requests free
        # their blocks in step order, so block placement is reproducible from run to run.
        stopped: dict[Request, None] = {}
        # Async scheduling only: requests preempted while a step that samples for them ran.
        stopped_preempted: set[Request] = set()
        num_generation_tokens = 0
        failed_loads = self.kv_transfer.update_from_output(model_runner_output.kv_connector_output)
        for request_id in failed_loads:
            self._restart_request(self.requests[request_id])
        delay_frees: dict[Request, bool] = {}
        for client_index, failed in self._failed_outputs:
            outputs.setdefault(client_index, []).append(failed)
        self._failed_outputs = []
        for request_id in scheduler_output.num_scheduled_tokens:
            request = self.requests.get(request_id)
            if request is None or request.is_finished() or request_id in failed_loads:
                continue  # aborted while the step ran, or its KV load failed (it starts over)
            if request.mm_features:
                self.encoder_scheduler.free_consumed(request)
            req_index = model_runner_output.req_id_to_index[request_id]
            generated = sampled[req_index]
            drafts = scheduler_output.scheduled_spec_decode_tokens.get(request_id)
            if drafts and generated:
                # Computed were the real token and every draft; the KV of the rejected ones is
                # garbage and is recomputed (its slots overwritten) from the next step on.
                request.num_computed_tokens -= len(drafts) + 1 - len(generated)
                if self.spec_decoding_stats is not None:
                    self.spec_decoding_stats.observe(len(drafts), len(generated) - 1)
            new_token_ids: list[int] = []
            was_preempted = request.status == RequestStatus.PREEMPTED
            for token_id in generated:
                request.append_output_token_ids(token_id)
                new_token_ids.append(token_id)
                if self._check_stop(request):
                    stopped[request] = None
                    if was_preempted:
                        stopped_preempted.add(request)
                    break
            new_prompt_logprobs = (_take_prompt_logprobs(request, prompt_logprobs.get(request_id))
                                   if prompt_logprobs else None)
            if not new_token_ids and new_prompt_logprobs is None:
                continue
            num_generation_tokens += len(new_token_ids)
            new_logprobs = logprobs.get(request_id) if logprobs else None
            if new_logprobs is not None and len(new_logprobs.sampled_token_ranks) > len(new_token_ids):
                new_logprobs = _slice_logprobs(new_logprobs, 0, len(new_token_ids))
            is_stopped = request in stopped
            finish_reason = _FINISH_REASON.get(request.status) if is_stopped else None
            kv_transfer_params = None
            if is_stopped:
                delay_frees[request], kv_transfer_params = self.kv_transfer.request_finished(request)
            outputs.setdefault(request.client_index, []).append(
                EngineCoreOutput(
                    request_id=request_id,
                    new_token_ids=new_token_ids,
                    new_logprobs=new_logprobs,
                    finish_reason=finish_reason,
                    stop_reason=request.stop_reason,
                    num_cached_tokens=max(request.num_cached_tokens, 0),
                    events=request.take_events(),
                    kv_transfer_params=kv_transfer_params,
                    error=RequestError(*request.error) if request.error is not None else None,
                    new_prompt_logprobs=new_prompt_logprobs,
                    pooled=model_runner_output.pooler_output.get(request_id),
                )
            )
        if stopped:
            self.running = [r for r in self.running if r not in stopped]
            if stopped_preempted:
                self.waiting.remove_requests(stopped_preempted)
            for request in stopped:
                self._free_request(request, delay_frees.get(request, False))
        self._last_num_generation_tokens = num_generation_tokens
        return {
            client: EngineCoreOutputs(outputs=client_outputs)
            for client, client_outputs in outputs.items()
        }

    def _check_stop(self, request: Request) -> bool:
        """Stop checks after one appended token: the grammar, length, min_tokens, EOS, stop_token_ids."""
        so_request = request.structured_output_request
        if so_request is not None:  # advance its matcher: it may end the request
            ended = so_request.accept_token(request.output_token_ids[-1])
            if ended is not None:
                request.status, request.error = ended
                if request.error is not None and request.num_output_tokens <= request.sampling_params.min_tokens:
                    # Not an engine bug: the grammar allowed only a stop token, which min_tokens masked.
                    request.error = ("RequestRejectedError", (
                        f"structured output: the constraint allowed only the stop token after "
                        f"{request.num_output_tokens - 1} tokens, but min_tokens="
                        f"{request.sampling_params.min_tokens} forbids stopping before then; lower min_tokens."))
                return True
        params = request.sampling_params
        if request.num_tokens >= self.max_model_len or (
            request.max_tokens is not None and request.num_output_tokens >= request.max_tokens
        ):
            request.status = RequestStatus.FINISHED_LENGTH_CAPPED
            return True
        if request.num_output_tokens < params.min_tokens:
            return False
        last_token_id = request.output_token_ids[-1]
        if not params.ignore_eos and last_token_id == request.eos_token_id:
            request.status = RequestStatus.FINISHED_STOPPED
            return True
        if last_token_id in params.all_stop_token_ids:
            request.status = RequestStatus.FINISHED_STOPPED
            request.stop_reason = last_token_id
            return True
        return False

    # -- finish and free --------------------------------------------------------------------
    def _fail_request(self, request: Request, error: tuple[str, str]) -> None:
        """Finish a request the core cannot serve (it holds no blocks); update_from_output answers it."""
        request.status = RequestStatus.FINISHED_ABORTED
        self._free_request(request)
        self._failed_outputs.append((request.client_index, EngineCoreOutput(
            request_id=request.request_id, new_token_ids=[], finish_reason=FinishReason.ABORT, stop_reason=error[1],
            events=request.take_events(), error=RequestError(*error))))

    def _free_request(self, request: Request, delay_free: bool | None = None) -> None:
        """Release the request's blocks (unless a KV connector still needs them) and forget it."""
        if delay_free is None:
            delay_free, _ = self.kv_transfer.request_finished(request)
        self._free_blocks(request, delay_free)
        self.encoder_scheduler.free(request)
        self.finished_req_ids.add(request.request_id)
        del self.requests[request.request_id]
        if self.proposer is not None:
            self.proposer.forget(request.request_id)
        if self.structured_output_manager is not None:
            self.structured_output_manager.finish_request(request)

    def _free_blocks(self, request: Request, delay_free: bool) -> None:
        """Give a finished request's KV blocks back (the KV connector may hold them a while)."""
        if delay_free:
            self.kv_transfer.delay_free(request)
        else:
            self.kv_cache_manager.free(request)

    def _restart_request(self, request: Request) -> None:
        """Recompute a request from scratch after a failed synchronous load (not a preemption)."""
        self.running.remove(request)
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = 0
        self.waiting.prepend_request(request)

    # -- stats ------------------------------------------------------------------------------
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
            lora=self._lora_stats(),
            spec_decoding=self.spec_decoding_stats.copy() if self.spec_decoding_stats is not None else None,
        )

    def _lora_stats(self) -> LoRAStats | None:
        if self.max_loras is None:
            return None

        def names(requests: Iterable[Request]) -> list[str]:
            return list(dict.fromkeys(r.lora_request.lora_name for r in requests if r.lora_request is not None))

        return LoRAStats(max_lora=self.max_loras, running_lora_adapters=names(self.running),
                         waiting_lora_adapters=names(self.waiting))


def _take_prompt_logprobs(request: Request, chunk: tuple[int, LogprobsLists] | None) -> LogprobsLists | None:
    """The chunk's rows the frontend has not had yet: a request recomputed after a preemption
    computes its prompt positions again, and each goes out once."""
    if chunk is None:
        return None
    start, lists = chunk
    skip = request.num_prompt_logprobs_sent - start
    if skip >= len(lists.sampled_token_ranks):
        return None
    if skip > 0:
        lists = _slice_logprobs(lists, skip)
    request.num_prompt_logprobs_sent += len(lists.sampled_token_ranks)
    return lists


def _slice_logprobs(lists: LogprobsLists, start: int, stop: int | None = None) -> LogprobsLists:
    """Rows [start, stop) of a LogprobsLists."""
    return LogprobsLists(lists.logprob_token_ids[start:stop], lists.logprobs[start:stop],
                         lists.sampled_token_ranks[start:stop])
