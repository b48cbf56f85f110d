"""LoadShapeScreen: a form to shape the built-in load (rate, lengths, shared prefix)."""

from __future__ import annotations

from dataclasses import replace

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Grid, Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label, Static

from lm_console.load_generator import LoadShape

FIELDS = (
    ("rate", "requests per second"),
    ("prompt_len", "prompt tokens, min-max"),
    ("output_len", "output tokens, min-max"),
    ("shared_prefix_share", "share of requests with a shared prefix, 0-1"),
    ("prefix_len", "shared prefix tokens"),
    ("max_in_flight", "max requests in flight"),
)


def _fmt(value: object) -> str:
    return f"{value[0]}-{value[1]}" if isinstance(value, tuple) else str(value)


def parse_shape(base: LoadShape, values: dict[str, str]) -> LoadShape:
    """A new LoadShape from the form's strings; ValueError names the bad field."""
    changes: dict[str, object] = {}
    for name, text in values.items():
        try:
            if name in ("prompt_len", "output_len"):
                low, _, high = text.partition("-")
                pair = (int(low), int(high or low))
                if not 1 <= pair[0] <= pair[1]:
                    raise ValueError
                changes[name] = pair
            elif name in ("prefix_len", "max_in_flight"):
                changes[name] = max(int(text), 1)
            elif name == "shared_prefix_share":
                changes[name] = min(max(float(text), 0.0), 1.0)
            else:
                changes[name] = min(max(float(text), 0.1), 64.0)
        except ValueError:
            raise ValueError(f"{name}: {text!r} is not valid") from None
    return replace(base, **changes)  # type: ignore[arg-type]


class LoadShapeScreen(ModalScreen[LoadShape | None]):
    """Returns the new shape, or None when cancelled."""

    BINDINGS = [Binding("escape", "cancel", "cancel")]

    def __init__(self, shape: LoadShape) -> None:
        super().__init__()
        self.shape = shape

    def compose(self) -> ComposeResult:
        with Vertical(id="shape-box"):
            with Grid(id="shape-grid"):
                for name, label in FIELDS:
                    yield Label(label)
                    yield Input(_fmt(getattr(self.shape, name)), id=f"shape-{name}")
            yield Static("", id="shape-error")
            with Horizontal(id="shape-buttons"):
                yield Button("Apply", variant="primary", id="apply")
                yield Button("Cancel", id="cancel")

    def on_mount(self) -> None:
        self.query_one("#shape-box").border_title = "Shape the load"

    def on_input_submitted(self) -> None:
        self._apply()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        self._apply() if event.button.id == "apply" else self.dismiss(None)

    def action_cancel(self) -> None:
        self.dismiss(None)

    def _apply(self) -> None:
        values = {name: self.query_one(f"#shape-{name}", Input).value for name, _ in FIELDS}
        try:
            self.dismiss(parse_shape(self.shape, values))
        except ValueError as error:
            self.query_one("#shape-error", Static).update(f"[#e06c75]{error}[/]")
