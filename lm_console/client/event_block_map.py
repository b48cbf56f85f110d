"""EventBlockMap: an attached server's prefix cache drawn from its KV events, for the block map.

A vLLM server publishes no block map, but its KV events say which blocks enter (BlockStored) and
leave (BlockRemoved, AllBlocksCleared) its prefix cache, by hash. Each hash gets a cell of our own
(the lowest free one) for as long as the server holds it, so the map shows how full the prefix
cache is and how it churns. Cells are not the server's block ids (events do not carry them), and a
block that is in use without a full-block hash (a partial last block) has no event: the usage
gauge counts those.
"""

from __future__ import annotations

import heapq

from lm_console.client.types import KVEventRecord
from lm_console.engine.metrics.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from lm_console.engine.metrics.stats import BLOCK_STATE_CACHED, BLOCK_STATE_FREE

DEVICE_MEDIA = (None, "GPU")  # the device pool; an offload tier (CPU, DISK) has its own events


class EventBlockMap:
    """Cells for the hashes the server's device pool holds; `states` is the map (one byte a cell)."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"an event block map needs the pool's size, got num_blocks={num_blocks}")
        self.num_blocks = num_blocks
        self.states = bytearray([BLOCK_STATE_FREE]) * num_blocks
        self.cell_of: dict[tuple[int | None, object], int] = {}  # (group, hash) -> cell
        self._free = list(range(num_blocks))  # a heap: the lowest free cell first
        self.num_overflow = 0  # stored hashes with no free cell (the server reports more blocks than its pool)
        self.num_unmatched_removals = 0  # removals of hashes stored before this console subscribed

    @property
    def num_cached(self) -> int:
        return len(self.cell_of)

    def apply(self, records: list[KVEventRecord]) -> None:
        """Fold one batch of events in, in order."""
        for record in records:
            event = record.event
            if isinstance(event, BlockStored) and event.medium in DEVICE_MEDIA:
                for block_hash in event.block_hashes:
                    self._store((event.group_idx, block_hash))
            elif isinstance(event, BlockRemoved) and event.medium in DEVICE_MEDIA:
                for block_hash in event.block_hashes:
                    self._remove((event.group_idx, block_hash))
            elif isinstance(event, AllBlocksCleared) and event.medium in DEVICE_MEDIA:
                self.clear()

    def clear(self) -> None:
        self.cell_of.clear()
        self.states[:] = bytes([BLOCK_STATE_FREE]) * self.num_blocks
        self._free = list(range(self.num_blocks))

    def _store(self, key: tuple[int | None, object]) -> None:
        if key in self.cell_of:
            return
        if not self._free:
            self.num_overflow += 1
            return
        cell = heapq.heappop(self._free)
        self.cell_of[key] = cell
        self.states[cell] = BLOCK_STATE_CACHED

    def _remove(self, key: tuple[int | None, object]) -> None:
        cell = self.cell_of.pop(key, None)
        if cell is None:
            # vLLM's removals carry no group index where its stores do: match the hash alone.
            match = next((k for k in self.cell_of if k[1] == key[1]), None) if key[0] is None else None
            if match is None:
                self.num_unmatched_removals += 1
                return
            cell = self.cell_of.pop(match)
        self.states[cell] = BLOCK_STATE_FREE
        heapq.heappush(self._free, cell)
