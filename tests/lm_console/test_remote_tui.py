"""Pilot tests of `lmc tui --url`: a live lm-console server in full, a /metrics-only server degraded."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest
from http_helpers import API_KEY, ServerThread, console_app
from openai_standin import WORDS, StandinState, set_metrics, standin_app

from lm_console.client.remote import RemoteConsoleClient
from lm_console.tui.app import ConsoleApp
from lm_console.tui.widgets.block_map import BlockMap
from lm_console.tui.widgets.kv_event_log import KVEventLog
from lm_console.tui.widgets.request_table import RequestTable
from lm_console.tui.widgets.scheduler_panel import SchedulerPanel

SIZE = (120, 36)
DEADLINE_S = 120  # a liveness bound for polling loops, not a performance assertion


def text_of(widget) -> str:  # noqa: ANN001
    return str(widget.render())


async def until(pilot, app: ConsoleApp, condition, what: str = "the expected state") -> None:  # noqa: ANN001
    """Tick the app until `condition()` holds."""
    end = time.monotonic() + DEADLINE_S
    while not condition():
        assert time.monotonic() < end, f"the console never showed {what} (dead: {app.dead_error!r})"
        await pilot.pause(0.05)
        app.tick()


@pytest.fixture(scope="module")
def served(tiny_llama_dir):  # noqa: ANN001, ANN201
    from engine import AsyncLLM

    llm = AsyncLLM(str(tiny_llama_dir), dtype="float32", max_model_len=256, num_gpu_blocks_override=64,
                   max_num_seqs=2, enable_kv_cache_events=True, stat_loggers=[])
    server = ServerThread(console_app(llm, idle_snapshot_s=0.2, requests_interval_s=0.2)).start()
    yield SimpleNamespace(llm=llm, server=server)
    server.stop()
    llm.shutdown()


def test_the_dashboard_shows_the_servers_own_state(served) -> None:  # noqa: ANN001
    from engine import RequestOutputKind, SamplingParams

    llm, server = served.llm, served.server
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=220, output_kind=RequestOutputKind.DELTA)
    ids = [f"other-client-{i}" for i in range(4)]
    tasks: list[asyncio.Task] = []

    async def submit() -> None:
        async def one(request_id: str) -> None:
            async for _ in llm.generate(f"{request_id} asks about the history of tea", params, request_id):
                pass

        tasks.extend(asyncio.get_running_loop().create_task(one(i)) for i in ids)

    async def scenario() -> dict:
        client = RemoteConsoleClient(server.url, api_key=API_KEY)
        app = ConsoleApp(client, tick_hz=0)
        seen: dict = {}
        async with app.run_test(size=SIZE) as pilot:
            await until(pilot, app, lambda: app.engine_state == "serving")
            seen["header"] = text_of(app.query_one("#engine-status"))
            server.call(submit)
            await until(pilot, app, lambda: app.telemetry.view.num_running == 2 and app.telemetry.view.num_waiting == 2,
                        "2 running, 2 waiting")
            await until(pilot, app, lambda: app.query_one(KVEventLog).num_received > 0, "KV events")
            seen["events_subtitle"] = str(app.query_one("#kv-events").border_subtitle)
            server.call(lambda: llm.sleep(1))  # the engine stops stepping: its state holds still
            state = server.call(llm.get_block_pool_state)
            received = app.telemetry.view.num_stats
            await until(pilot, app, lambda: app.telemetry.view.num_stats >= received + 2)  # fresh snapshots
            await until(pilot, app, lambda: len(app.server_requests.active) == 4)
            seen.update(state=state, view=app.telemetry.view, map=app.query_one(BlockMap).states,
                        scheduler=text_of(app.query_one(SchedulerPanel)),
                        table=str(app.query_one(RequestTable).border_title),
                        rows={r.request_id: r.state for r in app.server_requests.rows(time.time())})
            server.call(lambda: llm.wake_up())
            server.call(lambda: llm.abort(ids))
            await pilot.press("q")
        return seen

    seen = asyncio.run(scenario())

    async def finish() -> None:
        await asyncio.gather(*tasks, return_exceptions=True)

    server.call(finish)
    from llm_helpers import assert_no_leaked_blocks

    assert_no_leaked_blocks(server.call(llm.get_block_pool_state))
    state, view = seen["state"], seen["view"]
    assert f"@ {server.url}" in seen["header"] and "float32" in seen["header"] and "64 blocks" in seen["header"]
    assert (view.num_running, view.num_waiting) == (state.num_running_reqs, state.num_waiting_reqs) == (2, 2)
    assert seen["map"] == state.block_states and view.block_states == state.block_states
    assert view.num_used_blocks == state.block_states.count(1) > 0
    assert "running 2" in seen["scheduler"] and "waiting 2" in seen["scheduler"]
    assert seen["table"] == "Requests on the server ─ 4 in flight"
    assert sorted(seen["rows"].values()) == ["RUNNING", "RUNNING", "WAITING", "WAITING"]
    assert set(seen["rows"]) == set(ids)
    assert "/lmc/v1/stream?topics=kv" in seen["events_subtitle"]


def test_events_url_prints_the_servers_kv_events(served) -> None:  # noqa: ANN001
    import json

    from typer.testing import CliRunner

    from engine import SamplingParams
    from lm_console.cli import app

    llm, server = served.llm, served.server
    tasks: list[asyncio.Task] = []

    async def submit() -> None:
        async def one(i: int) -> None:
            params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=64)
            async for _ in llm.generate(f"events request {i} about rivers", params, f"events-{i}"):
                pass

        tasks.extend(asyncio.get_running_loop().create_task(one(i)) for i in range(2))

    async def finish() -> None:
        await asyncio.gather(*tasks)

    refused = CliRunner().invoke(app, ["events", "--url", server.url, "--count", "1"])
    assert refused.exit_code != 0 and "refused the API key" in refused.output
    server.call(submit)
    result = CliRunner().invoke(app, ["events", "--url", server.url, "--api-key", API_KEY, "--count", "3",
                                      "--duration", "120"])
    server.call(finish)
    assert result.exit_code == 0, result.output
    events = [json.loads(line) for line in result.stdout.splitlines()]
    assert len(events) == 3 and all(e["type"] in ("BlockStored", "BlockRemoved", "AllBlocksCleared") for e in events)
    assert [e["seq"] for e in events] == sorted(e["seq"] for e in events)


def test_a_metrics_only_server_degrades_each_panel_with_a_note() -> None:
    import zmq

    from engine.metrics.kv_events import BlockStored, KVEventPublisher

    state = StandinState()
    context = zmq.Context()
    publisher = KVEventPublisher(context, "tcp://127.0.0.1:*")

    async def scenario(server: ServerThread, endpoint: str | None) -> dict:
        set_metrics(server.app, running=3, waiting=1, usage=0.25)
        client = RemoteConsoleClient(server.url, kv_events_endpoint=endpoint, poll_interval_s=0.05)
        app = ConsoleApp(client, tick_hz=0)
        async with app.run_test(size=SIZE) as pilot:
            await until(pilot, app, lambda: app.telemetry.view.num_running == 3)
            if endpoint:
                log = app.query_one(KVEventLog)
                end = time.monotonic() + DEADLINE_S
                while log.num_received == 0:  # PUB/SUB: publish until the subscription has joined
                    assert time.monotonic() < end
                    publisher.publish([BlockStored([b"\x02" * 32], None, list(range(16)), 16)])
                    await pilot.pause(0.05)
                    app.tick()
            app.tick()
            await pilot.pause()
            seen = {"pool_title": str(app.query_one("#block-pool").border_title),
                    "pool_note": str(app.query_one("#block-pool").border_subtitle),
                    "map": app.query_one(BlockMap).states, "scheduler": text_of(app.query_one(SchedulerPanel)),
                    "events_title": str(app.query_one("#kv-events").border_title),
                    "num_events": app.query_one(KVEventLog).num_received,
                    "table": str(app.query_one(RequestTable).border_title),
                    "header": text_of(app.query_one("#engine-status")), "state": app.engine_state}
            await pilot.press("q")
        return seen

    try:
        with ServerThread(standin_app(state)) as server:
            bare = asyncio.run(scenario(server, None))
            with_events = asyncio.run(scenario(server, publisher.endpoint))
    finally:
        publisher.close()
        context.term()
    assert bare["state"] == "serving" and "standin-model @ http://127.0.0.1" in bare["header"]
    assert bare["pool_title"] == "KV block pool ─ usage 25% of 2,048"
    assert "no block map from this server" in bare["pool_note"] and bare["map"] == b""
    assert "running 3" in bare["scheduler"] and "waiting 1" in bare["scheduler"]
    assert "no per-step stats" in bare["scheduler"] and "steps/s" not in bare["scheduler"]
    assert "no KV events from this server" in bare["events_title"] and bare["num_events"] == 0
    assert bare["table"].startswith("Requests of this console")
    assert with_events["num_events"] > 0 and "no KV events" not in with_events["events_title"]


def test_load_and_chat_go_over_http() -> None:
    from lm_console.load_generator import LoadShape

    state = StandinState()

    async def scenario(server: ServerThread) -> dict:
        client = RemoteConsoleClient(server.url, poll_interval_s=0.05)
        app = ConsoleApp(client, load=True, shape=LoadShape(rate=20.0, output_len=(2, 4)), tick_hz=0)
        async with app.run_test(size=SIZE) as pilot:
            await until(pilot, app, lambda: app.book.num_finished >= 3)
            await pilot.press("l")  # load off
            chunks = [c async for c in app.session.send("hello over http")]
            seen = {"finished": app.book.num_finished, "chat": "".join(c.text for c in chunks)}
            await pilot.press("q")
        return seen

    with ServerThread(standin_app(state)) as server:
        seen = asyncio.run(scenario(server))
    loads = [b for b in state.bodies if "prompt" in b]
    assert len(loads) >= 3 and all(isinstance(b["prompt"], list) and b["ignore_eos"] for b in loads)
    assert seen["chat"] == "".join(WORDS) and state.bodies[-1]["messages"][-1]["content"] == "hello over http"
