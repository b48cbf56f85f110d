"""EngineDeadScreen: the red panel over the console when the engine fails or dies."""

from __future__ import annotations

from pathlib import Path

from textual.app import ComposeResult
from textual.binding import Binding
from textual.screen import ModalScreen

from lm_console.tui.widgets.engine_error import EngineErrorPanel


class EngineDeadScreen(ModalScreen[None]):
    """Shows the error and what to do; q quits, escape goes back to the (frozen) console."""

    BINDINGS = [Binding("q,ctrl+q", "app.quit", "quit"), Binding("escape", "dismiss", "back")]

    def __init__(self, error: BaseException, log_path: Path | None = None) -> None:
        super().__init__()
        self.error = error
        self.log_path = log_path

    def compose(self) -> ComposeResult:
        yield EngineErrorPanel(id="engine-error")

    def on_mount(self) -> None:
        self.query_one(EngineErrorPanel).show_error(self.error, self.log_path)

    async def action_dismiss(self, result: None = None) -> None:
        self.dismiss(result)
