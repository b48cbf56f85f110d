"""The engine core's unfinished requests with their KV blocks: the console's request inspector.

One utility call (EngineCore.get_request_blocks) answers "which blocks are this request's, and
which of them does it share": cost O(blocks held by unfinished requests), not O(pool size).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from lm_console.engine.kv_cache_hashing import get_block_hash
from lm_console.engine.metrics.stats import RequestBlocks, RequestBlocksState

if TYPE_CHECKING:
    from lm_console.engine.core.sched.scheduler import Scheduler


def snapshot_request_blocks(scheduler: Scheduler, kv_cache_manager: Any,
                            extra_block_ids: Iterable[int] = ()) -> RequestBlocksState:
    """Every unfinished request's status, preemptions and block ids (per group), with block hashes."""
    coordinator = getattr(kv_cache_manager, "coordinator", None)  # None: an encoder-only model
    pool = getattr(kv_cache_manager, "block_pool", None)
    hashes: dict[int, bytes] = {}
    rows: list[RequestBlocks] = []
    for request in scheduler.requests.values():
        if request.is_finished():
            continue
        groups = coordinator.get_blocks(request.request_id) if coordinator is not None else ()
        block_ids = [[block.block_id for block in blocks] for blocks in groups]
        for blocks in groups:
            for block in blocks:
                if block.block_hash is not None and not block.is_null:
                    hashes[block.block_id] = get_block_hash(block.block_hash)
        rows.append(RequestBlocks(
            request.request_id, request.status.name, request.num_preemptions, request.num_prompt_tokens,
            request.num_computed_tokens, request.num_cached_tokens, block_ids,
            request.lora_request.lora_name if request.lora_request is not None else None))
    if pool is not None:
        for block_id in extra_block_ids:
            if 0 < block_id < len(pool.blocks) and pool.blocks[block_id].block_hash is not None:
                hashes[block_id] = get_block_hash(pool.blocks[block_id].block_hash)
    return RequestBlocksState(rows, hashes)


def merge_request_blocks(states: list[RequestBlocksState]) -> RequestBlocksState:
    """Every engine core's answer as one (data parallelism): the requests in core rank order.

    Request ids are unique across cores, so the rows simply concatenate. Block ids are per core
    (each core has its own pool): block_hashes maps an id that several cores hash to the lowest
    rank's hash.
    """
    hashes: dict[int, bytes] = {}
    for state in reversed(states):  # lower ranks last, so they win
        hashes.update(state.block_hashes)
    return RequestBlocksState([row for state in states for row in state.requests], hashes)
