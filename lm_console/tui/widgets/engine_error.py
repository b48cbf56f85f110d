"""EngineErrorPanel: the red panel shown instead of a traceback when the engine is unavailable."""

from __future__ import annotations

from pathlib import Path

from textual.markup import escape
from textual.widgets import Static

from lm_console.client.types import EngineUnavailable
from lm_console.tui.stderr_capture import log_tail


class EngineErrorPanel(Static):
    """What went wrong, and what to do about it."""

    def show_error(self, error: BaseException, log_path: Path | None = None) -> None:
        during_start = isinstance(error, EngineUnavailable) and error.during_start
        hint = error.hint if isinstance(error, EngineUnavailable) else ""
        title = "The engine failed to start" if during_start else "The engine stopped"
        self.border_title = title
        message = escape(str(error) or type(error).__name__)
        tail = log_tail(log_path)
        log = ""
        if log_path is not None:
            log = f"\n\n[b]Engine log[/b] ({escape(str(log_path))}):\n[#7f848e]{escape(tail) or '(empty)'}[/]"
        self.update(
            f"[b]{title}.[/b]\n\n{message}\n\n"
            f"[b]What to do:[/b] {escape(hint) or 'restart the console; run `lmc generate` to see the full error.'}"
            f"{log}\n\nPress [b]q[/b] to quit."
        )
