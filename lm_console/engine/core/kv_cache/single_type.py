"""Per-attention-type block managers (after vLLM's vllm/v1/core/single_type_kv_cache_manager.py)."""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from collections import defaultdict
from collections.abc import Sequence
from typing import TYPE_CHECKING

from lm_console.engine.core.kv_cache.block import KVCacheBlock
from lm_console.engine.core.kv_cache.block_pool import BlockPool
from lm_console.engine.kv_cache_hashing import BlockHash, BlockHashListWithBlockSize
from lm_console.engine.kv_cache_interface import FullAttentionSpec, KVCacheSpec, SlidingWindowSpec, cdiv

if TYPE_CHECKING:
    from lm_console.engine.request import Request


class SingleTypeKVCacheManager(ABC):
    """Blocks of one KV cache group for every request (after vLLM's SingleTypeKVCacheManager).

    Invariants: req_to_blocks[r] is append-only except that remove_skipped_blocks may replace
    leading blocks by the null block; req_to_blocks[r][:num_cached_block[r]] are already in the
    prefix cache (or null); each request holds one reference on each non-null block it lists.
    """

    def __init__(self, kv_cache_spec: KVCacheSpec, block_pool: BlockPool, enable_caching: bool, kv_cache_group_id: int) -> None:
        self.kv_cache_spec = kv_cache_spec
        self.block_size = kv_cache_spec.block_size
        self.block_pool = block_pool
        self.enable_caching = enable_caching
        self.kv_cache_group_id = kv_cache_group_id
        self.req_to_blocks: defaultdict[str, list[KVCacheBlock]] = defaultdict(list)
        # Requests appear here once they hold blocks that count as cached; the fast path of
        # get_num_blocks_to_allocate relies on running requests never getting new prefix hits.
        self.num_cached_block: dict[str, int] = {}
        self._null_block = block_pool.null_block

    def get_num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock],
        total_computed_tokens: int,
    ) -> int:
        """Blocks allocate_slots would take from the free queue."""
        num_required_blocks = cdiv(num_tokens, self.block_size)
        num_req_blocks = len(self.req_to_blocks.get(request_id, ()))
        if request_id in self.num_cached_block:
            # Fast path: a running request has no new hits. After rejected draft tokens it may
            # already hold more blocks than needed, hence the max.
            assert len(new_computed_blocks) == 0
            return max(num_required_blocks - num_req_blocks, 0)
        num_skipped_blocks = self.get_num_skipped_tokens(total_computed_tokens) // self.block_size
        num_local_computed_blocks = num_req_blocks + len(new_computed_blocks)
        num_new_blocks = max(num_required_blocks - max(num_skipped_blocks, num_local_computed_blocks), 0)
        # Hits sitting in the free queue leave it on touch(), so they cost free capacity too.
        num_skipped_new_computed = max(num_skipped_blocks - num_req_blocks, 0)
        num_evictable_blocks = sum(
            1 for block in new_computed_blocks[num_skipped_new_computed:] if block.ref_cnt == 0 and not block.is_null
        )
        return num_new_blocks + num_evictable_blocks

    def allocate_new_computed_blocks(
        self,
        request_id: str,
        new_computed_blocks: Sequence[KVCacheBlock],
        num_local_computed_tokens: int,
        num_external_computed_tokens: int,
    ) -> None:
        """Give a new request its prefix-cache hits and external-KV blocks."""
        if request_id in self.num_cached_block:
            assert len(new_computed_blocks) == 0, "a running request cannot get new prefix hits"
            return
        req_blocks = self.req_to_blocks[request_id]
        assert len(req_blocks) == 0, f"request {request_id} already holds blocks"
        num_total_computed_tokens = num_local_computed_tokens + num_external_computed_tokens
        num_skipped_tokens = self.get_num_skipped_tokens(num_total_computed_tokens)
        num_skipped_blocks = num_skipped_tokens // self.block_size
        if num_skipped_blocks > 0:
            # Hits outside the attention window are useless: hold the null block there instead.
            new_computed_blocks = new_computed_blocks[num_skipped_blocks:]
            num_external_computed_tokens = min(num_total_computed_tokens - num_skipped_tokens, num_external_computed_tokens)
        if self.enable_caching:
            self.block_pool.touch(new_computed_blocks)
        else:
            assert len(new_computed_blocks) == 0, "prefix hits without prefix caching"
        req_blocks.extend([self._null_block] * num_skipped_blocks)
        req_blocks.extend(new_computed_blocks)
        self.num_cached_block[request_id] = len(req_blocks)
        if num_external_computed_tokens > 0:
            # KV arriving from a connector still needs local blocks to land in.
            num_new = cdiv(num_total_computed_tokens, self.block_size) - len(req_blocks)
            req_blocks.extend(self.block_pool.get_new_blocks(max(num_new, 0)))

    def allocate_new_blocks(self, request_id: str, num_tokens: int) -> list[KVCacheBlock]:
        """Grow the request to cdiv(num_tokens, block_size) blocks; return only the new ones."""
        req_blocks = self.req_to_blocks[request_id]
        num_new_blocks = cdiv(num_tokens, self.block_size) - len(req_blocks)
        if num_new_blocks <= 0:
            return []
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks)
        req_blocks.extend(new_blocks)
        return new_blocks

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Enter the request's newly full blocks into the prefix cache."""
        num_cached_blocks = self.num_cached_block.get(request.request_id, 0)
        num_full_blocks = num_tokens // self.block_size
        if num_cached_blocks >= num_full_blocks:
            return
        self.block_pool.cache_full_blocks(
            request=request,
            blocks=self.req_to_blocks[request.request_id],
            num_cached_blocks=num_cached_blocks,
            num_full_blocks=num_full_blocks,
            block_size=self.block_size,
            kv_cache_group_id=self.kv_cache_group_id,
        )
        self.num_cached_block[request.request_id] = num_full_blocks

    def free(self, request_id: str) -> None:
        """Release all blocks of a request, tail first so the tail is evicted first."""
        req_blocks = self.req_to_blocks.pop(request_id, [])
        self.block_pool.free_blocks(reversed(req_blocks))
        self.num_cached_block.pop(request_id, None)

    def remove_skipped_blocks(self, request_id: str, total_computed_tokens: int) -> None:
        """Free blocks no longer attended to, replacing them by the null block."""
        num_skipped_tokens = self.get_num_skipped_tokens(total_computed_tokens)
        if num_skipped_tokens <= 0:
            return
        blocks = self.req_to_blocks[request_id]
        num_skipped_blocks = min(num_skipped_tokens // self.block_size, len(blocks))
        removed_blocks: list[KVCacheBlock] = []
        # Walk backwards: once a null block shows up, everything before it was freed earlier.
        for i in range(num_skipped_blocks - 1, -1, -1):
            if blocks[i] is self._null_block:
                break
            removed_blocks.append(blocks[i])
            blocks[i] = self._null_block
        self.block_pool.free_blocks(removed_blocks)

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """Leading tokens outside the attention window; 0 means all are attended."""
        return 0

    @abstractmethod
    def get_num_common_prefix_blocks(self, running_request_id: str) -> int:
        """Leading blocks shared by every running request (cascade attention)."""

    @classmethod
    @abstractmethod
    def find_longest_cache_hit(
        cls,
        block_hashes: Sequence[BlockHash] | BlockHashListWithBlockSize,
        max_length: int,
        kv_cache_group_ids: Sequence[int],
        block_pool: BlockPool,
        kv_cache_spec: KVCacheSpec,
        use_eagle: bool = False,
        alignment_tokens: int | None = None,
    ) -> tuple[list[KVCacheBlock], ...]:
        """The longest usable prefix hit in at most max_length tokens, one block list per group."""


class FullAttentionManager(SingleTypeKVCacheManager):
    """Full attention: nothing is skipped; hits are downward closed (after vLLM's FullAttentionManager)."""

    @classmethod
    def find_longest_cache_hit(
        cls,
        block_hashes: Sequence[BlockHash] | BlockHashListWithBlockSize,
        max_length: int,
        kv_cache_group_ids: Sequence[int],
        block_pool: BlockPool,
        kv_cache_spec: KVCacheSpec,
        use_eagle: bool = False,
        alignment_tokens: int | None = None,
    ) -> tuple[list[KVCacheBlock], ...]:
        """Scan left to right and stop at the first miss: the hash chain makes later hits impossible."""
        block_size = kv_cache_spec.block_size
        alignment_tokens = alignment_tokens or block_size
        computed_blocks: tuple[list[KVCacheBlock], ...] = tuple([] for _ in kv_cache_group_ids)
        max_num_blocks = max_length // block_size
        for block_hash in itertools.islice(block_hashes, max_num_blocks):
            cached_blocks = block_pool.get_cached_block(block_hash, kv_cache_group_ids)
            if cached_blocks is None:
                break
            for computed, cached in zip(computed_blocks, cached_blocks):
                computed.append(cached)
        if use_eagle and computed_blocks[0]:
            # EAGLE needs the hidden states of the last hit block, which the cache does not keep.
            for computed in computed_blocks:
                computed.pop()
        # Hybrid models need the hit to end on a multiple of every group's block size.
        while computed_blocks[0] and len(computed_blocks[0]) * block_size % alignment_tokens != 0:
            for computed in computed_blocks:
                computed.pop()
        return computed_blocks

    def get_num_common_prefix_blocks(self, running_request_id: str) -> int:
        """Count leading blocks whose ref_cnt equals the number of requests."""
        num_requests = len(self.req_to_blocks)
        num_common_blocks = 0
        for block in self.req_to_blocks.get(running_request_id, ()):
            if block.ref_cnt != num_requests:
                break
            num_common_blocks += 1
        return num_common_blocks


class SlidingWindowManager(SingleTypeKVCacheManager):
    """Sliding-window attention: blocks behind the window are freed (after vLLM's SlidingWindowManager).

    The token at position p attends to positions (p - sliding_window, p], so once
    num_computed_tokens tokens are in the cache the first num_computed_tokens - sliding_window + 1
    are dead weight: remove_skipped_blocks (base class) frees their blocks and puts the null
    block in their place. A running request therefore holds about
    cdiv(sliding_window, block_size) + 1 real blocks, however long it grows.
    """

    def __init__(self, kv_cache_spec: KVCacheSpec, block_pool: BlockPool, enable_caching: bool, kv_cache_group_id: int) -> None:
        assert isinstance(kv_cache_spec, SlidingWindowSpec), kv_cache_spec
        super().__init__(kv_cache_spec, block_pool, enable_caching, kv_cache_group_id)
        self.sliding_window = kv_cache_spec.sliding_window

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """Tokens the next token no longer sees."""
        return max(0, num_computed_tokens - self.sliding_window + 1)

    @classmethod
    def find_longest_cache_hit(
        cls,
        block_hashes: Sequence[BlockHash] | BlockHashListWithBlockSize,
        max_length: int,
        kv_cache_group_ids: Sequence[int],
        block_pool: BlockPool,
        kv_cache_spec: KVCacheSpec,
        use_eagle: bool = False,
        alignment_tokens: int | None = None,
    ) -> tuple[list[KVCacheBlock], ...]:
        """Scan right to left for a run of cached blocks that covers the window.

        A hit of L tokens is usable when the blocks holding tokens [L - sliding_window + 1, L)
        are cached: cdiv(sliding_window - 1, block_size) contiguous blocks ending at L, or a
        shorter run that starts at block 0. Blocks before the run are returned as the null
        block. Unlike full attention, a miss does not end the search: an earlier run may do.
        """
        assert isinstance(kv_cache_spec, SlidingWindowSpec), kv_cache_spec
        block_size = kv_cache_spec.block_size
        alignment_tokens = alignment_tokens or block_size
        num_contiguous_needed = cdiv(kv_cache_spec.sliding_window - 1, block_size)
        if use_eagle:
            num_contiguous_needed += 1  # EAGLE recomputes the last hit block (popped below)
        max_num_blocks = max_length // block_size
        null_block = block_pool.null_block
        computed_blocks: tuple[list[KVCacheBlock], ...] = tuple(
            [null_block] * max_num_blocks for _ in kv_cache_group_ids
        )
        num_contiguous = 0
        match_found = False
        if num_contiguous_needed == 0:
            # A window of one token needs no cached KV: every aligned length is a hit.
            max_num_blocks -= max_num_blocks % (alignment_tokens // block_size)
            return tuple([null_block] * max_num_blocks for _ in kv_cache_group_ids)
        for i in range(max_num_blocks - 1, -1, -1):
            cached_blocks = block_pool.get_cached_block(block_hashes[i], kv_cache_group_ids)
            if cached_blocks is None:
                num_contiguous = 0
                continue
            if num_contiguous == 0 and (i + 1) * block_size % alignment_tokens != 0:
                continue  # a hit must end on an alignment boundary: this block cannot end one
            for computed, cached in zip(computed_blocks, cached_blocks):
                computed[i] = cached
            num_contiguous += 1
            if num_contiguous >= num_contiguous_needed:
                # Blocks i .. i + num_contiguous - 1 cover the window: the hit ends there.
                for computed in computed_blocks:
                    del computed[i + num_contiguous :]
                match_found = True
                break
        if not match_found:
            # Only a run that starts at block 0 can be shorter than the window.
            for computed in computed_blocks:
                del computed[num_contiguous:]
        if use_eagle and computed_blocks[0]:
            for computed in computed_blocks:
                computed.pop()
        return computed_blocks

    def get_num_common_prefix_blocks(self, running_request_id: str) -> int:
        """Always 0: the prefix blocks are null blocks, so no cascade attention."""
        return 0


# Which manager serves which KVCacheSpec (vLLM's spec_manager_map).
spec_manager_map: dict[type[KVCacheSpec], type[SingleTypeKVCacheManager]] = {
    FullAttentionSpec: FullAttentionManager,
    SlidingWindowSpec: SlidingWindowManager,
}


def get_manager_for_kv_cache_spec(
    kv_cache_spec: KVCacheSpec, block_pool: BlockPool, enable_caching: bool, kv_cache_group_id: int
) -> SingleTypeKVCacheManager:
    """Instantiate the manager class registered for the spec's type."""
    manager_class = spec_manager_map.get(type(kv_cache_spec))
    if manager_class is None:
        raise NotImplementedError(
            f"No KV cache manager for {type(kv_cache_spec).__name__}; supported: "
            f"{[spec.__name__ for spec in spec_manager_map]}."
        )
    return manager_class(kv_cache_spec, block_pool, enable_caching, kv_cache_group_id)
