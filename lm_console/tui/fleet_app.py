"""FleetConsoleApp: `lmc tui --url A --url B ...` or `--fleet FILE`: the fleet tab, then today's
dashboard, chat and charts of one server at a time.

The fleet tab polls every server's /metrics (lm_console.fleet) in a worker and shows one row per
server and the alert log; the header's second line lists the alerts firing now. Enter on a row
attaches the dashboard to that server: the console's client is replaced by that server's
RemoteConsoleClient and the dashboard, chat and charts are mounted afresh, so nothing of the
previous server shows. A server that goes away is a DOWN row and a `down` alert; the attached
one also shows `dead` in the header, without the modal the single-server console raises.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Callable
from pathlib import Path

from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.message import Message
from textual.widgets import DataTable, Footer, Static, TabbedContent, TabPane

from lm_console.chat_session import ChatSession
from lm_console.client.remote import RemoteConsoleClient
from lm_console.fleet.alerts import AlertEvent
from lm_console.fleet.config import FleetConfig
from lm_console.fleet.monitor import Fleet, ServerRow
from lm_console.load_generator import LoadShape
from lm_console.request_book import RequestBook
from lm_console.tui.app import ConsoleApp
from lm_console.tui.screens.help import HelpScreen, help_text
from lm_console.tui.telemetry import Telemetry
from lm_console.tui.widgets.charts_view import ChartsView
from lm_console.tui.widgets.chat_view import ChatView
from lm_console.tui.widgets.dashboard import Dashboard
from lm_console.tui.widgets.engine_status import EngineStatus
from lm_console.tui.widgets.fleet_view import AlertLog, FleetTable, FleetView, alert_line

DETACH_TIMEOUT_S = 10.0  # a server that does not close our streams in time is left to its timeouts


FLEET_HELP = ("[b #61afef]fleet[/]\n"
              "  [b #e5c07b]0 or f                [/] the fleet tab: one row per server\n"
              "  [b #e5c07b]↑↓, enter (or a click)[/] open that server in the dashboard, chat and charts tabs\n"
              "  Rows in red have an alert firing (listed in the header); the log below the table says when "
              "each fired and cleared.\n\n")


class FleetHelpScreen(HelpScreen):
    """The console's help with the fleet's keys first."""

    def compose(self) -> ComposeResult:
        with VerticalScroll(id="help-box"):
            yield Static(FLEET_HELP + help_text())


class FleetPolled(Message):
    """The fleet worker read every server once: the rows and the alert log's new events."""

    def __init__(self, rows: list[ServerRow], events: list[AlertEvent]) -> None:
        super().__init__()
        self.rows = rows
        self.events = events


class FleetConsoleApp(ConsoleApp):
    """The operator console over a fleet: a fleet tab first, then one server's dashboard."""

    BINDINGS = [Binding("0,f", "show_tab('fleet')", "fleet", key_display="0"), *ConsoleApp.BINDINGS]
    CSS = """
    #fleet-alerts { height: 1; padding: 0 1; background: $panel; }
    FleetTable { height: 1fr; border: round $primary 60%; border-title-color: $text; }
    AlertLog { height: 10; border: round $primary 60%; border-title-color: $text; padding: 0 1; }
    """

    def __init__(self, config: FleetConfig, *, shape: LoadShape | None = None,
                 clock: Callable[[], float] = time.time, tick_hz: float = 6.0, log_path: Path | None = None) -> None:
        self.fleet = Fleet(config)
        first = config.servers[0]
        super().__init__(RemoteConsoleClient(first.url, api_key=first.api_key), shape=shape, clock=clock,
                         tick_hz=tick_hz, log_path=log_path)
        self.attached = first.name  # the server the dashboard, chat and charts show
        self.rows: list[ServerRow] = []
        self._fleet_polling = False

    # -- layout ---------------------------------------------------------------------------
    def compose(self) -> ComposeResult:
        yield EngineStatus(id="engine-status")
        yield Static(id="fleet-alerts")
        with TabbedContent(id="tabs", initial="fleet"):
            with TabPane("Fleet", id="fleet"):
                yield FleetView(id="fleet-view")
            with TabPane("Dashboard", id="dashboard"):
                yield Dashboard(id="dash")
            with TabPane("Chat", id="chat-tab"):
                yield ChatView(self.session, id="chat")
            with TabPane("Charts", id="charts-tab"):
                yield ChartsView(id="charts")
        yield Footer(show_command_palette=False)

    def on_mount(self) -> None:
        super().on_mount()
        self.query_one("#fleet-alerts", Static).update(f"[b]fleet[/] {len(self.fleet.monitors)} servers · polling…")
        self.poll_fleet()
        self.set_interval(self.fleet.config.poll_interval_s, self.poll_fleet)

    # -- the fleet ------------------------------------------------------------------------
    @work(group="fleet", exit_on_error=False)
    async def poll_fleet(self) -> None:
        """Read every server's /metrics once (skipped while the previous poll runs)."""
        if self._fleet_polling or self.quitting:
            return
        self._fleet_polling = True
        try:
            events = await self.fleet.poll()
            self.post_message(FleetPolled(self.fleet.rows(), events))
        finally:
            self._fleet_polling = False

    def on_fleet_polled(self, message: FleetPolled) -> None:
        self.rows = message.rows
        with self.batch_update():
            self.query_one(FleetTable).show(message.rows, self.attached)
            self.query_one(AlertLog).add(message.events)
            self.query_one("#fleet-alerts", Static).update(alert_line(self.fleet.alerts, message.rows))

    @on(DataTable.RowSelected, "#fleet-table")
    async def _row_selected(self, event: DataTable.RowSelected) -> None:
        event.stop()  # not the request table's inspector
        if event.row_key.value:
            await self.drill_down(str(event.row_key.value))

    async def drill_down(self, name: str) -> None:
        """Attach the dashboard, chat and charts to server `name` and show its dashboard."""
        spec = self.fleet.spec(name)
        if name != self.attached or self.engine_state == "dead":
            await self._detach_server()
            self.attached = name
            self._reset(RemoteConsoleClient(spec.url, api_key=spec.api_key))
            await self._remount()
            self.run_worker(self._start_engine(), group="engine", exit_on_error=False)
        self.query_one(FleetTable).show(self.rows, self.attached)
        self.action_show_tab("dashboard")

    async def _detach_server(self) -> None:
        """End the attached server's streams and requests (the server keeps running)."""
        self.quitting = True  # the streams end on purpose: not an engine death
        try:
            for group in ("engine", "streams", "core-poll"):
                self.workers.cancel_group(self, group)
            if self.load is not None:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(self.load.close(), DETACH_TIMEOUT_S)
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.client.shutdown(), DETACH_TIMEOUT_S)
        finally:
            self.quitting = False

    def _reset(self, client: RemoteConsoleClient) -> None:
        """The console's per-server state, fresh for `client` (as ConsoleApp.__init__ sets it)."""
        self.client = client
        self.book = RequestBook()
        self.telemetry = Telemetry(self.book)
        self.session = ChatSession(client, self.book, clock=self.clock)
        self.load = None
        self.info = None
        self.engine_state = "starting"
        self.dead_error = None
        self.server_requests = None
        self.core_requests = None
        self._core_poll_at = -math.inf
        self._core_polling = False
        self._charted = None

    async def _remount(self) -> None:
        """New dashboard, chat and charts widgets: nothing of the previous server stays on screen."""
        for pane_id, widget_id, make in (("dashboard", "dash", lambda: Dashboard(id="dash")),
                                         ("chat-tab", "chat", lambda: ChatView(self.session, id="chat")),
                                         ("charts-tab", "charts", lambda: ChartsView(id="charts"))):
            await self.query_one(f"#{widget_id}").remove()
            await self.query_one(f"#{pane_id}", TabPane).mount(make())

    # -- ConsoleApp hooks -----------------------------------------------------------------
    def engine_died(self, error: BaseException) -> None:
        """The attached server went away: the header says dead and the fleet row says down (no modal:
        the fleet stays usable, and enter on any row attaches again)."""
        if self.dead_error is not None or self.quitting:
            return
        self.dead_error = error
        self.engine_state = "dead"
        if self.load is not None:
            self.load.stop()
        self.query_one(EngineStatus).show(self.info, self.engine_state)
        self.notify(f"{self.attached}: {error}", severity="error", timeout=6)

    def action_help(self) -> None:
        self.push_screen(FleetHelpScreen())

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action == "show_tab":
            return True
        return super().check_action(action, parameters)

    def action_show_tab(self, tab: str) -> None:
        if tab == "fleet":
            self.query_one(TabbedContent).active = "fleet"
            self.query_one(FleetTable).focus()
            return
        super().action_show_tab(tab)

    async def action_quit(self) -> None:
        self.quitting = True
        self.workers.cancel_group(self, "fleet")
        await self.fleet.close()
        await super().action_quit()
