"""TieredKVStore: the CPU tier in front of the disk tier, with a background disk writer.

LMCache-style: a stored chunk enters the CPU tier at once (so the next lookup hits) and is
written through to disk by one background thread (so it survives restarts and is visible to
other processes). A load reads the CPU tier, else the disk (and promotes the chunk to CPU).
One store per process and configuration is shared by the scheduler-role and the worker-role
connector (get_shared_store), as LMCache shares one engine per instance.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch

from lm_console.engine.distributed.kv_transfer.offload.chunk_codec import CorruptChunkError
from lm_console.engine.distributed.kv_transfer.offload.cpu_tier import CPUTier
from lm_console.engine.distributed.kv_transfer.offload.disk_tier import DiskTier
from lm_console.engine.metrics.kv_events import BlockRemoved, BlockStored, KVCacheEvent
from lm_console.engine.metrics.stats import KVTierStats

logger = logging.getLogger(__name__)

_STOP = object()


@dataclass(slots=True)
class _WriteJob:
    key: bytes
    tensor: torch.Tensor
    parent: bytes | None
    token_ids: list[int]


class TieredKVStore:
    """chunk key -> KV tensor [num_layers, 2, chunk_size, num_kv_heads, head_dim] over CPU and disk.

    Thread-safe. Invariants: a queued disk write holds its tensor until written (at most
    max_pending_bytes of them; beyond that writes are dropped, never blocking the engine);
    close() joins the writer within its timeout.
    """

    def __init__(self, cpu_bytes: int, disk_path: str | None, disk_bytes: int,
                 chunk_shape: tuple[int, ...], dtype: torch.dtype, chunk_size: int) -> None:
        self.chunk_shape = chunk_shape
        self.dtype = dtype
        self.chunk_size = chunk_size
        self.cpu = CPUTier(cpu_bytes)
        self.disk = DiskTier(disk_path, disk_bytes) if disk_path else None
        self._lock = threading.Lock()
        self._events: list[KVCacheEvent] = []
        self._queue: queue.Queue[Any] = queue.Queue()
        self._pending_bytes = 0
        self.max_pending_bytes = max(cpu_bytes, 1 << 28)
        self._writer: threading.Thread | None = None
        self._closed = False

    # -- lookups (scheduler side) ------------------------------------------------------------
    def lookup_prefix(self, keys: list[bytes]) -> tuple[int, int]:
        """(chunks found, how many of them only on disk) for the longest stored prefix of keys."""
        num_disk = 0
        for i, key in enumerate(keys):
            with self._lock:
                in_cpu = key in self.cpu
                if in_cpu:
                    self.cpu.counters.hits += 1
                else:
                    self.cpu.counters.misses += 1
            if in_cpu:
                continue
            if self.disk is not None and self.disk.contains(key):
                with self._lock:
                    self.disk.counters.hits += 1
                num_disk += 1
                continue
            if self.disk is not None:
                with self._lock:
                    self.disk.counters.misses += 1
            return i, num_disk
        return len(keys), num_disk

    def contains(self, key: bytes) -> bool:
        with self._lock:
            if key in self.cpu:
                return True
        return self.disk is not None and self.disk.contains(key)

    def pin(self, key: bytes) -> bool:
        with self._lock:
            return self.cpu.pin(key)

    def unpin(self, key: bytes) -> None:
        with self._lock:
            self.cpu.unpin(key)

    # -- data (worker side) -----------------------------------------------------------------
    def get_cached(self, key: bytes) -> torch.Tensor | None:
        """The chunk if the CPU tier holds it (never touches the disk)."""
        with self._lock:
            return self.cpu.get(key)

    def get(self, key: bytes) -> torch.Tensor | None:
        """The chunk from CPU, else from disk (promoted to CPU); CorruptChunkError if the file is bad."""
        with self._lock:
            tensor = self.cpu.get(key)
        if tensor is not None:
            return tensor
        if self.disk is None:
            return None
        tensor = self.disk.read(key, self.dtype, self.chunk_shape)
        if tensor is not None:
            self._put_cpu(key, tensor, None, None)
        return tensor

    def put(self, key: bytes, tensor: torch.Tensor, parent: bytes | None, token_ids: list[int]) -> None:
        """Store a chunk in the CPU tier now and queue its write to disk."""
        self._put_cpu(key, tensor, parent, token_ids)
        if self.disk is None or not self.disk.writable or self._closed:
            return
        with self._lock:
            if self._pending_bytes + tensor.nbytes > self.max_pending_bytes:
                logger.debug("KV offload: disk writer behind; chunk %s not written", key.hex()[:12])
                return
            self._pending_bytes += tensor.nbytes
        self._ensure_writer()
        self._queue.put(_WriteJob(key, tensor, parent, token_ids))

    def _put_cpu(self, key: bytes, tensor: torch.Tensor, parent: bytes | None, token_ids: list[int] | None) -> None:
        with self._lock:
            if key in self.cpu:
                return
            stored, evicted = self.cpu.put(key, tensor)
            if evicted:
                self._events.append(BlockRemoved(block_hashes=evicted, medium="CPU"))
            if stored and token_ids is not None:
                self._events.append(BlockStored(block_hashes=[key], parent_block_hash=parent, token_ids=token_ids,
                                                block_size=self.chunk_size, medium="CPU"))

    def discard(self, key: bytes) -> None:
        """Forget a chunk found corrupt, so lookups stop offering it."""
        if self.disk is not None:
            self.disk.remove(key)

    # -- the disk writer -------------------------------------------------------------------
    def _ensure_writer(self) -> None:
        with self._lock:
            if self._writer is None:
                self._writer = threading.Thread(target=self._write_loop, name="kv-offload-writer", daemon=True)
                self._writer.start()

    def _write_loop(self) -> None:
        assert self.disk is not None
        while True:
            job = self._queue.get()
            try:
                if job is _STOP:
                    return
                if self.disk.writable and not self.disk.contains(job.key):
                    evicted = self.disk.write(job.key, job.tensor)
                    with self._lock:
                        if evicted:
                            self._events.append(BlockRemoved(block_hashes=evicted, medium="DISK"))
                        if self.disk.contains(job.key):
                            self._events.append(BlockStored(block_hashes=[job.key], parent_block_hash=job.parent,
                                                            token_ids=job.token_ids, block_size=self.chunk_size,
                                                            medium="DISK"))
            except Exception:  # noqa: BLE001 - the writer must outlive any one bad write
                logger.exception("KV offload: disk write failed")
            finally:
                if job is not _STOP:
                    with self._lock:
                        self._pending_bytes -= job.tensor.nbytes
                self._queue.task_done()

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until every queued disk write is done; False on timeout."""
        deadline = time.monotonic() + timeout_s
        while self._queue.unfinished_tasks:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.002)
        return True

    def close(self, timeout_s: float = 10.0) -> None:
        """Finish queued writes (up to timeout_s) and stop the writer."""
        if self._closed:
            return
        self._closed = True
        if self._writer is not None:
            self._queue.put(_STOP)
            self._writer.join(timeout_s)
            if self._writer.is_alive():
                logger.warning("KV offload: the disk writer did not stop within %.0f s", timeout_s)

    # -- observability ---------------------------------------------------------------------
    def make_stats(self) -> list[KVTierStats]:
        """A snapshot of both tiers' occupancy and cumulative counters."""
        tiers: list[Any] = [self.cpu] + ([self.disk] if self.disk is not None else [])
        with self._lock:
            return [KVTierStats(medium=t.medium, capacity_bytes=t.capacity_bytes, used_bytes=t.used_bytes,
                                num_chunks=len(t), hits=t.counters.hits, misses=t.counters.misses,
                                bytes_in=t.counters.bytes_in, bytes_out=t.counters.bytes_out,
                                evictions=t.counters.evictions, errors=t.counters.errors) for t in tiers]

    def take_events(self) -> list[KVCacheEvent]:
        with self._lock:
            events, self._events = self._events, []
        return events


# -- one store per (process, configuration), shared by the two connector roles ------------------
_shared_stores: dict[tuple[Any, ...], list[Any]] = {}
_shared_lock = threading.Lock()


def get_shared_store(key: tuple[Any, ...], create: Any) -> TieredKVStore:
    """The store for key (created by create() on first use); each call needs a release_shared_store()."""
    with _shared_lock:
        entry = _shared_stores.get(key)
        if entry is None:
            entry = _shared_stores[key] = [create(), 0]
        entry[1] += 1
        return entry[0]


def release_shared_store(key: tuple[Any, ...]) -> None:
    """Drop one reference; the last one closes the store."""
    with _shared_lock:
        entry = _shared_stores.get(key)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] > 0:
            return
        del _shared_stores[key]
    entry[0].close()


__all__ = ["CorruptChunkError", "TieredKVStore", "get_shared_store", "release_shared_store"]
