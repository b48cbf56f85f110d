"""The Scheduler's state, requests in and out, and finishing and freeing them (see scheduler.py)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from lm_console.engine.core.kv_cache import KVCacheManager
from lm_console.engine.core.sched.encoder_scheduling import NoEncoderScheduler
from lm_console.engine.core.sched.kv_connector_scheduling import KVConnectorScheduling, NoKVConnector
from lm_console.engine.core.sched.request_queue import create_request_queue
from lm_console.engine.protocol import EngineCoreEventType, EngineCoreOutput, FinishReason, RequestError
from lm_console.engine.request import Request, RequestStatus

if TYPE_CHECKING:
    from lm_console.engine.core.sched.encoder_scheduling import EncoderScheduler
    from lm_console.engine.distributed.kv_transfer.base import KVConnectorBase
    from lm_console.engine.structured_output import StructuredOutputManager


class SchedulerBase:
    """The Scheduler's state and request bookkeeping; the scheduling steps build on it (scheduler.py)."""

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
    ) -> None:
        self.kv_cache_manager = kv_cache_manager
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

    def _init_kv_connector_state(self, connector: KVConnectorBase | None) -> None:
        """Use `connector` for KV transfer (None: no connector)."""
        self.kv_transfer = (NoKVConnector() if connector is None
                            else KVConnectorScheduling(connector, self.kv_cache_manager))

    # -- requests in and out --------------------------------------------------------------
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

    # -- finish and free -----------------------------------------------------------------
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
