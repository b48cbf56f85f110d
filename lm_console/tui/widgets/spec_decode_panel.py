"""SpecDecodePanel: speculative decoding's acceptance over time (hidden when the engine does not speculate).

Acceptance rate = accepted / proposed draft tokens; mean accepted length = tokens a verifying
request-step emits, the target's own token included (1 + accepted / drafts, vLLM's mean
acceptance length). "recent" is over the samples since the previous refresh, the sparkline its
history, "all" since the engine started.
"""

from __future__ import annotations

from textual.widgets import Static

from lm_console.tui.render import fmt_count, fmt_pct, sparkline
from lm_console.tui.telemetry import DashboardView


class SpecDecodePanel(Static):
    """Acceptance rate (recent, history, all), mean accepted length, drafts and tokens."""

    def on_mount(self) -> None:
        self.border_title = "Speculative decoding"
        self.display = False

    def show(self, view: DashboardView) -> None:
        spec = view.spec_decoding
        if spec is None:
            return
        self.display = True
        width = max(self.content_size.width - 16, 4)
        mean_all = spec.mean_acceptance_length
        mean_recent = view.spec_mean_length_recent
        self.update(
            f"accepted [b]{fmt_pct(view.spec_acceptance_recent)}[/b] recent · all {fmt_pct(spec.acceptance_rate)}\n"
            f"[#98c379]{sparkline(view.spec_acceptance_history, width, 1.0)}[/] "
            f"len {'-' if mean_recent is None else f'{mean_recent:.2f}'}\n"
            f"mean accepted length {'-' if mean_all is None else f'{mean_all:.2f}'} · drafts "
            f"{fmt_count(spec.num_drafts)} · accepted {fmt_count(spec.num_accepted_tokens)}/"
            f"{fmt_count(spec.num_draft_tokens)}"
        )
