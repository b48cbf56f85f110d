"""EngineCoreProc: the EngineCore in its own process, served over ZMQ (seed: lines 1115-1332).

Sockets: a DEALER connected to the frontend's ROUTER (requests, aborts, utility calls in; the
start-up handshake out), one PUSH per client connected to that client's PULL (outputs), and
an optional PUB for KV cache events. The busy loop blocks on its inputs while idle, and while
there is work alternates: drain every pending input without blocking, step(), send.
The core exits on SHUTDOWN, on SIGTERM, and when its parent dies (the death pipe closes).
"""

from __future__ import annotations

import logging
import os
import signal
import traceback
from multiprocessing.connection import Connection
from typing import Any

import msgspec
import zmq

from engine.config import EngineArgs
from engine.core.engine_core import EngineCore
from engine.ipc import EngineAddresses, MsgpackDecoder, MsgpackEncoder, make_socket
from engine.metrics.kv_events import KVEventPublisher
from engine.protocol import (
    EngineCoreOutput, EngineCoreOutputs, EngineCoreReadyInfo, EngineCoreRequest,
    EngineCoreRequestType, EngineCoreStartupFailure, FinishReason, UtilityCall, UtilityOutput,
)

logger = logging.getLogger(__name__)

_CLOSE_LINGER_MS = 500

# Methods of EngineCore that a UtilityCall may name.
UTILITY_METHODS = frozenset({
    "reset_prefix_cache", "get_stats", "get_block_pool_state", "get_prefix_cache_hashes",
    "sleep", "wake_up", "is_sleeping", "flush_kv_connector",
})


class EngineCoreProc:
    """The busy loop around one EngineCore: poll inputs, step(), send outputs per client."""

    def __init__(self, engine_core: EngineCore, context: zmq.Context, input_socket: zmq.Socket,
                 output_sockets: list[zmq.Socket], death_fd: int | None = None,
                 publisher: KVEventPublisher | None = None) -> None:
        self.engine_core = engine_core
        self.context = context
        self.input_socket = input_socket
        self.output_sockets = output_sockets
        self.publisher = publisher
        self.encoder = MsgpackEncoder()
        self.request_decoder = MsgpackDecoder(list[EngineCoreRequest])
        self.abort_decoder = MsgpackDecoder(list[str])
        self.utility_decoder = MsgpackDecoder(UtilityCall)
        self.poller = zmq.Poller()
        self.poller.register(input_socket, zmq.POLLIN)
        self.death_fd = death_fd
        if death_fd is not None:
            self.poller.register(death_fd, zmq.POLLIN)
        self.num_rejected_messages = 0
        self.parent_died = False

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
                for request in self.request_decoder.decode(payload):
                    self._add_request(request)
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

    def _add_request(self, request: EngineCoreRequest) -> None:
        try:
            self.engine_core.add_request(request)
        except Exception as error:  # noqa: BLE001 - the caller must not wait forever
            logger.error("Rejected request %r: %s", request.request_id, error)
            self._send(request.client_index, EngineCoreOutputs(outputs=[EngineCoreOutput(
                request_id=request.request_id, new_token_ids=[], finish_reason=FinishReason.ABORT,
                stop_reason=f"rejected by the engine core: {error}")]))

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
        self.output_sockets[client_index].send_multipart(self.encoder.encode(outputs), copy=False)

    def _send_idle_stats(self) -> None:
        if not self.engine_core.config.scheduler_config.log_stats:
            return
        stats = self.engine_core.make_stats(force_block_map=True)
        stats.num_scheduled_tokens = stats.num_prompt_tokens = stats.num_generation_tokens = 0
        self._send(0, EngineCoreOutputs(scheduler_stats=stats))

    def send_dead(self, reason: str) -> None:
        """Tell every client why the core is about to exit."""
        for client_index in range(len(self.output_sockets)):
            try:
                self._send(client_index, EngineCoreOutputs(engine_dead_reason=reason))
            except zmq.ZMQError:
                pass


def run_engine_core(engine_args: EngineArgs, addresses: EngineAddresses, identity: bytes,
                    death_reader: Connection | None = None) -> None:
    """Entry point of the engine-core process: build, handshake, serve, clean up."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the frontend's to handle
    signal.signal(signal.SIGTERM, _raise_system_exit)
    context = zmq.Context()
    input_socket, _ = make_socket(context, zmq.DEALER, addresses.input_address, bind=False,
                                  identity=identity)
    output_sockets = [make_socket(context, zmq.PUSH, address, bind=False)[0]
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
                publisher = KVEventPublisher(context, addresses.kv_events_endpoint)
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
            kv_events_endpoint=publisher.endpoint if publisher else None, pid=os.getpid())
        input_socket.send_multipart([EngineCoreRequestType.READY.frame(), *encoder.encode(info)])
        death_fd = death_reader.fileno() if death_reader is not None else None
        proc = EngineCoreProc(engine_core, context, input_socket, output_sockets, death_fd, publisher)
        try:
            proc.run_busy_loop()
        except SystemExit:
            raise
        except BaseException as error:
            logger.exception("The engine core failed; it exits.")
            proc.send_dead(f"{type(error).__name__}: {error}")
            raise SystemExit(1) from error
    finally:
        if engine_core is not None:
            engine_core.shutdown()
        if publisher is not None:
            publisher.close()
        for socket in (input_socket, *output_sockets):
            socket.close(linger=_CLOSE_LINGER_MS)  # let a start-up failure or death reason out
        context.term()
        if proc is not None and proc.parent_died:
            addresses.cleanup()  # the frontend cannot remove its socket dir any more


def _raise_system_exit(signum: int, frame: Any) -> None:
    raise SystemExit(0)
