"""ThroughputPanel: prompt and generation tokens per second and KV usage, as sparklines."""

from __future__ import annotations

from textual.widgets import Static

from lm_console.tui.render import fmt_count, fmt_rate, sparkline
from lm_console.tui.telemetry import DashboardView


class ThroughputPanel(Static):
    """Prompt (prefill) and generated tokens per second over the last seconds."""

    def on_mount(self) -> None:
        self.border_title = "Throughput"

    def show(self, view: DashboardView) -> None:
        width = max(self.content_size.width - 20, 4)
        self.update(
            f"prompt [#c678dd]{sparkline(view.prompt_history, width)}[/] {fmt_rate(view.prompt_tps):>6} tok/s\n"
            f"gen    [#98c379]{sparkline(view.gen_history, width)}[/] {fmt_rate(view.gen_tps):>6} tok/s\n"
            f"KV     [#56b6c2]{sparkline(view.kv_history, width, 1.0)}[/] {view.kv_usage * 100:>5.0f}% used\n"
            f"requests done {fmt_count(view.num_finished)} · failed {fmt_count(view.num_failed)}"
            f"{' (server)' if view.figures_source == 'server' else ''}"
        )
