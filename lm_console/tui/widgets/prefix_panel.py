"""PrefixPanel: prefix-cache hit rate over the recent requests and overall, with a sparkline."""

from __future__ import annotations

from textual.widgets import Static

from lm_console.tui.render import fmt_pct, sparkline
from lm_console.tui.telemetry import DashboardView


class PrefixPanel(Static):
    """Hit rate = cached prompt tokens / prompt tokens looked up."""

    def __init__(self, recent_requests: int = 1000, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.recent_requests = recent_requests

    def on_mount(self) -> None:
        self.border_title = "Prefix cache"

    def show(self, view: DashboardView) -> None:
        width = max(self.content_size.width - 16, 4)
        recent = f"last {self.recent_requests // 1000}k req" if self.recent_requests >= 1000 else f"last {self.recent_requests} req"
        self.update(
            f"hit rate [b]{fmt_pct(view.hit_rate_recent)}[/b] ({recent})\n"
            f"[#e5c07b]{sparkline(view.hit_rate_history, width, 1.0)}[/] "
            f"{'server' if view.figures_source == 'server' else 'all'} {fmt_pct(view.hit_rate_all)}"
        )
