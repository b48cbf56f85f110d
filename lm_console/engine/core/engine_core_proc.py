"""EngineCoreProc: the EngineCore in its own process, served over ZMQ.

Sockets: a DEALER connected to the frontend's ROUTER (requests, aborts, utility calls in; the
start-up handshake out), one PUSH per client connected to that client's PULL (outputs), and
an optional PUB for KV cache events. The busy loop blocks on its inputs while idle, and while
there is work alternates: drain every pending input without blocking, step(), send.
The core exits on SHUTDOWN, on SIGTERM, and when its parent dies (the death pipe closes),
and removes the ipc socket dir whichever it was.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import traceback
from multiprocessing.connection import Connection
from typing import Any

import msgspec
import zmq

from lm_console.engine import kv_cache_hashing
from lm_console.engine.admission import error_for_path, read_request_ids
from lm_console.engine.config.engine_args import EngineArgs
from lm_console.engine.core.engine_core import EngineCore
from lm_console.engine.errors import (
    EngineError, InvalidPromptError, InvalidSamplingParamsError, RequestRejectedError,
)
from lm_console.engine.ipc import EngineAddresses, MsgpackDecoder, MsgpackEncoder, is_tcp, make_socket
from lm_console.engine.metrics.kv_events import KVEventPublisher
from lm_console.engine.process_flags import enter_engine_process
from lm_console.engine.protocol import (
    EngineCoreOutput, EngineCoreOutputs, EngineCoreReadyInfo, EngineCoreRequest,
    EngineCoreRequestType, EngineCoreStartupFailure, FinishReason, RequestError, UtilityCall, UtilityOutput,
)

logger = logging.getLogger(__name__)

_CLOSE_LINGER_MS = 500

# Methods of EngineCore that a UtilityCall may name.
UTILITY_METHODS = frozenset({
    "reset_prefix_cache", "get_stats", "get_block_pool_state", "get_prefix_cache_hashes", "get_request_blocks",
    "sleep", "wake_up", "is_sleeping", "flush_kv_connector",
})


class EngineCoreProc:
    """The busy loop around one EngineCore: poll inputs, step(), send outputs per client.

    Every request gets an answer: a request that cannot be decoded or fails the core's own
    checks (token ids, client index, logprobs, placeholder ranges) is answered with an error
    output for its id, alone; the rest of its message is admitted. A heartbeat thread sends an
    empty EngineCoreOutputs to every client every heartbeat_interval_s, idle or busy (a long
    step included), so the frontend can tell a stopped core (SIGSTOP, a frozen machine) from a
    quiet one. A thread, not the loop: a slow first step (a kernel compile) is no false alarm,
    at the price of not noticing a loop that hangs while the process runs.
    """

    def __init__(self, engine_core: EngineCore, context: zmq.Context, input_socket: zmq.Socket,
                 output_sockets: list[zmq.Socket], death_fd: int | None = None,
                 publisher: KVEventPublisher | None = None, max_logprobs: int = -1,
                 heartbeat_interval_s: float | None = None) -> None:
        self.engine_core = engine_core
        self.context = context
        self.input_socket = input_socket
        self.output_sockets = output_sockets
        self.publisher = publisher
        self.max_logprobs = max_logprobs
        self.vocab_size = engine_core.config.model_config.vocab_size
        self.engine_index = engine_core.config.parallel_config.data_parallel_rank
        self.encoder = MsgpackEncoder()
        # ADD payloads decode one request at a time, so a bad request fails alone.
        self.add_list_decoder = msgspec.msgpack.Decoder(list[msgspec.Raw])
        self.request_decoder = MsgpackDecoder(EngineCoreRequest)
        self.abort_decoder = MsgpackDecoder(list[str])
        self.utility_decoder = MsgpackDecoder(UtilityCall)
        self.poller = zmq.Poller()
        self.poller.register(input_socket, zmq.POLLIN)
        self.death_fd = death_fd
        if death_fd is not None:
            self.poller.register(death_fd, zmq.POLLIN)
        # The executor's monitor thread wakes an idle loop through this pipe when a worker dies.
        self.executor_failed_r, self.executor_failed_w = os.pipe()
        self.poller.register(self.executor_failed_r, zmq.POLLIN)
        self.num_rejected_messages = 0
        self.num_rejected_requests = 0
        self.parent_died = False
        # The output sockets are shared with the heartbeat thread: every send holds this lock.
        self.send_lock = threading.Lock()
        self.heartbeat_interval_s = heartbeat_interval_s
        self._heartbeat_stop = threading.Event()
        self._heartbeat_thread: threading.Thread | None = None

    # -- heartbeat --------------------------------------------------------------------------
    def start_heartbeat(self) -> None:
        """Send an empty EngineCoreOutputs to every client every heartbeat_interval_s."""
        if self.heartbeat_interval_s is None or self._heartbeat_thread is not None:
            return
        self._heartbeat_thread = threading.Thread(target=self._run_heartbeat, name="EngineCoreHeartbeat",
                                                  daemon=True)
        self._heartbeat_thread.start()

    def stop_heartbeat(self) -> None:
        self._heartbeat_stop.set()
        if self._heartbeat_thread is not None:
            self._heartbeat_thread.join(5.0)

    def _run_heartbeat(self) -> None:
        assert self.heartbeat_interval_s is not None
        while not self._heartbeat_stop.wait(self.heartbeat_interval_s):
            for client_index in range(len(self.output_sockets)):
                try:
                    self._send(client_index, EngineCoreOutputs())
                except zmq.ZMQError:
                    return  # the sockets are closing

    # -- the loop ---------------------------------------------------------------------------
    def run_busy_loop(self) -> None:
        """Serve until SHUTDOWN or the parent's death."""
        was_busy = False
        while True:
            if not self._process_input_socket(block=not self.engine_core.has_work()):
                return
            if self.engine_core.has_work():
                outputs, _ = self.engine_core.step()
                self._send_outputs(outputs)
                was_busy = True
            if was_busy and not self.engine_core.has_work():
                self._send_idle_stats()  # the console sees the final, idle state
                was_busy = False

    def _process_input_socket(self, block: bool) -> bool:
        """Handle every message that is waiting (after blocking for one if block); False: stop."""
        events = dict(self.poller.poll(None if block else 0))
        if self.death_fd is not None and self.death_fd in events:
            logger.warning("The frontend process died; the engine core exits.")
            self.parent_died = True
            return False
        if self.executor_failed_r in events:
            logger.error("A worker of the executor died; the engine core exits.")
            return False
        if self.input_socket not in events:
            return True
        while True:
            try:
                frames = self.input_socket.recv_multipart(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return True
            if not self._handle_message(frames):
                return False

    def _handle_message(self, frames: list[Any]) -> bool:
        """Dispatch one input message; a malformed one is logged and dropped. False: stop."""
        try:
            request_type = EngineCoreRequestType(frames[0].bytes[0])
            payload = frames[1:]
            if request_type == EngineCoreRequestType.ADD:
                self._add_requests(payload)
            elif request_type == EngineCoreRequestType.ABORT:
                self.engine_core.abort_requests(self.abort_decoder.decode(payload))
            elif request_type == EngineCoreRequestType.UTILITY:
                self._run_utility(self.utility_decoder.decode(payload))
            elif request_type == EngineCoreRequestType.SHUTDOWN:
                return False
            else:
                raise ValueError(f"{request_type.name} is not an input message")
        except Exception as error:  # noqa: BLE001 - a bad message must not stop the engine
            self.num_rejected_messages += 1
            logger.error("Rejected a malformed message on the input socket (%d frames): %s: %s",
                         len(frames), type(error).__name__, error)
        return True

    def _add_requests(self, payload: list[Any]) -> None:
        """Admit each request of an ADD message on its own; answer every one that fails."""
        items = self.add_list_decoder.decode(payload[0].buffer if isinstance(payload[0], zmq.Frame) else payload[0])
        for raw in items:
            try:
                request = self.request_decoder.decode_part(raw, payload)
            except Exception as error:  # noqa: BLE001 - undecodable: answer what can be read
                request_id, client_index = read_request_ids(raw)
                self._reject(request_id, client_index, _decode_error(error))
                continue
            self._add_request(request)

    def _add_request(self, request: EngineCoreRequest) -> None:
        error = self._check_request(request)
        if error is None:
            try:
                self.engine_core.add_request(request)
            except EngineError as engine_error:
                error = engine_error
            except Exception as other:  # noqa: BLE001 - the caller must not wait forever
                error = RequestRejectedError(f"the engine core refused the request: {type(other).__name__}: {other}")
        if error is not None:
            self._reject(request.request_id, request.client_index, error)

    def _check_request(self, request: EngineCoreRequest) -> EngineError | None:
        """The core's own checks: what would crash the model or the scheduler if it got in."""
        if not 0 <= request.client_index < len(self.output_sockets):
            return RequestRejectedError(
                f"client_index={request.client_index} is not one of this engine's {len(self.output_sockets)} clients.")
        token_ids = request.prompt_token_ids
        max_model_len = self.engine_core.config.model_config.max_model_len
        if not token_ids or len(token_ids) >= max_model_len:
            return InvalidPromptError(
                f"the prompt has {len(token_ids)} tokens; it must have 1 to {max_model_len - 1} (max_model_len).")
        if min(token_ids) < 0 or max(token_ids) >= self.vocab_size:
            return InvalidPromptError(f"prompt_token_ids must be in [0, {self.vocab_size}) for this model.")
        params = request.sampling_params
        if params.logprobs is not None and 0 <= self.max_logprobs < params.logprobs:
            return InvalidSamplingParamsError(
                f"logprobs={params.logprobs} exceeds max_logprobs={self.max_logprobs}.")
        for feature in request.mm_features or ():
            if feature.offset < 0 or feature.length < 1 or feature.offset + feature.length > len(token_ids):
                return InvalidPromptError(
                    f"a multimodal placeholder at [{feature.offset}, {feature.offset + feature.length}) lies "
                    f"outside the {len(token_ids)}-token prompt.")
        remaining = max_model_len - len(token_ids)
        if params.max_tokens is None or params.max_tokens > remaining:
            params.max_tokens = remaining  # as the frontend does: the request must end
            params.min_tokens = min(params.min_tokens, remaining)
        return None

    def _reject(self, request_id: str | None, client_index: int | None, error: EngineError) -> None:
        """Answer a refused request with its error (on client 0 if its client index is unusable)."""
        self.num_rejected_requests += 1
        if request_id is None:
            self.num_rejected_messages += 1
            logger.error("Rejected a request whose id cannot be read: %s: %s", type(error).__name__, error)
            return
        logger.error("Rejected request %r: %s: %s", request_id, type(error).__name__, error)
        if client_index is None or not 0 <= client_index < len(self.output_sockets):
            client_index = 0
        self._send(client_index, EngineCoreOutputs(outputs=[EngineCoreOutput(
            request_id=request_id, new_token_ids=[], finish_reason=FinishReason.ABORT,
            stop_reason=f"rejected by the engine core: {error}",
            error=RequestError(type(error).__name__, str(error)))]))

    def _run_utility(self, call: UtilityCall) -> None:
        output = UtilityOutput(call_id=call.call_id)
        try:
            if call.method not in UTILITY_METHODS:
                raise ValueError(f"unknown utility method {call.method!r}; allowed: {sorted(UTILITY_METHODS)}")
            result = getattr(self.engine_core, call.method)(*call.args)
            output.result = msgspec.Raw(msgspec.msgpack.encode(result))
        except Exception as error:  # noqa: BLE001 - reported to the caller, not fatal
            output.failure_message = f"{type(error).__name__}: {error}"
        outputs = {call.client_index: EngineCoreOutputs(utility_output=output)}
        self.engine_core.attach_kv_events(outputs)  # e.g. AllBlocksCleared after a reset
        self._send_outputs(outputs)

    # -- output -----------------------------------------------------------------------------
    def _send_outputs(self, outputs: dict[int, EngineCoreOutputs]) -> None:
        for client_index, client_outputs in outputs.items():
            if self.publisher is not None and client_outputs.kv_events is not None:
                self.publisher.publish_batch(client_outputs.kv_events)
            self._send(client_index, client_outputs)

    def _send(self, client_index: int, outputs: EngineCoreOutputs) -> None:
        outputs.engine_index = self.engine_index
        with self.send_lock:
            frames = self.encoder.encode(outputs)
            self.output_sockets[client_index].send_multipart(frames, copy=False)

    def _send_idle_stats(self) -> None:
        if not self.engine_core.config.scheduler_config.log_stats:
            return
        stats = self.engine_core.make_stats(force_block_map=True)
        stats.num_scheduled_tokens = stats.num_prompt_tokens = stats.num_generation_tokens = 0
        self._send(0, EngineCoreOutputs(scheduler_stats=stats))

    def on_executor_failed(self, reason: str) -> None:
        """A worker died (executor monitor thread): tell the clients now, and stop the loop."""
        self.send_dead(reason)
        os.write(self.executor_failed_w, b"x")

    def send_dead(self, reason: str) -> None:
        """Tell every client why the core is about to exit."""
        for client_index in range(len(self.output_sockets)):
            try:
                self._send(client_index, EngineCoreOutputs(engine_dead_reason=reason))
            except zmq.ZMQError:
                pass


def run_engine_core(engine_args: EngineArgs, addresses: EngineAddresses, identity: bytes,
                    death_reader: Connection | None = None) -> None:
    """Entry point of the engine-core process (or Ray actor): build, handshake, serve, clean up."""
    enter_engine_process()  # a core process starts daemonic, yet may start children: see process_flags
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the frontend's to handle
    signal.signal(signal.SIGTERM, _raise_system_exit)
    context = zmq.Context()
    input_socket, _ = make_socket(context, zmq.DEALER, addresses.input_address, bind=False,
                                  identity=identity, curve=addresses.curve)
    output_sockets = [make_socket(context, zmq.PUSH, address, bind=False, curve=addresses.curve)[0]
                      for address in addresses.output_addresses]
    encoder = MsgpackEncoder()
    proc: EngineCoreProc | None = None
    engine_core: EngineCore | None = None
    publisher: KVEventPublisher | None = None
    try:
        try:
            config = engine_args.create_engine_config()
            engine_core = EngineCore(config)
            if config.cache_config.enable_kv_cache_events and addresses.kv_events_endpoint:
                curve = addresses.curve if is_tcp(addresses.kv_events_endpoint) else None
                publisher = KVEventPublisher(context, addresses.kv_events_endpoint,
                                             curve_secret_key=curve.kv_events_secret if curve else None)
        except BaseException as error:  # noqa: BLE001 - every start-up failure goes to the frontend
            failure = EngineCoreStartupFailure(
                exc_type=type(error).__name__, exc_module=type(error).__module__,
                message=str(error), traceback=traceback.format_exc())
            input_socket.send_multipart([EngineCoreRequestType.STARTUP_FAILED.frame(),
                                         *encoder.encode(failure)])
            return
        config = engine_core.config  # with the KV cache's num_blocks decided
        info = EngineCoreReadyInfo(
            model_config=config.model_config, cache_config=config.cache_config,
            scheduler_config=config.scheduler_config, device_config=config.device_config,
            kv_events_endpoint=publisher.endpoint if publisher else None, pid=os.getpid(),
            kv_events_server_key=(addresses.curve.kv_events_public.decode()
                                  if publisher is not None and publisher.curve and addresses.curve else None),
            none_hash=kv_cache_hashing.NONE_HASH)
        input_socket.send_multipart([EngineCoreRequestType.READY.frame(), *encoder.encode(info)])
        death_fd = death_reader.fileno() if death_reader is not None else None
        proc = EngineCoreProc(engine_core, context, input_socket, output_sockets, death_fd, publisher,
                              max_logprobs=engine_args.max_logprobs,
                              heartbeat_interval_s=heartbeat_interval(engine_args.liveness_timeout_s))
        engine_core.model_executor.register_failure_callback(proc.on_executor_failed)
        proc.start_heartbeat()
        try:
            proc.run_busy_loop()
        except SystemExit:
            raise
        except BaseException as error:
            logger.exception("The engine core failed; it exits.")
            proc.send_dead(f"{type(error).__name__}: {error}")
            raise SystemExit(1) from error
    finally:
        if proc is not None:
            proc.stop_heartbeat()
        if engine_core is not None:
            engine_core.shutdown()
        if publisher is not None:
            publisher.close()
        for socket in (input_socket, *output_sockets):
            socket.close(linger=_CLOSE_LINGER_MS)  # let a start-up failure or death reason out
        context.term()
        # Whatever ended the core (SHUTDOWN, SIGTERM to the process group, the parent's death),
        # the engine is over: remove the socket dir here too, for a frontend that cannot
        # (killed by the same SIGTERM). The frontend's own removal tolerates it being gone.
        addresses.cleanup()


def _decode_error(error: BaseException) -> EngineError:
    if isinstance(error, EngineError):
        return error
    if isinstance(error, msgspec.ValidationError):
        return error_for_path(str(error), where="was refused by the engine core's decode")
    return RequestRejectedError(f"the engine core cannot decode the request: {type(error).__name__}: {error}")


def heartbeat_interval(liveness_timeout_s: float | None) -> float | None:
    """How often the core sends a heartbeat: several per liveness timeout, at most every 2 s."""
    if liveness_timeout_s is None:
        return None
    return min(max(liveness_timeout_s / 5, 0.01), 2.0)


def _raise_system_exit(signum: int, frame: Any) -> None:
    raise SystemExit(0)
