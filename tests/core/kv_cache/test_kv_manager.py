"""KVCacheManager: prefix hits, allocate_slots stages, chunking, stats, events."""

from __future__ import annotations

import pytest

from lm_console.engine.core.kv_cache import KVCacheBlocks, KVCacheManager
from lm_console.engine.errors import InvalidEngineArgsError
from lm_console.engine.metrics.kv_events import BlockStored
from lm_console.engine.request import Request
from lm_console.engine.sampling_params import SamplingParams

BLOCK_SIZE = 4


def _manager(num_blocks: int = 16, **kwargs) -> KVCacheManager:  # type: ignore[no-untyped-def]
    return KVCacheManager(num_blocks=num_blocks, block_size=BLOCK_SIZE, max_model_len=128, **kwargs)


def _schedule_prefill(manager: KVCacheManager, request: Request) -> KVCacheBlocks | None:
    """What the scheduler does for a waiting request: look up, allocate, mark computed."""
    computed, num_computed = manager.get_computed_blocks(request)
    blocks = manager.allocate_slots(request, request.num_tokens - num_computed, num_computed, computed)
    if blocks is not None:
        request.num_computed_tokens = request.num_tokens
    return blocks


def _ids(manager: KVCacheManager, request: Request) -> list[int]:
    return manager.get_block_ids(request.request_id)[0]


def test_prefix_hit_across_two_requests(make_request) -> None:  # type: ignore[no-untyped-def]
    manager = _manager()
    shared = list(range(100, 108))  # two full blocks
    r1 = make_request("r1", shared + [1, 2, 3])
    assert _schedule_prefill(manager, r1) is not None
    r2 = make_request("r2", shared + [7, 8, 9, 10, 11])
    computed, num_computed = manager.get_computed_blocks(r2)
    assert num_computed == 8
    assert computed.get_block_ids() == (_ids(manager, r1)[:2],)
    new_blocks = manager.allocate_slots(r2, r2.num_tokens - num_computed, num_computed, computed)
    assert new_blocks is not None and len(new_blocks.blocks[0]) == 2
    assert _ids(manager, r2)[:2] == _ids(manager, r1)[:2]
    assert [manager.block_pool.blocks[i].ref_cnt for i in _ids(manager, r1)[:2]] == [2, 2]
    assert manager.get_num_common_prefix_blocks("r2") == [2]
    stats = manager.make_prefix_cache_stats()
    assert stats is not None and (stats.requests, stats.queries, stats.hits) == (2, 11 + 13, 8)
    assert manager.make_prefix_cache_stats().requests == 0  # type: ignore[union-attr]


def test_lookups_of_preempted_requests_are_counted_apart(make_request) -> None:  # type: ignore[no-untyped-def]
    """vLLM's preempted-request prefix-cache counters: only the lookups of requests that were
    preempted (their recomputation) count there; the hit rate is hits / queries of all."""
    manager = _manager()
    first = make_request("first", list(range(100, 110)))  # 10 tokens
    assert _schedule_prefill(manager, first) is not None
    again = make_request("again", list(range(100, 113)))  # 13 tokens, 8 of them hits
    manager.get_computed_blocks(again)
    stats = manager.make_prefix_cache_stats()
    assert stats is not None and (stats.requests, stats.queries, stats.hits) == (2, 23, 8)
    assert (stats.preempted_requests, stats.preempted_queries, stats.preempted_hits) == (0, 0, 0)
    assert stats.hit_rate == 8 / 23
    again.num_preemptions = 1
    manager.get_computed_blocks(again)
    stats = manager.make_prefix_cache_stats()
    assert stats is not None and (stats.requests, stats.queries, stats.hits) == (1, 13, 8)
    assert (stats.preempted_requests, stats.preempted_queries, stats.preempted_hits) == (1, 13, 8)
    assert stats.hit_rate == 8 / 13
    assert manager.make_prefix_cache_stats().hit_rate == 0.0  # type: ignore[union-attr]


@pytest.mark.parametrize("num_tokens, expected_hit", [(8, 4), (9, 8), (12, 8), (13, 12)])
def test_full_hit_recomputes_last_token(make_request, num_tokens: int, expected_hit: int) -> None:  # type: ignore[no-untyped-def]
    manager = _manager()
    tokens = list(range(num_tokens))
    first = make_request("a", tokens)
    _schedule_prefill(manager, first)
    manager.free(first)
    again = make_request("b", tokens)
    _, num_computed = manager.get_computed_blocks(again)
    # max hit = num_tokens - 1, rounded down to whole blocks
    assert num_computed == expected_hit == (num_tokens - 1) // BLOCK_SIZE * BLOCK_SIZE


def test_hit_on_freed_blocks_revives_them(make_request) -> None:  # type: ignore[no-untyped-def]
    manager = _manager(num_blocks=5)  # 4 usable blocks
    first = make_request("a", list(range(9)))
    _schedule_prefill(manager, first)
    manager.free(first)
    assert manager.num_free_blocks == 4 and manager.usage == 0.0
    again = make_request("b", list(range(9)))
    computed, num_computed = manager.get_computed_blocks(again)
    assert num_computed == 8
    assert manager.allocate_slots(again, 1, num_computed, computed) is not None
    # the two hit blocks left the free queue on touch() plus one new block
    assert manager.num_free_blocks == 1


def test_prompt_logprobs_and_disabled_caching_skip_lookup(make_request) -> None:  # type: ignore[no-untyped-def]
    manager = _manager()
    _schedule_prefill(manager, make_request("a", list(range(9))))
    logprobs_request = make_request("b", list(range(9)), prompt_logprobs=1)
    assert manager.get_computed_blocks(logprobs_request) == (manager.empty_kv_cache_blocks, 0)
    no_cache = _manager(enable_caching=False)
    request = make_request("c", list(range(9)))
    _schedule_prefill(no_cache, request)
    assert all(no_cache.block_pool.blocks[i].block_hash is None for i in _ids(no_cache, request))
    no_cache.free(request)
    assert no_cache.get_computed_blocks(make_request("d", list(range(9))))[1] == 0


def test_allocate_slots_none_without_side_effects(make_request) -> None:  # type: ignore[no-untyped-def]
    manager = _manager(num_blocks=6, enable_kv_cache_events=True)  # 5 usable blocks
    holder = make_request("h", list(range(12)))
    _schedule_prefill(manager, holder)  # 3 blocks
    manager.free(holder)
    pinned = make_request("p", [50, 51, 52, 53, 54])
    _schedule_prefill(manager, pinned)  # takes the 2 plain free blocks; 3 cached ones stay free
    manager.take_events()
    big = make_request("big", list(range(12)) + list(range(60, 72)))  # 6 blocks, 3 of them cached
    computed, num_computed = manager.get_computed_blocks(big)
    assert num_computed == 12 and len(computed.blocks[0]) == 3
    states, refs = manager.get_block_states(), manager.get_block_ref_counts()
    free_order = [b.block_id for b in manager.block_pool.free_block_queue.get_all_free_blocks()]
    assert manager.allocate_slots(big, big.num_tokens - num_computed, num_computed, computed) is None
    assert manager.get_block_states() == states and manager.get_block_ref_counts() == refs
    assert [b.block_id for b in manager.block_pool.free_block_queue.get_all_free_blocks()] == free_order
    assert manager.get_block_ids("big") == ([],) and manager.take_events() == []
    # even one more token does not fit: the 3 evictable hits leave the queue on touch()
    assert manager.allocate_slots(big, 1, num_computed, computed) is None
    manager.free(pinned)
    blocks = manager.allocate_slots(big, 8, num_computed, computed)
    assert blocks is not None and len(blocks.blocks[0]) == 2  # only the new blocks are returned
    assert len(_ids(manager, big)) == 5 and manager.num_free_blocks == 0


def test_chunked_prefill_then_decode(make_request) -> None:  # type: ignore[no-untyped-def]
    manager = _manager()
    request = make_request("r", list(range(10)))
    first = manager.allocate_slots(request, 6)
    assert first is not None and first.get_block_ids() == ([1, 2],)
    request.num_computed_tokens = 6
    assert len(manager.block_pool.cached_block_hash_to_block) == 1  # only block 0 is full
    second = manager.allocate_slots(request, 4)
    assert second is not None and second.get_block_ids() == ([3],)
    request.num_computed_tokens = 10
    assert len(manager.block_pool.cached_block_hash_to_block) == 2
    request.append_output_token_ids([10, 11])  # decode: block 2 becomes full
    assert manager.allocate_slots(request, 1) is manager.empty_kv_cache_blocks
    request.num_computed_tokens = 11
    assert manager.allocate_slots(request, 1) is manager.empty_kv_cache_blocks
    request.num_computed_tokens = 12
    assert len(manager.block_pool.cached_block_hash_to_block) == 3
    request.append_output_token_ids(12)
    fourth = manager.allocate_slots(request, 1)
    assert fourth is not None and fourth.get_block_ids() == ([4],)
    assert _ids(manager, request) == [1, 2, 3, 4]


def test_lookahead_tokens_get_slots_but_are_not_cached(make_request) -> None:  # type: ignore[no-untyped-def]
    manager = _manager()
    request = make_request("r", list(range(8)))
    blocks = manager.allocate_slots(request, 8, num_lookahead_tokens=3)
    assert blocks is not None and len(blocks.blocks[0]) == 3
    assert len(manager.block_pool.cached_block_hash_to_block) == 2


def test_max_model_len_caps_slots(make_request) -> None:  # type: ignore[no-untyped-def]
    manager = KVCacheManager(num_blocks=16, block_size=BLOCK_SIZE, max_model_len=10)
    request = make_request("r", list(range(8)))
    blocks = manager.allocate_slots(request, 8, num_lookahead_tokens=8)
    assert blocks is not None and len(blocks.blocks[0]) == 3  # cdiv(10, 4)


def test_free_returns_tail_first(make_request) -> None:  # type: ignore[no-untyped-def]
    manager = _manager(num_blocks=5)
    request = make_request("r", list(range(12)))
    _schedule_prefill(manager, request)
    manager.free(request)
    free_ids = [b.block_id for b in manager.block_pool.free_block_queue.get_all_free_blocks()]
    assert free_ids == [4, 3, 2, 1]
    assert manager.get_block_ids("r") == ([],)


def test_delay_cache_blocks_and_explicit_cache_blocks(make_request) -> None:  # type: ignore[no-untyped-def]
    manager = _manager(enable_kv_cache_events=True)
    request = make_request("r", list(range(9)))
    blocks = manager.allocate_slots(request, 9, delay_cache_blocks=True)
    assert blocks is not None and blocks.get_unhashed_block_ids() == [1, 2, 3]
    assert manager.take_events() == []
    manager.cache_blocks(request, 9)
    (event,) = manager.take_events()
    assert isinstance(event, BlockStored) and event.token_ids == list(range(8))
    assert manager.get_blocks("r").get_unhashed_block_ids() == [3]


def test_external_computed_tokens_get_blocks(make_request) -> None:  # type: ignore[no-untyped-def]
    manager = _manager()
    request = make_request("r", list(range(10)))
    blocks = manager.allocate_slots(request, 2, num_external_computed_tokens=8)
    assert blocks is not None
    assert len(_ids(manager, request)) == 3  # 2 blocks for external KV + 1 for the new tokens
    # The external KV's blocks are allocated with the hits, ahead of the new tokens' block:
    # only the latter comes back as new.
    assert _ids(manager, request) == [1, 2, 3] and blocks.get_block_ids() == ([3],)


def test_reset_prefix_cache_and_stats_flag(make_request) -> None:  # type: ignore[no-untyped-def]
    manager = _manager()
    request = make_request("r", list(range(9)))
    _schedule_prefill(manager, request)
    assert manager.reset_prefix_cache() is False
    manager.free(request)
    manager.make_prefix_cache_stats()
    assert manager.reset_prefix_cache() is True
    stats = manager.make_prefix_cache_stats()
    assert stats is not None and stats.reset
    assert manager.get_computed_blocks(make_request("s", list(range(9))))[1] == 0
    assert _manager(log_stats=False).make_prefix_cache_stats() is None


def test_hash_block_size_smaller_than_block_size(make_request) -> None:  # type: ignore[no-untyped-def]
    manager = KVCacheManager(num_blocks=16, block_size=8, max_model_len=64, hash_block_size=4)
    first = make_request("a", list(range(20)), block_size=4)
    _schedule_prefill(manager, first)
    second = make_request("b", list(range(20)), block_size=4)
    computed, num_computed = manager.get_computed_blocks(second)
    assert num_computed == 16 and computed.get_block_ids() == (_ids(manager, first)[:2],)


def test_kv_cache_blocks_helpers() -> None:
    manager = _manager()
    pool = manager.block_pool
    a = KVCacheBlocks(([pool.blocks[1]],))
    b = KVCacheBlocks(([pool.blocks[2], pool.blocks[3]],))
    assert (a + b).get_block_ids() == ([1, 2, 3],)
    assert a.new_empty().get_block_ids() == ([],)
    assert a.new_empty().get_block_ids(allow_none=True) is None


def test_input_validation(make_request) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(InvalidEngineArgsError):
        KVCacheManager(num_blocks=1, block_size=4, max_model_len=8)
    with pytest.raises(InvalidEngineArgsError):
        KVCacheManager(num_blocks=4, block_size=4, max_model_len=8, hash_block_size=3)
    manager = _manager()
    with pytest.raises(ValueError):
        manager.allocate_slots(make_request("r", [1, 2]), 0)
    no_hasher = Request("x", [1, 2, 3, 4, 5], SamplingParams(), None)
    with pytest.raises(ValueError, match="block_hasher"):
        manager.allocate_slots(no_hasher, 5)
    assert manager.get_block_ids("x") == ([],)  # rejected before any state changed
    assert _manager(enable_caching=False).allocate_slots(no_hasher, 5) is not None


# -- a prefix hit needs every token of the prefix equal ------------------------------------------
def _assert_no_hit_when_any_token_differs(make_request) -> None:  # type: ignore[no-untyped-def]
    """Blocks of 16: a cached 33-token prompt; a prompt that differs in any one token of the first
    32 hits exactly the full blocks before that token."""
    manager = KVCacheManager(num_blocks=64, block_size=16, max_model_len=128)
    base = list(range(200, 233))
    first = make_request("base", base, block_size=16)
    _schedule_prefill(manager, first)
    manager.free(first)
    for pos in range(32):
        tokens = list(base)
        tokens[pos] = 7
        _, num_computed = manager.get_computed_blocks(make_request(f"p{pos}", tokens, block_size=16))
        assert num_computed == pos // 16 * 16, f"token {pos} differs, yet {num_computed} tokens hit"
    _, num_computed = manager.get_computed_blocks(make_request("same", base, block_size=16))
    assert num_computed == 32


def test_a_prefix_hit_needs_every_token_equal(make_request) -> None:  # type: ignore[no-untyped-def]
    _assert_no_hit_when_any_token_differs(make_request)


def test_negative_control_a_hash_that_drops_tokens_gives_false_hits(make_request, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The mutation (block hashes read every 4th token: 12 of 16 ignored) must fail the check."""
    from lm_console.engine import kv_cache_hashing as hashing

    real = hashing.hash_block_tokens
    monkeypatch.setattr(hashing, "hash_block_tokens",
                        lambda fn, parent, tokens, extra=None: real(fn, parent, list(tokens)[::4], extra))
    with pytest.raises(AssertionError, match="yet"):
        _assert_no_hit_when_any_token_differs(make_request)


def test_two_blocks_are_the_smallest_cache_one_usable_beside_the_null_block(make_request) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(InvalidEngineArgsError, match="num_blocks=1 is too small"):
        _manager(num_blocks=1)
    manager = _manager(num_blocks=2)
    assert manager.num_free_blocks == 1
    request = make_request("a", [1, 2, 3])
    assert _schedule_prefill(manager, request) is not None
    assert _ids(manager, request) == [1]
    assert _schedule_prefill(manager, make_request("b", [4, 5, 6])) is None  # nothing left
