"""EngineProcess: the engine-core process and the frontend's sockets to it, started and closed.

Start-up: bind ROUTER + PULL, start the process (forkserver by default: the server imports
torch and the engine once, and every later engine core forks from it; $LMC_ENGINE_START_METHOD
picks spawn instead), then wait for READY or STARTUP_FAILED on the ROUTER while watching the
process sentinel. The core gets the read end of a pipe whose write end only this process
holds: when the frontend dies, the pipe closes and the core exits, so no orphan is left.
"""

from __future__ import annotations

import builtins
import contextlib
import logging
import multiprocessing
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import zmq

from lm_console.engine import envs
from lm_console.engine import errors as engine_errors
from lm_console.engine.config.engine_args import EngineArgs
from lm_console.engine.errors import EngineDeadError, EngineStartupError
from lm_console.engine.ipc import EngineAddresses, MsgpackDecoder, MsgpackEncoder, make_engine_addresses, make_socket
from lm_console.engine.malloc_tuning import huge_page_heap
from lm_console.engine.platform import apply_openmp_wait_environment
from lm_console.engine.process_flags import children_allowed
from lm_console.engine.protocol import (
    EngineCoreReadyInfo, EngineCoreRequestType, EngineCoreStartupFailure,
)

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = envs.LMC_ENGINE_STARTUP_TIMEOUT.as_float()
SHUTDOWN_TIMEOUT_S = 5.0
# Imported once by the forkserver, so that each engine core starts in a fraction of a second.
# (A Llama config import pulls in most of transformers' config machinery.)
_FORKSERVER_PRELOAD = ["lm_console.engine.core.engine_core_proc", "lm_console.engine.models.registry",
                       "transformers.models.auto.configuration_auto",
                       "transformers.models.llama.configuration_llama"]


def mp_context() -> Any:
    """The multiprocessing context that starts engine cores."""
    default = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"
    method = envs.LMC_ENGINE_START_METHOD.get() or default
    context = multiprocessing.get_context(method)
    # Before the forkserver starts: it imports torch (its OpenMP reads its variables then) and
    # every core it forks inherits them.
    apply_openmp_wait_environment()
    if method == "forkserver":
        context.set_forkserver_preload(_FORKSERVER_PRELOAD)
    return context


class EngineProcess:
    """Everything the client owns outside Python objects: process, sockets, temp dir, pipes."""

    def __init__(self, engine_args: EngineArgs, num_clients: int = 1) -> None:
        engine_args._verify()  # a bad argument fails here, before any socket or process exists
        self.engine_args = engine_args
        self.addresses = self._make_addresses(num_clients)
        self.context = zmq.Context()
        curve = self.addresses.curve
        self.input_socket, self.addresses.input_address = make_socket(
            self.context, zmq.ROUTER, self.addresses.input_address, bind=True, curve=curve)
        self.output_socket, self.addresses.output_addresses[0] = make_socket(
            self.context, zmq.PULL, self.addresses.output_addresses[0], bind=True, curve=curve)
        self.send_lock = threading.Lock()
        self.core_identity = b"engine-core-0"
        self.wake_r, self.wake_w = os.pipe()
        self.proc: Any = None
        self.death_writer: Any = None
        self.reader_thread: threading.Thread | None = None
        self.closing = False
        self.closed = False

    def _make_addresses(self, num_clients: int) -> EngineAddresses:
        """The sockets' addresses (a core on another machine needs others: RayEngineProcess)."""
        args = self.engine_args
        return make_engine_addresses(args.zmq_transport, num_clients, args.enable_kv_cache_events,
                                     args.kv_events_endpoint)

    def exit_description(self) -> str:
        """Why the core is gone, for the EngineDeadError of its unexpected exit."""
        return f"The engine core process (pid {self.proc.pid}) died with exit code {self.proc.exitcode}."

    def start(self, while_starting: Callable[[], None] | None = None) -> EngineCoreReadyInfo:
        """Start the core and wait for its handshake; raise its start-up error if it fails.

        while_starting runs in this thread while the core starts (e.g. frontend imports).
        """
        self.launch()
        if while_starting is not None:
            while_starting()
        return self.wait_for_ready()

    def launch(self) -> None:
        """Start the core process without waiting for it (several cores start side by side)."""
        context = mp_context()
        death_reader, self.death_writer = context.Pipe(duplex=False)
        proc = context.Process(
            target=_run_engine_core, name="EngineCore", daemon=True,
            args=(_core_environment(self.engine_args), self.engine_args, self.addresses, self.core_identity,
                  death_reader))
        try:
            # children_allowed: an LLM built in a daemonic process (a Pool worker) may start it.
            with _main_module_hidden(), children_allowed(), huge_page_heap():
                proc.start()
        finally:
            death_reader.close()
        self.proc = proc

    def wait_for_ready(self) -> EngineCoreReadyInfo:
        poller = zmq.Poller()
        poller.register(self.input_socket, zmq.POLLIN)
        poller.register(self.proc.sentinel, zmq.POLLIN)
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while (remaining := deadline - time.monotonic()) > 0:
            events = dict(poller.poll(remaining * 1000))
            if self.input_socket in events:
                identity, type_frame, *payload = self.input_socket.recv_multipart()
                if type_frame == EngineCoreRequestType.READY.frame():
                    self.core_identity = identity
                    return MsgpackDecoder(EngineCoreReadyInfo).decode(payload)
                if type_frame == EngineCoreRequestType.STARTUP_FAILED.frame():
                    raise startup_error(MsgpackDecoder(EngineCoreStartupFailure).decode(payload))
                logger.warning("Ignored an unexpected message during the engine handshake")
            elif self.proc.sentinel in events and not self.input_socket.poll(100):
                raise EngineStartupError(
                    f"{self.exit_description()} It was not ready yet; its stderr above has the details.")
        raise EngineStartupError(f"The engine core was not ready after {STARTUP_TIMEOUT_S:.0f} s.")

    def send(self, request_type: EngineCoreRequestType, obj: Any, encoder: MsgpackEncoder) -> None:
        """Send one message to the core (any thread)."""
        with self.send_lock:
            if self.closing:
                raise EngineDeadError("The engine was shut down.")
            frames = [self.core_identity, request_type.frame(), *encoder.encode(obj)]
            try:
                self.input_socket.send_multipart(frames, copy=False)
            except zmq.ZMQError as error:
                raise EngineDeadError(f"The engine core is unreachable: {error}") from error

    def close(self, sink: Any = None) -> None:
        """Stop the core (SHUTDOWN, then SIGTERM, then SIGKILL) and release everything."""
        with self.send_lock:
            if self.closing:
                return
            self.closing = True
            if self.proc is not None and self.proc.is_alive():
                try:
                    self.input_socket.send_multipart(
                        [self.core_identity, EngineCoreRequestType.SHUTDOWN.frame(), b""],
                        flags=zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass
        if self.proc is not None:
            self.proc.join(SHUTDOWN_TIMEOUT_S)
            for stop in (self.proc.terminate, self.proc.kill):
                if self.proc.is_alive():
                    stop()
                    self.proc.join(2.0)
        os.write(self.wake_w, b"x")
        thread = self.reader_thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(2.0)
        elif thread is None and sink is not None:
            sink.on_dead(EngineDeadError("The engine was shut down."), unexpected=False)
        self.input_socket.close(linger=0)
        self.output_socket.close(linger=0)
        self.context.term()
        if self.death_writer is not None:
            self.death_writer.close()
        os.close(self.wake_r)
        os.close(self.wake_w)
        self.addresses.cleanup()
        self.closed = True


@contextlib.contextmanager
def _main_module_hidden() -> Iterator[None]:
    """Keep multiprocessing from re-running the user's __main__ in the engine core.

    The core needs nothing from __main__ (its target and arguments live in engine modules), and
    a script that builds an LLM at top level, without an `if __name__ == "__main__":` guard,
    must work as it does in-process.
    """
    main = sys.modules.get("__main__")
    if main is None:
        yield
        return
    missing = object()
    saved_file, saved_spec = main.__dict__.get("__file__", missing), main.__dict__.get("__spec__")
    main.__dict__.pop("__file__", None)
    main.__spec__ = None
    try:
        yield
    finally:
        main.__spec__ = saved_spec
        if saved_file is not missing:
            main.__file__ = saved_file


def _core_environment(engine_args: EngineArgs) -> dict[str, str]:
    """Variables the core needs from this process's present environment (a forkserver's is older)."""
    environment: dict[str, str] = {}
    if engine_args.data_parallel_size > 1:
        # Data parallelism over several GPUs: core i gets the i-th of CUDA_VISIBLE_DEVICES (with
        # fewer listed, the cores share them and gpu_memory_utilization must leave room for all).
        visible = [d.strip() for d in envs.CUDA_VISIBLE_DEVICES.get().split(",") if d.strip()]
        if len(visible) >= engine_args.data_parallel_size:
            environment["CUDA_VISIBLE_DEVICES"] = visible[engine_args.data_parallel_rank]
    if engine_args.distributed_executor_backend == "ray":
        from lm_console.engine.executor.ray_utils import core_ray_environment  # torch-free, ray-free

        environment.update(core_ray_environment())
    return environment


def _run_engine_core(environment: dict[str, str], *args: Any) -> None:
    os.environ.update(environment)
    # A torch-free module holds the process target, so the frontend never imports the core.
    from lm_console.engine.core.engine_core_proc import run_engine_core

    run_engine_core(*args)


def startup_error(failure: EngineCoreStartupFailure) -> BaseException:
    """The core's start-up exception rebuilt in this process (same type when it is known)."""
    cls: Any = None
    if failure.exc_module == "lm_console.engine.errors":
        cls = getattr(engine_errors, failure.exc_type, None)
    elif failure.exc_module == "builtins":
        cls = getattr(builtins, failure.exc_type, None)
    if not (isinstance(cls, type) and issubclass(cls, Exception)):
        cls = None
    try:
        error = cls(failure.message) if cls is not None else None
    except Exception:  # noqa: BLE001 - an exception type with an unusual constructor
        error = None
    if error is None:
        error = EngineStartupError(f"The engine core failed to start: {failure.exc_type}: {failure.message}")
    if hasattr(error, "add_note") and failure.traceback:
        error.add_note("Engine core traceback:\n" + failure.traceback)
    return error
