"""MessageQueue: a shared-memory ring buffer, one writer and N readers.

The executor broadcasts each SchedulerOutput to every worker through it, and each worker answers
through one of its own (one reader: the executor). Layout of the shared segment:

    [slot 0 data | slot 1 data | ... | slot S-1 data][slot 0 flags | ... | slot S-1 flags]
    slot data:  kind (u8: inline / overflow), num_frames (u32), frame lengths (u64 each), frames
    slot flags: written (u8), then one read flag (u8) per reader

Protocol. The writer owns slot i when it was never written or every reader has read it; it
clears `written`, writes the data, clears the read flags, sets `written`. Reader r may read
slot i when `written` is set and its own read flag is clear; it copies the frames out, then sets
its read flag. Writer and readers walk the slots in the same order, so a reader sees every
message once, in order (never skipped: the writer waits for it), and never a torn one (the
`written` flag is set only after the data, and cleared before the writer touches it again).
A message that does not fit a slot goes over a ZMQ XPUB/SUB pair; its slot then says
"overflow" and the reader takes the frames from its SUB socket, so ordering still follows
the slots. Nothing is pickled: the queue carries bytes (the callers encode with msgspec).

Lifetime. The writer creates the segment; wait_until_ready() returns once every reader has
attached and subscribed, and the writer then unlinks the segment's name at once: the mapping
stays valid in every process, and no /dev/shm entry outlives a crash (SIGKILL of anyone).
"""

from __future__ import annotations

import os
import struct
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing import resource_tracker, shared_memory
from typing import Any

import zmq

_INLINE, _OVERFLOW = 0, 1
_HEAD = struct.Struct("<BI")  # kind, num_frames
_LEN = struct.Struct("<Q")
# Waiting: spin (yielding the core) this long, then sleep a growing share of the wait so an
# idle reader costs almost no CPU on a shared machine: naps of at most _MAX_SLEEP_S, or of
# _IDLE_SLEEP_S once the wait has lasted _IDLE_AFTER_S (an idle engine; the first step after
# it starts at most that much later).
_SPIN_S = 2e-4
_MAX_SLEEP_S = 1e-3
_IDLE_AFTER_S = 1.0
_IDLE_SLEEP_S = 5e-3
_fence_lock = threading.Lock()


def _memory_fence() -> None:
    # A lock round trip is a full barrier on every platform CPython runs on: the data stores
    # of a slot become visible before its flag store (x86 keeps store order anyway; ARM does not).
    _fence_lock.acquire()
    _fence_lock.release()


@dataclass(frozen=True)
class Handle:
    """What a reader needs to attach (passed in process start-up arguments, never on a socket)."""

    shm_name: str
    num_readers: int
    num_slots: int
    max_chunk_bytes: int
    overflow_address: str


class MessageQueue:
    """A broadcast queue of byte frames from one writer to num_readers readers."""

    def __init__(self, num_readers: int, num_slots: int = 8, max_chunk_bytes: int = 1 << 20) -> None:
        """Create the queue as its writer (see create_reader for the readers' side)."""
        if num_readers < 1 or num_slots < 1 or max_chunk_bytes < _HEAD.size + _LEN.size:
            raise ValueError(f"bad queue geometry: {num_readers} readers, {num_slots} slots of {max_chunk_bytes} B")
        self.num_readers, self.num_slots, self.max_chunk_bytes = num_readers, num_slots, max_chunk_bytes
        self.is_writer = True
        self.reader_rank = -1
        self._flags_offset = num_slots * max_chunk_bytes
        self._shm = shared_memory.SharedMemory(create=True, size=self._flags_offset + num_slots * (1 + num_readers))
        assert self._shm.buf is not None
        self._buf: memoryview = self._shm.buf
        self._buf[self._flags_offset:] = bytes(num_slots * (1 + num_readers))
        self._unlinked = False
        self._context = zmq.Context()
        self._ipc_dir: str | None = tempfile.mkdtemp(prefix="lmc-mq-")
        self._socket = self._context.socket(zmq.XPUB)
        self._socket.setsockopt(zmq.XPUB_VERBOSE, 1)  # one subscription message per reader
        self._socket.setsockopt(zmq.SNDHWM, 0)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.bind(f"ipc://{self._ipc_dir}/overflow.sock")
        self._overflow_address = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self._current = 0
        self._closed = False
        self._all_read = bytes([1]) * num_readers

    @classmethod
    def create_reader(cls, handle: Handle, reader_rank: int) -> MessageQueue:
        """Attach to the writer's queue as reader `reader_rank` (0 <= rank < num_readers)."""
        if not 0 <= reader_rank < handle.num_readers:
            raise ValueError(f"reader_rank={reader_rank} is not in [0, {handle.num_readers})")
        self = cls.__new__(cls)
        self.num_readers, self.num_slots = handle.num_readers, handle.num_slots
        self.max_chunk_bytes = handle.max_chunk_bytes
        self.is_writer = False
        self.reader_rank = reader_rank
        self._flags_offset = handle.num_slots * handle.max_chunk_bytes
        self._shm = _attach(handle.shm_name)
        assert self._shm.buf is not None
        self._buf = self._shm.buf
        self._unlinked = True  # the writer's to unlink
        self._context = zmq.Context()
        self._ipc_dir = None
        self._socket = self._context.socket(zmq.SUB)
        self._socket.setsockopt(zmq.RCVHWM, 0)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.connect(handle.overflow_address)
        self._socket.setsockopt(zmq.SUBSCRIBE, b"")  # tells the writer this reader is attached
        self._overflow_address = handle.overflow_address
        self._current = 0
        self._closed = False
        self._all_read = bytes([1]) * handle.num_readers
        return self

    def export_handle(self) -> Handle:
        """The Handle readers attach with."""
        assert self.is_writer
        return Handle(self._shm.name, self.num_readers, self.num_slots, self.max_chunk_bytes, self._overflow_address)

    def wait_until_ready(self, timeout: float | None = None, cancel: Callable[[], bool] | None = None) -> None:
        """Writer: wait until every reader has attached and subscribed, then unlink the name.

        Raises TimeoutError after `timeout` seconds, or ConnectionAbortedError when cancel()
        says to stop waiting (a reader process died before it attached).
        """
        if not self.is_writer:
            return
        deadline = None if timeout is None else time.monotonic() + timeout
        num_subscribed = 0
        while num_subscribed < self.num_readers:
            if self._socket.poll(50):
                if self._socket.recv()[:1] == b"\x01":
                    num_subscribed += 1
            elif cancel is not None and cancel():
                raise ConnectionAbortedError("a reader of the message queue went away before it attached")
            elif deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"{num_subscribed} of {self.num_readers} readers attached in {timeout} s")
        self._unlink()

    # -- slots ---------------------------------------------------------------------------------
    def _flags(self, slot: int) -> int:
        return self._flags_offset + slot * (1 + self.num_readers)

    def _writable(self, flags: int) -> bool:
        buf = self._buf
        return buf[flags] == 0 or buf[flags + 1:flags + 1 + self.num_readers] == self._all_read

    def _readable(self, flags: int) -> bool:
        return self._buf[flags] == 1 and self._buf[flags + 1 + self.reader_rank] == 0

    def enqueue(self, frames: Sequence[Any], timeout: float | None = None,
                cancel: Callable[[], bool] | None = None) -> None:
        """Broadcast one message (a sequence of bytes-like frames) to every reader.

        Blocks while the next slot holds a message some reader has not read; raises
        TimeoutError after `timeout` s (0: do not wait) or ConnectionAbortedError if cancel().
        """
        assert self.is_writer and not self._closed
        views = [memoryview(f).cast("B") for f in frames]
        header = _HEAD.size + _LEN.size * len(views)
        total = header + sum(v.nbytes for v in views)
        slot = self._current
        flags = self._flags(slot)
        _wait(lambda: self._writable(flags), timeout, cancel)
        _memory_fence()
        buf = self._buf
        buf[flags] = 0  # the slot is being written: readers keep off
        _memory_fence()
        start = slot * self.max_chunk_bytes
        if total <= self.max_chunk_bytes:
            _HEAD.pack_into(buf, start, _INLINE, len(views))
            offset = start + _HEAD.size
            for view in views:
                _LEN.pack_into(buf, offset, view.nbytes)
                offset += _LEN.size
            for view in views:
                buf[offset:offset + view.nbytes] = view
                offset += view.nbytes
        else:
            _HEAD.pack_into(buf, start, _OVERFLOW, len(views))
            self._socket.send_multipart(views, copy=False)
        buf[flags + 1:flags + 1 + self.num_readers] = bytes(self.num_readers)
        _memory_fence()
        buf[flags] = 1
        self._current = (slot + 1) % self.num_slots

    def dequeue(self, timeout: float | None = None, cancel: Callable[[], bool] | None = None) -> list[bytes]:
        """The next message's frames (copied out of the segment). Blocks until one is written;
        raises TimeoutError after `timeout` s (0: do not wait) or ConnectionAbortedError if cancel()."""
        assert not self.is_writer and not self._closed
        slot = self._current
        flags = self._flags(slot)
        _wait(lambda: self._readable(flags), timeout, cancel)
        _memory_fence()
        buf = self._buf
        start = slot * self.max_chunk_bytes
        kind, num_frames = _HEAD.unpack_from(buf, start)
        if kind == _OVERFLOW:
            frames = self._socket.recv_multipart()
            assert len(frames) == num_frames, (len(frames), num_frames)
        else:
            offset = start + _HEAD.size
            lengths = [_LEN.unpack_from(buf, offset + i * _LEN.size)[0] for i in range(num_frames)]
            offset += _LEN.size * num_frames
            frames = []
            for length in lengths:
                frames.append(bytes(buf[offset:offset + length]))
                offset += length
        _memory_fence()
        buf[flags + 1 + self.reader_rank] = 1  # the writer may take the slot once all have read
        self._current = (slot + 1) % self.num_slots
        return frames

    # -- lifetime ------------------------------------------------------------------------------
    def _unlink(self) -> None:
        if not self._unlinked:
            self._unlinked = True
            try:
                self._shm.unlink()
            except FileNotFoundError:
                pass

    def close(self) -> None:
        """Release the mapping and sockets; the writer also unlinks the segment (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self._unlink()
        self._buf.release()
        try:
            self._shm.close()
        except BufferError:
            pass  # a frame view still alive; the mapping goes with the process
        self._socket.close(linger=0)
        self._context.term()
        if self._ipc_dir is not None:
            import shutil

            shutil.rmtree(self._ipc_dir, ignore_errors=True)

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


def _wait(ready: Callable[[], bool], timeout: float | None, cancel: Callable[[], bool] | None) -> None:
    """Return once ready(); spin briefly, then nap; TimeoutError / ConnectionAbortedError."""
    if ready():
        return
    start = time.monotonic()
    while True:
        if ready():
            return
        elapsed = time.monotonic() - start
        if timeout is not None and elapsed >= timeout:
            raise TimeoutError(f"the message queue was not ready within {timeout} s")
        if cancel is not None and cancel():
            raise ConnectionAbortedError("stopped waiting on the message queue")
        if elapsed < _SPIN_S:
            os.sched_yield()
        elif elapsed < _IDLE_AFTER_S:
            time.sleep(min(elapsed * 0.05, _MAX_SLEEP_S))
        else:
            time.sleep(_IDLE_SLEEP_S)


_attach_lock = threading.Lock()


def _attach(name: str) -> shared_memory.SharedMemory:
    """Open an existing segment without handing it to this process's resource tracker.

    Before Python 3.13 attaching registers the segment too (bpo-38119), so the reader's tracker
    would unlink the writer's segment when the reader exits, or warn about a "leak". Only the
    writer owns the name.
    """
    if sys.version_info >= (3, 13):
        return shared_memory.SharedMemory(name=name, track=False)  # type: ignore[call-arg]
    with _attach_lock:
        register = resource_tracker.register
        resource_tracker.register = lambda *args, **kwargs: None  # type: ignore[assignment]
        try:
            return shared_memory.SharedMemory(name=name)
        finally:
            resource_tracker.register = register  # type: ignore[assignment]
