"""RequestTable: the console's requests (load and chat) with state, tokens, TTFT and elapsed."""

from __future__ import annotations

from textual.widgets import DataTable

from lm_console.request_book import ABORTED, FAILED, FINISHED, RUNNING, WAITING, TrackedRequest
from lm_console.tui.render import fmt_seconds

STATE_STYLE = {WAITING: "#e5c07b", RUNNING: "#98c379", FINISHED: "#5c6370", ABORTED: "#d19a66",
               FAILED: "#e06c75", "PREEMPTED": "#e06c75"}
COLUMNS = ("id", "state", "prompt", "gen", "cached", "TTFT", "elapsed", "pre")
WIDTHS = (9, 9, 6, 4, 6, 7, 7, 3)
PRIORITY_COLUMN, PRIORITY_WIDTH = "prio", 5
LORA_COLUMN, LORA_WIDTH = "adapter", 12


class RequestTable(DataTable):
    """Rows keyed by request id; updated in place each tick.

    A "prio" column (scheduling priority, lower first) joins once a request with a priority
    other than 0 shows up: under the default fcfs policy every priority is 0. An "adapter" column
    (the request's LoRA adapter, "-" for the base model) joins once a request with one shows up.
    """

    show_priority = False
    show_lora = False

    def on_mount(self) -> None:
        self.border_title = "Requests"
        self.cursor_type = "row"
        self.zebra_stripes = False
        self._add_columns()

    def _add_columns(self) -> None:
        for name, width in zip(COLUMNS, WIDTHS):
            self.add_column(name, key=name, width=width)
        if self.show_priority:
            self.add_column(PRIORITY_COLUMN, key=PRIORITY_COLUMN, width=PRIORITY_WIDTH)
        if self.show_lora:
            self.add_column(LORA_COLUMN, key=LORA_COLUMN, width=LORA_WIDTH)

    title = "Requests"  # "Requests on the server" when attached to an lm-console server

    @property
    def cursor_request_id(self) -> str | None:
        """The request under the cursor, None when the table is empty."""
        if not self.row_count:
            return None
        return str(self.coordinate_to_cell_key(self.cursor_coordinate).row_key.value)

    def show(self, rows: list[TrackedRequest], now: float, num_active: int) -> None:
        order = [r.request_id for r in rows]
        if (not self.show_priority and any(r.priority for r in rows)) or (
                not self.show_lora and any(r.lora_name for r in rows)):
            self.show_priority = self.show_priority or any(r.priority for r in rows)
            self.show_lora = self.show_lora or any(r.lora_name for r in rows)
            self.clear(columns=True)
            self._add_columns()
        if order != [key.value for key in self.rows]:
            # Membership or order changed: rebuild (a few dozen rows), keeping the cursor on its request.
            # (Unfocused, the table shows its top: nobody is reading a row.)
            keep, scroll_y = (self.cursor_request_id, self.scroll_y) if self.has_focus else (None, 0.0)
            self.clear()
            for request in rows:
                self.add_row(*self._cells(request, now), key=request.request_id)
            if keep in order:
                self.move_cursor(row=order.index(keep), animate=False, scroll=False)
                self.scroll_to(y=scroll_y, animate=False, immediate=True)
        else:
            for request in rows:
                for column, value in zip(self._columns()[1:], self._cells(request, now)[1:]):
                    self.update_cell(request.request_id, column, value)
        self.border_title = f"{self.title} ─ {num_active} in flight"

    def _columns(self) -> tuple[str, ...]:
        return (COLUMNS + ((PRIORITY_COLUMN,) if self.show_priority else ())
                + ((LORA_COLUMN,) if self.show_lora else ()))

    def _cells(self, request: TrackedRequest, now: float) -> tuple[str, ...]:
        state = request.table_state
        style = STATE_STYLE.get(state, "")
        cells = (
            request.request_id, f"[{style}]{state}[/]", f"{request.num_prompt_tokens:>6}",
            f"{request.num_generated:>4}", f"{request.num_cached:>6}", f"{fmt_seconds(request.ttft_s):>7}",
            f"{request.elapsed(now):5.1f} s", f"{request.num_preemptions:>3}" if request.num_preemptions else "  -",
        )
        if self.show_priority:
            cells += (f"{request.priority:>4}",)
        if self.show_lora:
            cells += ((request.lora_name or "-")[:LORA_WIDTH],)
        return cells
