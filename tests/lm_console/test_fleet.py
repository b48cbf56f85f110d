"""The fleet over three live `lmc serve` apps (build_app over a tiny model, 127.0.0.1): the fleet tab
(Pilot) with a decode stall, a server stopped and replaced on its URL, and drill-down; `lmc top --once`."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
from console_helpers import DEADLINE_S, SIZE, text_of, until
from http_helpers import API_KEY, ServerThread, lmc_app

from lm_console.fleet.alerts import DECODE_STALL, DOWN
from lm_console.fleet.metrics import ITL, TTFT, bucket_delta, histogram_quantile, parse_reading
from lm_console.fleet.monitor import UP

pytestmark = pytest.mark.slow

NAMES = ("a", "b", "c")


@pytest.fixture(scope="module")
def fleet_servers(tiny_llama_dir):  # noqa: ANN001, ANN201
    """Three engines, each behind the real server app; `servers` is replaced when a test restarts one."""
    from lm_console.engine import AsyncLLM

    # a runs two requests at a time (four make two wait); b and c take a trace's bursts.
    llms = [AsyncLLM(str(tiny_llama_dir), dtype="float32", max_model_len=256, num_gpu_blocks_override=64,
                     max_num_seqs=2 if name == "a" else 16, stat_loggers=[]) for name in NAMES]
    state = SimpleNamespace(llms=dict(zip(NAMES, llms)), servers={})
    try:
        for name, llm in state.llms.items():
            state.servers[name] = ServerThread(lmc_app(llm, idle_snapshot_s=0.2)).start()
        yield state
    finally:
        for server in state.servers.values():
            server.stop()
        for llm in llms:
            llm.shutdown()


def write_fleet(path: Path, servers: dict, alerts: str = "") -> Path:
    entries = "".join(f'[[server]]\nname = "{name}"\nurl = "{server.url}"\napi_key = "{API_KEY}"\n\n'
                      for name, server in servers.items())
    # Short polls and a short stall threshold keep the test quick; a long latency window keeps
    # every request of the test in it, so the quantiles equal the servers' whole histograms.
    path.write_text(f"poll_interval_s = 0.25\nlatency_window_s = 3600\n\n{entries}[alerts]\n{alerts}\n")
    return path


def metrics_of(url: str) -> str:
    return httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=10).text


def test_the_fleet_view_tracks_live_servers_alerts_and_a_server_that_goes_away(fleet_servers, tmp_path) -> None:  # noqa: ANN001
    from lm_console.engine import RequestOutputKind, SamplingParams
    from lm_console.fleet.config import load_fleet
    from lm_console.tui.fleet_app import FleetConsoleApp
    from lm_console.tui.widgets.fleet_view import AlertLog, FleetTable

    servers, llm = fleet_servers.servers, fleet_servers.llms["a"]
    config = load_fleet(write_fleet(tmp_path / "fleet.toml", servers,
                                    "decode_stall_s = 1.0\ndown_after_failures = 1\n"))
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=200, output_kind=RequestOutputKind.DELTA)
    ids = [f"fleet-{i}" for i in range(4)]
    tasks: list[asyncio.Task] = []

    async def submit() -> None:
        async def one(request_id: str) -> None:
            async for _ in llm.generate(f"{request_id} asks about the history of tea", params, request_id):
                pass

        tasks.extend(asyncio.get_running_loop().create_task(one(i)) for i in ids)

    def row(app: FleetConsoleApp, name: str):  # noqa: ANN202
        return next(r for r in app.rows if r.name == name)

    async def scenario() -> dict:
        app = FleetConsoleApp(config, tick_hz=0)
        seen: dict = {}
        async with app.run_test(size=SIZE) as pilot:
            await until(pilot, app, lambda: len(app.rows) == 3 and all(r.state == UP for r in app.rows), "3 up")
            seen["kinds"] = {r.name: r.kind for r in app.rows}
            # Load on a; once tokens flow, a's engine sleeps with requests running: a decode stall.
            server_a = servers["a"]
            server_a.call(submit)
            await until(pilot, app, lambda: row(app, "a").figures.gen_tps > 0 and row(app, "a").figures.running == 2,
                        "a generating")
            server_a.call(lambda: llm.sleep(1))
            await until(pilot, app, lambda: DECODE_STALL in row(app, "a").alerts, "a's decode stall alert")
            polls = app.fleet.num_polls
            await until(pilot, app, lambda: app.fleet.num_polls >= polls + 2, "two polls of the sleeping engine")
            # The engine holds still: the row and a fresh /metrics describe the same moment.
            seen["rows"] = {r.name: r for r in app.rows}
            # The quantiles are over the console's window: since its first reading of each server
            # (a server of this module may have answered other tests' requests before).
            seen["bases"] = {m.name: m.history[0] for m in app.fleet.monitors}
            seen["metrics"] = {name: metrics_of(server.url) for name, server in servers.items()}
            seen["header_stall"] = text_of(app.query_one("#fleet-alerts"))
            seen["table_a"] = [str(c) for c in app.query_one(FleetTable).get_row("a")]
            server_a.call(lambda: llm.wake_up())
            await until(pilot, app, lambda: DECODE_STALL not in row(app, "a").alerts, "the stall cleared")
            server_a.call(lambda: llm.abort(ids))

            # c, whose dashboard is open, goes away: a DOWN row and a `down` alert; the dashboard
            # says dead, and the console keeps running (no modal over the fleet).
            await app.drill_down("c")
            await until(pilot, app, lambda: app.engine_state == "serving" and app.attached == "c", "c's dashboard")
            port = servers["c"].port
            servers["c"].stop()
            await until(pilot, app, lambda: row(app, "c").state == "down" and app.engine_state == "dead", "c down")
            seen["screen_down"] = type(app.screen).__name__
            seen["header_down"] = text_of(app.query_one("#fleet-alerts"))
            seen["c_down"] = row(app, "c")
            # A replacement answers on the same URL: c is up again and its alert clears.
            servers["c"] = ServerThread(lmc_app(fleet_servers.llms["c"], idle_snapshot_s=0.2), port=port).start()
            await until(pilot, app, lambda: row(app, "c").state == UP and not row(app, "c").alerts, "c back")
            seen["header_back"] = text_of(app.query_one("#fleet-alerts"))
            seen["log"] = [(e.server, e.kind, e.fired) for e in app.fleet.alerts.log]
            seen["log_lines"] = len(app.query_one(AlertLog).lines)

            # Drill-down: enter on b's row attaches the dashboard to b.
            table = app.query_one(FleetTable)
            table.focus()
            table.move_cursor(row=table.get_row_index("b"))
            await pilot.press("enter")
            await until(pilot, app, lambda: app.engine_state == "serving" and app.attached == "b", "b's dashboard")
            app.tick()  # the header is drawn on the tick
            seen["tab"] = app.query_one("#tabs").active
            seen["header"] = text_of(app.query_one("#engine-status"))
            await pilot.press("q")
        return seen

    seen = asyncio.run(asyncio.wait_for(scenario(), DEADLINE_S * 2))

    async def finish() -> None:
        await asyncio.gather(*tasks, return_exceptions=True)

    servers["a"].call(finish)
    assert seen["kinds"] == {"a": "lm-console", "b": "lm-console", "c": "lm-console"}
    for name, text in seen["metrics"].items():
        reading, shown = parse_reading(text, 0.0), seen["rows"][name].figures
        assert shown.running == reading.gauges["vllm:num_requests_running"]
        assert shown.waiting == reading.gauges["vllm:num_requests_waiting"]
        assert shown.kv_usage == pytest.approx(reading.gauges["vllm:kv_cache_usage_perc"])
        base = seen["bases"][name]
        for p50, p99, histogram in ((shown.ttft_p50, shown.ttft_p99, TTFT), (shown.itl_p50, shown.itl_p99, ITL)):
            window = bucket_delta(reading.buckets[histogram], base.buckets.get(histogram))
            assert p50 == histogram_quantile(0.5, window)
            assert p99 == histogram_quantile(0.99, window)
        queries = (reading.counters.get("vllm:prefix_cache_queries_total", 0.0)
                   - base.counters.get("vllm:prefix_cache_queries_total", 0.0))
        hits = reading.counters.get("vllm:prefix_cache_hits_total", 0.0) - base.counters.get("vllm:prefix_cache_hits_total", 0.0)
        assert shown.prefix_hit_rate == (pytest.approx(hits / queries) if queries else None)
    a = seen["rows"]["a"].figures
    assert (a.running, a.waiting) == (2, 2) and a.kv_usage > 0 and a.ttft_p50 is not None and a.itl_p99 is not None
    assert a.decode_stall_s >= 1.0 and "decode_stall" in seen["table_a"][-1]
    assert "a decode_stall" in seen["header_stall"]
    assert seen["c_down"].figures is None and DOWN in seen["c_down"].alerts
    assert "1 down" in seen["header_down"] and "c down" in seen["header_down"]
    assert seen["screen_down"] != "EngineDeadScreen"
    assert "no alerts" in seen["header_back"]
    log = seen["log"]
    assert log.index(("a", DECODE_STALL, True)) < log.index(("a", DECODE_STALL, False))
    assert log.index(("c", DOWN, True)) < log.index(("c", DOWN, False))
    assert seen["log_lines"] == len(log)
    assert seen["tab"] == "dashboard" and servers["b"].url in seen["header"]


def test_top_once_json_exits_1_while_an_alert_fires(fleet_servers, tmp_path) -> None:  # noqa: ANN001
    from typer.testing import CliRunner

    from lm_console.cli import app

    servers = {name: fleet_servers.servers[name] for name in ("a", "b")}
    quiet = write_fleet(tmp_path / "quiet.toml", servers)
    result = CliRunner().invoke(app, ["top", "--once", "--json", "--fleet", str(quiet), "--interval", "0.3"])
    assert result.exit_code == 0, result.output
    document = json.loads(result.stdout)
    assert [s["name"] for s in document["servers"]] == ["a", "b"] and document["alerts"] == []
    assert all(s["state"] == "up" and s["figures"]["running"] == 0 for s in document["servers"])

    # Thresholds from the file: a KV-usage alert at 0 fires on an idle server.
    strict = write_fleet(tmp_path / "strict.toml", servers, "kv_usage = 0\n")
    result = CliRunner().invoke(app, ["top", "--once", "--json", "--fleet", str(strict), "--interval", "0.3"])
    assert result.exit_code == 1, result.output
    document = json.loads(result.stdout)
    assert {(a["server"], a["kind"]) for a in document["alerts"]} == {("a", "kv_usage"), ("b", "kv_usage")}
    assert document["thresholds"]["kv_usage"] == 0

    # A server that does not answer: down, exit 1; the others still reported.
    result = CliRunner().invoke(app, ["top", "--once", "--json", "--fleet", str(quiet), "--url",
                                      "gone=http://127.0.0.1:9", "--interval", "0.3"])
    assert result.exit_code == 1, result.output
    document = json.loads(result.stdout)
    states = {s["name"]: s["state"] for s in document["servers"]}
    assert states == {"a": "up", "b": "up", "gone": "down"}
    assert [(a["server"], a["kind"]) for a in document["alerts"]] == [("gone", "down")]

    # The same fleet file is what `lmc tui --fleet` reads: a bad one is refused before any screen.
    (tmp_path / "typo.toml").write_text('[[server]]\nurl = "http://127.0.0.1:9"\n[alerts]\nkv_usag = 0.5\n')
    refused = CliRunner().invoke(app, ["tui", "--fleet", str(tmp_path / "typo.toml")])
    assert refused.exit_code == 2 and "unknown alert 'kv_usag'" in refused.output
    refused = CliRunner().invoke(app, ["tui", "--url", servers["a"].url, "--url", servers["b"].url,
                                       "--num-blocks", "8"])
    assert refused.exit_code == 2 and "--num-blocks" in refused.output


VLLM_METRICS = """\
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{{engine="0",model_name="m"}} 3.0
vllm:num_requests_running{{engine="1",model_name="m"}} 1.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{{engine="0",model_name="m"}} 2.0
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{{engine="0",model_name="m"}} 0.5
# TYPE vllm:generation_tokens counter
vllm:generation_tokens_total{{engine="0",model_name="m"}} {gen}
# TYPE vllm:num_preemptions counter
vllm:num_preemptions_total{{engine="0",model_name="m"}} {preempted}
# TYPE vllm:request_success counter
vllm:request_success_total{{engine="0",finished_reason="stop",model_name="m"}} 7.0
vllm:request_success_total{{engine="0",finished_reason="error",model_name="m"}} {failed}
# TYPE http_requests counter
http_requests_total{{handler="/v1/completions",method="POST",status="2xx"}} 9.0
http_requests_total{{handler="/v1/completions",method="POST",status="5xx"}} {http5xx}
# TYPE vllm:time_per_output_token_seconds histogram
vllm:time_per_output_token_seconds_bucket{{engine="0",le="0.1",model_name="m"}} {fast}
vllm:time_per_output_token_seconds_bucket{{engine="0",le="0.5",model_name="m"}} {slow}
vllm:time_per_output_token_seconds_bucket{{engine="0",le="+Inf",model_name="m"}} {slow}
vllm:time_per_output_token_seconds_count{{engine="0",model_name="m"}} {slow}
vllm:time_per_output_token_seconds_sum{{engine="0",model_name="m"}} 1.0
"""


def test_a_vllm_servers_metrics_become_figures_and_alerts() -> None:
    """vLLM's text (older names, two engines, HTTP 5xx and `error` finishes): rates over the window,
    quantiles of the window's buckets, a restart starting the counters over, and the alerts."""
    from lm_console.fleet.alerts import ERRORS, KV_USAGE, PREEMPTIONS, Thresholds, firing_kinds
    from lm_console.fleet.metrics import compute_figures, restarted

    def reading(t: float, **values: float):  # noqa: ANN202
        fields = {"gen": 100.0, "preempted": 0.0, "failed": 0.0, "http5xx": 0.0, "fast": 0.0, "slow": 0.0,
                  **values}
        return parse_reading(VLLM_METRICS.format(**fields), t)

    first, second = reading(0.0), reading(2.0, gen=300.0, preempted=4.0, failed=1.0, http5xx=1.0, fast=4.0,
                            slow=10.0)
    assert not first.is_ours and first.model == "m"
    figures = compute_figures([first, second], rate_window_s=10.0, latency_window_s=60.0)
    assert (figures.running, figures.waiting, figures.kv_usage) == (4, 2, 0.5)  # summed over engines
    assert (figures.gen_tps, figures.preemptions_per_s, figures.errors_per_s) == (100.0, 2.0, 1.0)
    # The window's ITL observations: 4 under 0.1 s, 6 in (0.1, 0.5]: p50 interpolates in the second bucket.
    assert figures.itl_p50 == pytest.approx(0.1 + 0.4 * (5 - 4) / 6)
    firing = firing_kinds(figures, False, Thresholds(kv_usage=0.5))
    assert set(firing) == {KV_USAGE, PREEMPTIONS, ERRORS}
    assert set(firing_kinds(figures, False, Thresholds())) == {PREEMPTIONS, ERRORS}
    # The server restarted: its counters went down, so what it counts now is all new.
    third = reading(3.0, gen=50.0)
    assert restarted(third, second)
    assert compute_figures([second, third], rate_window_s=10.0, latency_window_s=None).gen_tps == 50.0


def test_a_recorded_trace_replays_against_another_server_at_its_pace(fleet_servers, tmp_path) -> None:  # noqa: ANN001
    """200 requests to b, recorded with --save-trace; replayed to c with --replay-trace (and recorded
    again): the same lengths in the same order, and the recorded arrival times."""
    import subprocess
    import sys

    from typer.testing import CliRunner

    from lm_console.bench.trace import load_trace
    from lm_console.cli import app

    b, c = fleet_servers.servers["b"].url, fleet_servers.servers["c"].url
    recorded, replayed = tmp_path / "recorded.jsonl", tmp_path / "replayed.jsonl"
    common = ["bench", "serve", "--api-key", API_KEY, "--no-progress"]
    result = CliRunner().invoke(app, [*common, "--url", b, "--num-prompts", "200", "--random-input-len", "12",
                                      "--random-output-len", "2", "--request-rate", "40", "--seed", "3",
                                      "--save-trace", str(recorded)])
    assert result.exit_code == 0, result.output
    # The replay runs in a process of its own, as it would against a remote server: here the
    # servers' threads share this process (and its GIL) with any client in it.
    root = Path(__file__).resolve().parents[2]
    replay = subprocess.run([sys.executable, "-m", "lm_console.cli", *common, "--url", c, "--replay-trace",
                             str(recorded), "--save-trace", str(replayed)], cwd=root, capture_output=True, text=True,
                            timeout=DEADLINE_S)
    assert replay.returncode == 0, replay.stdout + replay.stderr
    first, second = load_trace(recorded), load_trace(replayed)
    assert len(first) == len(second) == 200
    assert [(r.input_length, r.output_length) for r in first] == [(r.input_length, r.output_length) for r in second]
    assert len({r.input_length for r in first}) > 1 and len({r.output_length for r in first}) > 1  # not constant
    span = first[-1].timestamp_ms
    assert span > 2000  # 200 requests at 40/s: several seconds of Poisson arrivals
    assert abs(second[-1].timestamp_ms - span) <= 0.05 * span
    # Each arrival within 5% of the span, for 95% of them: on a shared 2-core machine the client can
    # be descheduled for a moment, and the replay then catches up (it paces against its start).
    offs = sorted(abs(x.timestamp_ms - y.timestamp_ms) for x, y in zip(first, second))
    assert offs[int(0.95 * len(offs)) - 1] <= 0.05 * span, f"arrivals off by (ms): {offs[-20:]}"
