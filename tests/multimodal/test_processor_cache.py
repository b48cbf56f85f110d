"""ProcessorCache sender/receiver pair: identical eviction, data=None on a hit, clear miss error."""

from __future__ import annotations

import numpy as np
import pytest

from lm_console.engine.errors import MultiModalCacheMissError
from lm_console.engine.multimodal.inputs import MultiModalFeatureSpec
from lm_console.engine.multimodal.processor_cache import LRUSizeCache, MultiModalReceiverCache, MultiModalSenderCache


def feature(key: str, nbytes: int = 100) -> MultiModalFeatureSpec:
    return MultiModalFeatureSpec(key, 0, 4, data={"pixel_values": np.zeros(nbytes, dtype=np.uint8)})


def test_lru_size_cache_evicts_least_recent_by_size() -> None:
    cache: LRUSizeCache[str] = LRUSizeCache(250)
    cache.put("a", "A", 100)
    cache.put("b", "B", 100)
    cache.touch("a")
    cache.put("c", "C", 100)  # evicts b, the least recently used
    assert "a" in cache and "b" not in cache and cache.total_bytes == 200
    assert not cache.put("huge", "H", 251) and "huge" not in cache


def test_sender_and_receiver_stay_in_step() -> None:
    sender, receiver = MultiModalSenderCache(250), MultiModalReceiverCache(250)
    sequence = ["a", "b", "a", "c", "d", "a", "b"]
    for key in sequence:
        original = feature(key)
        sent = sender.get_and_update(original)
        assert original.data is not None  # the caller's object is never modified
        receiver.get_and_update(sent)  # a miss here would raise
        assert sent.data is not None or key in receiver.cache
        assert list(sender.cache._entries) == list(receiver.cache._entries)
    hits = [key for i, key in enumerate(sequence) if key in sequence[:i]]
    assert hits  # the sequence exercised hits and evictions


def test_receiver_miss_with_no_data_is_a_clear_error() -> None:
    receiver = MultiModalReceiverCache(1000)
    with pytest.raises(MultiModalCacheMissError, match="resend"):
        receiver.get_and_update(MultiModalFeatureSpec("x", 0, 4, data=None))
