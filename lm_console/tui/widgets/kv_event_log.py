"""KVEventLog: the tail of the KV-event stream, with pause and a substring filter (Line API)."""

from __future__ import annotations

from collections import deque

from rich.segment import Segment
from rich.style import Style
from textual.reactive import reactive
from textual.strip import Strip
from textual.widget import Widget

from lm_console.client.types import KVEventRecord
from lm_console.engine.metrics.kv_events import UnknownKVEvent
from lm_console.tui.render import fmt_clock, fmt_count, short_hash

KIND_STYLE = {"BlockStored": Style(color="#98c379"), "BlockRemoved": Style(color="#e06c75"),
              "AllBlocksCleared": Style(color="#e5c07b", bold=True)}
DIM = Style(color="#7f848e")
SHORT_KIND = {"BlockStored": "Stored", "BlockRemoved": "Removed", "AllBlocksCleared": "Cleared"}
UNKNOWN_STYLE = Style(color="#e5c07b", italic=True)


def describe(event: KVEventRecord) -> str:
    """The part of a log line after the kind."""
    count = len(event.block_hashes)
    blocks = f"{count} blk"
    if event.kind == "BlockStored":
        return (f"{blocks:<7}{event.num_tokens:>4} tok  {short_hash(event.block_hashes[0] if count else None, 6)}"
                f" ← {short_hash(event.parent_block_hash, 6)}")
    if event.kind == "BlockRemoved":
        return f"{blocks:<7} {' '.join(short_hash(h, 6) for h in event.block_hashes[:4])}"
    if isinstance(event.event, UnknownKVEvent):
        return f"skipped: {event.event.reason}"
    return "prefix cache reset"


class KVEventLog(Widget):
    """Keeps the last `max_lines` events; shows the newest that match the filter."""

    DEFAULT_CSS = "KVEventLog { height: 1fr; }"
    paused: reactive[bool] = reactive(False)
    filter_text: reactive[str] = reactive("")

    def __init__(self, max_lines: int = 2000, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.events: deque[KVEventRecord] = deque(maxlen=max_lines)
        self.held: deque[KVEventRecord] = deque(maxlen=max_lines)  # arrived while paused
        self.num_received = 0
        self.last_seq = 0
        self.num_gaps = 0
        self.num_unknown = 0  # events of a type this console does not know (or could not read)
        self.num_undecodable = 0  # whole messages the source could not read (set by the panel)
        self._visible: list[KVEventRecord] = []

    def add(self, events: list[KVEventRecord]) -> None:
        """Take a batch of new events (refreshes once, not per event)."""
        if not events:
            return
        for event in events:  # the events of one batch share its seq
            if event.seq and self.last_seq and event.seq > self.last_seq + 1:
                self.num_gaps += 1
            self.last_seq = event.seq or self.last_seq
        self.num_received += len(events)
        self.num_unknown += sum(event.is_unknown for event in events)
        (self.held if self.paused else self.events).extend(events)
        if not self.paused:
            self._refilter()

    def watch_paused(self, paused: bool) -> None:
        if not paused and self.held:
            self.events.extend(self.held)
            self.held.clear()
        self._refilter()

    def watch_filter_text(self) -> None:
        self._refilter()

    def status(self) -> str:
        """The panel's title suffix: counts, sequence gaps, pause and filter state."""
        gaps = "seq gap-free" if not self.num_gaps else f"[#e06c75]{self.num_gaps} seq gaps[/]"
        parts = [f"{fmt_count(self.num_received)} received", gaps]
        if self.num_unknown:
            parts.append(f"[#e5c07b]{fmt_count(self.num_unknown)} unknown[/]")
        if self.num_undecodable:
            parts.append(f"[#e06c75]{fmt_count(self.num_undecodable)} undecodable msgs[/]")
        if self.paused:
            parts.append(f"[#e5c07b]PAUSED ({len(self.held)} held)[/]")
        if self.filter_text:
            parts.append(f"filter '{self.filter_text}'")
        return " · ".join(parts)

    def _refilter(self) -> None:
        needle = self.filter_text.lower()
        matching = [e for e in self.events if not needle or needle in f"{e.kind} {describe(e)}".lower()]
        self._visible = matching[-max(self.size.height, 1):] if self.size.height else matching[-50:]
        self.refresh()

    def on_resize(self) -> None:
        self._refilter()

    def render_line(self, y: int) -> Strip:
        width = self.size.width
        offset = self.size.height - len(self._visible)  # newest at the bottom
        index = y - offset
        if index < 0 or index >= len(self._visible):
            return Strip.blank(width)
        event = self._visible[index]
        segments = [
            Segment(fmt_clock(event.ts) + " ", DIM),
            Segment(f"{SHORT_KIND.get(event.kind, event.kind)[:7]:<8}",
                    UNKNOWN_STYLE if event.is_unknown else KIND_STYLE.get(event.kind, Style())),
            Segment(describe(event)),
        ]
        return Strip(segments).crop_extend(0, width, None)
