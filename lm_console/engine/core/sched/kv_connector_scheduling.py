"""The Scheduler's KV connector duties (as in vLLM's Scheduler).

A composed object the Scheduler holds and calls at a few hook points; `NoKVConnector` (no
connector configured) answers every hook with "nothing to do", so the Scheduler has one code path.
- Admission: the connector's external tokens (ext_comp) feed allocate_slots; an async load parks
  the request in WAITING_FOR_REMOTE_KVS with its blocks allocated but not cached.
- After each step: finished_recving moves loaded requests back to WAITING (their valid blocks
  cached), invalid_block_ids cut a load back to its first bad block (those tokens are recomputed),
  finished_sending releases blocks whose free was delayed.
- Finish: request_finished() may delay the free and returns kv_transfer_params for the output.
Both classes are pure Python (no torch) and keep their own state; they touch the Scheduler's
queues only through what it passes in.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from lm_console.engine.request import Request, RequestStatus

if TYPE_CHECKING:
    from lm_console.engine.core.kv_cache.manager import KVCacheManager
    from lm_console.engine.scheduler_output import SchedulerOutput
    from lm_console.engine.distributed.kv_transfer.base import KVConnectorBase, KVConnectorMetadata
    from lm_console.engine.distributed.kv_transfer.output import KVConnectorOutput


class NoKVConnector:
    """The hooks when no KV connector is configured: nothing is external, nothing is delayed."""

    connector: KVConnectorBase | None = None
    kv_tier_stats: Any = None

    def has_pending_transfers(self) -> bool:
        return False

    def update_waiting_for_remote_kv(self, request: Request) -> bool:
        return True  # never parked: nothing to wait for

    def holds_loaded_blocks(self, request: Request) -> bool:
        return False

    def get_num_new_matched_tokens(self, request: Request, num_local_tokens: int) -> tuple[int | None, bool]:
        return 0, False

    def update_state_after_alloc(self, request: Request, num_local_tokens: int, num_external_tokens: int,
                                 load_async: bool) -> bool:
        return False

    def unpark_ready_requests(self, waiting: Iterable[Request]) -> bool:
        return False

    def take_recompute_req_ids(self) -> set[str]:
        return set()

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata | None:
        return None

    def update_from_output(self, kv_output: KVConnectorOutput | None) -> set[str]:
        return set()

    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        return False, None

    def delay_free(self, request: Request) -> None:
        raise AssertionError("no KV connector: a request's blocks are never held after it finishes")


class KVConnectorScheduling:
    """State and steps of the scheduler-side KV connector integration.

    Invariants: a request in _num_remote_tokens is WAITING_FOR_REMOTE_KVS and holds blocks;
    a request in _kv_ready is WAITING, holds blocks, and its num_computed_tokens are loaded and
    cached; a request in _delayed_free is finished but its blocks are not yet free.
    """

    def __init__(self, connector: KVConnectorBase, kv_cache_manager: KVCacheManager) -> None:
        self.connector = connector
        self.kv_cache_manager = kv_cache_manager
        self._num_remote_tokens: dict[str, int] = {}  # async load in flight: tokens it will complete
        self._num_valid_remote_tokens: dict[str, int] = {}  # cut back by load errors
        self.finished_recving_kv_req_ids: set[str] = set()
        self._kv_ready: set[str] = set()
        self._sync_loaded: dict[str, Request] = {}  # sync external hits in the step being run
        self._delayed_free: dict[str, Request] = {}
        self._recompute_req_ids: set[str] = set()  # the worker must drop their state (like preemption)
        self._no_external_kv: set[str] = set()  # a load failed: recompute, do not ask the connector again
        self.kv_tier_stats: Any = None

    def has_pending_transfers(self) -> bool:
        """Blocks still held for a finished request (the engine must keep stepping to free them)."""
        return bool(self._delayed_free)

    # -- admission -------------------------------------------------------------------------
    def update_waiting_for_remote_kv(self, request: Request) -> bool:
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

    def holds_loaded_blocks(self, request: Request) -> bool:
        """Whether the request already holds its loaded blocks (no prefix lookup needed)."""
        return request.request_id in self._kv_ready

    def get_num_new_matched_tokens(self, request: Request, num_local_tokens: int) -> tuple[int | None, bool]:
        """(external tokens, load asynchronously); (None, _): the connector cannot tell yet.

        (0, False) for a request that must compute every prompt token itself (prompt logprobs, MEAN
        pooling: they read each position's hidden state, which a load skips)."""
        if request.request_id in self._no_external_kv or request.sampling_params.needs_every_prompt_token:
            return 0, False
        return self.connector.get_num_new_matched_tokens(request, num_local_tokens)

    def update_state_after_alloc(self, request: Request, num_local_tokens: int, num_external_tokens: int,
                                 load_async: bool) -> bool:
        """Tell the connector; True when the request now waits for an async load (parked)."""
        req_id = request.request_id
        self._kv_ready.discard(req_id)
        self.connector.update_state_after_alloc(request, self.kv_cache_manager.get_blocks(req_id),
                                                num_external_tokens)
        if load_async:
            request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
            request.num_computed_tokens = num_local_tokens
            self._num_remote_tokens[req_id] = num_local_tokens + num_external_tokens
            return True
        if num_external_tokens > 0:
            self._sync_loaded[req_id] = request
        return False

    def unpark_ready_requests(self, waiting: Iterable[Request]) -> bool:
        """Release the blocks of waiting requests whose remote KV arrived (they restart as fresh
        requests; their loaded blocks stay in the prefix cache until evicted). Called when nothing
        runs and the queue head cannot allocate: parked requests holding blocks could otherwise
        starve each other forever. True when anything was released."""
        released = False
        for request in waiting:
            if request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                self.update_waiting_for_remote_kv(request)  # a finished load caches its blocks first
            if request.request_id in self._kv_ready:
                self._kv_ready.discard(request.request_id)
                self.kv_cache_manager.free(request)
                request.num_computed_tokens = 0
                released = True
        return released

    def take_recompute_req_ids(self) -> set[str]:
        """Requests restarted after a failed load since the last call (the worker drops them)."""
        ids, self._recompute_req_ids = self._recompute_req_ids, set()
        return ids

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata | None:
        return self.connector.build_connector_meta(scheduler_output)

    # -- after a step ----------------------------------------------------------------------
    def update_from_output(self, kv_output: KVConnectorOutput | None) -> set[str]:
        """Apply the worker side's report; returns running requests whose sync load failed: the
        Scheduler restarts them (their tokens of this step are dropped) and they are recomputed."""
        failed_sync: set[str] = set()
        if kv_output is not None:
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
        for req_id, request in self._sync_loaded.items():
            if req_id not in failed_sync and not request.is_finished():
                self.kv_cache_manager.cache_blocks(request, request.num_computed_tokens)
        self._sync_loaded.clear()
        self._recompute_req_ids |= failed_sync
        self._no_external_kv |= failed_sync
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

    # -- finish ----------------------------------------------------------------------------
    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        """(delay_free, kv_transfer_params) for a request that just finished (after vLLM's _connector_finished)."""
        req_id = request.request_id
        was_loading = req_id in self._num_remote_tokens and req_id not in self.finished_recving_kv_req_ids
        self._kv_ready.discard(req_id)
        self._sync_loaded.pop(req_id, None)
        self._no_external_kv.discard(req_id)
        self._num_valid_remote_tokens.pop(req_id, None)
        self._num_remote_tokens.pop(req_id, None)
        self.finished_recving_kv_req_ids.discard(req_id)
        block_ids = self.kv_cache_manager.get_block_ids(req_id)[0]
        delay_free, params = self.connector.request_finished(request, block_ids)
        # A load still in flight may write these blocks until the worker confirms it stopped.
        return delay_free or was_loading, params

    def delay_free(self, request: Request) -> None:
        """Hold the finished request's blocks until the worker reports its transfer done."""
        self._delayed_free[request.request_id] = request
