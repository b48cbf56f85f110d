"""HelpScreen: every key binding of the console, grouped by where it works."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Static

KEYS = (
    ("anywhere", (("1 / 2 / 3  (f2-f4)", "dashboard / chat / charts tab"), ("? or f1", "this help (escape closes it)"),
                  ("q or ctrl+q", "quit (shuts the engine down)"))),
    ("dashboard", (("p", "pause / resume the display"), ("l", "load generator on / off"),
                   ("+ / -", "load rate x1.5 / ÷1.5"), ("s", "shared-prefix share 0 → 25 → 50 → 75 → 100%"),
                   ("L", "shape the load: rate, lengths, shared prefix"),
                   ("space", "pause / resume the KV-event log"), ("/", "filter the KV-event log (substring)"),
                   ("r", "reset the prefix cache"),
                   ("t", "request table: ↑↓ scroll, enter (or a click) inspects"),
                   ("m", "block map: arrows pick a block, z / Z zoom out / in"))),
    ("chat", (("enter", "send"), ("shift+enter, ctrl+j", "new line"), ("escape", "stop the reply"),
              ("ctrl+l", "clear the conversation"))),
)
NOTES = (
    "Chat commands: /clear, /system TEXT, /temp X, /top_p X, /max N, /image PATH "
    "(attaches an image to the next message; needs a vision-language model such as demo-vlm).\n\n"
    "Block map: [#5fd35f]█[/] in use (brighter = shared by more requests), [#4fa3e0]▒[/] cached and "
    "evictable, [#5c6370]·[/] free, [#e06c75]×[/] the null block. Prefix hit rate = cached prompt "
    "tokens / prompt tokens looked up. Latency and the request table cover the console's own "
    "requests (load generator and chat)."
)


def help_text() -> str:
    """The key table as markup, one group per section."""
    lines = ["[b]lm-console keys[/b]", ""]
    for where, keys in KEYS:
        lines.append(f"[b #61afef]{where}[/]")
        lines += [f"  [b #e5c07b]{key:<22}[/] {what}" for key, what in keys]
        lines.append("")
    return "\n".join(lines) + NOTES


class HelpScreen(ModalScreen[None]):
    """A modal with the key table; any of escape, q, ? closes it."""

    BINDINGS = [Binding("escape,q,question_mark,f1", "dismiss", "close")]

    def compose(self) -> ComposeResult:
        with VerticalScroll(id="help-box"):
            yield Static(help_text())

    def on_mount(self) -> None:
        self.query_one("#help-box").border_title = "Help"

    async def action_dismiss(self, result: None = None) -> None:
        self.dismiss(result)
