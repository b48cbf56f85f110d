"""MultiprocExecutor: one worker process per tensor-parallel rank (after vLLM's vllm/v1/executor/multiproc_executor.py).

Calls go to every worker at once through one shared-memory MessageQueue (the executor writes,
each rank reads); answers come back through each rank's own response MessageQueue, and only
from the ranks a call asks (execute_model: none; sample_tokens: the output rank, 0). The
workers start with forkserver (one server imports torch and the engine once, each rank forks
from it) or spawn ($LMC_WORKER_START_METHOD), never plain fork: the core may hold CUDA state.

Death. A monitor thread waits on every worker's process sentinel. When one dies while the
executor is not shutting down, the executor is failed: every wait on a queue stops with
EngineDeadError at once, and the failure callback (the engine-core process sends
engine_dead_reason to its clients) runs. The workers watch a death pipe from this process, so
they exit with it; shutdown() stops them (ShutdownCall, then SIGTERM, then SIGKILL).
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import signal
import socket
import sys
import threading
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from multiprocessing.connection import wait as wait_for_objects
from typing import TYPE_CHECKING, Any

import msgspec

from lm_console.engine import envs
from lm_console.engine.distributed.message_queue import Handle, MessageQueue
from lm_console.engine.errors import EngineDeadError, EngineStartupError, InvalidEngineArgsError
from lm_console.engine.executor.abstract import Executor
from lm_console.engine.kv_cache_interface import FullAttentionSpec, KVCacheSpec, SlidingWindowSpec
from lm_console.engine.malloc_tuning import huge_page_heap
from lm_console.engine.process_flags import children_allowed, in_engine_process
from lm_console.engine.worker.rpc_protocol import (
    ALL_RANKS, ExecuteModelCall, ReadyInfo, RPCCall, SampleReply, ShutdownCall, WorkerCodec,
    method_name,
)

if TYPE_CHECKING:
    from lm_console.engine.model_runner_output import ModelRunnerOutput
    from lm_console.engine.scheduler_output import SchedulerOutput

logger = logging.getLogger(__name__)

BROADCAST_SLOTS = 8
BROADCAST_CHUNK_BYTES = 4 << 20  # a SchedulerOutput is KBs; an image's pixels overflow to ZMQ
STARTUP_TIMEOUT_S = envs.LMC_ENGINE_STARTUP_TIMEOUT.as_float()
SHUTDOWN_TIMEOUT_S = 5.0
# Imported once by the forkserver, so every rank starts in a fraction of a second (the
# transformers config machinery alone takes seconds: every rank reads the model's config).
_FORKSERVER_PRELOAD = ["lm_console.engine.worker.worker_proc", "lm_console.engine.worker.worker",
                       "transformers.models.auto.configuration_auto",
                       "transformers.models.llama.configuration_llama"]


class MultiprocExecutor(Executor):
    """collective_rpc over tensor_parallel_size worker processes; rank 0 is the output rank."""

    output_rank = 0

    def _init_executor(self) -> None:
        parallel = self.config.parallel_config
        if self.config.kv_transfer_config is not None or self.config.ec_transfer_config is not None:
            raise InvalidEngineArgsError(
                "kv_transfer_config / ec_transfer_config run with distributed_executor_backend='uni' only "
                "(their connector metadata does not cross to worker processes yet).")
        self.world_size = parallel.tensor_parallel_size
        self.codec = WorkerCodec()
        self.is_failed = False
        self.failure_reason: str | None = None
        self._failure_callbacks: list[Callable[[str], None]] = []
        self._shutting_down = False
        self._call_id = 0
        # One thread talks to the queues at a time; replies come back in call order, so
        # non-blocking sample_tokens calls wait in _pending until a result is asked for.
        self._lock = threading.RLock()
        self._pending: deque[tuple[int, _ReplyFuture]] = deque()
        self.procs: list[Any] = []
        self._own_forkserver: int | None = None  # the worker forkserver's pid, when ours to stop
        self.response_mqs: list[MessageQueue] = []
        self._death_writers: list[Any] = []
        self.broadcast_mq = MessageQueue(self.world_size, BROADCAST_SLOTS, BROADCAST_CHUNK_BYTES)
        try:
            self._start_workers()
        except BaseException:
            self.shutdown()
            raise
        self._monitor = threading.Thread(target=self._monitor_workers, name="MultiprocWorkerMonitor", daemon=True)
        self._monitor.start()
        self.collective_rpc("init_device")
        self.collective_rpc("load_model")

    # -- start-up ------------------------------------------------------------------------------
    def _start_workers(self) -> None:
        from lm_console.engine.worker.worker_proc import run_worker_process

        context = _worker_context()
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        ready_readers = []
        forkserver_before = _forkserver_pid() if context.get_start_method() == "forkserver" else -1
        for rank in range(self.world_size):
            ready_reader, ready_writer = context.Pipe(duplex=False)
            death_reader, death_writer = context.Pipe(duplex=False)
            proc = context.Process(
                target=run_worker_process, name=f"Worker_TP{rank}", daemon=True,
                args=(self.config, rank, rank, init_method, self.broadcast_mq.export_handle(),
                      ready_writer, death_reader))
            with _children_allowed(), huge_page_heap():
                proc.start()
            ready_writer.close()
            death_reader.close()
            self.procs.append(proc)
            self._death_writers.append(death_writer)
            ready_readers.append(ready_reader)
            if rank == 0 and forkserver_before is None and in_engine_process():
                self._own_forkserver = _forkserver_pid()  # launched by this start: ours to stop
        for rank, (proc, ready_reader) in enumerate(zip(self.procs, ready_readers)):
            ready = wait_for_objects([ready_reader, proc.sentinel], STARTUP_TIMEOUT_S)
            if ready_reader not in ready or not ready_reader.poll(0):
                raise EngineStartupError(f"Worker rank {rank} exited (code {proc.exitcode}) before it was ready.")
            info = msgspec.msgpack.decode(ready_reader.recv_bytes(), type=ReadyInfo)
            ready_reader.close()
            if info.failure is not None:
                raise EngineStartupError(f"Worker rank {rank} failed to start: {info.failure}")
            assert info.response_handle is not None
            self.response_mqs.append(MessageQueue.create_reader(Handle(*info.response_handle), 0))
        self.broadcast_mq.wait_until_ready(STARTUP_TIMEOUT_S, cancel=self._any_worker_dead)

    def _any_worker_dead(self) -> bool:
        return any(not proc.is_alive() for proc in self.procs)

    # -- death ---------------------------------------------------------------------------------
    def register_failure_callback(self, callback: Callable[[str], None]) -> None:
        """Call callback(reason) once if a worker dies (at once if one already has)."""
        self._failure_callbacks.append(callback)
        if self.is_failed and self.failure_reason is not None:
            callback(self.failure_reason)

    def _monitor_workers(self) -> None:
        sentinels = {proc.sentinel: (rank, proc) for rank, proc in enumerate(self.procs)}
        ready = wait_for_objects(list(sentinels))
        if self._shutting_down:
            return
        gone = [sentinels[sentinel] for sentinel in ready]
        for _rank, proc in gone:
            proc.join(0.1)
        # When one worker is killed, the others' collectives fail and they exit too; on a busy
        # machine several sentinels are ready by the time this thread runs. Name the one a
        # signal ended (the cause), not a survivor that exited on its peer's broken connection.
        rank, proc = min(gone, key=lambda item: (not (item[1].exitcode or 0) < 0, item[0]))
        reason = f"worker rank {rank} (pid {proc.pid}) died with exit code {proc.exitcode}"
        logger.error("The engine is dead: %s.", reason)
        self.failure_reason = reason
        self.is_failed = True
        # The survivors cannot go on without their peer, and one blocked in a collective would
        # notice only at the transport's timeout (a signal handler does not run inside it):
        # end them now, before the callback tells the callers, so no worker outlives the news.
        for other in self.procs:
            if other.is_alive():
                other.kill()
        for callback in self._failure_callbacks:
            try:
                callback(reason)
            except Exception:  # noqa: BLE001 - the other callbacks still run
                logger.exception("A failure callback of the MultiprocExecutor raised")

    def _is_failed(self) -> bool:
        return self.is_failed

    def _dead_error(self) -> EngineDeadError:
        return EngineDeadError(f"The engine's {self.failure_reason or 'worker processes are gone'}.")

    def check_health(self) -> None:
        if self.is_failed:
            raise self._dead_error()

    # -- calls ---------------------------------------------------------------------------------
    def _broadcast(self, message: Any) -> None:
        if self.is_failed:
            raise self._dead_error()
        try:
            self.broadcast_mq.enqueue(self.codec.encode(message), cancel=self._is_failed)
        except ConnectionAbortedError:
            raise self._dead_error() from None

    def _receive(self, rank: int, timeout: float | None) -> Any:
        try:
            reply = self.codec.decode_reply(self.response_mqs[rank].dequeue(timeout, cancel=self._is_failed))
        except ConnectionAbortedError:
            raise self._dead_error() from None
        return reply

    def _next_call_id(self) -> int:
        self._call_id += 1
        return self._call_id

    def _drain_pending(self, until: _ReplyFuture | None = None) -> None:
        """Read the output rank's replies to earlier non-blocking calls, oldest first (all of
        them, or up to `until`)."""
        with self._lock:
            while self._pending and (until is None or not until.done()):
                call_id, future = self._pending.popleft()
                try:
                    reply = self._receive(self.output_rank, None)
                    assert isinstance(reply, SampleReply) and reply.call_id == call_id, reply
                    future.set_result(reply.output)
                except BaseException as error:  # noqa: BLE001 - the caller of result() gets it
                    future.set_exception(error)

    def collective_rpc(self, method: str | Callable[..., Any], timeout: float | None = None,
                       args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None,
                       unique_reply_rank: int | None = None) -> list[Any]:
        """Run `method` on every worker; their results in rank order (only unique_reply_rank's
        when given). Arguments and results travel as msgpack: plain data, Structs, dataclasses."""
        name = method_name(method)
        reply_rank = ALL_RANKS if unique_reply_rank is None else unique_reply_rank
        with self._lock:
            self._drain_pending()
            call_id = self._next_call_id()
            self._broadcast(RPCCall(call_id, name, list(args), kwargs or {}, reply_rank))
            ranks = range(self.world_size) if reply_rank == ALL_RANKS else [reply_rank]
            results = []
            for rank in ranks:
                reply = self._receive(rank, timeout)
                assert reply.call_id == call_id, (reply.call_id, call_id)
                results.append(reply)
            # Every rank's reply is read before raising, so the next call finds the queues in step.
            failures = [reply.failure for reply in results if reply.failure is not None]
            if failures:
                raise RuntimeError(f"Worker call failed: {'; '.join(failures)}")
            return [msgspec.msgpack.decode(reply.result) if isinstance(reply.result, msgspec.Raw) else reply.result
                    for reply in results]

    def get_kv_cache_spec(self) -> dict[str, KVCacheSpec]:
        wire = self.collective_rpc(_kv_cache_spec_wire, unique_reply_rank=self.output_rank)[0]
        return {name: (FullAttentionSpec(block_size=block_size) if window is None
                       else SlidingWindowSpec(block_size=block_size, sliding_window=window))
                for name, (block_size, window) in wire.items()}

    def execute_model(self, scheduler_output: SchedulerOutput, non_block: bool = False) -> Future[None] | None:
        """Broadcast the step; no rank answers (a failure ends that worker, hence the engine).

        Never waits for the forward pass; non_block returns a completed Future for symmetry.
        """
        with self._lock:
            self._broadcast(ExecuteModelCall(self._next_call_id(), scheduler_output))
        if not non_block:
            return None
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def sample_tokens(self, non_block: bool = False) -> ModelRunnerOutput | Future[ModelRunnerOutput]:
        """The output rank's ModelRunnerOutput; non_block: a Future of it (the batch queue)."""
        with self._lock:
            call_id = self._next_call_id()
            self._broadcast(RPCCall(call_id, "sample_tokens", reply_rank=self.output_rank))
            future = _ReplyFuture(self)
            self._pending.append((call_id, future))
        if non_block:
            return future
        return future.result()

    # -- lifecycle -----------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Stop every worker (ShutdownCall, then SIGTERM, then SIGKILL) and free the queues."""
        if getattr(self, "_shut_down", False):
            return
        self._shut_down = self._shutting_down = True
        while self._pending:  # nobody will read these replies now
            self._pending.popleft()[1].set_exception(EngineDeadError("The engine was shut down."))
        if self.procs and not self.is_failed:
            with contextlib.suppress(Exception):
                self.broadcast_mq.enqueue(self.codec.encode(ShutdownCall()), timeout=1.0)
            for proc in self.procs:
                proc.join(SHUTDOWN_TIMEOUT_S)
        # A failed engine's survivors get no grace: their group is broken (the monitor killed
        # them already; this covers a failure found by a call before the monitor ran).
        for stop in (("terminate", "kill") if not self.is_failed else ("kill",)):
            for proc in self.procs:
                if proc.is_alive():
                    getattr(proc, stop)()
            for proc in self.procs:
                proc.join(2.0)
        for writer in self._death_writers:
            writer.close()
        for queue in (*self.response_mqs, self.broadcast_mq):
            queue.close()
        self._release_forkserver()

    def _release_forkserver(self) -> None:
        """Stop the worker forkserver this executor launched in an engine process.

        Left alone it exits only after the last process holding its "alive" pipe (the core and
        every worker) is gone, and then slowly: its interpreter tears down torch and the engine,
        over a second on a busy machine, an engine process outliving the engine. Its workers are
        all reaped by now (the joins above read their exit codes from it). Not in a user's
        process (an in-process engine core): engine cores started there may share the server.
        """
        pid, self._own_forkserver = self._own_forkserver, None
        if pid is not None:
            _stop_forkserver(pid)


class _ReplyFuture(Future):  # type: ignore[type-arg]
    """A reply the executor reads from the queue when someone asks for it (result())."""

    def __init__(self, executor: MultiprocExecutor) -> None:
        super().__init__()
        self._executor = executor

    def result(self, timeout: float | None = None) -> Any:
        if not self.done():
            self._executor._drain_pending(until=self)
        return super().result(timeout)


def _kv_cache_spec_wire(worker: Any) -> dict[str, tuple[int, int | None]]:
    """A worker's KV cache specs as plain data: name -> (block_size, sliding_window or None)."""
    return {name: (spec.block_size, getattr(spec, "sliding_window", None))
            for name, spec in worker.get_kv_cache_spec().items()}


def _forkserver_pid() -> int | None:
    """The pid of the forkserver this process launched (None: none, or one inherited)."""
    from multiprocessing import forkserver

    return forkserver._forkserver._forkserver_pid  # type: ignore[attr-defined]


def _stop_forkserver(pid: int) -> None:
    """SIGKILL this process's forkserver (pid) and forget it, as multiprocessing's own stop does
    but without waiting for the server's slow exit; a later worker start launches a new one."""
    from multiprocessing import forkserver, util

    server: Any = forkserver._forkserver  # type: ignore[attr-defined]
    with server._lock:
        if server._forkserver_pid != pid:
            return  # already replaced (it died and a later start relaunched it)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)
        os.close(server._forkserver_alive_fd)
        address = server._forkserver_address
        if address is not None and not util.is_abstract_socket_namespace(address):
            with contextlib.suppress(OSError):
                os.unlink(address)
        server._forkserver_address = server._forkserver_alive_fd = server._forkserver_pid = None


def _worker_context() -> Any:
    default = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"
    method = envs.LMC_WORKER_START_METHOD.get() or default
    if method not in ("forkserver", "spawn"):
        raise InvalidEngineArgsError(f"LMC_WORKER_START_METHOD={method!r} must be forkserver or spawn.")
    context = multiprocessing.get_context(method)
    if method == "forkserver":
        context.set_forkserver_preload(_FORKSERVER_PRELOAD)
    return context


@contextlib.contextmanager
def _children_allowed() -> Iterator[None]:
    """Let a daemonic process start workers (an in-process engine core in a user's daemonic
    process; an engine core drops the flag at entry, process_flags), and keep __main__ out of them.

    multiprocessing refuses children to daemonic processes because it cannot reap them when the
    daemon is killed. Our workers reap themselves: each exits when its death pipe to this process
    closes, which the kernel does whatever way this process ends. And a worker needs nothing from
    __main__: hiding it keeps a user's script without a `__main__` guard (an in-process engine
    core, multiprocess=False) from being run again in every worker.
    """
    main = sys.modules.get("__main__")
    saved = None if main is None else (main.__dict__.pop("__file__", None), getattr(main, "__spec__", None))
    if main is not None:
        main.__spec__ = None
    try:
        with children_allowed():
            yield
    finally:
        if main is not None and saved is not None:
            if saved[0] is not None:
                main.__file__ = saved[0]
            main.__spec__ = saved[1]


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
