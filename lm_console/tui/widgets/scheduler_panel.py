"""SchedulerPanel: running / waiting / preempted, token budget per step (bar + sparkline), steps/s."""

from __future__ import annotations

from textual.widgets import Static

from lm_console.tui.render import bar, fmt_count, sparkline
from lm_console.tui.telemetry import DashboardView


class SchedulerPanel(Static):
    """The scheduler's queues and how full each step's token budget is."""

    note: str | None = None  # set when the engine publishes no per-step stats (a /metrics-only server)

    def on_mount(self) -> None:
        self.border_title = "Scheduler"

    def show(self, view: DashboardView) -> None:
        width = max(self.content_size.width, 20)
        if self.note:
            preempted = f"preempted [b]{view.num_preempted_total}[/b]"
            self.update(f"running [b]{view.num_running}[/b]  waiting [b]{view.num_waiting}[/b]  {preempted}\n"
                        f"[#7f848e]{self.note}[/]")
            return
        budget = view.token_budget or 1
        label = f"{fmt_count(view.scheduled_tokens)}/{fmt_count(view.token_budget)}"
        bar_width = max(width - len(label) - 10, 4)
        preempted = f"preempted [b]{view.num_preempted_total}[/b]"
        if view.num_preempted_recent:  # preemptions in the last seconds, highlighted
            preempted = f"[#e5c07b]preempt [b]{view.num_preempted_total}[/b] (+{view.num_preempted_recent})[/]"
        self.update(
            f"running [b]{view.num_running}[/b]  waiting [b]{view.num_waiting}[/b]  {preempted}\n"
            f"budget ▕[#61afef]{bar(view.scheduled_tokens / budget, bar_width)}[/]▏{label}\n"
            f"[#61afef]{sparkline(view.tokens_per_step, max(width - 12, 4), float(budget))}[/] tokens/step\n"
            f"{view.steps_per_s:.1f} steps/s · step {view.step_ms:.0f} ms · {fmt_count(view.num_steps)} steps"
        )
