"""The Scheduler's KV connector duties (seed: KV Transfer, Scheduler integration, lines 3360-3395).

Kept out of scheduler.py: a mixin whose methods the Scheduler calls at a few hook points.
- Admission: the connector's external tokens (ext_comp) feed allocate_slots; an async load parks
  the request in WAITING_FOR_REMOTE_KVS with its blocks allocated but not cached.
- After each step: finished_recving moves loaded requests back to WAITING (their valid blocks
  cached), invalid_block_ids cut a load back to its first bad block (those tokens are recomputed),
  finished_sending releases blocks whose free was delayed.
- Finish: request_finished() may delay the free and returns kv_transfer_params for the output.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from engine.request import Request, RequestStatus

if TYPE_CHECKING:
    from engine.core.kv_cache import KVCacheManager
    from engine.core.sched.request_queue import FCFSRequestQueue
    from engine.distributed.kv_transfer.base import KVConnectorBase
    from engine.distributed.kv_transfer.output import KVConnectorOutput


class KVConnectorSchedulerMixin:
    """State and steps of the scheduler-side KV connector integration.

    Invariants: a request in _num_remote_tokens is WAITING_FOR_REMOTE_KVS and holds blocks;
    a request in _kv_ready is WAITING, holds blocks, and its num_computed_tokens are loaded and
    cached; a request in _delayed_free is finished but its blocks are not yet free.
    """

    connector: KVConnectorBase | None
    kv_cache_manager: KVCacheManager
    waiting: FCFSRequestQueue
    running: list[Request]
    requests: dict[str, Request]

    def _init_kv_connector_state(self, connector: KVConnectorBase | None) -> None:
        self.connector = connector
        self._num_remote_tokens: dict[str, int] = {}  # async load in flight: tokens it will complete
        self._num_valid_remote_tokens: dict[str, int] = {}  # cut back by load errors
        self.finished_recving_kv_req_ids: set[str] = set()
        self._kv_ready: set[str] = set()
        self._sync_loaded: set[str] = set()  # sync external hits in the step being run
        self._delayed_free: dict[str, Request] = {}
        self._recompute_req_ids: set[str] = set()  # the worker must drop their state (like preemption)
        self._no_external_kv: set[str] = set()  # a load failed: recompute, do not ask the connector again
        self.kv_tier_stats: Any = None

    def has_pending_kv_transfers(self) -> bool:
        """Blocks still held for a finished request (the engine must keep stepping to free them)."""
        return bool(self._delayed_free)

    # -- admission -------------------------------------------------------------------------
    def _update_waiting_for_remote_kv(self, request: Request) -> bool:
        """True (and the request WAITING again, its valid loaded blocks cached) once its load ended."""
        req_id = request.request_id
        if req_id not in self.finished_recving_kv_req_ids:
            return False
        self.finished_recving_kv_req_ids.discard(req_id)
        expected = self._num_remote_tokens.pop(req_id)
        num_computed = min(expected, self._num_valid_remote_tokens.pop(req_id, expected))
        num_computed = max(num_computed, request.num_computed_tokens)  # local hits stay valid
        self.kv_cache_manager.cache_blocks(request, num_computed)
        request.num_computed_tokens = num_computed
        request.status = RequestStatus.WAITING
        self._kv_ready.add(req_id)
        return True

    def _unpark_ready_requests(self) -> bool:
        """Release the blocks of waiting requests whose remote KV arrived (they restart as fresh
        requests; their loaded blocks stay in the prefix cache until evicted). Called when nothing
        runs and the queue head cannot allocate: parked requests holding blocks could otherwise
        starve each other forever. True when anything was released."""
        released = False
        for request in self.waiting:
            if request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                self._update_waiting_for_remote_kv(request)  # a finished load caches its blocks first
            if request.request_id in self._kv_ready:
                self._kv_ready.discard(request.request_id)
                self.kv_cache_manager.free(request)
                request.num_computed_tokens = 0
                released = True
        return released

    def _after_alloc(self, request: Request, num_local: int, num_external: int, load_async: bool) -> bool:
        """Tell the connector; True when the request now waits for an async load."""
        if self.connector is None:
            return False
        self._kv_ready.discard(request.request_id)
        self.connector.update_state_after_alloc(
            request, self.kv_cache_manager.get_blocks(request.request_id), num_external)
        if load_async:
            request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
            request.num_computed_tokens = num_local
            self._num_remote_tokens[request.request_id] = num_local + num_external
            return True
        if num_external > 0:
            self._sync_loaded.add(request.request_id)
        return False

    # -- after a step ----------------------------------------------------------------------
    def _update_from_kv_connector_output(self, kv_output: KVConnectorOutput | None) -> set[str]:
        """Apply the worker side's report; returns running requests whose sync load failed
        (their tokens of this step are dropped and they start over)."""
        failed_sync: set[str] = set()
        if kv_output is not None:
            if self.connector is not None:
                self.connector.update_connector_output(kv_output)
                self.kv_tier_stats = self.connector.latest_stats
            if kv_output.invalid_block_ids:
                failed_sync = self._handle_invalid_blocks(kv_output.invalid_block_ids)
            for req_id in (kv_output.finished_recving or set()) | (kv_output.finished_sending or set()):
                delayed = self._delayed_free.pop(req_id, None)
                if delayed is not None:
                    self.kv_cache_manager.free(delayed)
                elif req_id in self._num_remote_tokens:
                    self.finished_recving_kv_req_ids.add(req_id)
        for req_id in self._sync_loaded - failed_sync:
            request = self.requests.get(req_id)
            if request is not None and not request.is_finished():
                self.kv_cache_manager.cache_blocks(request, request.num_computed_tokens)
        self._sync_loaded.clear()
        for req_id in failed_sync:
            self._restart_request(self.requests[req_id])
        return failed_sync

    def _handle_invalid_blocks(self, invalid_block_ids: set[int]) -> set[str]:
        block_size = self.kv_cache_manager.block_size
        failed_sync: set[str] = set()
        for req_id in list(self._num_remote_tokens) + list(self._sync_loaded):
            block_ids = self.kv_cache_manager.get_block_ids(req_id)[0]
            first_bad = next((i for i, b in enumerate(block_ids) if b in invalid_block_ids), None)
            if first_bad is None:
                continue
            if req_id in self._sync_loaded:
                failed_sync.add(req_id)
            else:
                valid = first_bad * block_size
                self._num_valid_remote_tokens[req_id] = min(self._num_valid_remote_tokens.get(req_id, valid), valid)
        return failed_sync

    def _restart_request(self, request: Request) -> None:
        """Recompute a request from scratch after a failed synchronous load (not a preemption)."""
        self.running.remove(request)
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = 0
        self.waiting.prepend_request(request)
        self._recompute_req_ids.add(request.request_id)
        self._no_external_kv.add(request.request_id)

    def _take_recompute_req_ids(self) -> set[str]:
        ids, self._recompute_req_ids = self._recompute_req_ids, set()
        return ids

    # -- finish ----------------------------------------------------------------------------
    def _connector_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        """(delay_free, kv_transfer_params) for a request that just finished (seed: _connector_finished)."""
        req_id = request.request_id
        was_loading = req_id in self._num_remote_tokens and req_id not in self.finished_recving_kv_req_ids
        self._kv_ready.discard(req_id)
        self._sync_loaded.discard(req_id)
        self._no_external_kv.discard(req_id)
        self._num_valid_remote_tokens.pop(req_id, None)
        self._num_remote_tokens.pop(req_id, None)
        self.finished_recving_kv_req_ids.discard(req_id)
        if self.connector is None:
            return False, None
        block_ids = self.kv_cache_manager.get_block_ids(req_id)[0]
        delay_free, params = self.connector.request_finished(request, block_ids)
        # A load still in flight may write these blocks until the worker confirms it stopped.
        return delay_free or was_loading, params

    def _release_blocks(self, request: Request, delay_free: bool) -> None:
        if delay_free:
            self._delayed_free[request.request_id] = request
        else:
            self.kv_cache_manager.free(request)
