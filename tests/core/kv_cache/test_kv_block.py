"""KVCacheBlock, FreeKVCacheBlockQueue and BlockHashToBlockMap on hand-built blocks."""

from __future__ import annotations

import pytest

from lm_console.engine.core.kv_cache import BlockHashToBlockMap, FreeKVCacheBlockQueue, KVCacheBlock
from lm_console.engine.kv_cache_hashing import BlockHash, make_block_hash_with_group_id


def _ids(blocks: list[KVCacheBlock]) -> list[int]:
    return [block.block_id for block in blocks]


def _make_queue(n: int) -> tuple[list[KVCacheBlock], FreeKVCacheBlockQueue]:
    blocks = [KVCacheBlock(block_id=i) for i in range(n)]
    return blocks, FreeKVCacheBlockQueue(blocks)


def _check_links(queue: FreeKVCacheBlockQueue) -> None:
    # Walk forwards and backwards: both directions must agree with num_free_blocks.
    forward = queue.get_all_free_blocks()
    backward: list[KVCacheBlock] = []
    curr = queue.fake_free_list_tail.prev_free_block
    while curr is not queue.fake_free_list_head:
        assert curr is not None
        backward.append(curr)
        curr = curr.prev_free_block
    assert forward == backward[::-1]
    assert len(forward) == queue.num_free_blocks


def test_queue_initial_order_and_sentinels() -> None:
    blocks, queue = _make_queue(4)
    assert queue.num_free_blocks == 4
    assert _ids(queue.get_all_free_blocks()) == [0, 1, 2, 3]
    assert queue.fake_free_list_head.block_id == -1 and queue.fake_free_list_tail.block_id == -1
    assert queue.fake_free_list_head.next_free_block is blocks[0]
    assert queue.fake_free_list_tail.prev_free_block is blocks[3]
    assert blocks[0].prev_free_block is queue.fake_free_list_head
    _check_links(queue)


def test_queue_popleft_remove_append() -> None:
    blocks, queue = _make_queue(5)
    first = queue.popleft()
    assert first is blocks[0] and first.prev_free_block is None and first.next_free_block is None
    queue.remove(blocks[2])  # O(1) removal from the middle
    assert _ids(queue.get_all_free_blocks()) == [1, 3, 4]
    queue.append(blocks[2])
    queue.append(first)
    assert _ids(queue.get_all_free_blocks()) == [1, 3, 4, 2, 0]
    _check_links(queue)


def test_queue_popleft_n_and_append_n() -> None:
    blocks, queue = _make_queue(6)
    popped = queue.popleft_n(3)
    assert _ids(popped) == [0, 1, 2]
    assert all(b.prev_free_block is None and b.next_free_block is None for b in popped)
    assert queue.popleft_n(0) == []
    queue.append_n(reversed(popped))
    assert _ids(queue.get_all_free_blocks()) == [3, 4, 5, 2, 1, 0]
    queue.append_n([])
    _check_links(queue)


def test_queue_empty_errors() -> None:
    blocks, queue = _make_queue(2)
    queue.popleft_n(2)
    assert queue.num_free_blocks == 0
    assert queue.fake_free_list_head.next_free_block is queue.fake_free_list_tail
    with pytest.raises(ValueError):
        queue.popleft()
    with pytest.raises(ValueError):
        queue.popleft_n(1)
    with pytest.raises(RuntimeError):
        queue.remove(blocks[0])  # not in the queue
    queue.append(blocks[1])
    assert _ids(queue.get_all_free_blocks()) == [1]
    _check_links(queue)


def test_block_hash_set_once_and_reset() -> None:
    block = KVCacheBlock(block_id=7)
    key = make_block_hash_with_group_id(BlockHash(b"h" * 32), 0)
    assert block.block_hash is None
    block.block_hash = key
    assert block.block_hash == key
    with pytest.raises(AssertionError):
        block.block_hash = key
    block.reset_hash()
    assert block.block_hash is None
    assert block != KVCacheBlock(block_id=7)  # identity equality, no list walk
    assert "prev_free_block" not in repr(block)


def test_block_hash_to_block_map_single_then_dict() -> None:
    cache = BlockHashToBlockMap()
    key = make_block_hash_with_group_id(BlockHash(b"k" * 32), 0)
    b1, b2, b3 = KVCacheBlock(1), KVCacheBlock(2), KVCacheBlock(3)
    assert cache.get_one_block(key) is None
    cache.insert(key, b1)
    assert cache.get_one_block(key) is b1 and len(cache) == 1
    cache.insert(key, b2)  # promoted to a dict, duplicates kept
    assert cache.get_one_block(key) in (b1, b2)
    assert sorted(b.block_id for _, b in cache.items()) == [1, 2]
    assert cache.pop(key, 3) is None
    assert cache.pop(key, 1) is b1
    assert cache.get_one_block(key) is b2  # demoted back to a single block
    assert cache.pop(key, 3) is None and cache.get_one_block(key) is b2
    assert cache.pop(key, 2) is b2
    assert cache.get_one_block(key) is None and len(cache) == 0
    assert cache.pop(key, 2) is None
    cache.insert(key, b3)
    assert list(cache.items()) == [(key, b3)]
