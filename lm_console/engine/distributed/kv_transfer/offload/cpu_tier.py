"""CPUTier: chunks in host RAM under a byte limit, least recently used evicted first."""

from __future__ import annotations

from collections import OrderedDict

import torch

from lm_console.engine.distributed.kv_transfer.offload.counters import TierCounters


class CPUTier:
    """An LRU map chunk key -> tensor (on the CPU).

    Invariants: used_bytes == sum of the stored tensors' sizes <= capacity_bytes; a pinned key
    (a load in progress reads it) is never evicted. Not thread-safe: the store locks around it.
    """

    medium = "CPU"

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self.used_bytes = 0
        self._chunks: OrderedDict[bytes, torch.Tensor] = OrderedDict()
        self._pins: dict[bytes, int] = {}
        self.counters = TierCounters()

    def __len__(self) -> int:
        return len(self._chunks)

    def __contains__(self, key: bytes) -> bool:
        return key in self._chunks

    def get(self, key: bytes) -> torch.Tensor | None:
        """The chunk (now most recently used), or None; counts the bytes loaded."""
        tensor = self._chunks.get(key)
        if tensor is None:
            return None
        self._chunks.move_to_end(key)
        self.counters.bytes_out += tensor.nbytes
        return tensor

    def put(self, key: bytes, tensor: torch.Tensor) -> tuple[bool, list[bytes]]:
        """Store a chunk, evicting LRU unpinned ones to fit; (stored, evicted keys)."""
        if key in self._chunks:
            self._chunks.move_to_end(key)
            return True, []
        evicted: list[bytes] = []
        if tensor.nbytes > self.capacity_bytes:
            return False, evicted
        while self.used_bytes + tensor.nbytes > self.capacity_bytes:
            victim = next((k for k in self._chunks if not self._pins.get(k)), None)
            if victim is None:
                return False, evicted  # everything left is pinned by loads in flight
            self.used_bytes -= self._chunks.pop(victim).nbytes
            self.counters.evictions += 1
            evicted.append(victim)
        self._chunks[key] = tensor
        self.used_bytes += tensor.nbytes
        self.counters.bytes_in += tensor.nbytes
        return True, evicted

    def pin(self, key: bytes) -> bool:
        """Keep a stored chunk from eviction until unpin(); False if it is not stored."""
        if key not in self._chunks:
            return False
        self._pins[key] = self._pins.get(key, 0) + 1
        return True

    def unpin(self, key: bytes) -> None:
        count = self._pins.get(key, 0) - 1
        if count > 0:
            self._pins[key] = count
        else:
            self._pins.pop(key, None)
