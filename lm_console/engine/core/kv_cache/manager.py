"""KVCacheManager: the scheduler's interface to the paged KV cache (after vLLM's KVCacheManager)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, overload

from lm_console.engine.core.kv_cache.block import KVCacheBlock
from lm_console.engine.core.kv_cache.block_pool import BlockPool
from lm_console.engine.core.kv_cache.coordinator import KVCacheCoordinator, get_kv_cache_coordinator
from lm_console.engine.core.kv_cache.metrics import PrefixCacheStats
from lm_console.engine.errors import InvalidEngineArgsError
from lm_console.engine.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheSpec, SlidingWindowSpec
from lm_console.engine.metrics.kv_events import BlockStored, KVCacheEvent

if TYPE_CHECKING:
    from lm_console.engine.request import Request


@dataclass
class KVCacheBlocks:
    """Blocks handed to the scheduler: blocks[i][j] is group i's j-th block.

    Hides the block objects' internals from the scheduler, which only needs ids.
    """

    blocks: tuple[Sequence[KVCacheBlock], ...]

    def __add__(self, other: KVCacheBlocks) -> KVCacheBlocks:
        """Concatenate group by group."""
        return KVCacheBlocks(tuple(list(itertools.chain(mine, theirs)) for mine, theirs in zip(self.blocks, other.blocks)))

    @overload
    def get_block_ids(self, allow_none: Literal[False] = False) -> tuple[list[int], ...]: ...
    @overload
    def get_block_ids(self, allow_none: Literal[True]) -> tuple[list[int], ...] | None: ...
    def get_block_ids(self, allow_none: bool = False) -> tuple[list[int], ...] | None:
        """Block ids per group; None when allow_none and every group is empty."""
        if allow_none and all(len(group) == 0 for group in self.blocks):
            return None
        return tuple([block.block_id for block in group] for group in self.blocks)

    def get_unhashed_block_ids(self) -> list[int]:
        """Ids of the blocks not yet in the prefix cache (single group only; used by KV connectors)."""
        assert len(self.blocks) == 1, "only one group is supported"
        return [block.block_id for block in self.blocks[0] if block.block_hash is None]

    def new_empty(self) -> KVCacheBlocks:
        """An empty KVCacheBlocks with the same number of groups."""
        return KVCacheBlocks(tuple(() for _ in self.blocks))


class KVCacheManager:
    """Allocates, caches and frees the KV blocks of every request (after vLLM's KVCacheManager).

    Layers: KVCacheManager -> KVCacheCoordinator -> SingleTypeKVCacheManager -> BlockPool.
    Invariants: a request holds blocks from its first successful allocate_slots until free();
    allocate_slots either allocates everything asked for or returns None having changed nothing
    but the freeing of blocks that fell behind a sliding window (stage 1).
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        max_model_len: int,
        enable_caching: bool = True,
        enable_kv_cache_events: bool = False,
        hash_block_size: int | None = None,
        log_stats: bool = True,
        use_eagle: bool = False,
        kv_cache_config: KVCacheConfig | None = None,
    ) -> None:
        if num_blocks < 2:
            raise InvalidEngineArgsError(f"num_blocks={num_blocks} is too small: block 0 is the null block, need >= 2.")
        if block_size < 1:
            raise InvalidEngineArgsError(f"block_size={block_size} must be >= 1.")
        hash_block_size = block_size if hash_block_size is None else hash_block_size
        if hash_block_size < 1 or block_size % hash_block_size != 0:
            raise InvalidEngineArgsError(
                f"hash_block_size={hash_block_size} must be >= 1 and divide block_size={block_size}."
            )
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.log_stats = log_stats
        # No config: one full-attention group (every model without sliding-window layers).
        kv_cache_specs: list[KVCacheSpec] = [FullAttentionSpec(block_size=block_size)]
        if kv_cache_config is not None:
            kv_cache_specs = kv_cache_config.kv_cache_specs
            if any(spec.block_size != block_size for spec in kv_cache_specs):
                raise InvalidEngineArgsError(f"KV cache groups {kv_cache_specs} disagree with block_size={block_size}.")
        self.coordinator: KVCacheCoordinator = get_kv_cache_coordinator(
            kv_cache_specs=kv_cache_specs,
            num_gpu_blocks=num_blocks,
            max_model_len=max_model_len,
            enable_caching=enable_caching,
            enable_kv_cache_events=enable_kv_cache_events,
            hash_block_size=hash_block_size,
            use_eagle=use_eagle,
        )
        self.num_kv_cache_groups = len(self.coordinator.single_type_managers)
        self.block_pool: BlockPool = self.coordinator.block_pool
        # Per group, what a BlockStored event says about its cache (vLLM's kv_cache_spec_kind and window),
        # so that a consumer of the events can tell a sliding-window group's blocks from full ones.
        self.kv_cache_event_metadata: list[tuple[str, int | None]] = [
            ("sliding_window", spec.sliding_window) if isinstance(spec, SlidingWindowSpec) else ("full_attention", None)
            for spec in kv_cache_specs]
        self.prefix_cache_stats: PrefixCacheStats | None = PrefixCacheStats() if log_stats else None
        # Pre-built and shared: most steps return "no new blocks", and this avoids the garbage.
        self.empty_kv_cache_blocks = KVCacheBlocks(tuple(() for _ in range(self.num_kv_cache_groups)))

    # -- observation ---------------------------------------------------------------------------------
    @property
    def usage(self) -> float:
        """Fraction of non-null blocks in use."""
        return self.block_pool.get_usage()

    @property
    def num_free_blocks(self) -> int:
        """Free blocks, cached-and-evictable ones included."""
        return self.block_pool.get_num_free_blocks()

    def make_prefix_cache_stats(self) -> PrefixCacheStats | None:
        """Drain the prefix-cache counters (None when log_stats is off)."""
        if self.prefix_cache_stats is None:
            return None
        stats, self.prefix_cache_stats = self.prefix_cache_stats, PrefixCacheStats()
        return stats

    def take_events(self) -> list[KVCacheEvent]:
        """Drain the KV cache events of the block pool, each stored block tagged with its group's spec."""
        events = self.block_pool.take_events()
        for event in events:
            if isinstance(event, BlockStored) and event.group_idx is not None \
                    and 0 <= event.group_idx < len(self.kv_cache_event_metadata):
                event.kv_cache_spec_kind, event.kv_cache_spec_sliding_window = \
                    self.kv_cache_event_metadata[event.group_idx]
        return events

    def get_block_states(self) -> bytes:
        """One byte per block (0 free, 1 in use, 2 cached, 3 null), for the console."""
        return self.block_pool.get_block_states()

    def get_block_ref_counts(self) -> bytes:
        """One byte per block: ref_cnt clipped at 255, for the console."""
        return self.block_pool.get_block_ref_counts()

    # -- prefix cache ----------------------------------------------------------------------------------
    def get_computed_blocks(self, request: Request) -> tuple[KVCacheBlocks, int]:
        """Longest prefix-cache hit of a waiting request and its length in tokens."""
        # prompt_logprobs (and MEAN pooling) need every prompt token computed, so nothing may be skipped.
        if not self.enable_caching or request.sampling_params.needs_every_prompt_token:
            return self.empty_kv_cache_blocks, 0
        # A full hit must still recompute the last token: its logits sample the next one.
        max_cache_hit_length = request.num_tokens - 1
        computed_blocks, num_new_computed_tokens = self.coordinator.find_longest_cache_hit(
            request.block_hashes, max_cache_hit_length
        )
        if self.prefix_cache_stats is not None:
            self.prefix_cache_stats.record(
                num_tokens=request.num_tokens, num_hits=num_new_computed_tokens, preempted=request.num_preemptions > 0
            )
        return self.create_kv_cache_blocks(computed_blocks), num_new_computed_tokens

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: KVCacheBlocks | None = None,
        num_lookahead_tokens: int = 0,
        num_external_computed_tokens: int = 0,
        delay_cache_blocks: bool = False,
    ) -> KVCacheBlocks | None:
        """Give the request slots for num_new_tokens more tokens; None if the pool is short.

        Layout: | comp | new_comp | ext_comp | new | lookahead |. Returns only the newly
        allocated blocks; on None nothing has changed (the scheduler then preempts).
        """
        if num_new_tokens == 0 and num_external_computed_tokens == 0:
            raise ValueError("allocate_slots needs num_new_tokens > 0 or num_external_computed_tokens > 0")
        if self.enable_caching:
            self._check_block_hasher(request)  # before any state changes
        new_computed_block_list = (new_computed_blocks or self.empty_kv_cache_blocks).blocks
        num_local_computed_tokens = request.num_computed_tokens + num_new_computed_tokens
        total_computed_tokens = min(num_local_computed_tokens + num_external_computed_tokens, self.max_model_len)
        num_tokens_need_slot = min(total_computed_tokens + num_new_tokens + num_lookahead_tokens, self.max_model_len)

        # Stage 1: free blocks outside the attention window first; this can only help stage 2.
        self.coordinator.remove_skipped_blocks(request.request_id, total_computed_tokens)

        # Stage 2: capacity check, before any state changes.
        num_blocks_to_allocate = self.coordinator.get_num_blocks_to_allocate(
            request.request_id, num_tokens_need_slot, new_computed_block_list, total_computed_tokens
        )
        if num_blocks_to_allocate > self.block_pool.get_num_free_blocks():
            return None

        # Stage 3: take references on the prefix hits (touch() pulls them out of the free queue
        # before stage 4 could evict them).
        if any(new_computed_block_list) or num_external_computed_tokens > 0:
            self.coordinator.allocate_new_computed_blocks(
                request.request_id, new_computed_block_list, num_local_computed_tokens, num_external_computed_tokens
            )

        # Stage 4: fresh blocks for the new and lookahead tokens.
        new_blocks = self.coordinator.allocate_new_blocks(request.request_id, num_tokens_need_slot)

        # Stage 5: cache the blocks that will be full after this step. Lookahead (draft) tokens
        # are excluded: they may be rejected. P/D delays caching until the KV has arrived.
        if self.enable_caching and not delay_cache_blocks:
            num_tokens_to_cache = min(total_computed_tokens + num_new_tokens, request.num_tokens)
            self.coordinator.cache_blocks(request, num_tokens_to_cache)
        return self.create_kv_cache_blocks(new_blocks)

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Cache the full blocks among the first num_computed_tokens (KV connector, delayed caching)."""
        if self.enable_caching:
            self._check_block_hasher(request)
            self.coordinator.cache_blocks(request, num_computed_tokens)

    def free(self, request: Request) -> None:
        """Release every block of a finished or preempted request, tail first."""
        self.coordinator.free(request.request_id)

    def reset_prefix_cache(self) -> bool:
        """Forget all cached blocks; False (no change) while any request holds blocks."""
        if not self.block_pool.reset_prefix_cache():
            return False
        if self.prefix_cache_stats is not None:
            self.prefix_cache_stats.reset = True
        return True

    # -- lookup ------------------------------------------------------------------------------------------
    def get_blocks(self, request_id: str) -> KVCacheBlocks:
        """All blocks of a request."""
        return self.create_kv_cache_blocks(self.coordinator.get_blocks(request_id))

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        """All block ids of a request, per group."""
        return self.get_blocks(request_id).get_block_ids()

    def get_num_common_prefix_blocks(self, running_request_id: str) -> list[int]:
        """Leading blocks shared by every running request, per group."""
        return self.coordinator.get_num_common_prefix_blocks(running_request_id)

    def create_kv_cache_blocks(self, blocks: tuple[Sequence[KVCacheBlock], ...]) -> KVCacheBlocks:
        """Wrap per-group block lists, reusing empty_kv_cache_blocks when all are empty."""
        return KVCacheBlocks(blocks) if any(blocks) else self.empty_kv_cache_blocks

    @staticmethod
    def _check_block_hasher(request: Request) -> None:
        # Without a hasher, request.block_hashes stays empty and caching would fail deep inside
        # the block pool; say what is missing instead.
        if request.block_hasher is None:
            raise ValueError(
                f"Request {request.request_id} has no block_hasher but prefix caching is enabled; "
                "pass block_hasher=get_request_block_hasher(block_size, hash_fn) or disable caching."
            )
