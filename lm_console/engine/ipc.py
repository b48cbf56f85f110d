"""ZMQ plumbing shared by the engine core and its clients: addresses, sockets and the codec.

Addresses are ipc:// paths in a private 0700 temp dir by default, or tcp:// on loopback.
Every tcp socket is CURVE-authenticated and encrypted (CurveKeys): the frontend's ROUTER and
PULL are CURVE servers whose key pair is made at each start and reaches the engine core only
through its process start-up arguments (multiprocessing's private pipe, never argv and never
ZMQ); a peer without the server's public key cannot complete the handshake, so it can neither
send nor read. The KV-events PUB (bound by the core) is a CURVE server with a key pair of its
own whose public half is published (ready info, `llm.kv_events_server_key`) for subscribers.
The codec is msgpack (msgspec); tensors and numpy arrays inside a message leave the msgpack
payload as an Ext reference and travel as raw buffers in extra frames, so nothing is pickled
and large buffers are not copied into the payload.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass, field
from typing import Any

import msgspec
import zmq

_TENSOR_EXT = 1  # Ext payload: msgpack (kind, dtype, shape, frame index)


@dataclass(frozen=True)
class CurveKeys:
    """The CURVE key pairs (z85 bytes) of one engine's tcp sockets, made at start.

    server_*: the frontend's ROUTER and PULL; client_*: the engine core's DEALER and PUSH;
    kv_events_*: the core's KV-events PUB (its public key is given to subscribers).
    """

    server_public: bytes = field(repr=False)
    server_secret: bytes = field(repr=False)
    client_public: bytes = field(repr=False)
    client_secret: bytes = field(repr=False)
    kv_events_public: bytes = field(repr=False)
    kv_events_secret: bytes = field(repr=False)

    @classmethod
    def generate(cls) -> CurveKeys:
        if not zmq.has("curve"):
            from lm_console.engine.errors import InvalidEngineArgsError

            raise InvalidEngineArgsError(
                "zmq_transport='tcp' needs CURVE, but this pyzmq's libzmq was built without it; "
                "use zmq_transport='ipc'.")
        server, client, kv_events = zmq.curve_keypair(), zmq.curve_keypair(), zmq.curve_keypair()
        return cls(*server, *client, *kv_events)


def set_curve_server(socket: zmq.Socket, secret_key: bytes) -> None:
    """Make socket a CURVE server (before bind): only peers that know its public key get in."""
    socket.curve_secretkey = secret_key
    socket.curve_server = True


def set_curve_client(socket: zmq.Socket, server_public: bytes, public_key: bytes | None = None,
                     secret_key: bytes | None = None) -> None:
    """Make socket a CURVE client of the server with that public key (before connect)."""
    if public_key is None or secret_key is None:
        public_key, secret_key = zmq.curve_keypair()
    socket.curve_serverkey = server_public
    socket.curve_publickey = public_key
    socket.curve_secretkey = secret_key


@dataclass
class EngineAddresses:
    """Where the frontend's sockets bind and the core's connect (plus the KV events PUB)."""

    input_address: str  # frontend ROUTER binds, core DEALER connects
    output_addresses: list[str]  # one per client: frontend PULL binds, core PUSH connects
    kv_events_endpoint: str | None = None  # core PUB binds
    ipc_dir: str | None = field(default=None, repr=False)  # removed at shutdown
    curve: CurveKeys | None = field(default=None, repr=False)  # set when any address is tcp

    def cleanup(self) -> None:
        """Remove the private socket directory."""
        if self.ipc_dir is not None:
            shutil.rmtree(self.ipc_dir, ignore_errors=True)
            self.ipc_dir = None


def make_engine_addresses(transport: str = "ipc", num_clients: int = 1,
                          kv_events: bool = False, kv_events_endpoint: str | None = None,
                          host: str = "127.0.0.1", kv_events_host: str | None = None) -> EngineAddresses:
    """Fresh addresses: ipc paths in a new 0700 temp dir, or tcp ports on 127.0.0.1.

    host / kv_events_host (tcp only): where the frontend's sockets / the core's KV-events PUB
    bind when the core runs on another machine (a Ray data-parallel core); CURVE either way.
    """
    if transport == "ipc":
        ipc_dir = tempfile.mkdtemp(prefix="lmc-engine-")  # mkdtemp creates it 0700
        os.chmod(ipc_dir, 0o700)
        kv_default = f"ipc://{ipc_dir}/kv_events.sock"
        kv_endpoint = (kv_events_endpoint or kv_default) if kv_events else None
        return EngineAddresses(
            input_address=f"ipc://{ipc_dir}/input.sock",
            output_addresses=[f"ipc://{ipc_dir}/output_{i}.sock" for i in range(num_clients)],
            kv_events_endpoint=kv_endpoint, ipc_dir=ipc_dir,
            curve=CurveKeys.generate() if is_tcp(kv_endpoint) else None,
        )
    if transport == "tcp":
        # Port 0: the frontend binds first and reads back the port (see bind_socket).
        return EngineAddresses(
            input_address=f"tcp://{host}:*",
            output_addresses=[f"tcp://{host}:*"] * num_clients,
            kv_events_endpoint=(kv_events_endpoint or f"tcp://{kv_events_host or host}:*") if kv_events else None,
            curve=CurveKeys.generate(),
        )
    from lm_console.engine.errors import InvalidEngineArgsError

    raise InvalidEngineArgsError(f"zmq_transport={transport!r} must be one of ipc, tcp.")


def is_tcp(address: str | None) -> bool:
    return address is not None and address.startswith("tcp://")


def make_socket(context: zmq.Context, socket_type: int, address: str, bind: bool,
                identity: bytes | None = None, curve: CurveKeys | None = None) -> tuple[zmq.Socket, str]:
    """A socket with unbounded queues and no linger; returns it with its actual address.

    A tcp address needs curve: a bound socket is the CURVE server, a connected one its client.
    """
    socket = context.socket(socket_type)
    if is_tcp(address):
        if curve is None:
            socket.close(linger=0)
            raise ValueError(f"{address}: a tcp socket of the engine needs CURVE keys")
        if bind:
            set_curve_server(socket, curve.server_secret)
        else:
            set_curve_client(socket, curve.server_public, curve.client_public, curve.client_secret)
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt(zmq.SNDHWM, 0)
    socket.setsockopt(zmq.RCVHWM, 0)
    if identity is not None:
        socket.setsockopt(zmq.IDENTITY, identity)
    if socket_type == zmq.ROUTER:
        socket.setsockopt(zmq.ROUTER_MANDATORY, 1)  # fail loudly instead of dropping
    if bind:
        socket.bind(address)
        address = socket.getsockopt_string(zmq.LAST_ENDPOINT)
    else:
        socket.connect(address)
    return socket, address


class MsgpackEncoder:
    """msgpack with out-of-band buffers: encode(obj) -> [payload, *buffers]."""

    def __init__(self) -> None:
        self._encoder = msgspec.msgpack.Encoder(enc_hook=self._enc_hook)
        self._buffers: list[Any] | None = None

    def encode(self, obj: Any) -> list[Any]:
        """The frames of one message: the msgpack payload, then one frame per tensor."""
        self._buffers = buffers = [b""]
        try:
            buffers[0] = self._encoder.encode(obj)
            return buffers
        finally:
            self._buffers = None

    def _enc_hook(self, obj: Any) -> Any:
        module = type(obj).__module__
        if module == "numpy" and type(obj).__name__ == "ndarray":
            return self._add_buffer("numpy", str(obj.dtype), obj.shape, obj)
        if module == "torch" and type(obj).__name__ in ("Tensor", "Parameter"):
            tensor = obj.detach().cpu().contiguous()
            dtype = str(tensor.dtype).removeprefix("torch.")
            # Bytes view: works for every dtype, bfloat16 included (numpy has none).
            raw = tensor.view(-1).view(_torch().uint8).numpy() if tensor.numel() else b""
            return self._add_buffer("torch", dtype, tuple(tensor.shape), raw)
        raise NotImplementedError(f"cannot send {type(obj).__name__} to the engine core")

    def _add_buffer(self, kind: str, dtype: str, shape: tuple[int, ...], data: Any) -> msgspec.msgpack.Ext:
        assert self._buffers is not None
        import numpy as np

        buffer = np.ascontiguousarray(data).data if not isinstance(data, bytes) else data
        self._buffers.append(buffer)
        header = msgspec.msgpack.encode((kind, dtype, list(shape), len(self._buffers) - 1))
        return msgspec.msgpack.Ext(_TENSOR_EXT, header)


class MsgpackDecoder:
    """Decodes [payload, *buffers] produced by MsgpackEncoder into `type`."""

    def __init__(self, type: Any = Any) -> None:  # noqa: A002 - msgspec's own name
        self._decoder = msgspec.msgpack.Decoder(type, ext_hook=self._ext_hook)
        self._frames: list[Any] | None = None

    def decode(self, frames: list[Any]) -> Any:
        """Decode one message (a list of frames; bytes, memoryview or zmq.Frame)."""
        return self.decode_part(None, frames)

    def decode_part(self, data: Any, frames: list[Any]) -> Any:
        """Decode `data` (a msgspec.Raw cut from frames[0]; None: all of it) with frames' buffers."""
        self._frames = [f.buffer if isinstance(f, zmq.Frame) else f for f in frames]
        try:
            return self._decoder.decode(self._frames[0] if data is None else data)
        finally:
            self._frames = None

    def _ext_hook(self, code: int, data: memoryview) -> Any:
        if code != _TENSOR_EXT:
            raise ValueError(f"unknown msgpack extension type {code}")
        kind, dtype, shape, index = msgspec.msgpack.decode(data)
        assert self._frames is not None
        if not 0 < index < len(self._frames):
            raise ValueError(f"tensor frame {index} is missing ({len(self._frames)} frames)")
        buffer = self._frames[index]
        import numpy as np

        if kind == "numpy":
            return np.frombuffer(buffer, dtype=np.dtype(dtype)).reshape(shape)
        if kind == "torch":
            torch = _torch()
            raw = np.frombuffer(buffer, dtype=np.uint8).copy()  # writable: torch wants to own it
            return torch.from_numpy(raw).view(getattr(torch, dtype)).reshape(shape)
        raise ValueError(f"unknown buffer kind {kind!r}")


def _torch() -> Any:
    # Only reached when a tensor is actually sent or received: the frontend stays torch-free.
    import torch

    return torch
