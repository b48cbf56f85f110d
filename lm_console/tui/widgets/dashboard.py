"""Dashboard: the first tab: KV cache, throughput, latency and requests at a glance."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical

from lm_console.client.types import (
    UNAVAILABLE_BLOCK_MAP, UNAVAILABLE_KV_EVENTS, UNAVAILABLE_REQUESTS, UNAVAILABLE_STEPS,
)
from lm_console.load_generator import LoadGenerator
from lm_console.request_book import RequestBook
from lm_console.server_requests import ServerRequests
from lm_console.tui.telemetry import DashboardView
from lm_console.tui.widgets.block_pool_panel import BlockPoolPanel
from lm_console.tui.widgets.block_residency_panel import BlockResidencyPanel
from lm_console.tui.widgets.encoder_cache_panel import EncoderCachePanel
from lm_console.tui.widgets.kv_events_panel import KVEventsPanel
from lm_console.tui.widgets.kv_tiers_panel import KVTiersPanel
from lm_console.tui.widgets.latency_panel import LatencyPanel
from lm_console.tui.widgets.load_panel import LoadPanel
from lm_console.tui.widgets.prefix_panel import PrefixPanel
from lm_console.tui.widgets.request_table import RequestTable
from lm_console.tui.widgets.scheduler_panel import SchedulerPanel
from lm_console.tui.widgets.spec_decode_panel import SpecDecodePanel
from lm_console.tui.widgets.throughput_panel import ThroughputPanel


class Dashboard(Vertical):
    """Scheduler, block pool, throughput, prefix cache, latency, requests, KV events, load."""

    def compose(self) -> ComposeResult:
        with Horizontal(id="dash-top"):
            with Vertical(id="dash-left"):
                yield SchedulerPanel(id="scheduler")
                yield ThroughputPanel(id="throughput")
                yield KVTiersPanel(id="kv-tiers")
                yield BlockResidencyPanel(id="block-residency")  # shown once kv_cache_metrics reports
            with Vertical(id="dash-right"):
                yield BlockPoolPanel(id="block-pool")
                with Horizontal(id="dash-cache-row"):
                    yield PrefixPanel(id="prefix")
                    yield LatencyPanel(id="latency")
                yield EncoderCachePanel(id="encoder-cache")  # shown once a VLM reports it
                yield SpecDecodePanel(id="spec-decode")  # shown once the engine reports drafts
        yield LoadPanel(id="load")
        with Horizontal(id="dash-bottom"):
            yield RequestTable(id="requests")
            yield KVEventsPanel(id="kv-events")

    def set_unavailable(self, unavailable: dict[str, str], server_requests: bool = False,
                        block_map_source: str = "") -> None:
        """Panels without a source (EngineInfo.unavailable) say so instead of showing zeros."""
        self.query_one(BlockPoolPanel).note = unavailable.get(UNAVAILABLE_BLOCK_MAP)
        self.query_one(BlockPoolPanel).source = block_map_source
        self.query_one(SchedulerPanel).note = unavailable.get(UNAVAILABLE_STEPS)
        events = self.query_one(KVEventsPanel)
        events.note = unavailable.get(UNAVAILABLE_KV_EVENTS)
        events.update_title()
        table = self.query_one(RequestTable)
        if server_requests:
            table.title = "Requests on the server"
        elif UNAVAILABLE_REQUESTS in unavailable:
            table.title = "Requests of this console"
            table.tooltip = unavailable[UNAVAILABLE_REQUESTS]

    def show(self, view: DashboardView, book: RequestBook, load: LoadGenerator | None, now: float,
             requests: ServerRequests | None = None) -> None:
        """Render one tick (the caller wraps this in batch_update); `requests`: the server's table."""
        self.query_one(SchedulerPanel).show(view)
        self.query_one(ThroughputPanel).show(view)
        self.query_one(BlockPoolPanel).show(view)
        self.query_one(PrefixPanel).show(view)
        self.query_one(KVTiersPanel).show(view)
        self.query_one(BlockResidencyPanel).show(view.block_residency)
        self.query_one(LatencyPanel).show(view)
        self.query_one(EncoderCachePanel).show(view.encoder_cache)
        self.query_one(SpecDecodePanel).show(view)
        self.query_one(LoadPanel).show(load)
        if requests is not None:
            self.query_one(RequestTable).show(requests.rows(now), now, requests.num_requests)
        else:
            self.query_one(RequestTable).show(book.rows(now), now, len(book.active))
