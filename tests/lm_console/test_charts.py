"""The charts tab: throughput, KV usage and latency over time, from the telemetry's points."""

from __future__ import annotations

import asyncio

from textual_plotext import PlotextPlot

from lm_console.tui.demo import demo_app, drive_load
from lm_console.tui.widgets.charts_view import CHARTS, ChartsView


def test_charts_plot_the_telemetry_points_with_time_on_x() -> None:
    async def scenario() -> None:
        app, client, clock = demo_app()
        async with app.run_test(size=(120, 36)) as pilot:
            await drive_load(app, client, clock, num_steps=84)  # 4.2 s of the fake engine's time
            points = list(app.telemetry.chart)
            assert len(points) >= 4 and all(b.ts - a.ts >= 1.0 for a, b in zip(points, points[1:]))
            await pilot.press("3")
            await pilot.pause()
            assert app.query_one("TabbedContent").active == "charts-tab"
            for key, title in CHARTS:
                plot = app.query_one(f"#chart-{key}", PlotextPlot)
                assert plot.border_title == title
                text = plot.plt.build()
                assert "seconds (0 = now)" in text and "-60" in text  # at least a minute on the x axis
            # The throughput chart's series are the telemetry's own figures.
            drawn = app.query_one(ChartsView).drawn
            now = clock()
            assert drawn["throughput"]["prompt"] == ([p.ts - now for p in points], [p.prompt_tps for p in points])
            assert drawn["throughput"]["generated"][1] == [p.gen_tps for p in points]
            assert drawn["kv"]["in use"][1] == [p.kv_usage * 100 for p in points]
            assert drawn["ttft"]["p50"][1] == [p.ttft_p50 * 1000 for p in points if p.ttft_p50 is not None]
            assert max(drawn["throughput"]["prompt"][1]) > 0

    asyncio.run(scenario())
