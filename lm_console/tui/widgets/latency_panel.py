"""LatencyPanel: TTFT and TPOT p50 / p95 over the recently finished requests."""

from __future__ import annotations

from textual.widgets import Static

from lm_console.tui.render import fmt_seconds
from lm_console.tui.telemetry import DashboardView


class LatencyPanel(Static):
    """Time to first token and time per output token, from the console's finished requests."""

    def on_mount(self) -> None:
        self.border_title = "Latency"

    def show(self, view: DashboardView) -> None:
        self.update(
            f"TTFT  p50 [b]{fmt_seconds(view.ttft_p50):>7}[/b]  p95 {fmt_seconds(view.ttft_p95):>7}\n"
            f"TPOT  p50 [b]{fmt_seconds(view.tpot_p50):>7}[/b]  p95 {fmt_seconds(view.tpot_p95):>7}"
        )
