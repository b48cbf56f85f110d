"""Property tests: random allocate/grow/free/evict/touch sequences keep the pool's invariants."""

from __future__ import annotations

from collections import Counter

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kv_helpers import build_request
from lm_console.engine.core.kv_cache import KVCacheBlock, KVCacheManager
from lm_console.engine.kv_cache_hashing import get_block_hash, make_block_hash_with_group_id
from lm_console.engine.kv_cache_interface import FullAttentionSpec, KVCacheConfig, SlidingWindowSpec, get_kv_cache_config
from lm_console.engine.metrics.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from lm_console.engine.core.kv_cache.block_pool import BLOCK_STATE_CACHED, BLOCK_STATE_FREE, BLOCK_STATE_IN_USE, BLOCK_STATE_NULL
from lm_console.engine.request import Request

BLOCK_SIZE = 2
NUM_BLOCKS = 12
MAX_MODEL_LEN = 48
# A 3-token alphabet with 2-token blocks makes shared prefixes (and so prefix hits) frequent.
PROMPTS = st.lists(st.integers(0, 2), min_size=1, max_size=14)


class KVCacheMachine(RuleBasedStateMachine):
    """Drives a KVCacheManager like a scheduler would and checks the BlockPool after every step."""

    enable_caching = True
    kv_cache_config: KVCacheConfig | None = None  # None: one full-attention group

    def __init__(self) -> None:
        super().__init__()
        self.manager = KVCacheManager(
            num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, max_model_len=MAX_MODEL_LEN,
            enable_caching=self.enable_caching, enable_kv_cache_events=True,
            kv_cache_config=self.kv_cache_config,
        )
        self.num_groups = self.manager.num_kv_cache_groups
        self.last_computed: dict[str, int] = {}  # computed tokens at each request's last allocation
        self.pool = self.manager.block_pool
        self.requests: dict[str, Request] = {}
        self.pins: list[KVCacheBlock] = []  # references taken with touch() outside any request
        self.num_created = 0
        self.stored_keys: Counter[bytes] = Counter()  # replay of the event stream

    # -- helpers ---------------------------------------------------------------------------------
    def _snapshot(self) -> tuple[object, ...]:
        free = [b.block_id for b in self.pool.free_block_queue.get_all_free_blocks()]
        blocks = {rid: self.manager.get_block_ids(rid) for rid in self.requests}
        return (self.pool.get_block_states(), self.pool.get_block_ref_counts(), free, blocks,
                len(self.pool.kv_event_queue), len(self.pool.cached_block_hash_to_block))

    def _allocate(self, request: Request, num_new_tokens: int, num_computed: int = 0, computed=None) -> bool:  # type: ignore[no-untyped-def]
        # Stage 1 frees blocks behind a sliding window even when the allocation then fails (a
        # no-regret change); apply it first so that "None changes nothing else" stays checkable.
        total_computed = min(request.num_computed_tokens + num_computed, MAX_MODEL_LEN)
        self.manager.coordinator.remove_skipped_blocks(request.request_id, total_computed)
        if request.request_id in self.last_computed:
            self.last_computed[request.request_id] = total_computed
        before = self._snapshot()
        blocks = self.manager.allocate_slots(request, num_new_tokens, num_computed, computed)
        if blocks is None:
            assert self._snapshot() == before, "allocate_slots returned None after changing state"
            return False
        self.last_computed[request.request_id] = request.num_computed_tokens + num_computed
        request.num_computed_tokens = request.num_computed_tokens + num_computed + num_new_tokens
        return True

    # -- rules -----------------------------------------------------------------------------------
    @rule(prompt=PROMPTS, chunk=st.integers(1, 8))
    def add_request(self, prompt: list[int], chunk: int) -> None:
        request = build_request(f"r{self.num_created}", prompt, BLOCK_SIZE)
        self.num_created += 1
        computed, num_computed = self.manager.get_computed_blocks(request)
        assert num_computed % BLOCK_SIZE == 0 and num_computed <= request.num_tokens - 1
        if not self.enable_caching:
            assert num_computed == 0
        num_new_tokens = min(chunk, request.num_tokens - num_computed)
        if self._allocate(request, num_new_tokens, num_computed, computed):
            self.requests[request.request_id] = request

    @precondition(lambda self: self.requests)
    @rule(data=st.data(), num_output=st.integers(1, 3), chunk=st.integers(1, 8))
    def grow(self, data: st.DataObject, num_output: int, chunk: int) -> None:
        request = self.requests[data.draw(st.sampled_from(sorted(self.requests)))]
        if request.num_computed_tokens == request.num_tokens:  # decode: the model sampled tokens
            if request.num_tokens + num_output > MAX_MODEL_LEN:
                return
            request.append_output_token_ids(data.draw(st.lists(st.integers(0, 2), min_size=num_output, max_size=num_output)))
        self._allocate(request, min(chunk, request.num_tokens - request.num_computed_tokens))

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    def free_request(self, data: st.DataObject) -> None:
        request = self.requests.pop(data.draw(st.sampled_from(sorted(self.requests))))
        self.manager.free(request)
        assert self.manager.get_block_ids(request.request_id) == ([],) * self.num_groups

    @rule(block_ids=st.sets(st.integers(1, NUM_BLOCKS - 1), max_size=4))
    def evict(self, block_ids: set[int]) -> None:
        self.pool.evict_blocks(block_ids)
        assert all(self.pool.blocks[i].block_hash is None for i in block_ids)

    @rule(block_ids=st.lists(st.integers(0, NUM_BLOCKS - 1), min_size=1, max_size=3))
    def touch(self, block_ids: list[int]) -> None:
        blocks = [self.pool.blocks[i] for i in block_ids]
        self.pool.touch(blocks)
        self.pins.extend(b for b in blocks if not b.is_null)

    @precondition(lambda self: self.pins)
    @rule(data=st.data())
    def unpin(self, data: st.DataObject) -> None:
        num = data.draw(st.integers(1, len(self.pins)))
        freed, self.pins = self.pins[:num], self.pins[num:]
        self.pool.free_blocks(freed)

    @rule()
    def reset_prefix_cache(self) -> None:
        idle = not self.requests and not self.pins
        assert self.manager.reset_prefix_cache() is idle
        if idle:
            assert len(self.pool.cached_block_hash_to_block) == 0

    @rule()
    def take_events(self) -> None:
        for event in self.manager.take_events():
            if isinstance(event, BlockStored):
                assert len(event.token_ids) == len(event.block_hashes) * BLOCK_SIZE
                self.stored_keys.update(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                for h in event.block_hashes:
                    assert self.stored_keys[h] > 0, "BlockRemoved for a hash never stored"
                    self.stored_keys[h] -= 1
            else:
                assert isinstance(event, AllBlocksCleared)
                self.stored_keys.clear()
        # After draining, the replayed stream describes exactly the map's content.
        # Events carry no group id, so hybrid groups are replayed by block hash alone.
        assert +self.stored_keys == Counter(get_block_hash(key) for key, _ in self.pool.cached_block_hash_to_block.items())

    # -- invariants --------------------------------------------------------------------------------
    @invariant()
    def ref_counts_match_holders(self) -> None:
        holders: Counter[int] = Counter(b.block_id for b in self.pins)
        for rid in self.requests:
            # Null blocks (id 0) stand in for sliding-window blocks that were freed.
            ids = [i for group in self.manager.get_block_ids(rid) for i in group if i != 0]
            assert len(ids) == len(set(ids)), "a request holds a block twice"
            holders.update(ids)
        for block in self.pool.blocks[1:]:
            assert block.ref_cnt == holders[block.block_id], (block.block_id, block.ref_cnt)
        assert self.pool.null_block.ref_cnt == 0 and 0 not in holders

    @invariant()
    def free_queue_is_consistent(self) -> None:
        queue = self.pool.free_block_queue
        walked: list[KVCacheBlock] = []
        prev, curr = queue.fake_free_list_head, queue.fake_free_list_head.next_free_block
        while curr is not queue.fake_free_list_tail:
            assert curr is not None and curr.prev_free_block is prev
            walked.append(curr)
            prev, curr = curr, curr.next_free_block
        assert queue.fake_free_list_tail.prev_free_block is prev
        assert len(walked) == queue.num_free_blocks == self.pool.get_num_free_blocks()
        expected = {b.block_id for b in self.pool.blocks if b.ref_cnt == 0 and not b.is_null}
        assert {b.block_id for b in walked} == expected and len(walked) == len(expected)
        assert self.pool.null_block not in walked
        for block in self.pool.blocks:
            in_queue = block.block_id in expected
            assert (block.prev_free_block is not None) == in_queue == (block.next_free_block is not None)

    @invariant()
    def prefix_cache_map_is_consistent(self) -> None:
        mapped = list(self.pool.cached_block_hash_to_block.items())
        for key, block in mapped:
            assert block.block_hash == key and not block.is_null
        mapped_ids = [block.block_id for _, block in mapped]
        assert len(mapped_ids) == len(set(mapped_ids))
        assert set(mapped_ids) == {b.block_id for b in self.pool.blocks if b.block_hash is not None}
        if not self.enable_caching:
            assert not mapped_ids
        # A request's cached blocks carry that request's hash (or none, after evict_blocks).
        for rid, request in self.requests.items():
            for group_id, blocks in enumerate(self.manager.get_blocks(rid).blocks):
                for i, block in enumerate(blocks):
                    if block.block_hash is not None:
                        assert block.block_hash == make_block_hash_with_group_id(request.block_hashes[i], group_id)

    @invariant()
    def block_states_match(self) -> None:
        states = self.pool.get_block_states()
        assert states[0] == BLOCK_STATE_NULL
        for block in self.pool.blocks[1:]:
            expected = BLOCK_STATE_IN_USE if block.ref_cnt else (
                BLOCK_STATE_CACHED if block.block_hash is not None else BLOCK_STATE_FREE)
            assert states[block.block_id] == expected
        assert 0.0 <= self.manager.usage <= 1.0

    def teardown(self) -> None:
        for request in self.requests.values():
            self.manager.free(request)
        self.pool.free_blocks(self.pins)
        assert self.pool.get_num_free_blocks() == NUM_BLOCKS - 1
        assert all(b.ref_cnt == 0 for b in self.pool.blocks)
        assert self.manager.usage == 0.0
        assert self.manager.reset_prefix_cache()


class KVCacheMachineNoCaching(KVCacheMachine):
    """Same sequences with prefix caching off: no hits, no hashes, same pool invariants."""

    enable_caching = False


class HybridKVCacheMachine(KVCacheMachine):
    """A full-attention group and two sliding-window groups (windows 3 and 5) sharing one pool."""

    kv_cache_config = get_kv_cache_config(
        {"full": FullAttentionSpec(BLOCK_SIZE), "local3": SlidingWindowSpec(BLOCK_SIZE, 3),
         "local5": SlidingWindowSpec(BLOCK_SIZE, 5)},
        num_blocks=NUM_BLOCKS,
    )

    @invariant()
    def sliding_groups_hold_only_the_window(self) -> None:
        for rid in self.requests:
            full, *local = self.manager.get_blocks(rid).blocks
            assert not any(b.is_null for b in full)
            for manager, blocks in zip(self.manager.coordinator.single_type_managers[1:], local):
                assert len(blocks) == len(full)
                # Exactly the blocks behind the window (as of the last allocation) are null.
                skipped = manager.get_num_skipped_tokens(self.last_computed[rid]) // BLOCK_SIZE
                assert [b.is_null for b in blocks] == [True] * skipped + [False] * (len(blocks) - skipped)


_SETTINGS = settings(
    max_examples=150, stateful_step_count=30, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestKVCacheMachine = KVCacheMachine.TestCase
TestKVCacheMachine.settings = _SETTINGS
TestKVCacheMachineNoCaching = KVCacheMachineNoCaching.TestCase
TestKVCacheMachineNoCaching.settings = settings(_SETTINGS, max_examples=60)
TestHybridKVCacheMachine = HybridKVCacheMachine.TestCase
TestHybridKVCacheMachine.settings = settings(_SETTINGS, max_examples=100)
