"""BlockMap: every KV block as one cell, coloured by state, drawn with the Line API."""

from __future__ import annotations

from rich.segment import Segment
from rich.style import Style
from textual.geometry import Size
from textual.scroll_view import ScrollView
from textual.strip import Strip

from engine.metrics.stats import BLOCK_STATE_CACHED, BLOCK_STATE_FREE, BLOCK_STATE_IN_USE, BLOCK_STATE_NULL

# In use: darker to brighter green as more requests share the block.
IN_USE_STYLES = [Style(color=c) for c in ("#3fa34d", "#5fd35f", "#a8f060", "#f0f060")]
CELL = {
    BLOCK_STATE_FREE: ("·", Style(color="#5c6370")),
    BLOCK_STATE_CACHED: ("▒", Style(color="#4fa3e0")),
    BLOCK_STATE_NULL: ("×", Style(color="#e06c75")),
}
IN_USE_CHAR = "█"


def legend_text() -> str:
    """Legend markup for the panel's subtitle line."""
    return ("[#3fa34d]█[/][#5fd35f]█[/][#a8f060]█[/][#f0f060]█[/] in use (ref 1…4+)  "
            "[#4fa3e0]▒[/] cached, evictable  [#5c6370]·[/] free  [#e06c75]×[/] null")


class BlockMap(ScrollView, can_focus=False):
    """One character cell a block, wrapped to the widget width; scrolls when the pool is larger."""

    DEFAULT_CSS = "BlockMap { height: 1fr; scrollbar-size-vertical: 1; }"

    def __init__(self, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.states: bytes = b""
        self.ref_counts: bytes | None = None

    def set_blocks(self, states: bytes | None, ref_counts: bytes | None) -> None:
        """Show a new block map (no-op if unchanged)."""
        if states is None or (states == self.states and ref_counts == self.ref_counts):
            return
        self.states, self.ref_counts = states, ref_counts
        self._update_virtual_size()
        self.refresh()

    @property
    def columns(self) -> int:
        return max(self.scrollable_content_region.width, 1)

    def blocks_in_view(self) -> tuple[int, int]:
        """(first, last) block index shown, 0-based inclusive; (0, -1) when empty."""
        if not self.states:
            return 0, -1
        first = int(self.scroll_offset.y) * self.columns
        last = min(first + self.scrollable_content_region.height * self.columns, len(self.states)) - 1
        return first, last

    def on_resize(self) -> None:
        self._update_virtual_size()

    def _update_virtual_size(self) -> None:
        rows = -(-len(self.states) // self.columns) if self.states else 0
        self.virtual_size = Size(self.columns, rows)

    def render_line(self, y: int) -> Strip:
        """Row y of the visible region: blocks [row * columns, (row + 1) * columns)."""
        columns = self.columns
        row = y + int(self.scroll_offset.y)
        start = row * columns
        states, refs = self.states, self.ref_counts
        if start >= len(states):
            return Strip.blank(self.size.width)
        segments: list[Segment] = []
        run_text: list[str] = []
        run_style: Style | None = None
        for index in range(start, min(start + columns, len(states))):
            char, style = self._cell(states[index], refs[index] if refs is not None and index < len(refs) else 1)
            if style is not run_style and run_text:
                segments.append(Segment("".join(run_text), run_style))
                run_text = []
            run_style = style
            run_text.append(char)
        if run_text:
            segments.append(Segment("".join(run_text), run_style))
        return Strip(segments).extend_cell_length(self.size.width)

    @staticmethod
    def _cell(state: int, ref_count: int) -> tuple[str, Style]:
        if state == BLOCK_STATE_IN_USE:
            return IN_USE_CHAR, IN_USE_STYLES[min(max(ref_count, 1), len(IN_USE_STYLES)) - 1]
        return CELL.get(state, CELL[BLOCK_STATE_FREE])
