"""Paged KV cache management, pure Python (after vLLM's vllm/v1/core/kv_cache_manager.py and block_pool.py).

The types the KV cache shares with other layers live at the bottom: the specs and KVCacheConfig
in lm_console/engine/kv_cache_interface.py, the prefix hash chain in lm_console/engine/kv_cache_hashing.py, the KV cache
events in lm_console/engine/metrics/kv_events.py.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lm_console._lazy import lazy_exports

if TYPE_CHECKING:
    from lm_console.engine.core.kv_cache.block import FreeKVCacheBlockQueue, KVCacheBlock
    from lm_console.engine.core.kv_cache.block_pool import BlockHashToBlockMap, BlockPool
    from lm_console.engine.core.kv_cache.manager import KVCacheBlocks, KVCacheManager
    from lm_console.engine.core.kv_cache.metrics import PrefixCacheStats

__all__ = [
    "BlockHashToBlockMap",
    "BlockPool",
    "FreeKVCacheBlockQueue",
    "KVCacheBlock",
    "KVCacheBlocks",
    "KVCacheManager",
    "PrefixCacheStats",
]

__getattr__ = lazy_exports(__name__, {
    "FreeKVCacheBlockQueue": "lm_console.engine.core.kv_cache.block",
    "KVCacheBlock": "lm_console.engine.core.kv_cache.block",
    "BlockHashToBlockMap": "lm_console.engine.core.kv_cache.block_pool",
    "BlockPool": "lm_console.engine.core.kv_cache.block_pool",
    "KVCacheBlocks": "lm_console.engine.core.kv_cache.manager",
    "KVCacheManager": "lm_console.engine.core.kv_cache.manager",
    "PrefixCacheStats": "lm_console.engine.core.kv_cache.metrics",
})
