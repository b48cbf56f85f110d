"""EventBlockMap: a server's prefix cache as cells, from its KV events alone."""

from __future__ import annotations

import pytest

from lm_console.client.event_block_map import EventBlockMap
from lm_console.client.types import KVEventRecord
from lm_console.engine.metrics.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from lm_console.engine.metrics.stats import BLOCK_STATE_CACHED, BLOCK_STATE_FREE

C, F = BLOCK_STATE_CACHED, BLOCK_STATE_FREE


def _rows(*events: object) -> list[KVEventRecord]:
    return [KVEventRecord(1.0, event) for event in events]  # type: ignore[arg-type]


def test_cells_follow_stores_removals_and_resets() -> None:
    block_map = EventBlockMap(4)
    block_map.apply(_rows(BlockStored([1, 2, 3], None, [0] * 12, 4, group_idx=0)))
    assert bytes(block_map.states) == bytes([C, C, C, F])
    block_map.apply(_rows(BlockRemoved([2], group_idx=0)))
    assert bytes(block_map.states) == bytes([C, F, C, F])
    # The lowest free cell is reused; a hash stored twice keeps its cell.
    block_map.apply(_rows(BlockStored([9, 1], 3, [0] * 8, 4, group_idx=0)))
    assert bytes(block_map.states) == bytes([C, C, C, F]) and block_map.cell_of[(0, 9)] == 1
    # An offload tier's events are not the device pool's.
    block_map.apply(_rows(BlockStored([7], None, [0] * 4, 4, medium="CPU"), BlockRemoved([1], medium="CPU")))
    assert block_map.num_cached == 3
    block_map.apply(_rows(BlockStored([5, 6], None, [0] * 8, 4, group_idx=0)))
    assert block_map.num_cached == 4 and block_map.num_overflow == 1  # more than the pool: counted, not drawn
    block_map.apply(_rows(BlockRemoved([404], group_idx=0)))
    assert block_map.num_unmatched_removals == 1
    block_map.apply(_rows(AllBlocksCleared()))
    assert bytes(block_map.states) == bytes([F] * 4) and block_map.num_cached == 0


def test_a_removal_without_a_group_matches_the_hash() -> None:
    block_map = EventBlockMap(2)
    block_map.apply(_rows(BlockStored([b"h"], None, [0] * 4, 4, group_idx=0), BlockRemoved([b"h"], group_idx=None)))
    assert block_map.num_cached == 0 and block_map.num_unmatched_removals == 0


def test_a_pool_size_is_required() -> None:
    with pytest.raises(ValueError, match="pool's size"):
        EventBlockMap(0)
