"""The request table's "prio" column: absent under fcfs (all 0), shown once a priority appears."""

from __future__ import annotations

import asyncio

from textual.app import App, ComposeResult

from lm_console.request_book import RUNNING, WAITING, TrackedRequest
from lm_console.tui.widgets.request_table import COLUMNS, RequestTable


class _TableApp(App):
    def compose(self) -> ComposeResult:
        yield RequestTable()


def test_priority_column_appears_with_the_first_priority() -> None:
    async def main() -> None:
        app = _TableApp()
        async with app.run_test() as pilot:
            table = app.query_one(RequestTable)
            plain = TrackedRequest("a", "server", 0.0, num_prompt_tokens=5, state=RUNNING)
            table.show([plain], 1.0, 1)
            await pilot.pause()
            assert tuple(c.value for c in table.columns) == COLUMNS and "prio" not in COLUMNS
            urgent = TrackedRequest("b", "server", 0.5, num_prompt_tokens=7, state=WAITING, priority=-3)
            table.show([plain, urgent], 1.0, 2)
            await pilot.pause()
            assert [c.value for c in table.columns][-1] == "prio"
            assert str(table.get_cell("b", "prio")).strip() == "-3" and str(table.get_cell("a", "prio")).strip() == "0"
            urgent.priority = 1  # updated in place
            table.show([plain, urgent], 2.0, 2)
            assert str(table.get_cell("b", "prio")).strip() == "1"

    asyncio.run(main())
