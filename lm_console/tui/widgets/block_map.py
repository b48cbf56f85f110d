"""BlockMap: the KV block pool drawn with the Line API, one cell a block or a group of blocks.

Zoom 1 draws one cell per block, coloured by state; zoom N > 1 draws one cell per N consecutive
blocks, its glyph the share of the group that is occupied (in use or cached) and its colour the
group's main state. render_line touches only the blocks of the rows in view, so a frame costs
O(rows x columns x zoom) whatever the pool's size (benchmarks/block_map_frame.py measures it).
A cursor (`selected`) picks one block; `highlight` marks a request's blocks (the inspector).
"""

from __future__ import annotations

import numpy as np
from rich.segment import Segment
from rich.style import Style
from textual.binding import Binding
from textual.geometry import Size
from textual.message import Message
from textual.scroll_view import ScrollView
from textual.strip import Strip

from lm_console.engine.metrics.stats import BLOCK_STATE_CACHED, BLOCK_STATE_FREE, BLOCK_STATE_IN_USE, BLOCK_STATE_NULL

# In use: darker to brighter green as more requests share the block.
IN_USE_STYLES = [Style(color=c) for c in ("#3fa34d", "#5fd35f", "#a8f060", "#f0f060")]
CELL = {
    BLOCK_STATE_FREE: ("·", Style(color="#5c6370")),
    BLOCK_STATE_CACHED: ("▒", Style(color="#4fa3e0")),
    BLOCK_STATE_NULL: ("×", Style(color="#e06c75")),
}
IN_USE_CHAR = "█"
HIGHLIGHT = Style(color="#ff79c6", bold=True)  # the inspected request's blocks
CURSOR = Style(reverse=True)
ZOOMS = (1, 4, 16, 64, 256, 1024)
GROUP_GLYPHS = "·░▒▓█"  # share of the group occupied: none, <1/3, <2/3, less than all, all
GROUP_COLOURS = (Style(color="#5fd35f"), Style(color="#4fa3e0"), Style(color="#5c6370"))  # in use, cached, free

# Cell codes -> (char, style): in use by ref count, the other states, the marked ones, then groups.
CODE_OTHER = len(IN_USE_STYLES)  # + the block state
CODE_MARK_IN_USE = CODE_OTHER + 4
CODE_MARK_OTHER = CODE_MARK_IN_USE + 1
CODE_GROUP = CODE_MARK_OTHER + 1  # + glyph * 3 + colour
CODE_GROUP_MARK = CODE_GROUP + len(GROUP_GLYPHS) * 3  # + glyph
CODES: list[tuple[str, Style]] = (
    [(IN_USE_CHAR, style) for style in IN_USE_STYLES]
    + [CELL[BLOCK_STATE_FREE], (IN_USE_CHAR, IN_USE_STYLES[0]), CELL[BLOCK_STATE_CACHED], CELL[BLOCK_STATE_NULL]]
    + [(IN_USE_CHAR, HIGHLIGHT), ("▒", HIGHLIGHT)]
    + [(glyph, colour) for glyph in GROUP_GLYPHS for colour in GROUP_COLOURS]
    + [(glyph, HIGHLIGHT) for glyph in GROUP_GLYPHS]
)
ALL_CODES = CODES + [(char, style + CURSOR) for char, style in CODES]  # code + len(CODES): under the cursor


def legend_text(zoom: int = 1) -> str:
    """Legend markup for the panel's subtitle line."""
    if zoom > 1:
        return (f"1 cell = {zoom} blocks: [#5c6370]·[/]░▒▓█ occupied share, colour: "
                "[#5fd35f]in use[/] / [#4fa3e0]cached[/] / [#5c6370]free[/] (most)")
    return ("[#3fa34d]█[/][#5fd35f]█[/][#a8f060]█[/][#f0f060]█[/] in use (ref 1…4+)  "
            "[#4fa3e0]▒[/] cached, evictable  [#5c6370]·[/] free  [#e06c75]×[/] null")


class BlockMap(ScrollView, can_focus=True):
    """Wrapped to the widget width; scrolls when the pool is larger. Focused: arrows move the cursor."""

    DEFAULT_CSS = "BlockMap { height: 1fr; scrollbar-size-vertical: 1; }"
    BINDINGS = [
        Binding("z", "zoom(1)", "zoom out", show=False), Binding("Z", "zoom(-1)", "zoom in", show=False),
        Binding("left", "move(-1, 0)", show=False), Binding("right", "move(1, 0)", show=False),
        Binding("up", "move(0, -1)", show=False), Binding("down", "move(0, 1)", show=False),
        Binding("pageup", "move(0, -10)", show=False), Binding("pagedown", "move(0, 10)", show=False),
        Binding("home", "jump(0)", show=False), Binding("end", "jump(-1)", show=False),
    ]

    class Selected(Message):
        """The cursor moved to `block_id`."""

        def __init__(self, block_id: int) -> None:
            super().__init__()
            self.block_id = block_id

    def __init__(self, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.states: bytes = b""
        self.ref_counts: bytes | None = None
        self.zoom = 1
        self.selected: int | None = None
        self.highlight: frozenset[int] = frozenset()
        self._highlight_mask: np.ndarray | None = None
        self._array = np.zeros(0, dtype=np.uint8)

    # -- data -----------------------------------------------------------------------------
    def set_blocks(self, states: bytes | None, ref_counts: bytes | None) -> None:
        """Show a new block map (no-op if unchanged)."""
        if states is None or (states == self.states and ref_counts == self.ref_counts):
            return
        resized = len(states) != len(self.states)
        self.states, self.ref_counts = states, ref_counts
        self._array = np.frombuffer(states, dtype=np.uint8)
        if resized:
            self._update_virtual_size()
        self.refresh()

    def set_highlight(self, block_ids: set[int] | frozenset[int]) -> None:
        """Mark these blocks (an inspected request's); empty clears."""
        block_ids = frozenset(block_ids)
        if block_ids != self.highlight:
            self.highlight = block_ids
            self._highlight_mask = None
            self.refresh()

    def set_zoom(self, zoom: int) -> None:
        """Blocks per cell (one of ZOOMS); keeps the cursor (or the first row) in view."""
        anchor = self.selected if self.selected is not None else self.blocks_in_view()[0]
        self.zoom = zoom
        self._update_virtual_size()
        self._scroll_to_block(max(anchor, 0))
        self.refresh()

    # -- geometry -------------------------------------------------------------------------
    @property
    def columns(self) -> int:
        return max(self.scrollable_content_region.width, 1)

    @property
    def blocks_per_row(self) -> int:
        return self.columns * self.zoom

    def blocks_in_view(self) -> tuple[int, int]:
        """(first, last) block index shown, 0-based inclusive; (0, -1) when empty."""
        if not self.states:
            return 0, -1
        first = int(self.scroll_offset.y) * self.blocks_per_row
        last = min(first + self.scrollable_content_region.height * self.blocks_per_row, len(self.states)) - 1
        return first, last

    def block_at(self, x: int, y: int) -> int | None:
        """The first block of the cell at widget offset (x, y), or None."""
        if x >= self.columns:
            return None
        block = (y + int(self.scroll_offset.y)) * self.blocks_per_row + x * self.zoom
        return block if block < len(self.states) else None

    def on_resize(self) -> None:
        self._update_virtual_size()

    def _update_virtual_size(self) -> None:
        rows = -(-len(self.states) // self.blocks_per_row) if self.states else 0
        self.virtual_size = Size(self.columns, rows)

    def _scroll_to_block(self, block: int) -> None:
        row = block // self.blocks_per_row
        top, height = int(self.scroll_offset.y), max(self.scrollable_content_region.height, 1)
        if row < top:
            self.scroll_to(y=row, animate=False, immediate=True)
        elif row >= top + height:
            self.scroll_to(y=row - height + 1, animate=False, immediate=True)

    # -- actions --------------------------------------------------------------------------
    def action_zoom(self, step: int) -> None:
        index = ZOOMS.index(self.zoom) if self.zoom in ZOOMS else 0
        self.set_zoom(ZOOMS[min(max(index + step, 0), len(ZOOMS) - 1)])

    def action_move(self, dx: int, dy: int) -> None:
        if not self.states:
            return
        current = self.selected if self.selected is not None else self.blocks_in_view()[0]
        self.select(current + dx * self.zoom + dy * self.blocks_per_row)

    def action_jump(self, block: int) -> None:
        if self.states:
            self.select(block % len(self.states))

    def select(self, block: int) -> None:
        """Put the cursor on `block` (clamped to the pool), scroll it into view, announce it."""
        block = min(max(block, 0), len(self.states) - 1)
        block -= block % self.zoom
        self.selected = block
        self._scroll_to_block(block)
        self.refresh()
        self.post_message(self.Selected(block))

    def on_click(self, event) -> None:  # noqa: ANN001 - textual.events.Click
        block = self.block_at(event.x, event.y)
        if block is not None:
            self.focus()
            self.select(block)

    # -- drawing --------------------------------------------------------------------------
    # Each cell becomes a small integer code (state and shade, or glyph and colour); a row is cut
    # into runs of equal codes with numpy, and Python only touches one Segment per run: a frame
    # costs O(rows x columns x zoom) in numpy and O(runs) in Python, whatever the pool's size.
    def render_line(self, y: int) -> Strip:
        """Row y of the visible region: cells [row * columns, (row + 1) * columns)."""
        row = y + int(self.scroll_offset.y)
        start = row * self.blocks_per_row
        if start >= len(self.states):
            return Strip.blank(self.size.width)
        codes = self._block_codes(start) if self.zoom == 1 else self._group_codes(start)
        if self.selected is not None and start <= self.selected < start + self.blocks_per_row:
            codes[(self.selected - start) // self.zoom] += len(CODES)  # the cursor's variant
        values = codes.tolist()
        segments: list[Segment] = []
        begin = 0
        for stop in [*(np.flatnonzero(np.diff(codes)) + 1).tolist(), len(values)]:
            char, style = ALL_CODES[values[begin]]
            segments.append(Segment(char * (stop - begin), style))
            begin = stop
        # Every glyph is one cell wide: the strip's length is known (no per-segment measuring).
        return Strip(segments, len(values)).extend_cell_length(self.size.width)

    def _marked(self, start: int, stop: int) -> np.ndarray | None:
        if not self.highlight:
            return None
        if self._highlight_mask is None or len(self._highlight_mask) != len(self.states):
            mask = np.zeros(len(self.states), dtype=bool)
            ids = [b for b in self.highlight if 0 <= b < len(self.states)]
            mask[ids] = True
            self._highlight_mask = mask
        return self._highlight_mask[start:stop]

    def _block_codes(self, start: int) -> np.ndarray:
        stop = min(start + self.columns, len(self.states))
        states = self._array[start:stop]
        codes = np.where(states == BLOCK_STATE_IN_USE, 0, states.astype(np.int16) + CODE_OTHER)
        if self.ref_counts is not None and len(self.ref_counts) >= stop:
            refs = np.frombuffer(self.ref_counts, dtype=np.uint8, count=stop - start, offset=start)
            codes = np.where(states == BLOCK_STATE_IN_USE, np.clip(refs, 1, len(IN_USE_STYLES)).astype(np.int16) - 1, codes)
        marked = self._marked(start, stop)
        if marked is not None:
            codes = np.where(marked, np.where(states == BLOCK_STATE_IN_USE, CODE_MARK_IN_USE, CODE_MARK_OTHER), codes)
        return codes.astype(np.int16)

    def _group_codes(self, start: int) -> np.ndarray:
        zoom = self.zoom
        stop = min(start + self.columns * zoom, len(self.states))
        num_cells = -(-(stop - start) // zoom)
        padded = np.full(num_cells * zoom, BLOCK_STATE_FREE, dtype=np.uint8)
        padded[:stop - start] = self._array[start:stop]
        groups = padded.reshape(num_cells, zoom)
        in_use = (groups == BLOCK_STATE_IN_USE).sum(axis=1)
        cached = (groups == BLOCK_STATE_CACHED).sum(axis=1)
        occupied = zoom - (groups == BLOCK_STATE_FREE).sum(axis=1)  # in use, cached or the null block
        glyph = np.where(occupied == zoom, len(GROUP_GLYPHS) - 1,
                         np.where(occupied == 0, 0, 1 + np.minimum((occupied * 3) // zoom, 2)))
        colour = np.where((in_use >= cached) & (in_use > 0), 0, np.where(cached > 0, 1, 2))
        codes = CODE_GROUP + glyph * 3 + colour
        marked = self._marked(start, stop)
        if marked is not None:
            mask = np.zeros(num_cells * zoom, dtype=bool)
            mask[:stop - start] = marked
            codes = np.where(mask.reshape(num_cells, zoom).any(axis=1), CODE_GROUP_MARK + glyph, codes)
        return codes.astype(np.int16)

