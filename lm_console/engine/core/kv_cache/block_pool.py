"""BlockPool: physical block allocation, free LRU queue and prefix-cache index."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING

from lm_console.engine.core.kv_cache.block import FreeKVCacheBlockQueue, KVCacheBlock
from lm_console.engine.kv_cache_hashing import (
    BlockHash,
    BlockHashListWithBlockSize,
    BlockHashWithGroupId,
    get_block_hash,
    get_group_id,
    make_block_hash_with_group_id,
)
from lm_console.engine.metrics.kv_events import (
    AllBlocksCleared, BlockRemoved, BlockStored, ExternalBlockHash, KVCacheEvent,
)
from lm_console.engine.metrics.stats import BLOCK_STATE_CACHED, BLOCK_STATE_FREE, BLOCK_STATE_IN_USE, BLOCK_STATE_NULL

if TYPE_CHECKING:
    from lm_console.engine.core.kv_cache.block_metrics import KVCacheMetricsCollector
    from lm_console.engine.request import Request

logger = logging.getLogger(__name__)


class BlockHashToBlockMap:
    """Prefix-cache index: BlockHashWithGroupId -> block(s) (after vLLM's BlockHashToBlockMap).

    Invariants: every stored block's block_hash equals its key; a value is a single block or a
    dict {block_id: block} of >= 2 blocks (most keys have one block, so no inner dict to GC).
    Duplicates are kept, not merged: block ids handed to a request never change (append-only).
    """

    __slots__ = ("_cache",)

    def __init__(self) -> None:
        self._cache: dict[BlockHashWithGroupId, KVCacheBlock | dict[int, KVCacheBlock]] = {}

    def get_one_block(self, key: BlockHashWithGroupId) -> KVCacheBlock | None:
        """Any one block cached under key, or None."""
        blocks = self._cache.get(key)
        if blocks is None or isinstance(blocks, KVCacheBlock):
            return blocks
        return next(iter(blocks.values()))

    def insert(self, key: BlockHashWithGroupId, block: KVCacheBlock) -> None:
        """Add a block under key, promoting a single value to a dict on the second block."""
        blocks = self._cache.get(key)
        if blocks is None:
            self._cache[key] = block
        elif isinstance(blocks, KVCacheBlock):
            self._cache[key] = {blocks.block_id: blocks, block.block_id: block}
        else:
            blocks[block.block_id] = block

    def pop(self, key: BlockHashWithGroupId, block_id: int) -> KVCacheBlock | None:
        """Remove and return the block block_id under key, or None if it is not there."""
        blocks = self._cache.get(key)
        if blocks is None:
            return None
        if isinstance(blocks, KVCacheBlock):
            if blocks.block_id != block_id:
                return None
            del self._cache[key]
            return blocks
        block = blocks.pop(block_id, None)
        if len(blocks) == 1:  # demote back to the cheap single-block form
            self._cache[key] = next(iter(blocks.values()))
        return block

    def __len__(self) -> int:
        return len(self._cache)

    def items(self) -> Iterator[tuple[BlockHashWithGroupId, KVCacheBlock]]:
        """Every (key, block) pair, duplicates included (tests and debugging)."""
        for key, blocks in self._cache.items():
            if isinstance(blocks, KVCacheBlock):
                yield key, blocks
            else:
                for block in blocks.values():
                    yield key, block


class BlockPool:
    """All KV cache blocks of one engine: allocation, LRU eviction, prefix-cache index.

    After vLLM's vllm/v1/core/block_pool.py. Invariants: blocks[i].block_id == i; blocks[0] is the null
    block, never in the free queue, never ref-counted, never cached; a block with ref_cnt == 0 is
    in free_block_queue (it may still carry a hash: cached and evictable); every hashed block is
    in cached_block_hash_to_block under its hash and vice versa.
    """

    def __init__(
        self,
        num_gpu_blocks: int,
        enable_caching: bool,
        hash_block_size: int,
        enable_kv_cache_events: bool = False,
    ) -> None:
        assert num_gpu_blocks >= 1 and hash_block_size >= 1, (num_gpu_blocks, hash_block_size)
        self.num_gpu_blocks = num_gpu_blocks
        self.enable_caching = enable_caching
        self.hash_block_size = hash_block_size
        self.blocks: list[KVCacheBlock] = [KVCacheBlock(block_id=idx) for idx in range(num_gpu_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        self.cached_block_hash_to_block = BlockHashToBlockMap()
        # The null block: block 0 stands in for skipped (e.g. out-of-window) blocks.
        self.null_block = self.free_block_queue.popleft()
        self.null_block.is_null = True
        self.enable_kv_cache_events = enable_kv_cache_events
        self.kv_event_queue: list[KVCacheEvent] = []
        # kv_cache_metrics: sampled block lifetimes (block_metrics.py); None when off.
        self.metrics_collector: KVCacheMetricsCollector | None = None

    # -- prefix cache ------------------------------------------------------------------------------
    def get_cached_block(self, block_hash: BlockHash, kv_cache_group_ids: Sequence[int]) -> list[KVCacheBlock] | None:
        """One cached block per group, or None unless every group hits."""
        cached_blocks: list[KVCacheBlock] = []
        for group_id in kv_cache_group_ids:
            block = self.cached_block_hash_to_block.get_one_block(
                make_block_hash_with_group_id(block_hash, group_id)
            )
            if block is None:
                return None
            cached_blocks.append(block)
        return cached_blocks

    def cache_full_blocks(
        self,
        request: Request,
        blocks: Sequence[KVCacheBlock],
        num_cached_blocks: int,
        num_full_blocks: int,
        block_size: int,
        kv_cache_group_id: int,
    ) -> None:
        """Enter blocks[num_cached_blocks:num_full_blocks] into the prefix cache."""
        if num_cached_blocks >= num_full_blocks:
            return
        new_full_blocks = blocks[num_cached_blocks:num_full_blocks]
        block_hashes: Sequence[BlockHash] | BlockHashListWithBlockSize = request.block_hashes
        if block_size != self.hash_block_size:
            block_hashes = BlockHashListWithBlockSize(request.block_hashes, self.hash_block_size, block_size)
        assert len(block_hashes) >= num_full_blocks, "the request block hasher is behind"
        stored_hashes: list[ExternalBlockHash] = []  # an event field: vLLM types it bytes | int
        for i, block in enumerate(new_full_blocks, start=num_cached_blocks):
            if block.is_null:
                continue  # skipped blocks hold no KV worth sharing
            block_hash: BlockHash = block_hashes[i]
            key = make_block_hash_with_group_id(block_hash, kv_cache_group_id)
            block.block_hash = key  # asserts the block was not cached already
            self.cached_block_hash_to_block.insert(key, block)
            stored_hashes.append(block_hash)
        if self.enable_kv_cache_events and stored_hashes:
            parent = block_hashes[num_cached_blocks - 1] if num_cached_blocks > 0 else None
            self.kv_event_queue.append(
                BlockStored(
                    block_hashes=stored_hashes,
                    parent_block_hash=parent,
                    token_ids=request.all_token_ids[num_cached_blocks * block_size : num_full_blocks * block_size],
                    block_size=block_size,
                    lora_id=request.lora_request.lora_int_id if request.lora_request is not None else None,
                    lora_name=request.lora_request.lora_name if request.lora_request is not None else None,
                    group_idx=kv_cache_group_id,
                )
            )

    # -- allocation --------------------------------------------------------------------------------
    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Pop num_blocks from the LRU front, evicting their cached hashes."""
        if num_blocks > self.get_num_free_blocks():
            raise ValueError(f"Cannot get {num_blocks} free blocks from the pool ({self.get_num_free_blocks()} free)")
        new_blocks = self.free_block_queue.popleft_n(num_blocks)
        collector = self.metrics_collector
        for block in new_blocks:
            if self.enable_caching:
                self._maybe_evict_cached_block(block)
            assert block.ref_cnt == 0, f"block {block.block_id} in the free queue has ref_cnt {block.ref_cnt}"
            block.ref_cnt += 1
            if collector is not None:
                collector.on_block_allocated(block.block_id)  # ends its previous life first
        return new_blocks

    def _maybe_evict_cached_block(self, block: KVCacheBlock) -> bool:
        """Drop a block's prefix-cache entry if it has one."""
        key = block.block_hash
        if key is None:
            return False
        if self.cached_block_hash_to_block.pop(key, block.block_id) is None:
            return False
        block.reset_hash()
        if self.enable_kv_cache_events:
            self.kv_event_queue.append(BlockRemoved(block_hashes=[get_block_hash(key)], group_idx=get_group_id(key)))
        return True

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on prefix-cache hits, pulling free ones out of the queue."""
        for block in blocks:
            if block.is_null:
                continue  # the null block is shared by everyone and never counted
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1
            if self.metrics_collector is not None:
                self.metrics_collector.on_block_accessed(block.block_id)

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference per block; blocks reaching 0 join the queue in the given order.

        Callers pass the blocks in eviction order (a request's tail first), so the prefix, the
        part most likely to be shared, stays cached longest.
        """
        freed: list[KVCacheBlock] = []
        for block in ordered_blocks:
            if block.is_null:
                continue
            assert block.ref_cnt > 0, f"double free of block {block.block_id}"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                freed.append(block)
        self.free_block_queue.append_n(freed)

    def evict_blocks(self, block_ids: Iterable[int]) -> None:
        """Drop the prefix-cache entries of the given blocks; they stay where they are."""
        for block_id in block_ids:
            self._maybe_evict_cached_block(self.blocks[block_id])

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only when no block is in use."""
        num_used_blocks = self.num_gpu_blocks - self.get_num_free_blocks()
        if num_used_blocks != 1:  # the null block is always "used"
            logger.warning("Failed to reset the prefix cache: %d blocks are still in use", num_used_blocks - 1)
            return False
        self.cached_block_hash_to_block = BlockHashToBlockMap()
        for block in self.blocks:
            block.reset_hash()
        if self.metrics_collector is not None:
            self.metrics_collector.on_reset()
        if self.enable_kv_cache_events:
            self.kv_event_queue.append(AllBlocksCleared())
        return True

    # -- observation -------------------------------------------------------------------------------
    def get_num_free_blocks(self) -> int:
        """Free blocks, cached-and-evictable ones included."""
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        """Fraction of non-null blocks in use."""
        total_gpu_blocks = self.num_gpu_blocks - 1
        if total_gpu_blocks <= 0:
            return 0.0
        return 1.0 - self.get_num_free_blocks() / total_gpu_blocks

    def take_events(self) -> list[KVCacheEvent]:
        """Drain the KV cache events by swapping the list."""
        events, self.kv_event_queue = self.kv_event_queue, []
        return events

    def get_block_states(self) -> bytes:
        """One byte per block: 0 free, 1 in use, 2 cached and evictable, 3 null (console block map)."""
        states = bytearray(
            [
                BLOCK_STATE_IN_USE if block.ref_cnt else (BLOCK_STATE_FREE if block._block_hash is None else BLOCK_STATE_CACHED)
                for block in self.blocks
            ]
        )
        states[0] = BLOCK_STATE_NULL
        return bytes(states)

    def get_block_ref_counts(self) -> bytes:
        """One byte per block: ref_cnt clipped at 255 (console shading of shared blocks)."""
        return bytes([ref_cnt if (ref_cnt := block.ref_cnt) < 256 else 255 for block in self.blocks])
