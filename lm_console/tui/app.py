"""ConsoleApp: the operator console (dashboard + chat) over any ConsoleClient.

Stream readers only append to deques (Telemetry, RequestBook); a set_interval timer flushes
them to the widgets a few times a second inside batch_update(). No torch is imported here.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from pathlib import Path

from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.css.query import NoMatches
from textual.widgets import DataTable, Footer, TabbedContent, TabPane

from lm_console.engine.metrics.stats import (
    BLOCK_STATE_CACHED, BLOCK_STATE_FREE, BLOCK_STATE_IN_USE, BLOCK_STATE_NULL, RequestBlocksState,
)

from lm_console.chat_session import ChatSession
from lm_console.client.protocol import ConsoleClient
from lm_console.client.types import EngineInfo, EngineUnavailable, hash_hex
from lm_console.load_generator import LoadGenerator, LoadShape
from lm_console.request_book import RequestBook, TrackedRequest
from lm_console.server_requests import ServerRequests
from lm_console.tui.screens.engine_dead import EngineDeadScreen
from lm_console.tui.screens.help import HelpScreen
from lm_console.tui.screens.load_shape import LoadShapeScreen
from lm_console.tui.screens.request_inspector import RequestInspector
from lm_console.tui.render import fmt_seconds
from lm_console.tui.telemetry import DashboardView, Telemetry
from lm_console.tui.widgets.block_map import BlockMap
from lm_console.tui.widgets.block_pool_panel import BlockPoolPanel
from lm_console.tui.widgets.charts_view import ChartsView
from lm_console.tui.widgets.chat_view import ChatView
from lm_console.tui.widgets.dashboard import Dashboard
from lm_console.tui.widgets.engine_status import EngineStatus
from lm_console.tui.widgets.kv_events_panel import KVEventsPanel
from lm_console.tui.widgets.request_table import RequestTable

DASHBOARD_ACTIONS = {"toggle_load", "rate_up", "rate_down", "cycle_share", "shape_load",
                     "pause_events", "filter_events", "reset_prefix_cache", "pause", "next_core",
                     "focus_requests", "focus_blocks"}
CORE_POLL_S = 0.4  # how often the engine core's request table (states, preemptions, blocks) is read


class ConsoleApp(App[None]):
    """`lmc tui` (dashboard and chat tabs) and `lmc chat` (chat_only)."""

    CSS_PATH = "app.tcss"
    TITLE = "lm-console"
    BINDINGS = [
        Binding("q", "quit", "quit"),
        Binding("ctrl+q", "quit", "quit", show=False, priority=True),
        Binding("question_mark,f1", "help", "help", key_display="?"),
        Binding("1,f2", "show_tab('dashboard')", "dash", key_display="1"),
        Binding("2,f3", "show_tab('chat')", "chat", key_display="2"),
        Binding("3,f4", "show_tab('charts')", "charts", key_display="3"),
        Binding("p", "pause", "pause"),
        Binding("l", "toggle_load", "load"),
        Binding("plus,equals_sign", "rate_up", "rate", key_display="+"),
        Binding("minus", "rate_down", "rate", key_display="-"),
        Binding("s", "cycle_share", "share"),
        Binding("L", "shape_load", "shape", show=False),
        Binding("space", "pause_events", "events"),
        Binding("slash", "filter_events", "filter", key_display="/"),
        Binding("r", "reset_prefix_cache", "reset cache"),
        Binding("c", "next_core", "core", show=False),  # data parallelism: the next engine core's gauges and map
        Binding("t", "focus_requests", "requests", show=False),
        Binding("m", "focus_blocks", "blocks", show=False),
    ]

    def __init__(self, client: ConsoleClient, *, load: bool = False, shape: LoadShape | None = None,
                 chat_only: bool = False, clock: Callable[[], float] = time.time,
                 tick_hz: float = 6.0, seed: int = 0, log_path: Path | None = None) -> None:
        super().__init__()
        self.client = client
        self.start_load = load
        self.shape = shape or LoadShape()
        self.chat_only = chat_only
        self.clock = clock
        self.tick_hz = tick_hz
        self.seed = seed
        self.log_path = log_path  # where the engine's stderr goes while the app runs
        self.book = RequestBook()
        self.telemetry = Telemetry(self.book)
        self.session = ChatSession(client, self.book, clock=clock)
        self.load: LoadGenerator | None = None
        self.info: EngineInfo | None = None
        self.engine_state = "starting"
        self.display_paused = False
        self.dead_error: BaseException | None = None
        self.quitting = False
        self.initial_images: list[str] = []  # `lmc chat --image PATH`: attached once the engine is up
        self.server_requests: ServerRequests | None = None  # an attached lm-console server's table
        # The engine core's requests with their blocks (client.request_blocks), polled every CORE_POLL_S.
        self.core_requests: RequestBlocksState | None = None
        self._core_poll_at = float("-inf")
        self._core_polling = False

    # -- layout ---------------------------------------------------------------------------
    def compose(self) -> ComposeResult:
        yield EngineStatus(id="engine-status")
        if self.chat_only:
            yield ChatView(self.session, id="chat")
        else:
            with TabbedContent(id="tabs"):
                with TabPane("Dashboard", id="dashboard"):
                    yield Dashboard(id="dash")
                with TabPane("Chat", id="chat-tab"):
                    yield ChatView(self.session, id="chat")
                with TabPane("Charts", id="charts-tab"):
                    yield ChartsView(id="charts")
        yield Footer(show_command_palette=False)

    def on_mount(self) -> None:
        self.query_one(EngineStatus).show(None, self.engine_state)
        if self.chat_only:
            self.query_one(ChatView).focus_prompt()
        if self.tick_hz:
            self.set_interval(1.0 / self.tick_hz, self.tick)
        self.run_worker(self._start_engine(), group="engine", exit_on_error=False)

    # -- engine lifecycle -----------------------------------------------------------------
    async def _start_engine(self) -> None:
        try:
            self.info = await self.client.start()
        except Exception as error:  # noqa: BLE001 - a failed start is a panel, not a traceback
            if not isinstance(error, EngineUnavailable):
                error = EngineUnavailable(f"{type(error).__name__}: {error}", during_start=True)
            self.engine_died(error)
            return
        self.engine_state = "serving"
        self.query_one(ChatView).on_engine_ready(self.info, self.initial_images)
        self.load = LoadGenerator(self.client, self.book, self.shape, self.info.vocab_size,
                                  seed=self.seed, clock=self.clock)
        if not self.chat_only:
            self.server_requests = self.client.server_requests
            self.query_one(Dashboard).set_unavailable(self.info.unavailable, self.server_requests is not None,
                                                      self.info.block_map_source)
            endpoint = self.client.kv_events_endpoint
            if endpoint:
                self.query_one(KVEventsPanel).border_subtitle = f"lmc events --endpoint {endpoint}"
            self.run_worker(self._read_stats(), group="streams", exit_on_error=False)
            self.run_worker(self._read_events(), group="streams", exit_on_error=False)
            if self.start_load:
                self.load.start()

    async def _read_stats(self) -> None:
        try:
            async for sample in self.client.stats_stream():
                self.telemetry.add_stats(sample)
        except Exception as error:  # noqa: BLE001
            self.engine_died(error)
        else:
            self._stream_ended("stats")

    async def _read_events(self) -> None:
        try:
            async for records in self.client.kv_events_stream():
                self.telemetry.add_events(records)
        except EngineUnavailable as error:  # the server's stream was lost: the engine went away
            self.engine_died(error)
        except Exception as error:  # noqa: BLE001 - a monitoring stream failed; the engine is not dead
            self._kv_events_failed(error)
        else:
            self._stream_ended("KV event")

    def _kv_events_failed(self, error: BaseException) -> None:
        """The KV-event source failed (a socket error, a bug): its panel says so, the rest goes on."""
        message = str(error) or type(error).__name__
        with contextlib.suppress(NoMatches):
            panel = self.query_one(KVEventsPanel)
            panel.note = f"[#e06c75]stopped: {message}[/]"
            panel.update_title()
        self.notify(f"KV events stopped: {message}", severity="warning", timeout=6)

    def _stream_ended(self, name: str) -> None:
        """A stream that ends while the console runs means the engine went away."""
        if not self.quitting:
            self.engine_died(EngineUnavailable(f"The engine's {name} stream ended: the engine stopped.",
                                               "Restart the console; the engine's log says why it stopped."))

    def engine_died(self, error: BaseException) -> None:
        """Show the engine-unavailable panel (once) and stop the load."""
        if self.dead_error is not None or self.quitting:
            return
        self.dead_error = error
        self.engine_state = "dead"
        if self.load is not None:
            self.load.stop()
        self.query_one(EngineStatus).show(self.info, self.engine_state)
        self.push_screen(EngineDeadScreen(error, self.log_path))

    def on_unmount(self) -> None:
        """Cancel the load's requests if the app ends without action_quit (tests, errors)."""
        if self.load is not None:
            self.load.cancel_all()

    # -- the UI tick ----------------------------------------------------------------------
    def tick(self) -> None:
        """Flush the deques into the widgets (a few times a second, one batch_update)."""
        now = self.clock()
        view = self.telemetry.flush(now)
        try:
            self._maybe_poll_core(now)
            self._render_tick(view, now)
        except NoMatches:  # the app is tearing down (or not composed yet): its widgets are gone
            pass

    def _render_tick(self, view: DashboardView, now: float) -> None:
        with self.batch_update():
            state = "paused" if self.display_paused and self.engine_state == "serving" else self.engine_state
            self.query_one(EngineStatus).show(self.info, state)
            if not self.chat_only and not self.display_paused:
                self.query_one(Dashboard).show(view, self.book, self.load, now, self.server_requests)
                dropped = self.client.num_dropped_frames
                if dropped:  # the server sampled this console's stream: it read too slowly
                    self.query_one("#scheduler").border_subtitle = f"sampled: {dropped:,} frames dropped"
                self.query_one(KVEventsPanel).add(self.telemetry.take_events(), self.client.num_kv_undecodable)
                self._show_selection(now)
            self.query_one(ChatView).flush()
            if not self.chat_only and self._active_tab() == "charts-tab":
                self._show_charts(now)
            if isinstance(self.screen, RequestInspector):
                self.screen.show(self._request(self.screen.request_id), self.core_requests,
                                 view.block_states, view.block_ref_counts, now)

    def _show_charts(self, now: float, force: bool = False) -> None:
        """Redraw the charts when a new point came (about once a second)."""
        points = self.telemetry.chart
        last = points[-1].ts if points else None
        if force or last != getattr(self, "_charted", None):
            self._charted = last
            # The x axis spans the data (at least a minute, at most the kept span).
            span = min(max(now - points[0].ts if points else 0.0, 60.0), self.telemetry.chart_span_s)
            self.query_one(ChartsView).show(list(points), now, span)

    # -- the engine core's requests: table states, the inspector, block details ------------
    def _maybe_poll_core(self, now: float) -> None:
        if (not self.client.capabilities.request_blocks or self.engine_state != "serving" or self._core_polling
                or now - self._core_poll_at < CORE_POLL_S):
            return
        block_map = self.query_one(BlockMap) if not self.chat_only else None  # NoMatches: no poll
        self._core_poll_at, self._core_polling = now, True
        extra = [block_map.selected] if block_map is not None and block_map.selected is not None else None

        async def read() -> None:
            try:
                self.core_requests = await self.client.request_blocks(extra)
                self.book.on_core_requests(self.core_requests, self.clock())
            except Exception:  # noqa: BLE001 - the streams report a dead engine; a poll only skips
                pass
            finally:
                self._core_polling = False

        self.run_worker(read(), group="core-poll", exit_on_error=False)

    def _request(self, request_id: str) -> TrackedRequest | None:
        if self.server_requests is not None and request_id in self.server_requests.active:
            return self.server_requests.active[request_id]
        return self.book.get(request_id)

    def _show_selection(self, now: float) -> None:
        """The table's cursor row's blocks in pink (while the table has focus); the block cursor's details."""
        table, block_map = self.query_one(RequestTable), self.query_one(BlockMap)
        request = self._request(table.cursor_request_id) if table.has_focus and table.cursor_request_id else None
        core_row = None
        if request is not None and self.core_requests is not None:
            core_row = next((r for r in self.core_requests.requests if r.request_id == request.request_id), None)
        block_map.set_highlight({b for g in core_row.block_ids for b in g if b} if core_row is not None else set())
        panel = self.query_one(BlockPoolPanel)
        panel.show_block_info(self.block_details(block_map.selected, now) if block_map.selected is not None else "")

    def block_details(self, block_id: int, now: float) -> str:
        """One line: the block's state, hash, ref count, age, the requests holding it, evictable or not."""
        view = self.telemetry.view
        states, refs = view.block_states or b"", view.block_ref_counts or b""
        if not 0 <= block_id < len(states):
            return ""
        state = {BLOCK_STATE_IN_USE: "in use", BLOCK_STATE_CACHED: "cached", BLOCK_STATE_FREE: "free",
                 BLOCK_STATE_NULL: "null block"}.get(states[block_id], "?")
        core = self.core_requests
        digest = core.block_hashes.get(block_id) if core is not None else None
        holders = sorted(r.request_id for r in core.requests if any(block_id in g for g in r.block_ids)) if core else []
        age = self.telemetry.block_age(block_id, now)
        evictable = states[block_id] == BLOCK_STATE_CACHED
        parts = [f"[b]block #{block_id}[/] {state}", f"hash {hash_hex(digest)[:12]}…" if digest else "no hash",
                 f"ref {refs[block_id] if block_id < len(refs) else '?'}",
                 f"age {fmt_seconds(age)}" if age is not None else "age -",
                 f"held by {', '.join(holders[:3])}{'…' if len(holders) > 3 else ''}" if holders else "held by none",
                 "[#4fa3e0]evictable[/]" if evictable else ("not evictable" if state == "in use" else "")]
        return " · ".join(p for p in parts if p)

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        if isinstance(event.data_table, RequestTable) and event.row_key.value:
            self.open_inspector(str(event.row_key.value))

    def open_inspector(self, request_id: str) -> None:
        """Push the request inspector for `request_id` (drawn at once, then on every tick)."""
        decode = self.client.decode_prompt if self.client.capabilities.decode_prompt else None
        screen = RequestInspector(request_id, decode)

        def draw() -> None:
            view = self.telemetry.view
            screen.show(self._request(request_id), self.core_requests, view.block_states, view.block_ref_counts,
                        self.clock())

        self.push_screen(screen)
        self.call_after_refresh(draw)

    def action_focus_requests(self) -> None:
        self.query_one(RequestTable).focus()

    def action_focus_blocks(self) -> None:
        block_map = self.query_one(BlockMap)
        block_map.focus()
        if block_map.selected is None and block_map.states:
            block_map.select(block_map.blocks_in_view()[0] + 1)

    # -- actions --------------------------------------------------------------------------
    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action in DASHBOARD_ACTIONS:
            return not self.chat_only and self._active_tab() == "dashboard"
        if action == "show_tab":
            return not self.chat_only
        return True

    def _active_tab(self) -> str:
        return self.query_one(TabbedContent).active if not self.chat_only else "chat-tab"

    def action_show_tab(self, tab: str) -> None:
        self.query_one(TabbedContent).active = {"dashboard": "dashboard", "charts": "charts-tab"}.get(tab, "chat-tab")
        if tab == "chat":
            self.query_one(ChatView).focus_prompt()
        else:
            self.set_focus(None)

    def on_tabbed_content_tab_activated(self) -> None:
        self.refresh_bindings()
        if self._active_tab() == "charts-tab":
            self._show_charts(self.clock(), force=True)

    def action_help(self) -> None:
        self.push_screen(HelpScreen())

    def action_pause(self) -> None:
        self.display_paused = not self.display_paused
        self.notify("Display paused (p resumes)." if self.display_paused else "Display resumed.", timeout=2)

    def action_toggle_load(self) -> None:
        if self.load is None:
            self.notify("The engine is not running yet.", severity="warning", timeout=2)
            return
        running = self.load.toggle()
        self.notify(f"Load {'on' if running else 'off'}: {self.load.shape.describe()}", timeout=3)

    def action_rate_up(self) -> None:
        self.shape.rate = min(self.shape.rate * 1.5, 64.0)

    def action_rate_down(self) -> None:
        self.shape.rate = max(self.shape.rate / 1.5, 0.1)

    def action_cycle_share(self) -> None:
        if self.load is not None:
            self.load.cycle_share()
            self.shape = self.load.shape

    def action_shape_load(self) -> None:
        def apply(shape: LoadShape | None) -> None:
            if shape is not None:
                self.shape = shape
                if self.load is not None:
                    self.load.apply(shape)

        self.push_screen(LoadShapeScreen(self.shape), apply)

    def action_pause_events(self) -> None:
        self.query_one(KVEventsPanel).toggle_pause()

    def action_filter_events(self) -> None:
        self.query_one(KVEventsPanel).open_filter()

    def action_next_core(self) -> None:
        """Data parallelism: show the next engine core's gauges and block map."""
        if self.telemetry.view.num_cores < 2:
            self.notify("This engine has one core (lmc tui --data-parallel-size N runs more).", timeout=2)
            return
        core = self.telemetry.next_core()
        self.notify(f"Showing engine core {core + 1} of {self.telemetry.view.num_cores}.", timeout=2)

    async def action_reset_prefix_cache(self) -> None:
        try:
            done = await self.client.reset_prefix_cache()
        except Exception as error:  # noqa: BLE001
            self.notify(f"Reset failed: {error}", severity="error")
            return
        self.notify("Prefix cache reset." if done else "Not reset: cached blocks are still in use.",
                    severity="information" if done else "warning", timeout=3)

    async def action_quit(self) -> None:
        """Stop the load, shut the engine down cleanly, exit."""
        self.quitting = True
        attached = self.info is not None and self.info.url
        self.notify("Detaching from the server…" if attached else "Shutting down the engine…", timeout=5)
        if self.load is not None:
            await self.load.close()
        try:
            await asyncio.wait_for(self.client.shutdown(), timeout=15)
        except Exception:  # noqa: BLE001 - exiting anyway
            pass
        self.exit()
