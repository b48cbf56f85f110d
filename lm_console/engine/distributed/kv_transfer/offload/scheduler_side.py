"""The OffloadConnector's scheduler role: lookups, load plans, and which chunks to save each step."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from lm_console.engine.distributed.kv_transfer.base import extend_tracked_block_ids
from lm_console.engine.distributed.kv_transfer.offload.chunk_hash import ChunkHasher
from lm_console.engine.distributed.kv_transfer.offload.metadata import ChunkLoad, ChunkSave, OffloadConnectorMetadata
from lm_console.engine.distributed.kv_transfer.offload.settings import OffloadSettings
from lm_console.engine.distributed.kv_transfer.offload.store import TieredKVStore

if TYPE_CHECKING:
    from lm_console.engine.kv_cache_interface import AllocatedBlocks
    from lm_console.engine.request import Request
    from lm_console.engine.scheduler_output import SchedulerOutput


class OffloadScheduler:
    """Scheduler-side state (get_num_new_matched_tokens / update_state_after_alloc / build_connector_meta).

    By default every hit loads asynchronously (is_async=True): the request waits in
    WAITING_FOR_REMOTE_KVS, off the forward pass, until its chunks are in its blocks. With
    load_mode "layerwise", hits held in the CPU tier (pinned at allocation) load during the
    forward instead, layer by layer (is_async=False).
    Either way a failed load is recomputed (from the first bad block, or from scratch).
    Invariant: _num_handled_chunks[r] chunks of request r were stored or found stored already.
    """

    def __init__(self, settings: OffloadSettings, store: TieredKVStore, hasher: ChunkHasher, block_size: int,
                 is_producer: bool, is_consumer: bool) -> None:
        self.settings = settings
        self.store = store
        self.hasher = hasher
        self.block_size = block_size
        self.is_producer = is_producer
        self.is_consumer = is_consumer
        self._hashes: dict[str, list[bytes]] = {}
        self._requests: dict[str, Request] = {}
        self._block_ids: dict[str, list[int]] = {}
        self._num_handled_chunks: dict[str, int] = {}
        self._lookups: dict[str, tuple[int, int, bool]] = {}  # request id -> (local tokens, hit tokens, is_async)
        self._pending_loads: dict[str, list[ChunkLoad]] = {}
        self._pending_layer_loads: dict[str, list[ChunkLoad]] = {}
        self._remote_deadlines: dict[str, float] = {}

    def _chunk_hashes(self, request: Request, num_tokens: int) -> list[bytes]:
        hashes = self._hashes.setdefault(request.request_id, [])
        return self.hasher.extend(request, hashes, num_tokens)

    # -- lookup ----------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        if not self.is_consumer or request.sampling_params.needs_every_prompt_token:
            return 0, False
        hashes = self._chunk_hashes(request, request.num_tokens)
        num_chunks, num_on_disk = self.store.lookup_prefix(hashes)
        expected = _expected_remote_chunks(request)
        if num_chunks < min(expected, len(hashes)):
            # P/D: the producer's chunks may still be on their way to the shared disk.
            deadline = self._remote_deadlines.setdefault(request.request_id,
                                                         time.monotonic() + self.settings.remote_wait_s)
            if time.monotonic() < deadline:
                return None, False
        # Whole blocks only, and at least the last token left to compute (its logits sample).
        max_tokens = (request.num_tokens - 1) // self.block_size * self.block_size
        hit_tokens = min(num_chunks * self.settings.chunk_size, max_tokens)
        if hit_tokens <= num_computed_tokens:
            return 0, False
        # CPU-resident hits load during the forward (layer by layer); disk reads are slow and can
        # fail, so those requests wait off the forward pass until their chunks are in place.
        is_async = self.settings.load_mode != "layerwise" or num_on_disk > 0
        self._lookups[request.request_id] = (num_computed_tokens, hit_tokens, is_async)
        return hit_tokens - num_computed_tokens, is_async

    def update_state_after_alloc(self, request: Request, blocks: AllocatedBlocks, num_external_tokens: int) -> None:
        req_id = request.request_id
        self._requests[req_id] = request
        self._block_ids[req_id] = list(blocks.get_block_ids()[0])
        self._num_handled_chunks.setdefault(req_id, 0)
        lookup = self._lookups.pop(req_id, None)
        if num_external_tokens == 0 or lookup is None:
            return
        num_local, hit_tokens, is_async = lookup
        size, block_ids = self.settings.chunk_size, self._block_ids[req_id]
        hashes = self._hashes[req_id]
        loads: list[ChunkLoad] = []
        start = num_local
        while start < hit_tokens:
            chunk = start // size
            end = min((chunk + 1) * size, hit_tokens)
            key = hashes[chunk]
            loads.append(ChunkLoad(key=key, token_offset=start - chunk * size,
                                   block_ids=block_ids[start // self.block_size:end // self.block_size],
                                   pinned=self.store.pin(key)))
            start = end
        (self._pending_loads if is_async else self._pending_layer_loads)[req_id] = loads

    # -- per step --------------------------------------------------------------------------
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> OffloadConnectorMetadata:
        metadata = OffloadConnectorMetadata(loads=self._pending_loads, layer_loads=self._pending_layer_loads)
        self._pending_loads, self._pending_layer_loads = {}, {}
        extend_tracked_block_ids(self._block_ids, scheduler_output)
        if not self.is_producer:
            return metadata
        size = self.settings.chunk_size
        blocks_per_chunk = size // self.block_size
        for req_id, num_tokens in scheduler_output.num_scheduled_tokens.items():
            request = self._requests.get(req_id)
            if request is None:
                continue
            done = request.num_computed_tokens + num_tokens  # KV that exists after this step
            limit = done if self.settings.save_decode else min(done, request.num_prompt_tokens)
            hashes = self._chunk_hashes(request, limit)
            block_ids = self._block_ids[req_id]
            for chunk in range(self._num_handled_chunks[req_id], limit // size):
                key = hashes[chunk]
                if not self.store.contains(key):
                    metadata.saves.append(ChunkSave(
                        key=key, parent=hashes[chunk - 1] if chunk else None,
                        block_ids=block_ids[chunk * blocks_per_chunk:(chunk + 1) * blocks_per_chunk],
                        token_ids=request.all_token_ids[chunk * size:(chunk + 1) * size]))
                self._num_handled_chunks[req_id] = chunk + 1
        return metadata

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Forget the request; a producer tells the consumer how many prompt chunks to expect."""
        req_id = request.request_id
        hashes = self._hashes.pop(req_id, [])
        for state in (self._requests, self._block_ids, self._num_handled_chunks, self._lookups,
                      self._remote_deadlines):
            state.pop(req_id, None)
        for load in self._pending_loads.pop(req_id, []) + self._pending_layer_loads.pop(req_id, []):
            if load.pinned:
                self.store.unpin(load.key)
        if not self.is_producer:
            return False, None
        num_prompt_chunks = min(len(hashes), request.num_prompt_tokens // self.settings.chunk_size)
        return False, {"do_remote_prefill": True, "num_chunks": num_prompt_chunks,
                       "chunk_size": self.settings.chunk_size}


def _expected_remote_chunks(request: Request) -> int:
    params = request.kv_transfer_params
    if not params or not params.get("do_remote_prefill"):
        return 0
    value = params.get("num_chunks", 0)
    return value if isinstance(value, int) and value > 0 else 0
