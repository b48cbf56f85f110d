"""A vLLM server's own figures from its /metrics: requests done, latency quantiles, hit rate, old names.

tests/data/vllm_metrics/vllm-0.32.0-cpu.txt is a real vLLM 0.32.0 CPU server's /metrics after 68
requests (tests/data/kv_events/README.md: the same server). The expected quantiles are worked out
by hand below from its buckets (Prometheus' histogram_quantile: linear inside the bucket the rank
falls in).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from console_helpers import SIZE, text_of, until
from http_helpers import ServerThread
from openai_standin import StandinState, standin_app

from lm_console.client.remote import RemoteConsoleClient
from lm_console.client.types import StatsSnapshot
from lm_console.client.vllm_metrics import TPOT, MetricsSampler, parse_metrics, server_figures
from lm_console.request_book import RequestBook
from lm_console.tui.app import ConsoleApp
from lm_console.tui.render import fmt_pct, fmt_seconds
from lm_console.tui.telemetry import Telemetry

REAL = (Path(__file__).resolve().parents[1] / "data" / "vllm_metrics" / "vllm-0.32.0-cpu.txt").read_text()

# TTFT: 68 observations; cumulative 33 at le=2.5 and 68 at le=5.0.
TTFT_P50 = 2.5 + 2.5 * (0.50 * 68 - 33) / (68 - 33)
TTFT_P95 = 2.5 + 2.5 * (0.95 * 68 - 33) / (68 - 33)
# TPOT (per request): 68; 24 at le=0.075, 37 at le=0.1 (p50); 63 at le=0.2, 68 at le=0.3 (p95).
TPOT_P50 = 0.075 + 0.025 * (0.50 * 68 - 24) / (37 - 24)
TPOT_P95 = 0.2 + 0.1 * (0.95 * 68 - 63) / (68 - 63)
# ITL: 76; 27 at le=0.075, 43 at le=0.1 (p50); 70 at le=0.2, 76 at le=0.3 (p95).
ITL_P50 = 0.075 + 0.025 * (0.50 * 76 - 27) / (43 - 27)
ITL_P95 = 0.2 + 0.1 * (0.95 * 76 - 70) / (76 - 70)


def test_the_figures_of_a_real_vllm_0_32_scrape() -> None:
    figures = server_figures(parse_metrics(REAL))
    assert (figures.num_finished, figures.num_failed) == (68, 0)  # all 68 finished by length
    assert (figures.prefix_queries, figures.prefix_hits) == (110370, 17408)
    assert figures.missing == []
    expected = {"ttft_p50": TTFT_P50, "ttft_p95": TTFT_P95, "tpot_p50": TPOT_P50, "tpot_p95": TPOT_P95,
                "itl_p50": ITL_P50, "itl_p95": ITL_P95}
    assert {name: getattr(figures, name) for name in expected} == pytest.approx(expected, rel=1e-12)


def test_older_names_count_as_the_current_ones() -> None:
    old = "\n".join(line.replace("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds")
                    .replace("vllm:prefix_cache_", "vllm:gpu_prefix_cache_")
                    for line in REAL.splitlines()
                    if "request_time_per_output_token" not in line) + "\n"
    figures = server_figures(parse_metrics(old))
    assert figures.itl_p50 == pytest.approx(ITL_P50, rel=1e-12)  # the ITL histogram under its old name
    assert (figures.prefix_queries, figures.prefix_hits) == (110370, 17408)
    assert figures.missing == [TPOT] and figures.tpot_p50 is None


def test_failed_requests_are_abort_and_error() -> None:
    lines = []
    for line in REAL.splitlines():
        if line.startswith("vllm:request_success_total") and 'finished_reason="abort"' in line:
            line = line.rsplit(" ", 1)[0] + " 3.0"
        if line.startswith("vllm:request_success_total") and 'finished_reason="repetition"' in line:
            line = line.rsplit(" ", 1)[0] + " 2.0"
        lines.append(line)
    figures = server_figures(parse_metrics("\n".join(lines) + "\n"))
    assert (figures.num_finished, figures.num_failed) == (70, 3)


def test_the_telemetry_shows_the_servers_figures_not_the_consoles() -> None:
    book = RequestBook()
    telemetry = Telemetry(book)
    sampler = MetricsSampler()
    telemetry.add_stats(sampler.sample(parse_metrics(REAL), now=1.0))
    view = telemetry.flush(2.0)
    assert view.figures_source == "server" and view.num_finished == 68
    assert view.ttft_p50 == pytest.approx(TTFT_P50) and view.itl_p95 == pytest.approx(ITL_P95)
    assert view.hit_rate_all == pytest.approx(17408 / 110370)
    # Negative control: a snapshot without server figures (an lm-console server's) leaves the console's own.
    own = Telemetry(book)
    own.add_stats(StatsSnapshot(timestamp=1.0))
    view = own.flush(2.0)
    assert view.figures_source == "" and view.num_finished == 0 and view.ttft_p50 is None


def test_the_dashboard_on_a_vllm_scrape_names_what_is_missing() -> None:
    state = StandinState()
    state.metrics_text = "\n".join(line for line in REAL.splitlines()
                                   if "request_time_per_output_token" not in line) + "\n"

    async def scenario(server: ServerThread) -> dict:
        client = RemoteConsoleClient(server.url, poll_interval_s=0.05)
        app = ConsoleApp(client, tick_hz=0)
        async with app.run_test(size=SIZE) as pilot:
            await until(pilot, app, lambda: app.telemetry.view.num_finished == 68, "the server's requests done")
            app.tick()
            await pilot.pause()
            seen = {"header": text_of(app.query_one("#engine-status")),
                    "latency": text_of(app.query_one("#latency")),
                    "latency_note": str(app.query_one("#latency").border_subtitle),
                    "throughput": text_of(app.query_one("#throughput")),
                    "prefix": text_of(app.query_one("#prefix")), "own": app.book.num_finished}
            await pilot.press("q")
        return seen

    with ServerThread(standin_app(state)) as server:
        seen = asyncio.run(scenario(server))
    assert "requests done 68 · failed 0 (server)" in seen["throughput"] and seen["own"] == 0
    assert f"TTFT  p50 {fmt_seconds(TTFT_P50):>7}" in seen["latency"] and fmt_seconds(ITL_P95) in seen["latency"]
    assert "not exported: request_time_per_output_token_seconds" in seen["latency_note"]
    assert "unavailable ─" in seen["header"] and "latency: no vllm:request_time_per_output_token_seconds" in seen["header"]
    assert "block map:" in seen["header"] and "KV events:" in seen["header"]  # no --kv-events-endpoint given
    assert f"server {fmt_pct(17408 / 110370)}" in seen["prefix"]
