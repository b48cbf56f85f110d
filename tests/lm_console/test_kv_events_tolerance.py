"""A KV-event stream the console cannot fully read is a monitoring problem, never a dead engine.

The console attached to a vLLM-like server (the stand-in) subscribes to a PUB socket that sends, in
turn: a message that is no batch at all, a batch in vLLM's current form with an event type the
console does not know beside a known one, and a well-formed batch. The panel counts the unknown
event and the undecodable message, shows the rest, and the engine stays "serving".
"""

from __future__ import annotations

import asyncio

import msgspec
from console_helpers import SIZE, kv_event_publisher, until
from http_helpers import ServerThread
from openai_standin import StandinState, standin_app

from lm_console.client.remote import RemoteConsoleClient
from lm_console.tui.app import ConsoleApp
from lm_console.tui.widgets.kv_event_log import KVEventLog

STORED = {"type": "BlockStored", "block_hashes": [7], "parent_block_hash": None, "token_ids": list(range(128)),
          "block_size": 128, "lora_id": None, "medium": "GPU", "lora_name": None, "group_idx": 0,
          "kv_cache_spec_kind": "full_attention"}


def test_unknown_events_and_bad_messages_are_counted_and_the_console_goes_on() -> None:
    async def scenario(server: ServerThread, publisher) -> dict:  # noqa: ANN001
        client = RemoteConsoleClient(server.url, kv_events_endpoint=publisher.endpoint, poll_interval_s=0.05)
        app = ConsoleApp(client, tick_hz=0)
        sent = {"n": 0}

        def send() -> None:  # PUB/SUB: publish until the subscription has joined
            seq = sent["n"].to_bytes(8, "big")
            sent["n"] += 1
            publisher.socket.send_multipart([b"", seq, b"\xc1not msgpack"])
            publisher.socket.send_multipart([b"", seq, msgspec.msgpack.encode(
                [1.0, [{"type": "BlockPinned", "block_hashes": [7]}, STORED], 0])])

        async with app.run_test(size=SIZE) as pilot:
            log = app.query_one(KVEventLog)
            await until(pilot, app, lambda: log.num_unknown > 0 and client.num_kv_undecodable > 0,
                        "an unknown event and an undecodable message", poke=send)
            app.tick()
            await pilot.pause()
            seen = {"title": str(app.query_one("#kv-events").border_title), "state": app.engine_state,
                    "dead": app.dead_error, "kinds": [event.kind for event in log.events][:2]}
            await pilot.press("q")
        return seen

    with kv_event_publisher() as publisher, ServerThread(standin_app(StandinState())) as server:
        seen = asyncio.run(scenario(server, publisher))
    assert seen["state"] == "serving" and seen["dead"] is None
    assert seen["kinds"] == ["BlockPinned", "BlockStored"]
    assert "unknown" in seen["title"] and "undecodable msgs" in seen["title"]
