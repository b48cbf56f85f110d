"""KV cache coordinators: fan a request's blocks out over the KV cache groups."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import TYPE_CHECKING

from lm_console.engine.core.kv_cache.block import KVCacheBlock
from lm_console.engine.core.kv_cache.block_pool import BlockPool
from lm_console.engine.core.kv_cache.single_type import (
    FullAttentionManager,
    SingleTypeKVCacheManager,
    get_manager_for_kv_cache_spec,
    spec_manager_map,
)
from lm_console.engine.kv_cache_hashing import BlockHash, BlockHashListWithBlockSize
from lm_console.engine.kv_cache_interface import FullAttentionSpec, KVCacheSpec

if TYPE_CHECKING:
    from lm_console.engine.request import Request


class KVCacheCoordinator(ABC):
    """Owns the BlockPool and one SingleTypeKVCacheManager per KV cache group.

    Invariants: single_type_managers[i] manages group i; every per-group tuple this class
    returns has one entry per group, in group order.
    """

    def __init__(
        self,
        kv_cache_specs: Sequence[KVCacheSpec],
        num_gpu_blocks: int,
        max_model_len: int,
        use_eagle: bool,
        enable_caching: bool,
        enable_kv_cache_events: bool,
        hash_block_size: int,
    ) -> None:
        self.kv_cache_specs = tuple(kv_cache_specs)
        self.max_model_len = max_model_len
        self.use_eagle = use_eagle
        self.enable_caching = enable_caching
        self.hash_block_size = hash_block_size
        self.block_pool = BlockPool(num_gpu_blocks, enable_caching, hash_block_size, enable_kv_cache_events)
        self.single_type_managers: tuple[SingleTypeKVCacheManager, ...] = tuple(
            get_manager_for_kv_cache_spec(spec, self.block_pool, enable_caching, group_id)
            for group_id, spec in enumerate(self.kv_cache_specs)
        )

    def get_num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: tuple[Sequence[KVCacheBlock], ...],
        total_computed_tokens: int,
    ) -> int:
        """Free blocks needed by all groups together."""
        return sum(
            manager.get_num_blocks_to_allocate(request_id, num_tokens, new_computed_blocks[i], total_computed_tokens)
            for i, manager in enumerate(self.single_type_managers)
        )

    def allocate_new_computed_blocks(
        self,
        request_id: str,
        new_computed_blocks: tuple[Sequence[KVCacheBlock], ...],
        num_local_computed_tokens: int,
        num_external_computed_tokens: int,
    ) -> None:
        """Hand each group its prefix hits (and blocks for external KV)."""
        for i, manager in enumerate(self.single_type_managers):
            manager.allocate_new_computed_blocks(
                request_id, new_computed_blocks[i], num_local_computed_tokens, num_external_computed_tokens
            )

    def allocate_new_blocks(self, request_id: str, num_tokens: int) -> tuple[list[KVCacheBlock], ...]:
        """Grow every group to cover num_tokens; return the new blocks per group."""
        return tuple(manager.allocate_new_blocks(request_id, num_tokens) for manager in self.single_type_managers)

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Cache the full blocks among the first num_computed_tokens tokens in every group."""
        for manager in self.single_type_managers:
            manager.cache_blocks(request, num_computed_tokens)

    def free(self, request_id: str) -> None:
        """Release the request's blocks in every group."""
        for manager in self.single_type_managers:
            manager.free(request_id)

    def remove_skipped_blocks(self, request_id: str, total_computed_tokens: int) -> None:
        """Free the blocks that fell out of every group's attention window."""
        for manager in self.single_type_managers:
            manager.remove_skipped_blocks(request_id, total_computed_tokens)

    def get_num_common_prefix_blocks(self, running_request_id: str) -> list[int]:
        """Common prefix blocks per group."""
        return [manager.get_num_common_prefix_blocks(running_request_id) for manager in self.single_type_managers]

    def get_blocks(self, request_id: str) -> tuple[list[KVCacheBlock], ...]:
        """The request's blocks per group (empty lists for unknown requests)."""
        return tuple(manager.req_to_blocks.get(request_id, []) for manager in self.single_type_managers)

    @abstractmethod
    def find_longest_cache_hit(
        self, block_hashes: list[BlockHash], max_cache_hit_length: int
    ) -> tuple[tuple[list[KVCacheBlock], ...], int]:
        """(hit blocks per group, hit length in tokens) for at most max_cache_hit_length tokens."""


class KVCacheCoordinatorNoPrefixCache(KVCacheCoordinator):
    """Prefix caching disabled: lookups always miss."""

    def get_num_common_prefix_blocks(self, running_request_id: str) -> list[int]:
        return [0] * len(self.single_type_managers)

    def find_longest_cache_hit(
        self, block_hashes: list[BlockHash], max_cache_hit_length: int
    ) -> tuple[tuple[list[KVCacheBlock], ...], int]:
        return tuple([] for _ in self.single_type_managers), 0


class UnitaryKVCacheCoordinator(KVCacheCoordinator):
    """Exactly one KV cache group with prefix caching."""

    def __init__(
        self,
        kv_cache_specs: Sequence[KVCacheSpec],
        num_gpu_blocks: int,
        max_model_len: int,
        use_eagle: bool,
        enable_caching: bool,
        enable_kv_cache_events: bool,
        hash_block_size: int,
    ) -> None:
        super().__init__(
            kv_cache_specs, num_gpu_blocks, max_model_len, use_eagle, enable_caching, enable_kv_cache_events, hash_block_size
        )
        assert len(self.kv_cache_specs) == 1, "UnitaryKVCacheCoordinator manages exactly one group"
        self.kv_cache_spec = self.kv_cache_specs[0]
        self.block_size = self.kv_cache_spec.block_size
        assert self.block_size % hash_block_size == 0, "block_size must be a multiple of hash_block_size"

    def find_longest_cache_hit(
        self, block_hashes: list[BlockHash], max_cache_hit_length: int
    ) -> tuple[tuple[list[KVCacheBlock], ...], int]:
        hashes: list[BlockHash] | BlockHashListWithBlockSize = block_hashes
        if self.block_size != self.hash_block_size:
            hashes = BlockHashListWithBlockSize(block_hashes, self.hash_block_size, self.block_size)
        hit_blocks = self.single_type_managers[0].find_longest_cache_hit(
            block_hashes=hashes,
            max_length=max_cache_hit_length,
            kv_cache_group_ids=[0],
            block_pool=self.block_pool,
            kv_cache_spec=self.kv_cache_spec,
            use_eagle=self.use_eagle,
            alignment_tokens=self.block_size,
        )
        return hit_blocks, len(hit_blocks[0]) * self.block_size


class HybridKVCacheCoordinator(KVCacheCoordinator):
    """Several KV cache groups of different specs, with prefix caching.

    Groups of equal spec form one attention group and are searched together (a block hash hits
    only if every group of the spec has it cached). Full attention comes first: its hits are
    downward closed, so any shorter length the other types settle on is still a hit for it.
    Invariant: attention_groups partition the group ids; every group has the same block size.
    """

    def __init__(
        self,
        kv_cache_specs: Sequence[KVCacheSpec],
        num_gpu_blocks: int,
        max_model_len: int,
        use_eagle: bool,
        enable_caching: bool,
        enable_kv_cache_events: bool,
        hash_block_size: int,
    ) -> None:
        super().__init__(
            kv_cache_specs, num_gpu_blocks, max_model_len, use_eagle, enable_caching, enable_kv_cache_events, hash_block_size
        )
        self.verify_and_split_kv_cache_groups()

    def verify_and_split_kv_cache_groups(self) -> None:
        """Bucket the groups by spec into attention_groups, full attention first."""
        group_ids_by_spec: dict[KVCacheSpec, list[int]] = {}
        for group_id, spec in enumerate(self.kv_cache_specs):
            group_ids_by_spec.setdefault(spec, []).append(group_id)
        self.attention_groups: list[tuple[KVCacheSpec, list[int], type[SingleTypeKVCacheManager]]] = sorted(
            ((spec, ids, spec_manager_map[type(spec)]) for spec, ids in group_ids_by_spec.items()),
            key=lambda group: not isinstance(group[0], FullAttentionSpec),
        )
        block_sizes = {spec.block_size for spec in self.kv_cache_specs}
        if len(block_sizes) != 1:
            raise NotImplementedError(f"hybrid KV cache groups need one block size, got {sorted(block_sizes)}")
        self.block_size = block_sizes.pop()
        assert self.block_size % self.hash_block_size == 0, "block_size must be a multiple of hash_block_size"
        num_full = sum(1 for spec, _, _ in self.attention_groups if isinstance(spec, FullAttentionSpec))
        # One full type plus one other: a single pass reaches the fixed point (after vLLM's is_simple_hybrid).
        self.is_simple_hybrid = len(self.attention_groups) == 2 and num_full == 1

    def find_longest_cache_hit(
        self, block_hashes: list[BlockHash], max_cache_hit_length: int
    ) -> tuple[tuple[list[KVCacheBlock], ...], int]:
        """Shrink the hit length until every attention type accepts it (a fixed point).

        Each pass asks every type for its longest hit within the current length; the length
        only decreases, so the loop ends. Full attention is searched once and then cut.
        """
        hashes: list[BlockHash] | BlockHashListWithBlockSize = block_hashes
        if self.block_size != self.hash_block_size:
            hashes = BlockHashListWithBlockSize(block_hashes, self.hash_block_size, self.block_size)
        block_size = self.block_size
        hits_by_type: list[tuple[list[KVCacheBlock], ...] | None] = [None] * len(self.attention_groups)
        hit_length = max_cache_hit_length
        while True:
            curr_hit_length = hit_length
            for idx, (spec, group_ids, manager_cls) in enumerate(self.attention_groups):
                cached = hits_by_type[idx]
                if cached is not None and manager_cls is FullAttentionManager:
                    # Downward closed: the earlier, longer hit cut to the new length is still a hit.
                    curr_hit_length = min(curr_hit_length, len(cached[0]) * block_size) // block_size * block_size
                    continue
                hits = manager_cls.find_longest_cache_hit(
                    block_hashes=hashes,
                    max_length=curr_hit_length,
                    kv_cache_group_ids=group_ids,
                    block_pool=self.block_pool,
                    kv_cache_spec=spec,
                    use_eagle=self.use_eagle,
                    alignment_tokens=block_size,
                )
                hits_by_type[idx] = hits
                curr_hit_length = len(hits[0]) * block_size
            if curr_hit_length >= hit_length or self.is_simple_hybrid:
                hit_length = curr_hit_length
                break
            hit_length = curr_hit_length
        num_blocks = hit_length // block_size
        hit_blocks: list[list[KVCacheBlock]] = [[] for _ in self.kv_cache_specs]
        for (_, group_ids, _), group_hits in zip(self.attention_groups, hits_by_type):
            assert group_hits is not None
            for group_id, blocks in zip(group_ids, group_hits):
                hit_blocks[group_id] = blocks[:num_blocks]
        return tuple(hit_blocks), hit_length


def get_kv_cache_coordinator(
    kv_cache_specs: Sequence[KVCacheSpec],
    num_gpu_blocks: int,
    max_model_len: int,
    enable_caching: bool,
    enable_kv_cache_events: bool,
    hash_block_size: int,
    use_eagle: bool = False,
) -> KVCacheCoordinator:
    """Pick the coordinator for the groups and caching mode (after vLLM's get_kv_cache_coordinator)."""
    args = (kv_cache_specs, num_gpu_blocks, max_model_len, use_eagle, enable_caching, enable_kv_cache_events, hash_block_size)
    if not enable_caching:
        return KVCacheCoordinatorNoPrefixCache(*args)
    if len(kv_cache_specs) == 1:
        return UnitaryKVCacheCoordinator(*args)
    return HybridKVCacheCoordinator(*args)
