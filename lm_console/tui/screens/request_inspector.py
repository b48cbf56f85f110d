"""RequestInspector: one request's life and its KV blocks (enter or click on a request row).

Its timeline as a bar (arrived, queued, scheduled, first token, each preemption, finished), the
prompt and the output, token counts, the blocks it holds highlighted in a block map, and its
prefix-hash chain: block by block, the hash and the other requests holding the same block.
The app refreshes it on every UI tick from the latest poll of the engine core's requests.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Static

from lm_console.client.types import RequestTimeline, hash_hex
from lm_console.engine.metrics.phases import request_phases
from lm_console.request_book import TrackedRequest
from lm_console.tui.render import fmt_clock, fmt_count, fmt_seconds
from lm_console.tui.widgets.block_map import BlockMap

MAX_CHAIN_LINES = 12
MAX_TEXT = 600


def timeline_of(request: TrackedRequest) -> RequestTimeline:
    """The engine's timestamps where the client had them, else what the console itself saw."""
    if request.timeline is not None:
        timeline = request.timeline
        return replace(timeline, finished=request.finished_ts if timeline.finished is None else timeline.finished,
                       preempted=list(timeline.preempted or request.seen_preempted))
    # The client's TTFT (its own clock's) places the first token; else when the console saw it.
    first_token = request.arrival + request.ttft_s if request.ttft_s is not None else request.first_token_ts
    return RequestTimeline(request.arrival, None, None, first_token, list(request.seen_preempted),
                           request.finished_ts)


def timeline_bar(timeline: RequestTimeline, now: float, width: int) -> str:
    """Markup: waiting ─ (yellow), prefill ▒ (blue), decode █ (green), ▼ each preemption (red)."""
    start = timeline.arrival
    end = timeline.finished if timeline.finished is not None else now
    span = max(end - start, 1e-6)

    def col(ts: float) -> int:
        return min(max(int((ts - start) / span * width), 0), width)

    scheduled = timeline.scheduled if timeline.scheduled is not None else timeline.first_token
    cells = []
    for x in range(width):
        ts = start + (x + 0.5) / width * span
        if scheduled is None or ts < scheduled:
            cells.append("[#e5c07b]─[/]")
        elif timeline.first_token is None or ts < timeline.first_token:
            cells.append("[#61afef]▒[/]")
        else:
            cells.append("[#98c379]█[/]")
    for ts in timeline.preempted:
        cells[min(col(ts), width - 1)] = "[b #e06c75]▼[/]"
    return "".join(cells)


def timeline_labels(timeline: RequestTimeline) -> str:
    """Each event as +seconds since arrival."""
    start = timeline.arrival
    parts = [f"arrived {fmt_clock(start)}"]
    for name, ts in (("queued", timeline.queued), ("scheduled", timeline.scheduled),
                     ("first token", timeline.first_token)):
        if ts is not None:
            parts.append(f"{name} +{fmt_seconds(max(ts - start, 0.0))}")
    parts += [f"[#e06c75]preempted +{fmt_seconds(max(ts - start, 0.0))}[/]" for ts in timeline.preempted]
    if timeline.finished is not None:
        parts.append(f"finished +{fmt_seconds(max(timeline.finished - start, 0.0))}")
    return " · ".join(parts)


def fmt_phase(seconds: float) -> str:
    """A phase's duration to 0.1 ms (finer than the table's: the figures match the OTLP span's)."""
    return f"{seconds * 1000:.1f} ms" if seconds < 1.0 else f"{seconds:.3f} s"


def timeline_phases(timeline: RequestTimeline) -> str:
    """The phase durations, split as the request's OTLP span and the Prometheus histograms split
    them (engine/metrics/phases.py): queue, prefill, decode, TTFT and end to end."""
    if timeline.scheduled is None:  # only the console's own clock: the phases are not known
        return "[#7f848e]phases: not known (no engine timestamps for this request)[/]"
    phases = request_phases(timeline.arrival, timeline.queued, timeline.scheduled, timeline.first_token,
                            timeline.last_token, timeline.finished)
    parts = [f"queue {fmt_phase(phases.time_in_queue)}", f"prefill {fmt_phase(phases.prefill)}",
             f"decode {fmt_phase(phases.decode)}"]
    if phases.time_to_first_token is not None:
        parts.append(f"TTFT {fmt_phase(phases.time_to_first_token)}")
    if phases.e2e is not None:
        parts.append(f"e2e {fmt_phase(phases.e2e)}")
    return "phases: " + " · ".join(parts)


def prefix_chain(request_id: str, block_ids: list[int], core: Any) -> list[str]:
    """One line per block (in token order): its id, hash and the other requests holding it."""
    if not block_ids:
        return ["[#7f848e]no blocks held (waiting, preempted or finished)[/]"]
    if core is None:
        return [f"[#7f848e]finished: its {len(block_ids)} blocks went back to the pool (hashed ones stay cached "
                f"until evicted): {' '.join(f'#{b}' for b in block_ids[:24])}{' …' if len(block_ids) > 24 else ''}[/]"]
    holders: dict[int, list[str]] = {}
    hashes: dict[int, bytes] = core.block_hashes
    wanted = set(block_ids)
    for row in core.requests:
        if row.request_id == request_id:
            continue
        for group in row.block_ids:
            for block in wanted.intersection(group):
                holders.setdefault(block, []).append(row.request_id)
    lines = []
    for position, block in enumerate(block_ids[:MAX_CHAIN_LINES]):
        digest = hashes.get(block)
        hash_text = hash_hex(digest)[:12] + "…" if digest is not None else "[#7f848e](partial: no hash yet)[/]"
        others = holders.get(block)
        names = sorted(others or ())
        more = f" +{len(names) - 4} more" if len(names) > 4 else ""
        shared = f"[#ff79c6]shared with {', '.join(names[:4])}{more}[/]" if names else "[#7f848e]own[/]"
        lines.append(f"{position:>3}  #{block:<6} {hash_text:<14} {shared}")
    if len(block_ids) > MAX_CHAIN_LINES:
        num_shared = sum(1 for b in block_ids if b in holders)
        lines.append(f"     … {len(block_ids) - MAX_CHAIN_LINES} more blocks ({num_shared} of all {len(block_ids)} shared)")
    return lines


def clip(text: str, limit: int = MAX_TEXT) -> str:
    text = text.replace("[", r"\[")
    return text if len(text) <= limit else text[:limit] + " …"


class RequestInspector(ModalScreen[None]):
    """See the module docstring; escape (or q, enter) closes it."""

    BINDINGS = [Binding("escape,q,enter", "dismiss", "close")]

    def __init__(self, request_id: str, decode: Callable[[list[int]], str] | None = None) -> None:
        super().__init__()
        self.request_id = request_id
        self.decode = decode
        self._prompt_text: str | None = None  # the prompt decoded, once

    def compose(self) -> ComposeResult:
        with Vertical(id="inspector-box"):
            yield Static(id="inspector-head")
            yield Static(id="inspector-bar")
            with VerticalScroll(id="inspector-body"):
                yield Static(id="inspector-text")
                yield Static(id="inspector-chain")
            yield BlockMap(id="inspector-map")

    def on_mount(self) -> None:
        self.query_one("#inspector-box").border_title = f"Request {self.request_id}"
        self.query_one("#inspector-box").border_subtitle = "escape closes · its blocks in pink"
        self.query_one("#inspector-map", BlockMap).can_focus = False

    def show(self, request: TrackedRequest | None, core: Any, states: bytes | None, refs: bytes | None,
             now: float) -> None:
        """Redraw from the app's latest data (called on every UI tick while open)."""
        if request is None:
            self.query_one("#inspector-head", Static).update(
                f"[#7f848e]{self.request_id} has left the console's table (finished a while ago).[/]")
            return
        box = self.query_one("#inspector-box")
        adapter = f" · adapter {request.lora_name}" if request.lora_name else ""
        box.border_title = (f"Request {request.request_id} ─ {request.table_state} · {request.source}{adapter}"
                            f" · {request.num_preemptions} preemption{'s' if request.num_preemptions != 1 else ''}")
        timeline = timeline_of(request)
        width = max(self.query_one("#inspector-bar").size.width, 20)
        row = next((r for r in core.requests if r.request_id == request.request_id), None) if core else None
        block_ids = [list(g) for g in row.block_ids] if row is not None else request.block_ids
        flat = [b for group in block_ids for b in group if b]
        live = row is not None
        block_size = self.app.info.block_size if getattr(self.app, "info", None) else 16
        cached_blocks = f" ({request.num_cached // max(block_size, 1)} blocks)" if request.num_cached else ""
        self.query_one("#inspector-head", Static).update(
            f"{timeline_labels(timeline)}\n{timeline_phases(timeline)}\n"
            f"tokens: prompt [b]{fmt_count(request.num_prompt_tokens)}[/] · generated [b]{fmt_count(request.num_generated)}[/]"
            f" · cached [b]{fmt_count(request.num_cached)}[/]{cached_blocks} · TTFT {fmt_seconds(request.ttft_s)}"
            f" · blocks {'held' if live else 'last held'} [b]{len(flat)}[/]"
            + (f" · computed {fmt_count(row.num_computed_tokens)}" if row is not None else ""))
        self.query_one("#inspector-bar", Static).update(timeline_bar(timeline, now, width))
        prompt = request.prompt
        if isinstance(prompt, list):
            if self._prompt_text is None:  # the prompt never changes: decode it once, not every tick
                self._prompt_text = self.decode(prompt) if self.decode is not None else " ".join(map(str, prompt))
            prompt_text = f"[#7f848e]({len(prompt)} token ids)[/] {clip(self._prompt_text)}"
        else:
            prompt_text = clip(prompt or "")
        output = clip(request.output_text) or "[#7f848e](nothing yet)[/]"
        self.query_one("#inspector-text", Static).update(
            f"[b #61afef]prompt[/] {prompt_text}\n[b #98c379]output[/] {output}\n")
        group0 = block_ids[0] if block_ids else []
        self.query_one("#inspector-chain", Static).update(
            "[b]prefix-hash chain[/] (KV group 0, token order: block, hash, who else holds it)\n"
            + "\n".join(prefix_chain(request.request_id, group0, core if live else None)))
        block_map = self.query_one("#inspector-map", BlockMap)
        block_map.set_blocks(states, refs)
        block_map.set_highlight(set(flat) if live else set())
        if flat and live:
            first = min(flat)
            lo, hi = block_map.blocks_in_view()
            if not lo <= first <= hi:
                block_map.scroll_to(y=first // block_map.blocks_per_row, animate=False, immediate=True)

    async def action_dismiss(self, result: None = None) -> None:
        self.dismiss(result)
