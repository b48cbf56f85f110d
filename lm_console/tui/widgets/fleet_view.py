"""The fleet tab: one row per server (FleetTable), the alert log (AlertLog), and the header's alert line."""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import DataTable, RichLog

from lm_console.fleet.alerts import AlertEvent, AlertBook
from lm_console.fleet.monitor import DOWN, UP, ServerRow
from lm_console.fleet.render import COLUMNS, row_cells
from lm_console.tui.render import fmt_clock


class FleetTable(DataTable[Text]):
    """One row per server, keyed by its name; enter (or a click) opens its dashboard."""

    def on_mount(self) -> None:
        self.cursor_type = "row"
        self.zebra_stripes = True
        for column in COLUMNS:
            self.add_column(column, key=column)

    def show(self, rows: list[ServerRow], attached: str | None) -> None:
        """Update the rows in place (the cursor stays on its server)."""
        for row in rows:
            style = "bold #e06c75" if row.alerts or row.state == DOWN else ("" if row.state == UP else "#e5c07b")
            cells = [Text(cell, style=style) for cell in row_cells(row)]
            if row.name == attached:
                cells[0] = Text("▶ " + row.name, style=style or "bold")
            if row.name in self.rows:
                for column, cell in zip(COLUMNS, cells):
                    self.update_cell(row.name, column, cell)
            else:
                self.add_row(*cells, key=row.name)

    @property
    def cursor_server(self) -> str | None:
        if not self.row_count:
            return None
        return str(self.coordinate_to_cell_key(self.cursor_coordinate).row_key.value)


class AlertLog(RichLog):
    """When each alert fired and cleared, newest last."""

    def add(self, events: list[AlertEvent]) -> None:
        for event in events:
            mark = "[b #e06c75]FIRED  [/]" if event.fired else "[#98c379]CLEARED[/]"
            self.write(f"{fmt_clock(event.t)} {mark} [b]{event.server}[/] {event.kind}: {event.detail}")


class FleetView(Vertical):
    """The fleet table above the alert log."""

    def compose(self) -> ComposeResult:
        table = FleetTable(id="fleet-table")
        table.border_title = "Fleet ─ enter opens a server's dashboard"
        yield table
        log = AlertLog(id="alert-log", markup=True, wrap=False, max_lines=1000)
        log.border_title = "Alerts fired and cleared"
        yield log


def alert_line(book: AlertBook, rows: list[ServerRow]) -> str:
    """The header's second line: the fleet's health and every alert firing now."""
    up = sum(row.state == UP for row in rows)
    down = sum(row.state == DOWN for row in rows)
    health = f"[b]fleet[/] {len(rows)} servers · {up} up" + (f" · [b #e06c75]{down} down[/]" if down else "")
    firing = book.summary()
    if not firing:
        return f"{health}    [#98c379]no alerts[/]"
    listed = ", ".join(f"{server} {kind}" for server, kind in firing[:6]) + ("…" if len(firing) > 6 else "")
    return f"{health}    [b #e06c75]▲ {len(firing)} alert{'s' if len(firing) > 1 else ''}: {listed}[/]"
