"""BlockPool: null block, allocation order, eviction, events, block states, reset."""

from __future__ import annotations

import pytest

from lm_console.engine.core.kv_cache import BlockPool
from lm_console.engine.core.kv_cache.block_pool import (
    BLOCK_STATE_CACHED,
    BLOCK_STATE_FREE,
    BLOCK_STATE_IN_USE,
    BLOCK_STATE_NULL,
)
from lm_console.engine.kv_cache_hashing import make_block_hash_with_group_id
from lm_console.engine.metrics.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

BLOCK_SIZE = 4


def _free_ids(pool: BlockPool) -> list[int]:
    return [block.block_id for block in pool.free_block_queue.get_all_free_blocks()]


def _cache_request_blocks(pool: BlockPool, request, blocks) -> None:  # type: ignore[no-untyped-def]
    num_full = request.num_tokens // BLOCK_SIZE
    pool.cache_full_blocks(request, blocks, 0, num_full, BLOCK_SIZE, kv_cache_group_id=0)


def test_null_block_is_block_zero_and_never_free() -> None:
    pool = BlockPool(5, enable_caching=True, hash_block_size=BLOCK_SIZE)
    assert pool.null_block is pool.blocks[0] and pool.null_block.is_null
    assert _free_ids(pool) == [1, 2, 3, 4] and pool.get_num_free_blocks() == 4
    pool.touch([pool.null_block])
    pool.free_blocks([pool.null_block, pool.null_block])
    assert pool.null_block.ref_cnt == 0 and 0 not in _free_ids(pool)
    blocks = pool.get_new_blocks(4)
    assert pool.null_block not in blocks


def test_null_block_never_cached(make_request) -> None:  # type: ignore[no-untyped-def]
    pool = BlockPool(5, enable_caching=True, hash_block_size=BLOCK_SIZE)
    request = make_request("r", list(range(8)))
    blocks = [pool.null_block, *pool.get_new_blocks(1)]
    _cache_request_blocks(pool, request, blocks)
    assert pool.null_block.block_hash is None
    assert blocks[1].block_hash == make_block_hash_with_group_id(request.block_hashes[1], 0)
    assert len(pool.cached_block_hash_to_block) == 1


def test_get_new_blocks_fifo_and_free_in_given_order() -> None:
    pool = BlockPool(6, enable_caching=False, hash_block_size=BLOCK_SIZE)
    blocks = pool.get_new_blocks(3)
    assert [b.block_id for b in blocks] == [1, 2, 3] and all(b.ref_cnt == 1 for b in blocks)
    pool.free_blocks(reversed(blocks))  # a request frees tail first
    assert _free_ids(pool) == [4, 5, 3, 2, 1]
    with pytest.raises(ValueError):
        pool.get_new_blocks(6)


def test_shared_block_freed_only_at_zero() -> None:
    pool = BlockPool(4, enable_caching=True, hash_block_size=BLOCK_SIZE)
    (block,) = pool.get_new_blocks(1)
    pool.touch([block])
    assert block.ref_cnt == 2
    pool.free_blocks([block])
    assert block.ref_cnt == 1 and block.block_id not in _free_ids(pool)
    pool.free_blocks([block])
    assert block.ref_cnt == 0 and _free_ids(pool)[-1] == block.block_id
    pool.touch([block])  # a hit on a free block pulls it out of the middle of the queue
    assert block.ref_cnt == 1 and block.block_id not in _free_ids(pool)


def test_a_double_free_is_refused_and_leaves_the_queue_as_it_was() -> None:
    """Freeing a block nobody holds would make its ref_cnt -1 and put it in the free queue
    twice (two requests would then get it): refused."""
    pool = BlockPool(4, enable_caching=True, hash_block_size=BLOCK_SIZE)
    (block,) = pool.get_new_blocks(1)
    pool.free_blocks([block])
    free = _free_ids(pool)
    with pytest.raises(AssertionError, match="double free"):
        pool.free_blocks([block])
    assert block.ref_cnt == 0 and _free_ids(pool) == free


def test_eviction_takes_oldest_cached_block_and_emits_block_removed(make_request) -> None:  # type: ignore[no-untyped-def]
    pool = BlockPool(3, enable_caching=True, hash_block_size=BLOCK_SIZE, enable_kv_cache_events=True)
    request = make_request("r", list(range(8)))
    blocks = pool.get_new_blocks(2)
    _cache_request_blocks(pool, request, blocks)
    pool.free_blocks(reversed(blocks))
    assert _free_ids(pool) == [2, 1]  # the tail block 2 is evicted first
    pool.take_events()
    (new_block,) = pool.get_new_blocks(1)
    assert new_block.block_id == 2 and new_block.block_hash is None
    assert pool.get_cached_block(request.block_hashes[1], [0]) is None
    assert pool.get_cached_block(request.block_hashes[0], [0]) == [pool.blocks[1]]
    assert pool.take_events() == [BlockRemoved(block_hashes=[request.block_hashes[1]], group_idx=0)]
    assert pool.take_events() == []  # drained


def test_block_stored_event_content(make_request) -> None:  # type: ignore[no-untyped-def]
    pool = BlockPool(6, enable_caching=True, hash_block_size=BLOCK_SIZE, enable_kv_cache_events=True)
    request = make_request("r", list(range(13)))
    blocks = pool.get_new_blocks(4)
    pool.cache_full_blocks(request, blocks, 0, 1, BLOCK_SIZE, 0)
    pool.cache_full_blocks(request, blocks, 1, 3, BLOCK_SIZE, 0)
    pool.cache_full_blocks(request, blocks, 3, 3, BLOCK_SIZE, 0)  # nothing new: no event
    first, second = pool.take_events()
    assert first == BlockStored(
        block_hashes=[request.block_hashes[0]], parent_block_hash=None, token_ids=[0, 1, 2, 3], block_size=BLOCK_SIZE,
        group_idx=0,
    )
    assert second.block_hashes == request.block_hashes[1:3]
    assert second.parent_block_hash == request.block_hashes[0]
    assert second.token_ids == list(range(4, 12)) and second.medium == "GPU"


def test_no_events_when_disabled(make_request) -> None:  # type: ignore[no-untyped-def]
    pool = BlockPool(4, enable_caching=True, hash_block_size=BLOCK_SIZE)
    request = make_request("r", list(range(4)))
    blocks = pool.get_new_blocks(1)
    _cache_request_blocks(pool, request, blocks)
    pool.free_blocks(blocks)
    pool.get_new_blocks(3)
    assert pool.take_events() == []


def test_block_states_and_ref_counts(make_request) -> None:  # type: ignore[no-untyped-def]
    pool = BlockPool(6, enable_caching=True, hash_block_size=BLOCK_SIZE)
    request = make_request("r", list(range(8)))
    blocks = pool.get_new_blocks(3)
    _cache_request_blocks(pool, request, blocks)
    pool.touch(blocks[:1])
    assert pool.get_block_states() == bytes([BLOCK_STATE_NULL, 1, 1, 1, 0, 0])
    assert pool.get_block_ref_counts() == bytes([0, 2, 1, 1, 0, 0])
    pool.free_blocks(reversed(blocks))
    assert pool.get_block_states() == bytes(
        [BLOCK_STATE_NULL, BLOCK_STATE_IN_USE, BLOCK_STATE_CACHED, BLOCK_STATE_FREE, BLOCK_STATE_FREE, BLOCK_STATE_FREE]
    )
    pool.free_blocks(blocks[:1])
    assert pool.get_block_states() == bytes([3, 2, 2, 0, 0, 0])
    for _ in range(300):
        pool.touch(blocks[:1])
    assert pool.get_block_ref_counts()[1] == 255  # clipped


def test_usage_excludes_null_block() -> None:
    pool = BlockPool(5, enable_caching=False, hash_block_size=BLOCK_SIZE)
    assert pool.get_usage() == 0.0
    blocks = pool.get_new_blocks(2)
    assert pool.get_usage() == pytest.approx(0.5)
    pool.free_blocks(blocks)
    assert pool.get_usage() == 0.0


def test_reset_prefix_cache_only_when_idle(make_request) -> None:  # type: ignore[no-untyped-def]
    pool = BlockPool(5, enable_caching=True, hash_block_size=BLOCK_SIZE, enable_kv_cache_events=True)
    request = make_request("r", list(range(8)))
    blocks = pool.get_new_blocks(2)
    _cache_request_blocks(pool, request, blocks)
    pool.take_events()
    assert pool.reset_prefix_cache() is False  # blocks still in use
    assert len(pool.cached_block_hash_to_block) == 2 and pool.take_events() == []
    pool.free_blocks(reversed(blocks))
    assert pool.reset_prefix_cache() is True
    assert len(pool.cached_block_hash_to_block) == 0
    assert all(block.block_hash is None for block in pool.blocks)
    assert pool.get_cached_block(request.block_hashes[0], [0]) is None
    assert pool.take_events() == [AllBlocksCleared()]
    assert pool.get_block_states() == bytes([3, 0, 0, 0, 0])


def test_evict_blocks_drops_hash_but_keeps_queue(make_request) -> None:  # type: ignore[no-untyped-def]
    pool = BlockPool(5, enable_caching=True, hash_block_size=BLOCK_SIZE, enable_kv_cache_events=True)
    request = make_request("r", list(range(8)))
    blocks = pool.get_new_blocks(2)
    _cache_request_blocks(pool, request, blocks)
    pool.free_blocks(reversed(blocks))
    pool.take_events()
    before = _free_ids(pool)
    pool.evict_blocks({blocks[0].block_id})
    assert blocks[0].block_hash is None and blocks[1].block_hash is not None
    assert _free_ids(pool) == before
    assert pool.take_events() == [BlockRemoved(block_hashes=[request.block_hashes[0]], group_idx=0)]
    pool.evict_blocks({blocks[0].block_id})  # idempotent: nothing to remove
    assert pool.take_events() == []


def test_duplicate_hashes_kept_and_evicted_separately(make_request) -> None:  # type: ignore[no-untyped-def]
    # Two requests computed the same block without hitting each other: both stay cached.
    pool = BlockPool(4, enable_caching=True, hash_block_size=BLOCK_SIZE)
    r1, r2 = make_request("a", [1, 2, 3, 4]), make_request("b", [1, 2, 3, 4])
    b1, b2 = pool.get_new_blocks(1), pool.get_new_blocks(1)
    _cache_request_blocks(pool, r1, b1)
    _cache_request_blocks(pool, r2, b2)
    assert pool.get_cached_block(r1.block_hashes[0], [0])[0] in (b1[0], b2[0])  # type: ignore[index]
    pool.free_blocks(b1 + b2)
    pool.get_new_blocks(2)  # evicts block 3 (plain free) then block 1
    cached = pool.get_cached_block(r1.block_hashes[0], [0])
    assert cached == [b2[0]]


def test_usage_is_the_fraction_of_usable_blocks_in_use_and_zero_with_none() -> None:
    pool = BlockPool(5, enable_caching=True, hash_block_size=BLOCK_SIZE)
    assert pool.get_usage() == 0.0
    blocks = pool.get_new_blocks(3)
    assert pool.get_usage() == 0.75
    pool.free_blocks(blocks)
    assert pool.get_usage() == 0.0
    assert BlockPool(1, enable_caching=True, hash_block_size=BLOCK_SIZE).get_usage() == 0.0  # the null block only
