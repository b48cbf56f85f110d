"""The console shows each request's LoRA adapter: an "adapter" column in the request table (once
a request with one shows up), fed by the engine core's request poll and the server's rows."""

from __future__ import annotations

import asyncio

from textual.app import App, ComposeResult

from lm_console.engine.entrypoints.console_protocol import RequestRow, RequestsFrame
from lm_console.engine.metrics.stats import RequestBlocks, RequestBlocksState
from lm_console.request_book import RUNNING, RequestBook, TrackedRequest
from lm_console.tui.widgets.request_table import COLUMNS, RequestTable


class _TableApp(App):
    def compose(self) -> ComposeResult:
        yield RequestTable()


def test_adapter_column_appears_with_the_first_adapter() -> None:
    async def main() -> None:
        app = _TableApp()
        async with app.run_test() as pilot:
            table = app.query_one(RequestTable)
            plain = TrackedRequest("a", "load", 0.0, num_prompt_tokens=5, state=RUNNING)
            table.show([plain], 1.0, 1)
            await pilot.pause()
            assert tuple(c.value for c in table.columns) == COLUMNS
            tuned = TrackedRequest("b", "load", 0.5, num_prompt_tokens=7, state=RUNNING, lora_name="sql-lora")
            table.show([plain, tuned], 1.0, 2)
            await pilot.pause()
            assert [c.value for c in table.columns][-1] == "adapter"
            assert str(table.get_cell("b", "adapter")).strip() == "sql-lora"
            assert str(table.get_cell("a", "adapter")).strip() == "-"

    asyncio.run(main())


def test_the_core_poll_and_the_server_rows_carry_the_adapter() -> None:
    book = RequestBook()
    request = book.submit("r1", "load", 0.0, 5)
    book.on_core_requests(RequestBlocksState([RequestBlocks("r1", "RUNNING", 0, 5, 5, 0, [[1]], "sql-lora")], {}), 1.0)
    assert request.lora_name == "sql-lora"
    from lm_console.server_requests import ServerRequests

    server = ServerRequests()
    server.update(RequestsFrame(1.0, 1, [RequestRow("s1", "RUNNING", 5, 1, 0, 0.5, None, 0, "chat-lora")]), 1.0)
    assert server.active["s1"].lora_name == "chat-lora"
