"""Paged KV cache management, pure Python (seed: KVCacheManager, BlockPool, prefix cache, lines 2058-3251).

The types the KV cache shares with other layers live at the bottom: the specs and KVCacheConfig
in engine/kv_cache_interface.py, the prefix hash chain in engine/kv_cache_hashing.py, the KV cache
events in engine/metrics/kv_events.py.
"""

from engine.core.kv_cache.block import FreeKVCacheBlockQueue, KVCacheBlock
from engine.core.kv_cache.block_pool import BlockHashToBlockMap, BlockPool
from engine.core.kv_cache.manager import KVCacheBlocks, KVCacheManager
from engine.core.kv_cache.metrics import PrefixCacheStats

__all__ = [
    "BlockHashToBlockMap",
    "BlockPool",
    "FreeKVCacheBlockQueue",
    "KVCacheBlock",
    "KVCacheBlocks",
    "KVCacheManager",
    "PrefixCacheStats",
]
