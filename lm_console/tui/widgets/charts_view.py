"""ChartsView: the third tab, charts with axes over the last minutes (time on x, 0 = now).

Throughput (prompt and generated tok/s), KV cache usage and the latency medians (TTFT, TPOT),
from Telemetry.chart (one point a second). Drawn with textual-plotext, redrawn at most once a
second and only while the tab is shown (plotext builds its text in Python: tens of ms a chart).
"""

from __future__ import annotations

from collections.abc import Sequence

from textual.app import ComposeResult
from textual.containers import Grid
from textual_plotext import PlotextPlot

from lm_console.tui.telemetry import ChartPoint

CHARTS = (("throughput", "Throughput (tok/s)"), ("kv", "KV cache usage (%)"),
          ("ttft", "TTFT p50 (ms)"), ("tpot", "TPOT p50 (ms)"))


class ChartsView(Grid):
    """A 2x2 grid of charts; `show(points, now)` redraws them."""

    DEFAULT_CSS = """
    ChartsView { grid-size: 2 2; grid-gutter: 0 1; height: 1fr; }
    ChartsView PlotextPlot { border: round $primary 60%; border-title-color: $text; border-title-style: bold; }
    """

    drawn: dict[str, dict[str, tuple[list[float], list[float]]]]  # chart -> series -> (xs, ys) last drawn

    def compose(self) -> ComposeResult:
        self.drawn = {}
        for key, title in CHARTS:
            plot = PlotextPlot(id=f"chart-{key}")
            plot.border_title = title
            yield plot

    def show(self, points: Sequence[ChartPoint], now: float, span_s: float) -> None:
        """Redraw every chart from the points (x: seconds before `now`)."""
        xs = [p.ts - now for p in points]
        self._draw("throughput", xs, {"prompt": [p.prompt_tps for p in points],
                                      "generated": [p.gen_tps for p in points]}, span_s)
        self._draw("kv", xs, {"in use": [p.kv_usage * 100 for p in points]}, span_s, y_max=100.0)
        self._draw("ttft", *_defined(xs, [p.ttft_p50 for p in points], "p50"), span_s)
        self._draw("tpot", *_defined(xs, [p.tpot_p50 for p in points], "p50"), span_s)

    def _draw(self, key: str, xs: list[float], series: dict[str, list[float]], span_s: float,
              y_max: float | None = None) -> None:
        plot = self.query_one(f"#chart-{key}", PlotextPlot)
        self.drawn[key] = {name: (xs[-len(values):] if values else [], list(values)) for name, values in series.items()}
        plt = plot.plt
        plt.clear_data()
        plt.clear_figure()
        plt.xlim(-span_s, 0)
        plt.xlabel("seconds (0 = now)")
        top = max([y_max or 0.0] + [max(values) for values in series.values() if values])
        plt.ylim(0, top * 1.05 if top > 0 else 1.0)
        for (name, values), colour in zip(series.items(), ("cyan", "green", "magenta")):
            if xs and values:
                plt.plot(xs[-len(values):], values, label=name if len(series) > 1 else None,
                         color=colour, marker="hd")
        plot.refresh()


def _defined(xs: list[float], values: list[float | None], name: str) -> tuple[list[float], dict[str, list[float]]]:
    """The points where the value is known, in ms."""
    pairs = [(x, v * 1000) for x, v in zip(xs, values) if v is not None]
    return [x for x, _ in pairs], {name: [v for _, v in pairs]}
