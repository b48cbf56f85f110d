"""DiskTier: chunk files in a directory under a byte limit; shareable by processes and restarts.

One file per chunk, named by its key, written atomically (temporary file, then rename), so a
reader in another process sees a whole file or none. Least recently used files (by mtime, which
a hit refreshes) are deleted first. A disk that fills up or cannot be written turns storing off
with one warning; loads keep working.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import OrderedDict
from pathlib import Path

import torch

from lm_console.engine.distributed.kv_transfer.offload.chunk_codec import CorruptChunkError, encode_header, read_chunk
from lm_console.engine.distributed.kv_transfer.offload.counters import TierCounters

logger = logging.getLogger(__name__)

_SUFFIX = ".kvchunk"


class DiskTier:
    """chunk key -> file `<dir>/<key hex>.kvchunk`, thread-safe.

    Invariant: the index holds the files this process knows (scanned at start, written, or found
    by a lookup); used_bytes is their total size. Another process's deletions show up as misses
    or failed reads, never as wrong data (the header names the key and carries a checksum).
    """

    medium = "DISK"

    def __init__(self, path: str | os.PathLike[str], capacity_bytes: int) -> None:
        self.path = Path(path)
        self.capacity_bytes = capacity_bytes
        self.counters = TierCounters()
        self.writable = True
        self._warned = False
        self._lock = threading.Lock()
        self._index: OrderedDict[bytes, int] = OrderedDict()
        self.used_bytes = 0
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            files = sorted(self.path.glob("*" + _SUFFIX), key=lambda p: p.stat().st_mtime)
            for file in files:
                self._index[bytes.fromhex(file.name.removesuffix(_SUFFIX))] = file.stat().st_size
                self.used_bytes += file.stat().st_size
        except (OSError, ValueError) as exc:
            self._disable(f"cannot use disk tier directory {self.path}: {exc}")
        if self.writable and not os.access(self.path, os.W_OK):
            self._disable(f"disk tier directory {self.path} is not writable")

    def _file(self, key: bytes) -> Path:
        return self.path / (key.hex() + _SUFFIX)

    def _disable(self, reason: str) -> None:
        self.writable = False
        if not self._warned:
            self._warned = True
            logger.warning("KV offload: %s; chunks will not be stored on disk (serving continues).", reason)

    def __len__(self) -> int:
        return len(self._index)

    def contains(self, key: bytes) -> bool:
        """Whether the chunk is on disk (possibly written by another process)."""
        with self._lock:
            if key in self._index:
                return True
        try:
            size = self._file(key).stat().st_size
        except OSError:
            return False
        with self._lock:
            if key not in self._index:
                self._index[key] = size
                self.used_bytes += size
        return True

    def read(self, key: bytes, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor | None:
        """The chunk, or None when absent; CorruptChunkError (and the file deleted) when it fails its checks."""
        file = self._file(key)
        try:
            f = open(file, "rb")
        except OSError:
            self._forget(key)
            return None
        try:
            with f:
                # the header and the file's size are checked before the payload is read, so a
                # huge or sparse file costs no memory (chunk_codec.read_chunk)
                tensor, num_read = read_chunk(f, os.fstat(f.fileno()).st_size, key, dtype, shape)
        except OSError:
            self._forget(key)
            return None
        except CorruptChunkError:
            with self._lock:
                self.counters.errors += 1
            self.remove(key)
            raise
        try:
            os.utime(file)  # a hit refreshes the file's place in the shared LRU order
        except OSError:
            pass
        with self._lock:
            self.counters.bytes_out += num_read
            if key in self._index:
                self._index.move_to_end(key)
        return tensor

    def write(self, key: bytes, tensor: torch.Tensor) -> list[bytes]:
        """Store the chunk atomically, evicting LRU files to fit; returns the evicted keys."""
        if not self.writable:
            return []
        header, payload = encode_header(key, tensor)
        size = len(header) + payload.nbytes
        if size > self.capacity_bytes:
            return []
        evicted = self._make_room(size)
        tmp = self.path / f".{key.hex()}.{os.getpid()}.{threading.get_ident()}.tmp"
        try:
            with open(tmp, "wb") as f:
                f.write(header)
                f.write(payload)
            os.replace(tmp, self._file(key))
        except OSError as exc:
            try:
                tmp.unlink(missing_ok=True)
            except OSError:
                pass
            with self._lock:
                self.counters.errors += 1
            self._disable(f"writing {self._file(key).name} failed ({exc})")
            return evicted
        with self._lock:
            if key not in self._index:
                self.used_bytes += size
            self._index[key] = size
            self._index.move_to_end(key)
            self.counters.bytes_in += size
        return evicted

    def _make_room(self, size: int) -> list[bytes]:
        evicted: list[bytes] = []
        while True:
            with self._lock:
                if self.used_bytes + size <= self.capacity_bytes or not self._index:
                    return evicted
                victim, _ = next(iter(self._index.items()))
            self.remove(victim)
            with self._lock:
                self.counters.evictions += 1
            evicted.append(victim)

    def remove(self, key: bytes) -> None:
        """Delete the chunk's file (another process may already have)."""
        try:
            self._file(key).unlink(missing_ok=True)
        except OSError:
            pass
        self._forget(key)

    def _forget(self, key: bytes) -> None:
        with self._lock:
            size = self._index.pop(key, None)
            if size is not None:
                self.used_bytes -= size
