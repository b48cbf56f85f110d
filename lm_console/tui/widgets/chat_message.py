"""ChatMessage: one turn of the transcript (Markdown body, streamed; footer with reply stats)."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import Vertical
from textual.markup import escape
from textual.widgets import Markdown, Static


class ChatMessage(Vertical):
    """A user, assistant or notice turn; streamed text is buffered and flushed on the UI tick."""

    def __init__(self, role: str, text: str = "", **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.role = role
        self.text = text
        self._dirty = False
        self.add_class(f"-{role}")

    def compose(self) -> ComposeResult:
        label = {"user": "you", "assistant": "assistant", "notice": "console"}.get(self.role, self.role)
        yield Static(label, classes="chat-role")
        yield Markdown(self.text, classes="chat-body")
        yield Static("", classes="chat-footer")

    def append(self, text: str) -> None:
        """Buffer streamed text; shown at the next flush()."""
        if text:
            self.text += text
            self._dirty = True

    def flush(self) -> bool:
        """Push buffered text to the Markdown widget; True when something changed."""
        if not self._dirty:
            return False
        self._dirty = False
        self.query_one(Markdown).update(self.text)
        return True

    def set_footer(self, text: str) -> None:
        self.query_one(".chat-footer", Static).update(escape(text))
