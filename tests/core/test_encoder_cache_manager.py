"""EncoderCacheManager: refcounts, lazy freeable entries, FIFO eviction only when space is needed."""

from __future__ import annotations

from lm_console.engine.core.encoder_cache_manager import EncoderCacheManager, compute_mm_encoder_budget
from lm_console.engine.request import MultiModalFeatureSpec, Request
from lm_console.engine.sampling_params import SamplingParams


def request(request_id: str, *items: tuple[str, int]) -> Request:
    """A request with one image per (identifier, num_embeds), placed one after another."""
    features, offset = [], 0
    for identifier, num_embeds in items:
        features.append(MultiModalFeatureSpec(identifier, offset, num_embeds))
        offset += num_embeds
    return Request(request_id, list(range(offset + 1)), SamplingParams(max_tokens=1), None, mm_features=features)


def check_invariants(manager: EncoderCacheManager) -> None:
    assert manager.num_free_slots <= manager.num_freeable_slots <= manager.cache_size
    assert manager.num_freeable_slots == manager.num_free_slots + sum(manager.freeable.values())
    assert all(not manager.cached[h] for h in manager.freeable)


def test_allocate_share_and_free_keeps_entries_until_space_is_needed() -> None:
    manager = EncoderCacheManager(cache_size=10)
    r1, r2 = request("r1", ("a", 4)), request("r2", ("a", 4))
    assert not manager.check_and_update_cache(r1, 0)
    assert manager.can_allocate(r1, 0, encoder_compute_budget=10, num_embeds_to_schedule=0)
    manager.allocate(r1, 0)
    assert manager.check_and_update_cache(r2, 0)  # shared: a hit takes a reference
    assert manager.cached["a"] == {"r1", "r2"} and manager.num_free_slots == 6
    manager.free(r1)
    assert manager.cached["a"] == {"r2"} and not manager.freeable
    manager.free(r2)
    assert manager.freeable == {"a": 4} and manager.num_free_slots == 6 and manager.num_freeable_slots == 10
    check_invariants(manager)
    assert manager.get_freed_mm_hashes() == []  # nothing evicted: lazy
    # A later request hits the freeable entry and takes it back.
    r3 = request("r3", ("a", 4))
    assert manager.check_and_update_cache(r3, 0)
    assert not manager.freeable and manager.num_freeable_slots == 6
    check_invariants(manager)


def test_eviction_is_fifo_over_freeable_entries_and_only_as_much_as_needed() -> None:
    manager = EncoderCacheManager(cache_size=10)
    for name in ("a", "b", "c"):
        r = request(f"r{name}", (name, 3))
        manager.can_allocate(r, 0, 10, 0)
        manager.allocate(r, 0)
        manager.free(r)
    assert list(manager.freeable) == ["a", "b", "c"] and manager.num_free_slots == 1
    big = request("big", ("d", 5))
    assert manager.can_allocate(big, 0, encoder_compute_budget=10, num_embeds_to_schedule=0)
    assert manager.get_freed_mm_hashes() == ["a", "b"]  # oldest first; c survives
    assert manager.get_freed_mm_hashes() == []
    manager.allocate(big, 0)
    assert set(manager.cached) == {"c", "d"} and manager.num_free_slots == 2
    check_invariants(manager)


def test_can_allocate_respects_the_compute_budget_and_referenced_entries() -> None:
    manager = EncoderCacheManager(cache_size=10)
    held = request("held", ("a", 8))
    manager.can_allocate(held, 0, 10, 0)
    manager.allocate(held, 0)
    other = request("other", ("b", 4))
    assert not manager.can_allocate(other, 0, encoder_compute_budget=3, num_embeds_to_schedule=0)
    assert not manager.can_allocate(other, 0, encoder_compute_budget=10, num_embeds_to_schedule=0)
    assert manager.get_freed_mm_hashes() == []  # a referenced entry is never evicted
    # Embeddings already planned this step count against the space.
    small = request("small", ("c", 1))
    assert not manager.can_allocate(small, 0, encoder_compute_budget=10, num_embeds_to_schedule=2)
    assert manager.can_allocate(small, 0, encoder_compute_budget=10, num_embeds_to_schedule=1)


def test_free_encoder_input_is_idempotent_and_per_item() -> None:
    manager = EncoderCacheManager(cache_size=20)
    r = request("r", ("a", 2), ("b", 3))
    for i in (0, 1):
        manager.allocate(r, i)
    manager.free_encoder_input(r, 0)
    manager.free_encoder_input(r, 0)
    assert manager.freeable == {"a": 2} and manager.get_cached_input_ids(r) == {1}
    manager.free(r)
    assert list(manager.freeable) == ["a", "b"]
    check_invariants(manager)


def test_compute_budget_and_cache_size_admit_one_largest_item() -> None:
    assert compute_mm_encoder_budget(100, 200, 50) == (100, 200)
    assert compute_mm_encoder_budget(16, 16, 50) == (50, 50)
