"""KV cache events drained by take_events() (seed: KV Cache Events, lines 2871-2882; publisher 3252-3549).

msgspec Structs in vLLM's wire shape: array_like and tagged, so one event encodes as
["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium].
They cross the process boundary inside a KVEventBatch (engine/metrics/kv_events.py).
"""

from __future__ import annotations

from typing import Union

import msgspec

from engine.core.kv_cache.hashing import BlockHash

MEDIUM_GPU = "GPU"  # where the blocks live; the CPU backend reports the same name for uniformity


class KVCacheEventBase(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Base of the tagged KV cache events (the tag is the class name)."""


class BlockStored(KVCacheEventBase):
    """Full blocks entered the prefix cache as one chain segment (seed: cache_full_blocks, lines 3190-3221)."""

    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None  # None when the segment starts the chain
    token_ids: list[int]  # the tokens of all stored blocks, len == len(block_hashes) * block_size
    block_size: int
    lora_id: int | None = None
    medium: str | None = MEDIUM_GPU


class BlockRemoved(KVCacheEventBase):
    """Blocks left the prefix cache, evicted for reuse or explicitly (seed: lines 2825-2854)."""

    block_hashes: list[BlockHash]
    medium: str | None = MEDIUM_GPU


class AllBlocksCleared(KVCacheEventBase):
    """The whole prefix cache was reset (seed: reset_prefix_cache, lines 2855-2870)."""

    medium: str | None = MEDIUM_GPU


KVCacheEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared]
