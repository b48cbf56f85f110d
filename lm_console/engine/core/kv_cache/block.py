"""KVCacheBlock metadata and the FreeKVCacheBlockQueue LRU list (after vLLM's vllm/v1/core/kv_cache_utils.py)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from lm_console.engine.kv_cache_hashing import BlockHashWithGroupId


@dataclass(slots=True, eq=False)
class KVCacheBlock:
    """CPU-side metadata of one physical KV cache block (after vLLM's KVCacheBlock).

    Invariants: ref_cnt counts the requests holding the block (the null block is never counted);
    the block is in the free queue iff ref_cnt == 0 and not is_null; _block_hash is set only by
    cache_full_blocks and cleared only by reset_hash (eviction or prefix-cache reset).
    eq=False: blocks compare by identity (the dataclass __eq__ would walk the linked list).
    """

    block_id: int
    ref_cnt: int = 0
    _block_hash: BlockHashWithGroupId | None = None
    # Links of the free list, threaded through the blocks so the queue allocates nothing.
    prev_free_block: KVCacheBlock | None = field(default=None, repr=False)
    next_free_block: KVCacheBlock | None = field(default=None, repr=False)
    is_null: bool = False

    @property
    def block_hash(self) -> BlockHashWithGroupId | None:
        """The packed hash under which the block sits in the prefix cache, or None."""
        return self._block_hash

    @block_hash.setter
    def block_hash(self, block_hash: BlockHashWithGroupId) -> None:
        # Setting twice would leave a stale map entry behind: reset_hash() must come first.
        assert self._block_hash is None, f"block {self.block_id} already has a hash"
        self._block_hash = block_hash

    def reset_hash(self) -> None:
        """Forget the hash when the block is evicted from the prefix cache."""
        self._block_hash = None


class FreeKVCacheBlockQueue:
    """Doubly linked LRU list of free blocks (after vLLM's FreeKVCacheBlockQueue).

    Invariants: fake_free_list_head <-> b_1 <-> ... <-> b_n <-> fake_free_list_tail with
    num_free_blocks == n; a block is linked (both links set) iff it is in the queue; the front
    holds the block to evict first. Not a deque because touch() must remove from the middle in O(1).
    """

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self.num_free_blocks = len(blocks)
        # Sentinels remove every "is the list empty / am I at an end" branch from the links code.
        self.fake_free_list_head = KVCacheBlock(block_id=-1)
        self.fake_free_list_tail = KVCacheBlock(block_id=-1)
        prev = self.fake_free_list_head
        for block in blocks:
            prev.next_free_block = block
            block.prev_free_block = prev
            prev = block
        prev.next_free_block = self.fake_free_list_tail
        self.fake_free_list_tail.prev_free_block = prev

    def popleft(self) -> KVCacheBlock:
        """Remove and return the front (least recently freed) block."""
        first = self.fake_free_list_head.next_free_block
        if first is self.fake_free_list_tail or first is None:
            raise ValueError("No free blocks available")
        self.remove(first)
        return first

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        """Remove and return the n front blocks, in queue order."""
        if n > self.num_free_blocks:
            raise ValueError(f"Cannot pop {n} blocks: only {self.num_free_blocks} are free")
        if n == 0:
            return []
        popped: list[KVCacheBlock] = []
        curr = self.fake_free_list_head.next_free_block
        for _ in range(n):
            assert curr is not None
            popped.append(curr)
            nxt = curr.next_free_block
            curr.prev_free_block = curr.next_free_block = None
            curr = nxt
        # Relink once instead of n times.
        assert curr is not None
        self.fake_free_list_head.next_free_block = curr
        curr.prev_free_block = self.fake_free_list_head
        self.num_free_blocks -= n
        return popped

    def remove(self, block: KVCacheBlock) -> None:
        """Unlink a block from anywhere in the queue in O(1)."""
        prev, nxt = block.prev_free_block, block.next_free_block
        if prev is None or nxt is None:
            raise RuntimeError(f"remove() called on block {block.block_id}, which is not free")
        prev.next_free_block = nxt
        nxt.prev_free_block = prev
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        """Put a block at the back (evicted last)."""
        last = self.fake_free_list_tail.prev_free_block
        assert last is not None
        last.next_free_block = block
        block.prev_free_block = last
        block.next_free_block = self.fake_free_list_tail
        self.fake_free_list_tail.prev_free_block = block
        self.num_free_blocks += 1

    def append_n(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Put blocks at the back in the given order."""
        last = self.fake_free_list_tail.prev_free_block
        assert last is not None
        num_appended = 0
        for block in blocks:
            last.next_free_block = block
            block.prev_free_block = last
            last = block
            num_appended += 1
        last.next_free_block = self.fake_free_list_tail
        self.fake_free_list_tail.prev_free_block = last
        self.num_free_blocks += num_appended

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """All free blocks front to back (for tests and debugging: O(n))."""
        result: list[KVCacheBlock] = []
        curr = self.fake_free_list_head.next_free_block
        while curr is not None and curr is not self.fake_free_list_tail:
            result.append(curr)
            curr = curr.next_free_block
        return result
