"""ProcessorCache: P0 sender / P1 receiver LRU pair (vLLM's "lru" mm_processor_cache_type).

Both sides hold the same keys (mm identifiers) with the same sizes (bytes of the processed
arrays) and see the same sequence of get_and_update calls (P0 in send order, P1 in receive
order), so they evict identically: when P0 finds an item cached it may send data=None and
P1 is sure to hold the data. P0 stores only what it needs to skip the HF processor (the
item's placeholder expansion); P1 stores the arrays.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import msgspec

from lm_console.engine.errors import MultiModalCacheMissError
from lm_console.engine.multimodal.inputs import MultiModalFeatureSpec

V = TypeVar("V")


def data_nbytes(data: dict[str, Any] | None) -> int:
    """Bytes of an item's processed arrays (the unit both caches count)."""
    if not data:
        return 0
    return sum(int(getattr(value, "nbytes", 0)) for value in data.values())


class LRUSizeCache(Generic[V]):
    """An LRU map bounded by the summed sizes of its values; an oversized value is not kept."""

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self._entries: OrderedDict[str, tuple[V, int]] = OrderedDict()
        self.total_bytes = 0

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def peek(self, key: str) -> V | None:
        """The value without touching the LRU order."""
        entry = self._entries.get(key)
        return entry[0] if entry is not None else None

    def touch(self, key: str) -> V:
        self._entries.move_to_end(key)
        return self._entries[key][0]

    def put(self, key: str, value: V, size: int) -> bool:
        """Insert as most recent, evicting the least recent; False when size exceeds capacity."""
        if size > self.capacity_bytes:
            return False
        while self.total_bytes + size > self.capacity_bytes and self._entries:
            _, (_, old_size) = self._entries.popitem(last=False)
            self.total_bytes -= old_size
        self._entries[key] = (value, size)
        self.total_bytes += size
        return True


@dataclass(slots=True)
class ItemPromptInfo:
    """What P0 keeps per item: its placeholder expansion, so a hit skips the HF processor."""

    token_ids: list[int]
    is_embed: bytes | None


class MultiModalSenderCache:
    """P0 side: metadata only; decides whether a feature's data may travel as None."""

    def __init__(self, capacity_bytes: int) -> None:
        self.cache: LRUSizeCache[ItemPromptInfo] = LRUSizeCache(capacity_bytes)

    def is_cached(self, key: str) -> bool:
        """Lookup that does not change the eviction order (after vLLM's is_cached)."""
        return key in self.cache

    def get_prompt_info(self, key: str) -> ItemPromptInfo | None:
        return self.cache.peek(key)

    def get_and_update(self, feature: MultiModalFeatureSpec,
                       info: ItemPromptInfo | None = None) -> MultiModalFeatureSpec:
        """At send time: a cached item travels without data (a copy is returned, the
        caller's feature is left alone); a new one is recorded (after vLLM's get_and_update)."""
        key = feature.identifier
        if key in self.cache:
            self.cache.touch(key)
            return msgspec.structs.replace(feature, data=None) if feature.data is not None else feature
        if feature.data is None:
            raise RuntimeError(f"mm item {key} was a processor-cache hit but left the cache before sending")
        self.cache.put(key, info or ItemPromptInfo([], feature.is_embed), data_nbytes(feature.data))
        return feature


class MultiModalReceiverCache:
    """P1 side: the arrays, filled in for features that arrive with data=None."""

    def __init__(self, capacity_bytes: int) -> None:
        self.cache: LRUSizeCache[dict[str, Any]] = LRUSizeCache(capacity_bytes)

    def get_and_update(self, feature: MultiModalFeatureSpec) -> None:
        """Mirror of the sender's call, in receive order; fills feature.data on a hit."""
        key = feature.identifier
        if feature.data is None:
            if key not in self.cache:
                raise MultiModalCacheMissError(
                    f"mm item {key} arrived without data and the engine core's processor cache "
                    "does not hold it (frontend and core caches out of step); resend the request.")
            feature.data = self.cache.touch(key)
            return
        if key in self.cache:
            self.cache.touch(key)
            return
        self.cache.put(key, feature.data, data_nbytes(feature.data))
