"""LatencyPanel: TTFT and TPOT p50 / p95 over the recently finished requests (or an attached server's)."""

from __future__ import annotations

from textual.widgets import Static

from lm_console.tui.render import fmt_seconds
from lm_console.tui.telemetry import DashboardView


class LatencyPanel(Static):
    """Time to first token, time per output token and (from a server) inter-token latency.

    The console's own finished requests, or, attached to a vLLM-compatible server, the quantiles of
    that server's histograms over everything it served since it started (its /metrics).
    """

    def on_mount(self) -> None:
        self.border_title = "Latency"

    def show(self, view: DashboardView) -> None:
        lines = [f"TTFT  p50 [b]{fmt_seconds(view.ttft_p50):>7}[/b]  p95 {fmt_seconds(view.ttft_p95):>7}",
                 f"TPOT  p50 [b]{fmt_seconds(view.tpot_p50):>7}[/b]  p95 {fmt_seconds(view.tpot_p95):>7}"]
        if view.figures_source == "server":
            lines.append(f"ITL   p50 [b]{fmt_seconds(view.itl_p50):>7}[/b]  p95 {fmt_seconds(view.itl_p95):>7}")
            self.border_title = "Latency (server, since start)"
            missing = ", ".join(name.removeprefix("vllm:") for name in view.missing_histograms)
            self.border_subtitle = f"not exported: {missing}" if missing else ""
            if self.parent is not None and self.parent.styles.height != 5:  # room for the ITL line
                self.parent.styles.height = 5
        self.update("\n".join(lines))
