"""KV cache events drained by take_events() (seed: KV Cache Events, lines 2871-2882; publisher 3252-3549).

Plain dataclasses for now; the multiprocess issue converts them to msgspec structs in
engine/protocol.py when they start crossing a process boundary.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.core.kv_cache.hashing import BlockHash

MEDIUM_GPU = "GPU"  # where the blocks live; the CPU backend reports the same name for uniformity


@dataclass(slots=True)
class BlockStored:
    """Full blocks entered the prefix cache as one chain segment (seed: cache_full_blocks, lines 3190-3221)."""

    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None  # None when the segment starts the chain
    token_ids: list[int]  # the tokens of all stored blocks, len == len(block_hashes) * block_size
    block_size: int
    medium: str | None = MEDIUM_GPU


@dataclass(slots=True)
class BlockRemoved:
    """Blocks left the prefix cache, evicted for reuse or explicitly (seed: lines 2825-2854)."""

    block_hashes: list[BlockHash]
    medium: str | None = MEDIUM_GPU


@dataclass(slots=True)
class AllBlocksCleared:
    """The whole prefix cache was reset (seed: reset_prefix_cache, lines 2855-2870)."""

    medium: str | None = field(default=MEDIUM_GPU)


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared
