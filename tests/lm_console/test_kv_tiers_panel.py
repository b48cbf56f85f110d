"""The KV tiers panel: telemetry folds tier counters into rates; the panel stays hidden without tiers."""

from __future__ import annotations

import asyncio
from lm_console.engine.metrics.stats import KVTierStats, SchedulerStats
from lm_console.client import FakeConsoleClient
from lm_console.request_book import RequestBook
from lm_console.tui.app import ConsoleApp
from lm_console.tui.telemetry import Telemetry
from lm_console.tui.widgets.kv_tiers_panel import KVTiersPanel, fmt_bytes


def tiers(bytes_in: int, bytes_out: int) -> list[KVTierStats]:
    return [KVTierStats("CPU", capacity_bytes=1 << 30, used_bytes=1 << 29, num_chunks=100, hits=3, misses=1,
                        bytes_in=bytes_in, bytes_out=bytes_out),
            KVTierStats("DISK", capacity_bytes=1 << 32, used_bytes=1 << 30, hits=1, misses=1, errors=2)]


def test_telemetry_tier_rates() -> None:
    telemetry = Telemetry(RequestBook(), window_s=2.0)
    telemetry.add_stats(SchedulerStats(timestamp=10.0, kv_tiers=tiers(0, 0)))
    telemetry.add_stats(SchedulerStats(timestamp=11.0, kv_tiers=tiers(4 << 20, 8 << 20)))
    view = telemetry.flush(11.0)
    assert [t.medium for t in view.kv_tiers] == ["CPU", "DISK"]
    assert view.kv_tier_rates["CPU"] == (4 << 20, 8 << 20)
    assert (fmt_bytes(812), fmt_bytes(12 << 10), fmt_bytes(3.4 * (1 << 20)), fmt_bytes(1 << 31)) == ("812", "12K", "3.4M", "2.0G")


def test_panel_hidden_without_tiers_and_shown_with_them(clock) -> None:  # noqa: ANN001
    async def scenario() -> None:
        client = FakeConsoleClient(auto_step=False, clock=clock, num_blocks=64)
        app = ConsoleApp(client, clock=clock, tick_hz=0)
        async with app.run_test(size=(120, 36)) as pilot:
            await pilot.pause()
            app.tick()
            await pilot.pause()
            panel = app.query_one(KVTiersPanel)
            assert not panel.display
            client.push_stats(SchedulerStats(timestamp=clock(), kv_tiers=tiers(1 << 20, 2 << 20)))
            await pilot.pause()
            app.tick()
            await pilot.pause()
            text = str(panel.render())
            assert panel.display and "CPU" in text and "DISK" in text and "50%" in text and "hit  75%" in text
            assert "err 2" in str(panel.border_subtitle)

    asyncio.run(scenario())
