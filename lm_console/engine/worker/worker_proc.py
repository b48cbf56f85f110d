"""The worker process of a MultiprocExecutor: start-up handshake and busy loop.

Start-up: attach to the executor's broadcast MessageQueue as reader `rank`, create this rank's
response MessageQueue, send ReadyInfo on the ready pipe, wait for the executor to attach.
Busy loop: dequeue a call, run it on the Worker, answer if this rank is asked to. A failure in
a call this rank does not answer (execute_model on a non-output rank) cannot be reported, and
the other ranks may already wait in a collective for this one: the process exits, and the
executor's monitor turns the death into EngineDeadError.

The process exits when its parent (the engine core) dies: a thread blocks on the death pipe,
whose write end only the parent holds, and ends the process when it closes. No orphan stays.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import traceback
from dataclasses import astuple
from multiprocessing.connection import Connection
from typing import Any

import msgspec

from lm_console.engine.config.engine_config import EngineConfig
from lm_console.engine.distributed.message_queue import Handle, MessageQueue
from lm_console.engine.process_flags import enter_engine_process
from lm_console.engine.worker.rpc_protocol import (
    ALL_RANKS, ExecuteModelCall, ReadyInfo, RPCReply, SampleReply, ShutdownCall, WorkerCodec,
    resolve_method,
)

logger = logging.getLogger(__name__)

RESPONSE_SLOTS = 4
RESPONSE_CHUNK_BYTES = 1 << 20


def run_worker_process(config: EngineConfig, rank: int, local_rank: int, distributed_init_method: str | None,
                       broadcast_handle: Handle, ready_writer: Connection, death_reader: Connection) -> None:
    """Entry point of one worker process."""
    enter_engine_process()  # started daemonic, yet may start children: see process_flags
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the frontend's to handle
    signal.signal(signal.SIGTERM, _raise_system_exit)
    threading.Thread(target=_exit_when_parent_dies, args=(death_reader,), name="WorkerDeathWatch",
                     daemon=True).start()
    broadcast: MessageQueue | None = None
    response: MessageQueue | None = None
    try:
        from lm_console.engine.worker.worker import Worker

        broadcast = MessageQueue.create_reader(broadcast_handle, rank)
        response = MessageQueue(1, RESPONSE_SLOTS, RESPONSE_CHUNK_BYTES)
        worker = Worker(config, rank=rank, local_rank=local_rank,
                        distributed_init_method=distributed_init_method, is_driver_worker=rank == 0)
        ready_writer.send_bytes(msgspec.msgpack.encode(
            ReadyInfo(rank, os.getpid(), list(astuple(response.export_handle())))))
        response.wait_until_ready(timeout=300)
    except BaseException as error:  # noqa: BLE001 - the executor must hear why
        ready_writer.send_bytes(msgspec.msgpack.encode(
            ReadyInfo(rank, os.getpid(), failure=f"{type(error).__name__}: {error}\n{traceback.format_exc()}")))
        raise
    finally:
        ready_writer.close()
    try:
        WorkerBusyLoop(worker, rank, broadcast, response).run()
    finally:
        worker.shutdown()
        broadcast.close()
        response.close()


class WorkerBusyLoop:
    """Dequeue a call, run it on the worker, reply when asked (one call at a time, in order)."""

    def __init__(self, worker: Any, rank: int, broadcast: MessageQueue, response: MessageQueue) -> None:
        self.worker, self.rank = worker, rank
        self.broadcast, self.response = broadcast, response
        self.codec = WorkerCodec()

    def run(self) -> None:
        while True:
            call = self.codec.decode_call(self.broadcast.dequeue())
            if isinstance(call, ShutdownCall):
                return
            replies = call.reply_rank in (ALL_RANKS, self.rank)
            try:
                if isinstance(call, ExecuteModelCall):
                    self.worker.execute_model(call.scheduler_output)
                    reply: Any = RPCReply(call.call_id, self.rank)
                elif call.method == "sample_tokens":
                    reply = SampleReply(call.call_id, self.rank, self.worker.sample_tokens())
                else:
                    result = resolve_method(self.worker, call.method)(*call.args, **call.kwargs)
                    reply = RPCReply(call.call_id, self.rank, msgspec.Raw(msgspec.msgpack.encode(result)))
            except Exception as error:  # noqa: BLE001 - answered, or fatal below
                if not replies:
                    logger.exception("Worker rank %d failed a call it cannot answer; it exits.", self.rank)
                    raise
                method = "execute_model" if isinstance(call, ExecuteModelCall) else call.method
                reply = RPCReply(call.call_id, self.rank,
                                 failure=f"{method} on rank {self.rank}: {type(error).__name__}: {error}")
            if replies:
                self.response.enqueue(self.codec.encode(reply))


def _exit_when_parent_dies(death_reader: Connection) -> None:
    try:
        death_reader.recv_bytes()
    except (EOFError, OSError):
        pass
    # The parent is gone (or closed the pipe at shutdown, after which we are stopping anyway).
    os._exit(0)


def _raise_system_exit(signum: int, frame: Any) -> None:
    raise SystemExit(0)

