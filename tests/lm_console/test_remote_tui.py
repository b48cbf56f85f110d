"""`--url` against a live `lmc serve` app (build_app over a tiny model): the TUI in full (Pilot),
`lmc events`, `lmc chat`, `lmc batch` and `lmc bench serve`; and the TUI degraded on a /metrics-only server."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest
from console_helpers import DEADLINE_S, SIZE, kv_event_publisher, text_of, until
from http_helpers import API_KEY, ServerThread, lmc_app
from openai_standin import WORDS, StandinState, set_metrics, standin_app

from lm_console.client.remote import RemoteConsoleClient
from lm_console.tui.app import ConsoleApp
from lm_console.tui.widgets.block_map import BlockMap
from lm_console.tui.widgets.kv_event_log import KVEventLog
from lm_console.tui.widgets.request_table import RequestTable
from lm_console.tui.widgets.scheduler_panel import SchedulerPanel

pytestmark = pytest.mark.slow



@pytest.fixture(scope="module")
def served(tiny_llama_dir):  # noqa: ANN001, ANN201
    from lm_console.engine import AsyncLLM

    llm = AsyncLLM(str(tiny_llama_dir), dtype="float32", max_model_len=256, num_gpu_blocks_override=64,
                   max_num_seqs=2, enable_kv_cache_events=True, stat_loggers=[])
    server = ServerThread(lmc_app(llm, idle_snapshot_s=0.2, requests_interval_s=0.2)).start()
    yield SimpleNamespace(llm=llm, server=server)
    server.stop()
    llm.shutdown()


def test_the_dashboard_shows_the_servers_own_state(served) -> None:  # noqa: ANN001
    from lm_console.engine import RequestOutputKind, SamplingParams

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
            # The table is polled on its own: wait for a poll taken after the engine fell asleep.
            def table_caught_up() -> bool:
                rows = [r.state for r in app.server_requests.rows(time.time())]
                return len(app.server_requests.active) == 4 and rows.count("RUNNING") >= state.num_running_reqs

            await until(pilot, app, table_caught_up, "the server's table after the engine slept")
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
    # The server's table knows "scheduled at least once" (RUNNING) from its output states: a request
    # preempted back to the waiting queue still shows RUNNING, so only a lower bound holds exactly.
    states = list(seen["rows"].values())
    assert set(states) <= {"RUNNING", "WAITING"} and states.count("RUNNING") >= state.num_running_reqs
    assert set(seen["rows"]) == set(ids)
    assert "/lmc/v1/stream?topics=kv" in seen["events_subtitle"]


def test_events_url_prints_the_servers_kv_events(served) -> None:  # noqa: ANN001
    import json

    from typer.testing import CliRunner

    from lm_console.engine import SamplingParams
    from lm_console.cli import app

    llm, server = served.llm, served.server
    tasks: list[asyncio.Task] = []
    stop = asyncio.Event()

    async def submit() -> None:
        # Requests keep coming until the command has printed its events: it subscribes after this
        # starts, and a fixed batch could finish (its blocks stored) before the subscription.
        async def keep_generating() -> None:
            i = 0
            while not stop.is_set():
                params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=32)
                async for _ in llm.generate(f"events request {i} about rivers", params, f"events-{i}"):
                    pass
                i += 1

        tasks.append(asyncio.get_running_loop().create_task(keep_generating()))

    async def finish() -> None:
        stop.set()
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


def test_the_client_yields_the_engines_stats_and_its_idle_snapshots(served) -> None:  # noqa: ANN001
    from lm_console.engine import SamplingParams
    from lm_console.engine.metrics.stats import SchedulerStats
    from lm_console.client.types import StatsSnapshot

    llm, server = served.llm, served.server
    tasks: list[asyncio.Task] = []

    async def submit() -> None:
        async def one() -> None:
            async for _ in llm.generate("a snapshot and then steps", SamplingParams(max_tokens=8), "snap-1"):
                pass

        tasks.append(asyncio.get_running_loop().create_task(one()))

    async def scenario() -> tuple[list, float]:
        client = RemoteConsoleClient(server.url, api_key=API_KEY)
        await client.start()
        received: list = []
        before = time.time()
        stream = client.stats_stream()
        async for stats in stream:
            received.append(stats)
            if len(received) == 1:
                server.call(submit)
            if type(stats) is SchedulerStats and stats.num_scheduled_tokens > 0:
                break
        await stream.aclose()
        await client.shutdown()
        return received, before

    state = server.call(llm.get_block_pool_state)
    received, before = asyncio.run(asyncio.wait_for(scenario(), DEADLINE_S))

    async def finish() -> None:
        await asyncio.gather(*tasks)

    server.call(finish)
    first, step = received[0], received[-1]
    assert isinstance(first, StatsSnapshot) and first.block_states == state.block_states  # on connect, idle
    assert first.num_scheduled_tokens == 0 and step.num_steps > first.num_steps
    assert all(s.timestamp >= before for s in received)  # stamped on this console's clock


def test_chat_url_streams_the_servers_reply(served) -> None:  # noqa: ANN001
    import httpx
    from typer.testing import CliRunner

    from lm_console.cli import app

    server = served.server
    result = CliRunner().invoke(app, ["chat", "--plain", "--url", server.url, "--api-key", API_KEY, "--system", "",
                                      "--temperature", "0", "--max-tokens", "12"], input="Tell me about tea\n")
    assert result.exit_code == 0, result.output
    # The same turn asked directly (greedy): the REPL printed exactly the server's reply.
    body = {"messages": [{"role": "user", "content": "Tell me about tea"}], "temperature": 0.0, "max_tokens": 12}
    direct = httpx.post(server.url + "/v1/chat/completions", json=body,
                        headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120)
    assert direct.status_code == 200, direct.text
    reply = direct.json()["choices"][0]["message"]["content"]
    assert reply and result.stdout == reply + "\n"
    refused = CliRunner().invoke(app, ["chat", "--plain", "--url", server.url], input="hi\n")
    assert refused.exit_code == 2 and "refused the API key" in refused.stderr  # refused at start: exit 2, as every command


def test_batch_url_runs_on_the_server_in_order(served, tmp_path) -> None:  # noqa: ANN001
    import json

    from typer.testing import CliRunner

    from lm_console.cli import app

    lines = [json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
                         "body": {"prompt": f"The river number {i} flows", "max_tokens": 4, "temperature": 0.0}})
             for i in range(4)]
    lines.insert(1, json.dumps({"custom_id": "long", "method": "POST", "url": "/v1/completions",
                                "body": {"prompt": "tea " * 300, "max_tokens": 4}}))  # beyond max_model_len 256
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_bytes(("\n".join(lines) + "\n").encode() + b"\xff\xfe not text\n")
    result = CliRunner().invoke(app, ["batch", "-i", str(source), "-o", str(out), "--url", served.server.url,
                                      "--api-key", API_KEY, "--concurrency", "2", "--no-progress"])
    assert result.exit_code == 0, result.output
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["custom_id"] for r in records] == ["r0", "long", "r1", "r2", "r3", None]
    ok = [r for r in records if r["error"] is None]
    assert len(ok) == 4 and all(r["response"]["body"]["usage"]["completion_tokens"] == 4 for r in ok)
    assert records[1]["response"]["status_code"] == 400 and "context length" in records[1]["error"]
    assert "not valid UTF-8" in records[-1]["error"]  # reliab's line check, on the --url path too
    assert "4 succeeded, 2 failed" in result.stderr


def test_bench_serve_url_measures_the_server(served, tmp_path) -> None:  # noqa: ANN001
    import json

    from typer.testing import CliRunner

    from lm_console.cli import app

    out = tmp_path / "serve.json"
    result = CliRunner().invoke(app, ["bench", "serve", "--url", served.server.url, "--api-key", API_KEY,
                                      "--num-prompts", "4", "--random-input-len", "16", "--random-output-len", "5",
                                      "--random-range-ratio", "0", "--max-concurrency", "2",
                                      "--save-result", str(out), "--no-progress"])
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert data["completed"] == 4 and data["failed"] == 0 and data["output_lens"] == [5] * 4
    # One ITL per chunk after the first; a chunk may carry several tokens when the client reads late.
    assert data["total_input_tokens"] == 4 * 16 and all(len(itl) <= 4 for itl in data["itls"])
    assert all(ttft > 0 for ttft in data["ttfts"])
    assert data["model_id"] == served.llm.config.model_config.model_name
    unauthorised = CliRunner().invoke(app, ["bench", "serve", "--url", served.server.url, "--num-prompts", "1",
                                            "--no-progress"])
    assert unauthorised.exit_code == 2 and "401" in unauthorised.stderr


def test_a_metrics_only_server_degrades_each_panel_with_a_note() -> None:
    from lm_console.engine.metrics.kv_events import BlockStored

    state = StandinState()

    async def scenario(server: ServerThread, endpoint: str | None) -> dict:
        set_metrics(server.app, running=3, waiting=1, usage=0.25)
        client = RemoteConsoleClient(server.url, kv_events_endpoint=endpoint, poll_interval_s=0.05)
        app = ConsoleApp(client, tick_hz=0)
        async with app.run_test(size=SIZE) as pilot:
            await until(pilot, app, lambda: app.telemetry.view.num_running == 3)
            if endpoint:
                log = app.query_one(KVEventLog)
                # PUB/SUB: publish until the subscription has joined.
                await until(pilot, app, lambda: log.num_received > 0, "a KV event",
                            poke=lambda: publisher.publish([BlockStored([b"\x02" * 32], None, list(range(16)), 16)]))
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

    with kv_event_publisher() as publisher, ServerThread(standin_app(state)) as server:
        bare = asyncio.run(scenario(server, None))
        with_events = asyncio.run(scenario(server, publisher.endpoint))
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
