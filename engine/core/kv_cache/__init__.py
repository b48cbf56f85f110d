"""Paged KV cache management, pure Python (seed: KVCacheManager, BlockPool, prefix cache, lines 2058-3251)."""

from engine.core.kv_cache.block import FreeKVCacheBlockQueue, KVCacheBlock
from engine.core.kv_cache.block_pool import BlockHashToBlockMap, BlockPool
from engine.core.kv_cache.events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from engine.core.kv_cache.hashing import (
    BlockHash,
    BlockHashWithGroupId,
    generate_block_hash_extra_keys,
    get_block_hash,
    get_group_id,
    get_hash_fn_by_name,
    get_request_block_hasher,
    hash_block_tokens,
    init_none_hash,
    make_block_hash_with_group_id,
    sha256,
    sha256_cbor,
)
from engine.core.kv_cache.kv_cache_spec import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    KVCacheTensor,
    SlidingWindowSpec,
    get_kv_cache_config,
    get_kv_cache_groups,
)
from engine.core.kv_cache.manager import KVCacheBlocks, KVCacheManager
from engine.core.kv_cache.metrics import PrefixCacheStats

__all__ = [
    "AllBlocksCleared",
    "BlockHash",
    "BlockHashToBlockMap",
    "BlockHashWithGroupId",
    "BlockPool",
    "BlockRemoved",
    "BlockStored",
    "FreeKVCacheBlockQueue",
    "FullAttentionSpec",
    "KVCacheBlock",
    "KVCacheBlocks",
    "KVCacheConfig",
    "KVCacheEvent",
    "KVCacheGroupSpec",
    "KVCacheManager",
    "KVCacheSpec",
    "KVCacheTensor",
    "PrefixCacheStats",
    "SlidingWindowSpec",
    "generate_block_hash_extra_keys",
    "get_block_hash",
    "get_group_id",
    "get_hash_fn_by_name",
    "get_kv_cache_config",
    "get_kv_cache_groups",
    "get_request_block_hasher",
    "hash_block_tokens",
    "init_none_hash",
    "make_block_hash_with_group_id",
    "sha256",
    "sha256_cbor",
]
