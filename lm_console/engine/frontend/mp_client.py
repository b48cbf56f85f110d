"""SyncMPClient and AsyncMPClient: the engine core in its own process.

The frontend binds a ROUTER (requests, aborts, utility calls; the core's handshake) and a PULL
(outputs). A background thread polls the PULL socket and the process sentinel, decodes each
EngineCoreOutputs, resolves utility calls and queues the rest; when the core dies every pending
and later call raises EngineDeadError at once. The thread holds no reference to the client,
so an unreferenced client is shut down by its finalizer.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import itertools
import logging
import queue
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import msgspec
import zmq

from lm_console.engine.config.engine_args import EngineArgs
from lm_console.engine.errors import EngineDeadError, EngineError, EngineUnresponsiveError, fresh_error
from lm_console.engine.frontend.core_client import EngineCoreClient
from lm_console.engine.frontend.engine_process import EngineProcess
from lm_console.engine.ipc import MsgpackDecoder, MsgpackEncoder
from lm_console.engine.metrics.stats import BlockPoolState, RequestBlocksState, SchedulerStats
from lm_console.engine.protocol import EngineCoreOutputs, EngineCoreRequest, EngineCoreRequestType, UtilityCall, UtilityOutput

logger = logging.getLogger(__name__)

_UTILITY_RESULT_TYPES: dict[str, Any] = {
    "get_stats": SchedulerStats, "get_block_pool_state": BlockPoolState, "get_request_blocks": RequestBlocksState,
    "get_prefix_cache_hashes": list[bytes], "reset_prefix_cache": bool,
    "sleep": bool, "wake_up": bool, "is_sleeping": bool,
}


class OutputSink:
    """Where the reader thread puts outputs; owns the pending utility calls and the dead state."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.pending_calls: dict[int, tuple[concurrent.futures.Future, Any]] = {}
        self.dead_error: EngineDeadError | None = None
        self.errored = False  # died unexpectedly (not shut down)

    def deliver(self, item: EngineCoreOutputs | BaseException) -> None:
        raise NotImplementedError

    def on_message(self, outputs: EngineCoreOutputs) -> None:
        """Route one decoded message (reader thread); a heartbeat (nothing in it) stops here."""
        if outputs.engine_dead_reason is not None:
            self.on_dead(EngineDeadError(f"The engine core failed: {outputs.engine_dead_reason}"))
            return
        if outputs.utility_output is not None:
            self._resolve_call(outputs.utility_output)
        if outputs.outputs or outputs.scheduler_stats or outputs.kv_events or outputs.finished_requests:
            self.deliver(outputs)

    def _resolve_call(self, utility: UtilityOutput) -> None:
        """Answer a pending utility call; a late answer (the caller gave up) is dropped quietly."""
        with self.lock:
            future, result_type = self.pending_calls.pop(utility.call_id, (None, None))
        if future is None or future.done():
            return
        try:
            if utility.failure_message is not None:
                future.set_exception(EngineError(f"utility call failed: {utility.failure_message}"))
            else:
                future.set_result(msgspec.msgpack.decode(utility.result, type=result_type))
        except msgspec.DecodeError as error:  # a result of the wrong shape: the caller learns why
            future.set_exception(EngineError(f"utility call answered with an undecodable result: {error}"))
        except concurrent.futures.InvalidStateError:
            pass  # cancelled between the check and the answer

    def on_dead(self, error: EngineDeadError, unexpected: bool = True) -> None:
        """Fail every pending call and wake every waiter (idempotent)."""
        with self.lock:
            if self.dead_error is not None:
                return
            self.dead_error = error
            self.errored = unexpected
            calls, self.pending_calls = self.pending_calls, {}
        for future, _ in calls.values():
            future.set_exception(fresh_error(error))
        self.deliver(error)


class SinkStateMixin:
    """The state of a client whose cores report to one OutputSink, and its shutdown (MPClient, DPClient)."""

    sink: OutputSink
    _finalizer: weakref.finalize

    def _check_alive(self) -> None:
        """Raise (a fresh copy of) the error the core died with, if it died."""
        if self.sink.dead_error is not None:
            raise fresh_error(self.sink.dead_error)

    @property
    def errored(self) -> bool:
        """True once the core died unexpectedly."""
        return self.sink.errored

    @property
    def dead_error(self) -> EngineDeadError | None:
        return self.sink.dead_error

    def shutdown(self) -> None:
        """Stop the core process(es) and release sockets (idempotent, any thread)."""
        self._finalizer()


class MPClient(SinkStateMixin, EngineCoreClient):
    """Starts the core process, sends inputs, and reads outputs on a background thread."""

    def __init__(self, engine_args: EngineArgs, sink: OutputSink, client_index: int = 0,
                 while_starting: Callable[[], None] | None = None, launched: EngineProcess | None = None) -> None:
        """launched: a core process already started with EngineProcess.launch() (data parallelism)."""
        self.sink = sink
        self.client_index = client_index
        self.encoder = MsgpackEncoder()
        self._call_ids = itertools.count()
        self.resources = launched if launched is not None else EngineProcess(engine_args)
        # From here on the finalizer owns the process; it runs at shutdown(), GC or exit.
        self._finalizer = weakref.finalize(self, self.resources.close, sink)
        try:
            if launched is None:
                self.ready_info = self.resources.start(while_starting)
            else:
                self.ready_info = self.resources.wait_for_ready()
        except BaseException:
            self._finalizer()
            raise
        self.proc = self.resources.proc
        self._reader = threading.Thread(target=_read_outputs,
                                        args=(self.resources, sink, engine_args.liveness_timeout_s),
                                        name="EngineCoreOutputReader", daemon=True)
        self.resources.reader_thread = self._reader
        self._reader.start()

    # -- inputs -----------------------------------------------------------------------------
    def _send(self, request_type: EngineCoreRequestType, obj: Any) -> None:
        self._check_alive()
        self.resources.send(request_type, obj, self.encoder)

    def add_request(self, request: EngineCoreRequest) -> None:
        self.add_requests([request])

    def add_requests(self, requests: list[EngineCoreRequest]) -> None:
        """Send requests in one message: the core admits them all before its next step."""
        for request in requests:
            request.client_index = self.client_index
        self._send(EngineCoreRequestType.ADD, requests)

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids:
            self._send(EngineCoreRequestType.ABORT, list(request_ids))

    def call_utility_future(self, method: str, *args: Any) -> concurrent.futures.Future:
        """Send a utility call; the future resolves when the core answers (or dies)."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        call_id = next(self._call_ids)
        with self.sink.lock:
            if self.sink.dead_error is not None:
                raise fresh_error(self.sink.dead_error)
            self.sink.pending_calls[call_id] = (future, _UTILITY_RESULT_TYPES.get(method, Any))
        try:
            self._send(EngineCoreRequestType.UTILITY, UtilityCall(call_id, self.client_index, method, list(args)))
        except BaseException:
            with self.sink.lock:
                self.sink.pending_calls.pop(call_id, None)
            raise
        return future

    def call_utility(self, method: str, *args: Any) -> Any:
        return self.call_utility_future(method, *args).result()


class _SyncSink(OutputSink):
    def __init__(self) -> None:
        super().__init__()
        self.queue: queue.Queue = queue.Queue()

    def deliver(self, item: EngineCoreOutputs | BaseException) -> None:
        self.queue.put_nowait(item)


class SyncMPClient(MPClient):
    """The multiprocess client of the synchronous LLM: get_output() blocks on a queue."""

    def __init__(self, engine_args: EngineArgs, client_index: int = 0,
                 while_starting: Callable[[], None] | None = None) -> None:
        super().__init__(engine_args, _SyncSink(), client_index, while_starting)

    def get_output(self) -> EngineCoreOutputs:
        item = self.sink.queue.get()
        if isinstance(item, BaseException):
            self.sink.queue.put_nowait(item)  # every later call fails fast too
            raise fresh_error(item)
        return item


class _AsyncSink(OutputSink):
    """A thread-safe deque plus an asyncio.Event on the consumer's loop."""

    def __init__(self) -> None:
        super().__init__()
        self.items: collections.deque = collections.deque()
        self.loop: asyncio.AbstractEventLoop | None = None
        self.ready: asyncio.Event | None = None

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        if self.loop is not loop:
            self.loop, self.ready = loop, asyncio.Event()
            self.ready.set()  # items may have arrived while no loop was bound

    def deliver(self, item: EngineCoreOutputs | BaseException) -> None:
        self.items.append(item)
        loop, ready = self.loop, self.ready
        if loop is not None and ready is not None:
            try:
                loop.call_soon_threadsafe(ready.set)
            except RuntimeError:
                pass  # the loop is closed; the next bind() picks the item up


class AsyncMPClient(MPClient):
    """The multiprocess client of AsyncLLM: awaitable outputs and utility calls."""

    def __init__(self, engine_args: EngineArgs, client_index: int = 0,
                 while_starting: Callable[[], None] | None = None) -> None:
        super().__init__(engine_args, _AsyncSink(), client_index, while_starting)

    async def get_output_async(self) -> EngineCoreOutputs:
        sink = self.sink
        sink.bind(asyncio.get_running_loop())
        while True:
            if sink.items:
                item = sink.items[0]
                if isinstance(item, BaseException):
                    raise fresh_error(item)  # left in place: every later call fails fast too
                return sink.items.popleft()
            sink.ready.clear()
            if not sink.items:
                await sink.ready.wait()

    async def call_utility_async(self, method: str, *args: Any) -> Any:
        return await asyncio.wrap_future(self.call_utility_future(method, *args))

    def get_output(self) -> EngineCoreOutputs:
        raise NotImplementedError("AsyncMPClient: use get_output_async()")


def _read_outputs(resources: EngineProcess, sink: OutputSink, liveness_timeout_s: float | None = None) -> None:
    """Reader thread: decode outputs until the core exits, goes silent, or the client shuts down.

    Every message counts as a sign of life (the core sends heartbeats while idle or busy); none
    for liveness_timeout_s marks the engine dead with EngineUnresponsiveError.
    """
    decoder = MsgpackDecoder(EngineCoreOutputs)
    socket = resources.output_socket
    poller = zmq.Poller()
    poller.register(socket, zmq.POLLIN)
    poller.register(resources.proc.sentinel, zmq.POLLIN)
    poller.register(resources.wake_r, zmq.POLLIN)
    last_heard = time.monotonic()

    def drain() -> None:
        nonlocal last_heard
        while True:
            try:
                frames = socket.recv_multipart(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            last_heard = time.monotonic()
            try:
                sink.on_message(decoder.decode(frames))
            except Exception:  # noqa: BLE001 - a bad message must not kill the reader
                logger.exception("Dropped an undecodable message from the engine core")

    try:
        while True:
            timeout_ms = None
            if liveness_timeout_s is not None:
                timeout_ms = max((last_heard + liveness_timeout_s - time.monotonic()) * 1000, 0)
            events = dict(poller.poll(timeout_ms))
            if socket in events:
                drain()
            if resources.wake_r in events:
                return
            if resources.proc.sentinel in events:
                if socket.poll(50):  # outputs sent just before the exit
                    drain()
                if not resources.closing:
                    sink.on_dead(EngineDeadError(resources.exit_description()))
                return
            if liveness_timeout_s is not None and time.monotonic() - last_heard >= liveness_timeout_s:
                if socket.poll(0):
                    continue  # it spoke just now
                if not resources.closing:
                    sink.on_dead(EngineUnresponsiveError(
                        f"The engine core process (pid {resources.proc.pid}) has been unresponsive for "
                        f"{time.monotonic() - last_heard:.1f} s (no heartbeat; liveness_timeout_s="
                        f"{liveness_timeout_s:g}): it is stopped or hung. Shut the engine down and start a new one."))
                return
    finally:
        if resources.closing:
            sink.on_dead(EngineDeadError("The engine was shut down."), unexpected=False)


__all__ = ["AsyncMPClient", "MPClient", "OutputSink", "SyncMPClient"]
