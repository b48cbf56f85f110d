"""tcp transport is CURVE-authenticated (issue 18 item 2): a peer without the key can neither inject nor read.

On main another local user connected plain ZMQ sockets to the tcp endpoints, injected a fake
"engine dead" and read prompts from the KV-events PUB. Here a plain socket (and one with the
wrong server key) connects to each endpoint: its handshake fails, what it sends never arrives,
it receives nothing, and the engine goes on serving; a keyed socket shows the check works.
"""

from __future__ import annotations

import time

import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

from lm_console.engine import LLM, SamplingParams
from lm_console.engine.ipc import MsgpackEncoder, set_curve_client
from lm_console.engine.metrics.kv_events import KVEventSubscriber
from lm_console.engine.protocol import EngineCoreOutputs

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]
_FAILED = {zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL,
           zmq.EVENT_HANDSHAKE_FAILED_AUTH, zmq.EVENT_DISCONNECTED}


def _handshake(socket: zmq.Socket, address: str) -> str:
    """Connect and report the first handshake outcome: "succeeded" or "failed"."""
    monitor = socket.get_monitor_socket()
    socket.connect(address)
    try:
        while monitor.poll(30_000):
            event = recv_monitor_message(monitor)["event"]
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                return "succeeded"
            if event in _FAILED:
                return "failed"
        return "no answer"
    finally:
        socket.disable_monitor()
        monitor.close(linger=0)


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    engine = LLM(str(tiny_llama_dir), dtype="float32", max_model_len=128, num_gpu_blocks_override=64,
                 zmq_transport="tcp", enable_kv_cache_events=True)
    yield engine
    engine.shutdown()


def test_every_tcp_endpoint_refuses_a_socket_without_the_key(llm) -> None:
    addresses = llm.engine_core.resources.addresses
    endpoints = {"requests (ROUTER)": (addresses.input_address, zmq.DEALER),
                 "outputs (PULL)": (addresses.output_addresses[0], zmq.PUSH),
                 "KV events (PUB)": (llm.kv_events_endpoint, zmq.SUB)}
    assert all(address.startswith("tcp://127.0.0.1:") for address, _ in endpoints.values())
    context = zmq.Context()
    try:
        for name, (address, socket_type) in endpoints.items():
            plain = context.socket(socket_type)
            assert _handshake(plain, address) == "failed", f"{name}: a plain socket got in"
            plain.close(linger=0)
            wrong = context.socket(socket_type)
            set_curve_client(wrong, zmq.curve_keypair()[0])  # a guessed server key
            assert _handshake(wrong, address) == "failed", f"{name}: a wrong key got in"
            wrong.close(linger=0)
        # The check is real: the core's own keys (and the published KV-events key) do get in.
        keyed = context.socket(zmq.PUSH)
        set_curve_client(keyed, addresses.curve.server_public)
        assert _handshake(keyed, addresses.output_addresses[0]) == "succeeded"
        keyed.close(linger=0)
    finally:
        context.term()


def test_a_keyless_peer_can_neither_inject_nor_read(llm) -> None:
    addresses = llm.engine_core.resources.addresses
    context = zmq.Context()
    try:
        # Inject: a fake "engine dead" on the outputs, a fake READY and a stolen identity on requests.
        injector = context.socket(zmq.PUSH)
        injector.connect(addresses.output_addresses[0])
        injector.send_multipart(MsgpackEncoder().encode(EngineCoreOutputs(engine_dead_reason="fake")))
        thief = context.socket(zmq.DEALER)
        thief.setsockopt(zmq.IDENTITY, llm.engine_core.resources.core_identity)
        thief.connect(addresses.input_address)
        # Read: a plain subscriber beside a keyed one.
        eavesdropper = context.socket(zmq.SUB)
        eavesdropper.setsockopt(zmq.SUBSCRIBE, b"")
        eavesdropper.connect(llm.kv_events_endpoint)
        subscriber = KVEventSubscriber(llm.kv_events_endpoint, context=context, server_key=llm.kv_events_server_key)
        time.sleep(0.5)  # let every connection attempt reach its handshake (not an assertion on time)
        params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
        out = llm.generate("a secret prompt that fills a block or two", params, use_tqdm=False)[0]
        assert len(out.outputs[0].token_ids) == 20 and not llm.engine_core.errored
        received = subscriber.receive(timeout_s=30)
        assert received is not None and received[1].events, "the keyed subscriber gets the events"
        assert not eavesdropper.poll(1000), "a plain subscriber read KV events"
        assert not thief.poll(0), "a plain socket with the core's identity received requests"
        llm.check_health()
        assert len(llm.generate("again", params, use_tqdm=False)[0].outputs[0].token_ids) == 20
        subscriber.close()
        for socket in (injector, thief, eavesdropper):
            socket.close(linger=0)
    finally:
        context.term()
