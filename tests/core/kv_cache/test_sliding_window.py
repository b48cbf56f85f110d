"""SlidingWindowManager and the HybridKVCacheCoordinator: cache-hit search, fixed point, freeing."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from lm_console.engine.core.kv_cache import BlockPool, KVCacheBlock, KVCacheManager
from lm_console.engine.kv_cache_hashing import make_block_hash_with_group_id
from lm_console.engine.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheGroupSpec,
    SlidingWindowSpec,
    get_kv_cache_config,
    get_kv_cache_groups,
)
from lm_console.engine.core.kv_cache.coordinator import HybridKVCacheCoordinator, get_kv_cache_coordinator
from lm_console.engine.kv_cache_hashing import BlockHash
from lm_console.engine.kv_cache_interface import cdiv
from lm_console.engine.core.kv_cache.single_type import SlidingWindowManager
from lm_console.engine.request import Request

BS = 4  # block size of the hand-built pools


def _hashes(num_blocks: int) -> list[BlockHash]:
    return [BlockHash(bytes([i]) * 8) for i in range(num_blocks)]


def _cache(pool: BlockPool, block_hash: BlockHash, group_id: int) -> KVCacheBlock:
    """Enter one fresh block into the prefix cache under (hash, group), then free it (evictable)."""
    (block,) = pool.get_new_blocks(1)
    key = make_block_hash_with_group_id(block_hash, group_id)
    block.block_hash = key
    pool.cached_block_hash_to_block.insert(key, block)
    pool.free_blocks([block])
    return block


def _populate(pool: BlockPool, hashes: list[BlockHash], cached: dict[int, set[int]]) -> dict[tuple[int, int], KVCacheBlock]:
    """cached[group] = block indices cached for that group; returns (group, index) -> block."""
    return {(g, i): _cache(pool, hashes[i], g) for g, indices in cached.items() for i in sorted(indices)}


# -- SlidingWindowManager ---------------------------------------------------------------------------
def test_num_skipped_tokens_matches_the_seed_example() -> None:
    pool = BlockPool(8, enable_caching=True, hash_block_size=BS)
    manager = SlidingWindowManager(SlidingWindowSpec(block_size=BS, sliding_window=4), pool, True, 0)
    # window 4, 7 tokens computed: token 7 sees 4..7, so 0..3 are skipped.
    assert manager.get_num_skipped_tokens(7) == 4
    assert manager.get_num_skipped_tokens(3) == 0
    assert manager.get_num_common_prefix_blocks("any") == 0


def _valid_sliding(n: int, need: int, cached: set[int]) -> bool:
    """Brute force: a hit of n blocks is usable when the last `need` of them are cached."""
    return all(k in cached for k in range(max(0, n - need), n))


@settings(max_examples=300, deadline=None)
@given(
    cached=st.sets(st.integers(0, 11), max_size=12),
    other=st.sets(st.integers(0, 11), max_size=12),
    window=st.integers(1, 14),
    max_length=st.integers(0, 50),
    two_groups=st.booleans(),
)
def test_sliding_window_hit_is_the_longest_usable(cached, other, window, max_length, two_groups) -> None:  # type: ignore[no-untyped-def]
    """Right-to-left search == brute force; blocks before the window come back as the null block."""
    hashes = _hashes(12)
    pool = BlockPool(40, enable_caching=True, hash_block_size=BS)
    group_ids = [0, 1] if two_groups else [0]
    blocks = _populate(pool, hashes, {0: cached, 1: other} if two_groups else {0: cached})
    hit_in_all = cached & other if two_groups else cached
    spec = SlidingWindowSpec(block_size=BS, sliding_window=window)
    hits = SlidingWindowManager.find_longest_cache_hit(hashes, max_length, group_ids, pool, spec)
    need = cdiv(window - 1, BS)
    max_blocks = min(max_length // BS, len(hashes))
    expected = max(n for n in range(max_blocks + 1) if _valid_sliding(n, need, hit_in_all))
    assert len(hits) == len(group_ids) and all(len(h) == expected for h in hits)
    for g, group_hits in zip(group_ids, hits):
        for k, block in enumerate(group_hits):
            if k >= expected - need:
                assert block is blocks[(g, k)]
            else:
                assert block is pool.null_block or block is blocks.get((g, k))


def test_with_eagle_a_sliding_hit_needs_one_more_block_and_gives_up_its_last() -> None:
    """EAGLE recomputes the last hit block: the window's run needs one more cached block, and
    the hit comes back one block shorter (none at all stays none)."""
    hashes = _hashes(6)
    pool = BlockPool(40, enable_caching=True, hash_block_size=BS)
    blocks = _populate(pool, hashes, {0: {0, 1, 2, 3, 4, 5}})
    spec = SlidingWindowSpec(block_size=BS, sliding_window=5)  # one block of window
    plain = SlidingWindowManager.find_longest_cache_hit(hashes, 24, [0], pool, spec)
    (eagle,) = SlidingWindowManager.find_longest_cache_hit(hashes, 24, [0], pool, spec, use_eagle=True)
    assert len(plain[0]) == 6 and plain[0][5] is blocks[(0, 5)]
    assert len(eagle) == 5 and eagle[4] is blocks[(0, 4)] and eagle[3] is pool.null_block
    pool = BlockPool(40, enable_caching=True, hash_block_size=BS)
    assert SlidingWindowManager.find_longest_cache_hit(hashes, 24, [0], pool, spec, use_eagle=True) == ([],)


# -- HybridKVCacheCoordinator ------------------------------------------------------------------------
@settings(max_examples=300, deadline=None)
@given(
    full=st.sets(st.integers(0, 11), max_size=12),
    local_a=st.sets(st.integers(0, 11), max_size=12),
    local_b=st.sets(st.integers(0, 11), max_size=12),
    window_a=st.integers(2, 12),
    window_b=st.integers(2, 12),
    three_types=st.booleans(),
    max_length=st.integers(0, 50),
)
def test_hybrid_fixed_point_is_the_longest_hit_every_type_accepts(  # type: ignore[no-untyped-def]
    full, local_a, local_b, window_a, window_b, three_types, max_length
) -> None:
    specs = [FullAttentionSpec(BS), SlidingWindowSpec(BS, window_a)]
    cached = {0: full, 1: local_a}
    if three_types and window_b != window_a:
        specs.append(SlidingWindowSpec(BS, window_b))
        cached[2] = local_b
    coordinator = get_kv_cache_coordinator(specs, 60, 256, True, False, BS)
    assert isinstance(coordinator, HybridKVCacheCoordinator)
    assert coordinator.is_simple_hybrid == (len(specs) == 2)
    hashes = _hashes(12)
    blocks = _populate(coordinator.block_pool, hashes, cached)
    hits, hit_length = coordinator.find_longest_cache_hit(hashes, max_length)

    def accepted(n: int) -> bool:
        if not all(k in full for k in range(n)):
            return False
        return all(
            _valid_sliding(n, cdiv(spec.sliding_window - 1, BS), cached[g])
            for g, spec in enumerate(specs) if isinstance(spec, SlidingWindowSpec)
        )

    max_blocks = min(max_length // BS, len(hashes))
    expected = max(n for n in range(max_blocks + 1) if accepted(n))
    assert hit_length == expected * BS
    assert [len(h) for h in hits] == [expected] * len(specs)
    assert [b.block_id for b in hits[0]] == [blocks[(0, k)].block_id for k in range(expected)]
    for g in range(1, len(specs)):
        need = cdiv(specs[g].sliding_window - 1, BS)
        assert all(hits[g][k] is blocks[(g, k)] for k in range(max(0, expected - need), expected))


def test_sliding_groups_of_one_spec_are_searched_together() -> None:
    """Two sliding groups with the same spec: a block is a hit only if both groups cached it."""
    specs = [FullAttentionSpec(BS), SlidingWindowSpec(BS, 5), SlidingWindowSpec(BS, 5)]
    coordinator = get_kv_cache_coordinator(specs, 40, 256, True, False, BS)
    assert isinstance(coordinator, HybridKVCacheCoordinator)
    assert [ids for _, ids, _ in coordinator.attention_groups] == [[0], [1, 2]]
    assert coordinator.is_simple_hybrid
    hashes = _hashes(6)
    # Full has all 6; group 1 has blocks 3..5; group 2 only 5: the window needs 1 block (ceil(4/4)).
    _populate(coordinator.block_pool, hashes, {0: set(range(6)), 1: {3, 4, 5}, 2: {4}})
    _, hit_length = coordinator.find_longest_cache_hit(hashes, 6 * BS)
    assert hit_length == 5 * BS  # block 4 is in both sliding groups; block 5 is not in group 2


# -- grouping ------------------------------------------------------------------------------------------
def test_kv_cache_groups_split_types_into_equal_groups() -> None:
    specs = {f"l{i}": SlidingWindowSpec(16, 32) if (i + 1) % 6 else FullAttentionSpec(16) for i in range(26)}
    config = get_kv_cache_config(specs, num_blocks=10)
    groups = config.kv_cache_groups
    assert groups[0] == KVCacheGroupSpec(("l5", "l11", "l17", "l23"), FullAttentionSpec(16))
    assert [len(g.layer_names) for g in groups] == [4, 4, 4, 4, 4, 4, 2]
    assert config.num_layers_per_block == 4
    every_layer = sorted(name for t in config.kv_cache_tensors for name in t.shared_by)
    assert every_layer == sorted(specs)
    # A full-attention-only model: one group, one tensor per layer (the layout it always had).
    only_full = get_kv_cache_groups({f"l{i}": FullAttentionSpec(16) for i in range(3)})
    assert only_full == [KVCacheGroupSpec(("l0", "l1", "l2"), FullAttentionSpec(16))]
    assert get_kv_cache_config(only_full, 5).num_layers_per_block == 3


# -- the manager over a hybrid config ----------------------------------------------------------------
def _hybrid_manager(num_blocks: int = 64, window: int = 9, caching: bool = True) -> KVCacheManager:
    layer_specs = {"full": FullAttentionSpec(BS), "local": SlidingWindowSpec(BS, window)}
    config = get_kv_cache_config(layer_specs, num_blocks)
    return KVCacheManager(num_blocks=num_blocks, block_size=BS, max_model_len=512, enable_caching=caching,
                          kv_cache_config=config)


def _run(manager: KVCacheManager, request: Request, num_decodes: int, chunk: int = 64) -> list[int]:
    """Prefill in chunks, then decode; returns the sliding group's real (non-null) block count per step."""
    def num_real_local_blocks() -> int:
        return sum(1 for b in manager.get_blocks(request.request_id).blocks[1] if not b.is_null)

    computed, num_computed = manager.get_computed_blocks(request)
    num_new = min(chunk, request.num_tokens - num_computed)
    assert manager.allocate_slots(request, num_new, num_computed, computed) is not None
    request.num_computed_tokens = num_computed + num_new
    held = [num_real_local_blocks()]
    while request.num_computed_tokens < request.num_tokens:
        num_new = min(chunk, request.num_tokens - request.num_computed_tokens)
        assert manager.allocate_slots(request, num_new) is not None
        request.num_computed_tokens += num_new
        held.append(num_real_local_blocks())
    for t in range(num_decodes):
        request.append_output_token_ids([1000 + t])
        assert manager.allocate_slots(request, 1) is not None
        request.num_computed_tokens += 1
        held.append(num_real_local_blocks())
    return held


def test_sliding_group_frees_blocks_behind_the_window(make_request) -> None:  # type: ignore[no-untyped-def]
    manager = _hybrid_manager(window=9)
    request = make_request("r", list(range(30)), block_size=BS)
    held = _run(manager, request, num_decodes=40, chunk=8)
    full_blocks, local_blocks = manager.get_blocks("r").blocks
    assert len(full_blocks) == len(local_blocks) == cdiv(70, BS)
    assert not any(b.is_null for b in full_blocks)
    # The window of 9 tokens spans at most 3 blocks of 4; one more for the token being written.
    assert max(held[4:]) <= cdiv(9, BS) + 1
    assert local_blocks[0].is_null and sum(1 for b in local_blocks if b.is_null) > 10
    in_use = manager.block_pool.num_gpu_blocks - 1 - manager.num_free_blocks
    assert in_use == len(full_blocks) + sum(1 for b in local_blocks if not b.is_null)
    manager.free(request)
    assert manager.num_free_blocks == manager.block_pool.num_gpu_blocks - 1


def test_hybrid_prefix_hit_reuses_full_prefix_and_sliding_window(make_request) -> None:  # type: ignore[no-untyped-def]
    manager = _hybrid_manager(window=9)
    prompt = list(range(40))
    first = make_request("a", prompt, block_size=BS)
    _run(manager, first, num_decodes=0)
    manager.free(first)
    again = make_request("b", prompt + [7, 7, 7], block_size=BS)
    computed, num_computed = manager.get_computed_blocks(again)
    assert num_computed == 40
    full_hits, local_hits = computed.blocks
    assert len(full_hits) == len(local_hits) == 10
    # Only the blocks of the last window are real hits in the sliding group.
    assert [b.is_null for b in local_hits] == [True] * 8 + [False] * 2
    assert manager.allocate_slots(again, 3, num_computed, computed) is not None
    full_blocks, local_blocks = manager.get_blocks("b").blocks
    assert [b.block_id for b in full_blocks[:10]] == [b.block_id for b in full_hits]
    assert all(local_blocks[k] is local_hits[k] for k in (8, 9))
    manager.free(again)
    assert manager.num_free_blocks == manager.block_pool.num_gpu_blocks - 1


def test_a_sliding_hit_counts_its_evictable_blocks_against_the_free_ones(make_request) -> None:  # type: ignore[no-untyped-def]
    """A hit of 40 tokens (window 9: the sliding group keeps blocks 8 and 9 of 10) for a request
    of 43 needs 14 free blocks: the 10 + 2 hits, which sit in the free queue, and one new block
    per group. With 12 free it is refused without side effects; with more it is admitted."""
    manager = _hybrid_manager(window=9)
    prompt = list(range(40))
    first = make_request("a", prompt, block_size=BS)
    _run(manager, first, num_decodes=0)
    full_blocks, local_blocks = manager.get_blocks("a").blocks
    assert len(full_blocks) == len(local_blocks) == 10
    hits = {b.block_id for b in full_blocks} | {b.block_id for b in local_blocks[8:]}
    manager.free(first)
    pool = manager.block_pool
    # Other requests hold every other block (touch: without evicting anything from the cache).
    others = [b for b in pool.free_block_queue.get_all_free_blocks() if b.block_id not in hits]
    pool.touch(others)
    again = make_request("b", prompt + [7, 7, 7], block_size=BS)
    computed, num_computed = manager.get_computed_blocks(again)
    assert num_computed == 40 and [b.is_null for b in computed.blocks[1]] == [True] * 8 + [False] * 2
    assert manager.allocate_slots(again, 3, num_computed, computed) is None
    assert manager.num_free_blocks == 12 and manager.get_block_ids("b") == ([], [])
    pool.free_blocks(others[:2])
    computed, num_computed = manager.get_computed_blocks(again)
    assert num_computed == 40
    assert manager.allocate_slots(again, 3, num_computed, computed) is not None
    assert manager.num_free_blocks == 0


def test_sliding_hit_survives_eviction_of_old_blocks(make_request) -> None:  # type: ignore[no-untyped-def]
    """A sliding group whose early blocks were evicted still gives a hit; full attention then cuts it."""
    manager = _hybrid_manager(window=5)
    prompt = list(range(24))
    first = make_request("a", prompt, block_size=BS)
    _run(manager, first, num_decodes=0)
    manager.free(first)
    # Evict the sliding group's cached copies of blocks 0..3: the window (1 block) still hits.
    pool = manager.block_pool
    hashes = first.block_hashes
    for k in range(4):
        block = pool.cached_block_hash_to_block.get_one_block(make_block_hash_with_group_id(hashes[k], 1))
        if block is not None:
            pool.evict_blocks([block.block_id])
    again = make_request("b", prompt + [9], block_size=BS)
    computed, num_computed = manager.get_computed_blocks(again)
    assert num_computed == 24
    assert [b.is_null for b in computed.blocks[1]] == [True] * 5 + [False]
    # Now evict the full group's block 2: full attention allows at most 2 blocks, and a sliding
    # hit of 1 or 2 blocks needs block 0 or 1, both evicted from the sliding group: no hit.
    block = pool.cached_block_hash_to_block.get_one_block(make_block_hash_with_group_id(hashes[2], 0))
    assert block is not None
    pool.evict_blocks([block.block_id])
    computed, num_computed = manager.get_computed_blocks(again)
    assert num_computed == 0 and computed.blocks == ((), ())


def test_stored_events_name_their_groups_cache_kind(make_request) -> None:  # type: ignore[no-untyped-def]
    """As vLLM's events: each BlockStored says its group and that group's kind (and window)."""
    from lm_console.engine.metrics.kv_events import BlockStored

    layer_specs = {"full": FullAttentionSpec(BS), "local": SlidingWindowSpec(BS, 9)}
    manager = KVCacheManager(num_blocks=64, block_size=BS, max_model_len=512, enable_caching=True,
                             kv_cache_config=get_kv_cache_config(layer_specs, 64), enable_kv_cache_events=True)
    _run(manager, make_request("r", list(range(3 * BS)), block_size=BS), num_decodes=0)
    stored = [event for event in manager.take_events() if isinstance(event, BlockStored)]
    kinds = {(event.group_idx, event.kv_cache_spec_kind, event.kv_cache_spec_sliding_window) for event in stored}
    assert kinds == {(0, "full_attention", None), (1, "sliding_window", 9)}
