"""`lmc tui --url` attached to a real vLLM 0.32 server with KV events, under `lmc bench serve --url` load.

The console reads what vLLM publishes: /metrics (its histograms and counters) and the ZMQ PUB of KV
events (msgpack maps tagged by "type"). While the load runs the block map (drawn from the events)
and the event log must move; once it is done, requests done, the TTFT / TPOT / ITL quantiles and
the prefix-cache hit rate on screen must equal what vLLM's /metrics says at that moment, computed
here independently from the raw exposition text (Prometheus' histogram_quantile rule).
"""

from __future__ import annotations

import asyncio
import math
import subprocess
import sys
import time
from pathlib import Path

import httpx
import msgspec
import pytest
from prometheus_client.parser import text_string_to_metric_families

from lm_console.client.remote import RemoteConsoleClient
from lm_console.engine.metrics.stats import BLOCK_STATE_CACHED
from lm_console.tui.app import ConsoleApp
from lm_console.tui.render import fmt_count, fmt_seconds
from lm_console.tui.widgets.kv_event_log import KVEventLog

# The first test to ask for the server waits for vLLM to start (it compiles its model: up to 20 minutes on a
# busy 2-core machine), beyond the suite's 600 s default.
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(2700)]
SIZE = (160, 48)
LOAD_DEADLINE_S = 900  # liveness bounds, not performance assertions
ROOT = Path(__file__).resolve().parents[2]


def _metrics(url: str) -> dict[str, object]:
    """What the test expects, read straight from vLLM's /metrics text (not through the console's parser)."""
    text = httpx.get(url + "/metrics", timeout=10).text
    buckets: dict[str, dict[float, float]] = {}
    finished: dict[str, float] = {}
    counters: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.endswith("_bucket"):
                per_bound = buckets.setdefault(sample.name[:-7], {})
                bound = float(sample.labels["le"])
                per_bound[bound] = per_bound.get(bound, 0.0) + sample.value
            elif sample.name == "vllm:request_success_total":
                reason = sample.labels["finished_reason"]
                finished[reason] = finished.get(reason, 0.0) + sample.value
            else:
                counters[sample.name] = counters.get(sample.name, 0.0) + sample.value
    return {"buckets": buckets, "finished": finished, "counters": counters}


def _quantile(q: float, per_bound: dict[float, float]) -> float | None:
    """histogram_quantile(q) as Prometheus defines it, written out again for the check."""
    bounds = sorted(per_bound)
    total = per_bound[bounds[-1]]
    if total == 0:
        return None
    rank, previous_bound, previous_count = q * total, 0.0, 0.0
    for bound in bounds:
        count = per_bound[bound]
        if count >= rank and count > previous_count:
            if math.isinf(bound):
                return previous_bound
            return previous_bound + (bound - previous_bound) * (rank - previous_count) / (count - previous_count)
        previous_bound, previous_count = bound, count
    return previous_bound


def _bench(url: str, out: Path) -> subprocess.Popen[bytes]:
    """Shared-prefix prompts longer than vLLM's CPU block (128 tokens): full blocks, so KV events."""
    return subprocess.Popen(
        [sys.executable, "-m", "lm_console.cli", "bench", "serve", "--url", url, "--dataset-name", "prefix",
         "--num-prompts", "12", "--prefix-len", "288", "--suffix-len", "16", "--num-prefixes", "2",
         "--random-output-len", "8", "--max-concurrency", "3", "--request-rate", "2", "--no-progress",
         "--save-result", str(out)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def test_the_console_reads_a_real_vllm_server(vllm_server, tmp_path) -> None:  # noqa: ANN001
    async def scenario() -> dict[str, object]:
        client = RemoteConsoleClient(vllm_server.url, kv_events_endpoint=vllm_server.kv_events_endpoint,
                                     poll_interval_s=0.5)
        app = ConsoleApp(client, tick_hz=4)
        seen: dict[str, object] = {}
        async with app.run_test(size=SIZE) as pilot:
            async def until(condition, what: str, deadline_s: float = 120) -> None:  # noqa: ANN001
                end = time.monotonic() + deadline_s
                while not condition():
                    assert app.dead_error is None, f"the console died: {app.dead_error!r}"
                    assert time.monotonic() < end, f"the console never showed {what}"
                    await pilot.pause(0.25)

            await until(lambda: app.engine_state == "serving" and app.telemetry.view.num_stats > 0, "the server")
            seen["header"] = str(app.query_one("#engine-status").render())
            log = app.query_one(KVEventLog)
            bench = _bench(vllm_server.url, tmp_path / "bench.json")
            try:
                # Live under load: events arrive and the map fills while the benchmark still runs.
                await until(lambda: log.num_received > 0 and (app.telemetry.view.block_states or b"").count(
                    BLOCK_STATE_CACHED) > 0, "KV events and a block map under load", LOAD_DEADLINE_S)
                seen["live_while_loading"] = bench.poll() is None
                seen["events_during_load"] = log.num_received
                seen["map_cells_during_load"] = app.telemetry.view.block_states.count(BLOCK_STATE_CACHED)
                output, _ = await asyncio.to_thread(bench.communicate, timeout=LOAD_DEADLINE_S)
            finally:
                if bench.poll() is None:
                    bench.kill()
            seen["bench_rc"], seen["bench_output"] = bench.returncode, output.decode(errors="replace")
            # The load is over: /metrics is still, so "at that moment" is any moment from here on.
            await asyncio.sleep(2.0)
            expected = await asyncio.to_thread(_metrics, vllm_server.url)
            done = sum(v for reason, v in expected["finished"].items() if reason not in ("abort", "error"))
            await until(lambda: app.telemetry.view.num_finished == done, "vLLM's requests done", 30)
            await pilot.pause(1.0)  # two more polls and ticks at the same values
            view = app.telemetry.view
            seen["view"] = {name: getattr(view, name) for name in (
                "num_finished", "num_failed", "ttft_p50", "ttft_p95", "tpot_p50", "tpot_p95", "itl_p50", "itl_p95",
                "hit_rate_all", "figures_source")}
            seen["expected"] = expected
            seen["throughput"] = str(app.query_one("#throughput").render())
            seen["latency"] = str(app.query_one("#latency").render())
            seen["latency_title"] = str(app.query_one("#latency").border_title)
            seen["pool_title"] = str(app.query_one("#block-pool").border_title)
            seen["pool_subtitle"] = str(app.query_one("#block-pool").border_subtitle)
            seen["events_title"] = str(app.query_one("#kv-events").border_title)
            seen["log_unknown"], seen["log_received"] = log.num_unknown, log.num_received
            seen["own_requests"] = app.book.num_finished
            seen["undecodable"] = client.num_kv_undecodable
            app.save_screenshot(str(tmp_path / "console.svg"))
            await pilot.press("q")
        return seen

    seen = asyncio.run(scenario())
    assert seen["bench_rc"] == 0, seen["bench_output"]
    result = msgspec.json.decode((tmp_path / "bench.json").read_bytes())
    assert result["completed"] == 12

    # The header names what a vLLM server cannot fill, and why.
    header = seen["header"]
    assert "unavailable ─" in header and "per-step stats" in header and "server's request table" in header
    assert "block map:" not in header and "KV events:" not in header  # both come from its KV events

    assert seen["live_while_loading"], "the map and the log only moved after the load"
    assert seen["events_during_load"] > 0 and seen["map_cells_during_load"] > 0
    assert seen["log_unknown"] == 0 and seen["undecodable"] == 0
    assert "prefix cache" in seen["pool_title"] and "(KV events), not its block ids" in seen["pool_subtitle"]
    assert "received" in seen["events_title"] and "unknown" not in seen["events_title"]

    view, expected = seen["view"], seen["expected"]
    finished, buckets = expected["finished"], expected["buckets"]
    done = int(sum(v for reason, v in finished.items() if reason not in ("abort", "error")))
    assert done >= 12 and view["figures_source"] == "server"
    # Negative control: the console's own requests (it sent none) are not what it shows.
    assert seen["own_requests"] == 0 and view["num_finished"] != seen["own_requests"]
    assert view["num_finished"] == done
    assert view["num_failed"] == int(sum(v for reason, v in finished.items() if reason in ("abort", "error")))
    for key, name in (("ttft", "vllm:time_to_first_token_seconds"),
                      ("tpot", "vllm:request_time_per_output_token_seconds"),
                      ("itl", "vllm:inter_token_latency_seconds")):
        p50, p95 = _quantile(0.50, buckets[name]), _quantile(0.95, buckets[name])
        assert p50 is not None and p95 is not None, name
        assert view[f"{key}_p50"] == pytest.approx(p50, rel=1e-12, abs=1e-15), name
        assert view[f"{key}_p95"] == pytest.approx(p95, rel=1e-12, abs=1e-15), name
    counters = expected["counters"]
    hits, queries = counters["vllm:prefix_cache_hits_total"], counters["vllm:prefix_cache_queries_total"]
    assert queries > 0 and hits > 0  # shared prefixes: the cache hit
    assert view["hit_rate_all"] == pytest.approx(hits / queries, rel=1e-12)
    # What the panels print is those numbers.
    assert f"requests done {fmt_count(done)}" in seen["throughput"]
    assert fmt_seconds(view["ttft_p50"]) in seen["latency"] and fmt_seconds(view["itl_p95"]) in seen["latency"]
    assert seen["latency_title"] == "Latency (server, since start)"
