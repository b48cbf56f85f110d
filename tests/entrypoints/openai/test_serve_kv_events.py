"""`lmc serve --kv-events-endpoint tcp://...`: outside subscribers with the printed CURVE key get the KV events."""

from __future__ import annotations

import re
import socket

import httpx
import pytest

from lm_console.engine.metrics.kv_events import BlockStored, KVEventSubscriber
from openai_server_helpers import ServeProcess


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.slow
def test_kv_events_are_published_on_tcp(tiny_llama_dir) -> None:
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    server = ServeProcess(str(tiny_llama_dir), "--dtype", "float32", "--max-model-len", "256", "--num-blocks", "128",
                          "--num-threads", "1", "--kv-events-endpoint", endpoint)
    subscriber = None
    try:
        # A tcp PUB is a CURVE server: the ready line gives the public key a subscriber needs.
        match = re.search(rf"KV events on {re.escape(endpoint)} \(CURVE server key (\S{{40}})\)", server.output)
        assert match, server.output
        subscriber = KVEventSubscriber(endpoint, server_key=match.group(1))
        stored = []
        with httpx.Client(base_url=server.url, timeout=60) as http:
            for attempt in range(20):  # ZMQ's slow joiner: the first batches may precede the subscription
                prompt = f"Attempt {attempt}: " + "the history of computing " * 4
                assert http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2}).status_code == 200
                while (received := subscriber.receive(timeout_s=0.5)) is not None:
                    stored += [e for e in received[1].events if isinstance(e, BlockStored)]
                if stored:
                    break
        assert stored and all(event.block_size == 16 for event in stored)
    finally:
        if subscriber is not None:
            subscriber.close()
        server.stop()
