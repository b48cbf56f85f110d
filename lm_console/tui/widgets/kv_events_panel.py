"""KVEventsPanel: the KV-event log with its filter box and status title."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import Input

from lm_console.client.types import KVEventRecord
from lm_console.tui.widgets.kv_event_log import KVEventLog


class KVEventsPanel(Vertical):
    """The event log; `/` shows the filter input, escape or enter hides it."""

    def compose(self) -> ComposeResult:
        yield Input(placeholder="filter (e.g. Removed, a hash prefix); enter to apply", id="kv-filter")
        yield KVEventLog(id="kv-log")

    def on_mount(self) -> None:
        self.query_one("#kv-filter", Input).display = False
        self.update_title()

    def add(self, events: list[KVEventRecord], num_undecodable: int = 0) -> None:
        """New events; num_undecodable: messages the source skipped as unreadable (a running total)."""
        log = self.query_one(KVEventLog)
        log.num_undecodable = num_undecodable
        log.add(events)
        self.update_title()

    note: str | None = None  # set when the engine publishes no KV events

    def update_title(self) -> None:
        status = self.note if self.note else self.query_one(KVEventLog).status()
        self.border_title = f"KV events ─ {status}"

    def toggle_pause(self) -> bool:
        log = self.query_one(KVEventLog)
        log.paused = not log.paused
        self.update_title()
        return log.paused

    def open_filter(self) -> None:
        box = self.query_one("#kv-filter", Input)
        box.display = True
        box.focus()

    def on_input_changed(self, event: Input.Changed) -> None:
        self.query_one(KVEventLog).filter_text = event.value.strip()
        self.update_title()

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.input.display = bool(event.value)
        self.screen.set_focus(None)
