"""MessageQueue: the shared-memory ring buffer's protocol, checked against a model and across processes."""

from __future__ import annotations

import multiprocessing
import os
import signal

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from lm_console.engine.distributed.message_queue import Handle, MessageQueue

pytestmark = pytest.mark.slow

CHUNK = 96  # small slots, so messages of a few dozen bytes already overflow to ZMQ


def _shm_entries() -> set[str]:
    return set(os.listdir("/dev/shm"))


class RingBufferMachine(RuleBasedStateMachine):
    """The queue against a model: reader r's backlog is the messages written since it last read.

    The writer may write iff no reader's backlog is num_slots (the next slot would be unread by
    it); a read returns the reader's oldest unread message, whole and unchanged.
    """

    def __init__(self) -> None:
        super().__init__()
        self.num_readers, self.num_slots = 2, 3
        self.writer = MessageQueue(self.num_readers, self.num_slots, CHUNK)
        self.readers = [MessageQueue.create_reader(self.writer.export_handle(), r) for r in range(self.num_readers)]
        self.writer.wait_until_ready(timeout=10)
        self.backlogs: list[list[list[bytes]]] = [[] for _ in range(self.num_readers)]
        self.sequence = 0

    @rule(sizes=st.lists(st.integers(0, 3 * CHUNK), min_size=0, max_size=3))
    def write(self, sizes: list[int]) -> None:
        self.sequence += 1
        frames = [bytes((self.sequence + i + j) % 256 for j in range(size)) for i, size in enumerate(sizes)]
        frames.insert(0, self.sequence.to_bytes(4, "little"))  # the sequence number says which message it is
        can_write = all(len(backlog) < self.num_slots for backlog in self.backlogs)
        if can_write:
            self.writer.enqueue(frames, timeout=0)
            for backlog in self.backlogs:
                backlog.append(frames)
        else:
            with pytest.raises(TimeoutError):  # the writer never overwrites an unread slot
                self.writer.enqueue(frames, timeout=0)

    @rule(reader=st.integers(0, 1))
    def read(self, reader: int) -> None:
        backlog = self.backlogs[reader]
        if backlog:
            assert self.readers[reader].dequeue(timeout=1) == backlog.pop(0)  # whole, in order, none skipped
        else:
            with pytest.raises(TimeoutError):
                self.readers[reader].dequeue(timeout=0)

    @precondition(lambda self: True)
    @invariant()
    def backlogs_bounded(self) -> None:
        assert all(len(backlog) <= self.num_slots for backlog in self.backlogs)

    def teardown(self) -> None:
        for reader in self.readers:
            reader.close()
        self.writer.close()


TestRingBuffer = RingBufferMachine.TestCase
TestRingBuffer.settings = settings(max_examples=30, stateful_step_count=40, deadline=None,
                                   suppress_health_check=[HealthCheck.too_slow])


def test_segment_unlinked_once_readers_attach_and_geometry_checked() -> None:
    writer = MessageQueue(1, 2, CHUNK)
    name = writer.export_handle().shm_name
    assert name in _shm_entries()
    reader = MessageQueue.create_reader(writer.export_handle(), 0)
    writer.wait_until_ready(timeout=10)
    assert name not in _shm_entries()  # no name left for a crash to leak
    writer.enqueue([b"still mapped"])
    assert reader.dequeue(timeout=1) == [b"still mapped"]
    reader.close()
    writer.close()
    with pytest.raises(ValueError, match="reader_rank"):
        MessageQueue.create_reader(writer.export_handle(), 1)


def _read_all(handle: Handle, rank: int, count: int, conn: multiprocessing.connection.Connection) -> None:
    queue = MessageQueue.create_reader(handle, rank)
    received = [queue.dequeue(timeout=30) for _ in range(count)]
    conn.send_bytes(b"".join(b"".join(frames) for frames in received))
    queue.close()


def _attach_and_hang(handle: Handle, rank: int) -> None:
    queue = MessageQueue.create_reader(handle, rank)
    signal.pause()
    queue.close()


def test_two_reader_processes_receive_every_message_in_order() -> None:
    context = multiprocessing.get_context("spawn")
    before = _shm_entries()
    writer = MessageQueue(2, 4, 256)
    messages = [[i.to_bytes(4, "little"), bytes([i % 256]) * (i * 37 % 700)] for i in range(200)]
    pipes, procs = [], []
    for rank in range(2):
        recv_end, send_end = context.Pipe(duplex=False)
        proc = context.Process(target=_read_all, args=(writer.export_handle(), rank, len(messages), send_end))
        proc.start()
        pipes.append(recv_end)
        procs.append(proc)
    writer.wait_until_ready(timeout=60)
    for frames in messages:
        writer.enqueue(frames, timeout=30)
    expected = b"".join(b"".join(frames) for frames in messages)
    for recv_end, proc in zip(pipes, procs):
        assert recv_end.poll(60)
        assert recv_end.recv_bytes() == expected
        proc.join(30)
    writer.close()
    assert _shm_entries() <= before


def test_reader_killed_leaves_no_segment_and_writer_blocks_not_overwrites() -> None:
    context = multiprocessing.get_context("spawn")
    before = _shm_entries()
    writer = MessageQueue(1, 2, CHUNK)
    proc = context.Process(target=_attach_and_hang, args=(writer.export_handle(), 0))
    proc.start()
    writer.wait_until_ready(timeout=60, cancel=lambda: not proc.is_alive())
    os.kill(proc.pid, signal.SIGKILL)
    proc.join(10)
    writer.enqueue([b"a"], timeout=0)
    writer.enqueue([b"b"], timeout=0)
    with pytest.raises(ConnectionAbortedError):  # the dead reader never frees a slot; cancel() ends the wait
        writer.enqueue([b"c"], cancel=lambda: not proc.is_alive())
    writer.close()
    assert _shm_entries() <= before
