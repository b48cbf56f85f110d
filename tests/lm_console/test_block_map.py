"""BlockMap: cells per block and per group, the highlight, the cursor and its keys, scrolling a large pool."""

from __future__ import annotations

import asyncio

from textual.app import App, ComposeResult

from lm_console.engine.metrics.stats import BLOCK_STATE_CACHED, BLOCK_STATE_FREE, BLOCK_STATE_IN_USE, BLOCK_STATE_NULL
from lm_console.tui.widgets.block_map import BlockMap


class MapApp(App[None]):
    def __init__(self) -> None:
        super().__init__()
        self.selected: list[int] = []

    def compose(self) -> ComposeResult:
        yield BlockMap(id="map")

    def on_block_map_selected(self, message: BlockMap.Selected) -> None:
        self.selected.append(message.block_id)


def line_text(block_map: BlockMap, y: int) -> str:
    return "".join(segment.text for segment in block_map.render_line(y))


def cursor_cells(block_map: BlockMap, y: int) -> list[int]:
    cells, x = [], 0
    for segment in block_map.render_line(y):
        if segment.style is not None and segment.style.reverse:
            cells.extend(range(x, x + len(segment.text)))
        x += len(segment.text)
    return cells


def test_cells_groups_highlight_and_cursor() -> None:
    async def scenario() -> None:
        app = MapApp()
        async with app.run_test(size=(40, 10)) as pilot:
            block_map = app.query_one(BlockMap)
            # 0 null, 1-4 in use (refs 1, 1, 2, 5), 5-6 cached, the rest free: 200 blocks.
            states = bytes([BLOCK_STATE_NULL] + [BLOCK_STATE_IN_USE] * 4 + [BLOCK_STATE_CACHED] * 2
                           + [BLOCK_STATE_FREE] * 193)
            refs = bytes([0, 1, 1, 2, 5] + [0] * 195)
            block_map.set_blocks(states, refs)
            await pilot.pause()
            columns = block_map.columns
            assert line_text(block_map, 0)[:9] == "×████▒▒··"
            styles = [s.style.color.name for s in block_map.render_line(0)][:3]
            assert styles[1] != styles[2]  # shared blocks are drawn brighter
            assert block_map.virtual_size.height == -(-200 // columns)
            block_map.set_highlight({2, 6})
            marked = [s for s in block_map.render_line(0) if s.style.bold]
            assert "".join(s.text for s in marked) == "█▒"
            # Zoom 4: cell 0 = blocks 0-3 (the null block and 3 in use: all occupied), cell 1 = blocks 4-7
            # (1 in use, 2 cached: 3 of 4), cell 2 = blocks 8-11 (free).
            block_map.set_highlight(set())
            block_map.set_zoom(4)
            text = line_text(block_map, 0)
            assert text[:3] == "█▓·"
            colours = [s.style.color.name for s in block_map.render_line(0)][:2]
            assert colours == ["#5fd35f", "#4fa3e0"]  # mostly in use, mostly cached
            assert block_map.virtual_size.height == -(-200 // (columns * 4))
            # The cursor: keys move it a cell (a group at zoom 4), announce the block.
            block_map.focus()
            block_map.set_zoom(1)
            await pilot.press("home", "right", "right", "down")
            assert block_map.selected == 2 + columns and app.selected[-1] == 2 + columns
            assert cursor_cells(block_map, 1) == [2]
            await pilot.press("end")
            assert block_map.selected == 199
            await pilot.press("Z")  # already the closest zoom: stays
            await pilot.press("z", "z")
            assert block_map.zoom == 16

    asyncio.run(scenario())


def test_a_large_pool_scrolls_to_the_cursor() -> None:
    async def scenario() -> None:
        app = MapApp()
        async with app.run_test(size=(50, 8)) as pilot:
            block_map = app.query_one(BlockMap)
            block_map.set_blocks(bytes([BLOCK_STATE_FREE]) * 100_000, bytes(100_000))
            await pilot.pause()
            first, last = block_map.blocks_in_view()
            assert first == 0 and last < 1000
            block_map.select(75_000)
            await pilot.pause()
            first, last = block_map.blocks_in_view()
            assert first <= 75_000 <= last
            block_map.set_zoom(1024)
            await pilot.pause()
            first, last = block_map.blocks_in_view()
            assert first == 0 and last == 99_999  # the whole pool on one screen
            row = (75_000 // 1024) // block_map.columns
            assert cursor_cells(block_map, row) == [(75_000 // 1024) % block_map.columns]

    asyncio.run(scenario())
