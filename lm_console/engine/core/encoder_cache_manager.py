"""EncoderCacheManager: the scheduler's bookkeeping of encoder outputs (after vLLM's vllm/v1/core/encoder_cache_manager.py).

Pure Python (no torch): the worker holds the tensors in `encoder_cache: dict[str, Tensor]`;
this class decides which mm items live there, counted in encoder embeddings ("slots").
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lm_console.engine.request import Request


@dataclass(slots=True)
class EncoderCacheCounters:
    """Cumulative counters for the console (hits, misses, encoder runs, evictions)."""

    num_lookups: int = 0
    num_hits: int = 0
    num_encoder_runs: int = 0  # items scheduled for computation
    num_external_loads: int = 0  # items an ECConnector loads instead
    num_evictions: int = 0


class EncoderCacheManager:
    """Refcounted encoder-output entries with lazy FIFO eviction.

    cached[mm_hash] is the set of requests referencing an entry. An entry whose set becomes
    empty is not dropped: it moves to `freeable` (insertion ordered) and stays usable until
    can_allocate() needs its space, evicting the oldest first; evicted hashes are reported
    once through get_freed_mm_hashes() so the worker pops the tensors.
    Invariants: num_free_slots <= num_freeable_slots <= cache_size;
    num_freeable_slots == num_free_slots + sum(freeable.values());
    cache_size - num_freeable_slots == slots of entries with at least one reference.
    """

    def __init__(self, cache_size: int) -> None:
        self.cache_size = cache_size
        self.num_free_slots = cache_size
        self.num_freeable_slots = cache_size
        self.cached: dict[str, set[str]] = {}
        self.freeable: OrderedDict[str, int] = OrderedDict()  # mm_hash -> num_embeds
        self.freed: list[str] = []
        self.counters = EncoderCacheCounters()

    def check_and_update_cache(self, request: Request, input_id: int) -> bool:
        """True (and a reference taken) when the item's output is cached."""
        feature = request.mm_features[input_id]
        mm_hash = feature.identifier
        self.counters.num_lookups += 1
        references = self.cached.get(mm_hash)
        if references is None:
            return False
        if not references:  # freeable: back in use
            self.num_freeable_slots -= self.freeable.pop(mm_hash)
        references.add(request.request_id)
        self.counters.num_hits += 1
        return True

    def can_allocate(self, request: Request, input_id: int, encoder_compute_budget: int,
                     num_embeds_to_schedule: int) -> bool:
        """Whether the item fits the step's compute budget and the cache, evicting freeable
        entries oldest-first if that is what it takes (after vLLM's can_allocate)."""
        num_embeds = request.mm_features[input_id].num_embeds
        if num_embeds > encoder_compute_budget:
            return False
        num_embeds += num_embeds_to_schedule
        if num_embeds <= self.num_free_slots:
            return True
        if num_embeds > self.num_freeable_slots:
            return False
        while num_embeds > self.num_free_slots:
            mm_hash, num_free = self.freeable.popitem(last=False)
            del self.cached[mm_hash]
            self.freed.append(mm_hash)
            self.num_free_slots += num_free
            self.counters.num_evictions += 1
        return True

    def allocate(self, request: Request, input_id: int) -> None:
        """Reserve the item's slots for the request (bookkeeping only; the worker fills them)."""
        feature = request.mm_features[input_id]
        mm_hash = feature.identifier
        references = self.cached.get(mm_hash)
        if references is None:
            references = self.cached[mm_hash] = set()
            num_embeds = feature.num_embeds
            self.num_free_slots -= num_embeds
            self.num_freeable_slots -= num_embeds
        elif not references:  # a freeable entry taken back (e.g. an external load of a known item)
            self.num_freeable_slots -= self.freeable.pop(mm_hash)
        references.add(request.request_id)

    def get_cached_input_ids(self, request: Request) -> set[int]:
        """Indices of the request's items whose entries the request references."""
        return {i for i, f in enumerate(request.mm_features)
                if request.request_id in self.cached.get(f.identifier, ())}

    def free_encoder_input(self, request: Request, input_id: int) -> None:
        """Drop the request's reference; the last one makes the entry freeable (not evicted)."""
        feature = request.mm_features[input_id]
        references = self.cached.get(feature.identifier)
        if not references or request.request_id not in references:
            return
        references.discard(request.request_id)
        if not references:
            self.freeable[feature.identifier] = feature.num_embeds
            self.num_freeable_slots += feature.num_embeds

    def free(self, request: Request) -> None:
        """Drop every reference of a finished or preempted request ."""
        for input_id in self.get_cached_input_ids(request):
            self.free_encoder_input(request, input_id)

    def get_freed_mm_hashes(self) -> list[str]:
        """Hashes evicted since the last call; the worker pops their tensors."""
        freed, self.freed = self.freed, []
        return freed

    # -- observation --------------------------------------------------------------------------------
    @property
    def num_used_slots(self) -> int:
        """Slots of entries some request references."""
        return self.cache_size - self.num_freeable_slots

    @property
    def num_freeable_only_slots(self) -> int:
        """Slots of unreferenced entries kept for reuse (evicted only when space is needed)."""
        return self.num_freeable_slots - self.num_free_slots


def compute_mm_encoder_budget(max_num_encoder_input_tokens: int, encoder_cache_size: int,
                              max_tokens_per_mm_item: int) -> tuple[int, int]:
    """(encoder_compute_budget, encoder_cache_size): both admit at least one largest item
    (after vLLM's compute_mm_encoder_budget)."""
    return (max(max_num_encoder_input_tokens, max_tokens_per_mm_item),
            max(encoder_cache_size, max_tokens_per_mm_item))
