"""LoadPanel: the built-in load generator's state and shape."""

from __future__ import annotations

from textual.widgets import Static

from lm_console.load_generator import LoadGenerator


class LoadPanel(Static):
    """One line: on/off, shape, in flight and submitted counts, the keys that change it."""

    def on_mount(self) -> None:
        self.border_title = "Load generator"

    def show(self, load: LoadGenerator | None) -> None:
        if load is None:
            self.update("[#7f848e]no load generator (the engine is not running)[/]")
            return
        state = "[b #98c379]● ON[/]" if load.running else "[#7f848e]○ off[/]"
        error = f"  [#e06c75]last error: {load.last_error}[/]" if load.last_error else ""
        self.update(
            f"{state}  {load.shape.describe()}  ·  in flight {load.num_in_flight} · sent {load.num_submitted}{error}\n"
            "[#7f848e]l on/off · +/- rate · s shared-prefix share · L shape…[/]"
        )
