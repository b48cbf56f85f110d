"""BlockPoolPanel: the block map with its usage summary, legend and the range in view."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import Static

from lm_console.tui.render import fmt_count
from lm_console.tui.telemetry import DashboardView
from lm_console.tui.widgets.block_map import BlockMap, legend_text


class BlockPoolPanel(Vertical):
    """Border title: usage and counts; body: the map; last line: legend and blocks in view."""

    def compose(self) -> ComposeResult:
        yield BlockMap(id="block-map")
        yield Static("", id="block-info")
        yield Static(legend_text(), id="block-legend")

    def show_block_info(self, text: str) -> None:
        """The selected block's details (hash, ref count, age, holders), or nothing."""
        info = self.query_one("#block-info", Static)
        info.display = bool(text)
        info.update(text)

    note: str | None = None  # set when the engine publishes no block map (a /metrics-only server)
    source: str = ""  # set when the map is not the engine's own pool (a vLLM server's, from its KV events)

    def on_mount(self) -> None:
        self.border_title = "KV block pool"

    def show(self, view: DashboardView) -> None:
        if self.note:
            self._show_without_map(view)
            return
        block_map = self.query_one(BlockMap)
        block_map.set_blocks(view.block_states, view.block_ref_counts)
        legend = self.query_one("#block-legend", Static)
        if getattr(legend, "zoom", 1) != block_map.zoom:
            legend.update(legend_text(block_map.zoom))
            legend.zoom = block_map.zoom  # type: ignore[attr-defined]
        cached = "?" if view.num_cached_blocks is None else fmt_count(view.num_cached_blocks)
        core = f" · core {view.selected_core + 1}/{view.num_cores} (c: next)" if view.num_cores > 1 else ""
        self.border_title = (
            f"KV block pool{core} ─ usage {view.kv_usage * 100:.0f}% · in use {fmt_count(view.num_used_blocks)}"
            f" · cached {cached} · free {fmt_count(view.num_free_blocks)} of {fmt_count(view.num_total_blocks)}"
        )
        first, last = block_map.blocks_in_view()
        total = len(block_map.states)
        if self.source:
            self.border_title = (
                f"KV block pool ─ usage {view.kv_usage * 100:.0f}% · in use {fmt_count(view.num_used_blocks)}"
                f" · prefix cache {cached} of {fmt_count(view.num_total_blocks)}")
            self.border_subtitle = self.source
        elif total and (first > 0 or last < total - 1):
            zoom = f" · {block_map.zoom} blocks/cell" if block_map.zoom > 1 else ""
            self.border_subtitle = (f"showing {fmt_count(first + 1)}-{fmt_count(last + 1)} of {fmt_count(total)}"
                                    f"{zoom} · m then arrows, z/Z zoom")
        elif not total:
            self.border_subtitle = "waiting for the first block map"
        else:
            zoom = f" · {block_map.zoom} blocks/cell" if block_map.zoom > 1 else ""
            self.border_subtitle = f"all {fmt_count(total)} blocks{zoom}"

    def _show_without_map(self, view: DashboardView) -> None:
        """Usage from the gauges alone; the map area says why there is no map."""
        total = f" of {fmt_count(view.num_total_blocks)}" if view.num_total_blocks else ""
        self.border_title = f"KV block pool ─ usage {view.kv_usage * 100:.0f}%{total}"
        self.border_subtitle = self.note
        legend = self.query_one("#block-legend", Static)
        if not getattr(legend, "showing_note", False):
            legend.update(f"[#7f848e]{self.note}[/]")
            legend.showing_note = True  # type: ignore[attr-defined]
