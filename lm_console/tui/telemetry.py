"""Telemetry: raw stats and events in, one DashboardView per UI tick out (pure Python, no UI).

Stream readers only append to deques (`add_stats`, `add_events`); the app's timer calls
`flush(now)` a few times a second, which folds the backlog into rolling windows and returns
the view every panel renders from. The stats are the engine's own SchedulerStats; their
`timestamp` places them in the rolling windows. A StatsSnapshot (an attached server's idle
snapshot or /metrics poll) adds its counters to the rates but is not an engine step: it does not
count in steps/s or in the tokens-per-step history.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from lm_console.engine.metrics.stats import (
    BLOCK_STATE_CACHED, BLOCK_STATE_FREE, BLOCK_STATE_IN_USE, EncoderCacheStats, KVTierStats, SchedulerStats,
    SpecDecodingStats,
)
from lm_console.client.types import KVEventRecord, ServerFigures, StatsSnapshot
from lm_console.tui.block_residency import BlockResidency
from lm_console.request_book import RequestBook, percentile

SPEC_HISTORY = 120  # acceptance-rate points the speculative-decoding sparkline keeps


@dataclass(slots=True)
class DashboardView:
    """Everything the dashboard shows at one tick."""

    num_running: int = 0
    num_waiting: int = 0
    num_preempted_total: int = 0
    num_preempted_recent: int = 0  # in the rate window
    scheduled_tokens: int = 0
    token_budget: int = 0
    tokens_per_step: list[float] = field(default_factory=list)
    steps_per_s: float = 0.0
    step_ms: float = 0.0
    num_steps: int = 0
    kv_usage: float = 0.0
    num_total_blocks: int = 0
    num_free_blocks: int = 0
    num_cached_blocks: int | None = None
    num_used_blocks: int = 0
    block_states: bytes | None = None
    block_ref_counts: bytes | None = None
    hit_rate_recent: float | None = None
    hit_rate_all: float | None = None
    hit_rate_history: list[float] = field(default_factory=list)
    prompt_tps: float = 0.0
    gen_tps: float = 0.0
    prompt_history: list[float] = field(default_factory=list)
    gen_history: list[float] = field(default_factory=list)
    kv_history: list[float] = field(default_factory=list)
    num_finished: int = 0
    num_failed: int = 0
    ttft_p50: float | None = None
    ttft_p95: float | None = None
    tpot_p50: float | None = None
    tpot_p95: float | None = None
    itl_p50: float | None = None  # an attached server's histogram only (the console's requests have no ITL)
    itl_p95: float | None = None
    # "server": requests done, latency and the overall hit rate are an attached server's own cumulative
    # figures (its /metrics); "": the requests this console sent.
    figures_source: str = ""
    missing_histograms: list[str] = field(default_factory=list)  # the server's, when figures_source
    num_events: int = 0
    num_stats: int = 0
    encoder_cache: EncoderCacheStats | None = None  # latest; None for a text-only engine
    # Speculative decoding (None: the engine does not speculate): the latest cumulative counters,
    # and the acceptance rate / mean accepted length between the last two samples that verified drafts.
    spec_decoding: SpecDecodingStats | None = None
    spec_acceptance_recent: float | None = None
    spec_mean_length_recent: float | None = None
    spec_acceptance_history: list[float] = field(default_factory=list)
    kv_tiers: list[KVTierStats] = field(default_factory=list)  # latest, cumulative counters
    kv_tier_rates: dict[str, tuple[float, float]] = field(default_factory=dict)  # medium -> (in, out) B/s
    # Data parallelism: the gauges and the block map are one core's (selected_core; `c` cycles);
    # the token rates count every core. cores: index -> (running, waiting, KV usage), latest.
    num_cores: int = 1
    selected_core: int = 0
    cores: dict[int, tuple[int, int, float]] = field(default_factory=dict)

    block_residency: BlockResidency | None = None  # sampled KV block lifetimes (kv_cache_metrics), since start


@dataclass(slots=True)
class ChartPoint:
    """One point of the charts tab (about one a second): the dashboard's figures at time `ts`."""

    ts: float
    prompt_tps: float
    gen_tps: float
    kv_usage: float
    ttft_p50: float | None
    tpot_p50: float | None


class Telemetry:
    """Rolling aggregates over the stats stream; see the module docstring for the data flow."""

    def __init__(self, book: RequestBook, window_s: float = 3.0, history: int = 60,
                 recent_requests: int = 1000) -> None:
        self.book = book
        self.window_s = window_s
        self.recent_requests = recent_requests
        self.pending_stats: deque[SchedulerStats] = deque(maxlen=10_000)
        self.pending_events: deque[KVEventRecord] = deque(maxlen=10_000)
        self.view = DashboardView()
        # ts, scheduled, prompt, gen, preempted, 1 for an engine step (0: a StatsSnapshot)
        self._steps: deque[tuple[float, int, int, int, int, int]] = deque()
        self._tokens_per_step: deque[float] = deque(maxlen=history)
        self._prompt_hist: deque[float] = deque(maxlen=history)
        self._gen_hist: deque[float] = deque(maxlen=history)
        self._hit_hist: deque[float] = deque(maxlen=history)
        self._kv_hist: deque[float] = deque(maxlen=history)
        self._prefix_recent: deque[tuple[int, int, int]] = deque()  # (requests, queries, hits)
        self._prefix_sums = [0, 0, 0]
        self._prefix_all = [0, 0]
        self._tier_points: deque[tuple[float, dict[str, tuple[int, int]]]] = deque()  # ts, medium -> (in, out)
        self._core_maps: dict[int, tuple[bytes, bytes | None]] = {}  # each core's latest block map
        self._core_latest: dict[int, SchedulerStats] = {}
        # The charts: one point a chart_step_s, chart_span_s of them.
        self.chart_step_s, self.chart_span_s = 1.0, 300.0
        self.chart: deque[ChartPoint] = deque(maxlen=int(self.chart_span_s / self.chart_step_s) + 1)
        # Per block: when it last left the free state (its content's age), NaN while free.
        self.block_since = np.zeros(0, dtype=np.float64)
        self._block_array = np.zeros(0, dtype=np.uint8)
        self.server: ServerFigures | None = None  # an attached server's latest cumulative figures

    def block_age(self, block_id: int, now: float) -> float | None:
        """Seconds since the block was last allocated (seen leaving the free state), None when free."""
        if not 0 <= block_id < len(self.block_since) or math.isnan(self.block_since[block_id]):
            return None
        return max(now - float(self.block_since[block_id]), 0.0)

    def _track_block_ages(self, states: bytes, ts: float) -> None:
        """Vectorised: O(pool) in numpy per block map (a few a second), nothing per block in Python."""
        new = np.frombuffer(states, dtype=np.uint8)
        occupied = (new == BLOCK_STATE_IN_USE) | (new == BLOCK_STATE_CACHED)
        if len(new) != len(self._block_array):  # the first map: ages start now
            self.block_since = np.where(occupied, ts, np.nan)
        else:
            was_occupied = (self._block_array == BLOCK_STATE_IN_USE) | (self._block_array == BLOCK_STATE_CACHED)
            self.block_since[occupied & ~was_occupied] = ts
            self.block_since[~occupied] = np.nan
        self._block_array = new

    def _fold_spec_decoding(self, spec: SpecDecodingStats, view: DashboardView) -> None:
        """Rates between this sample and the last one (the counters are cumulative)."""
        last = view.spec_decoding
        if last is not None and spec.num_draft_tokens > last.num_draft_tokens:
            drafts = spec.num_drafts - last.num_drafts
            accepted = spec.num_accepted_tokens - last.num_accepted_tokens
            view.spec_acceptance_recent = accepted / (spec.num_draft_tokens - last.num_draft_tokens)
            view.spec_mean_length_recent = 1 + accepted / drafts if drafts else None
            view.spec_acceptance_history = [*view.spec_acceptance_history[-(SPEC_HISTORY - 1):],
                                            view.spec_acceptance_recent]
        view.spec_decoding = spec

    def add_stats(self, sample: SchedulerStats) -> None:
        self.pending_stats.append(sample)

    def add_events(self, records: list[KVEventRecord]) -> None:
        self.pending_events.extend(records)

    def take_events(self) -> list[KVEventRecord]:
        """Events received since the last call (drained), for the event log."""
        events = list(self.pending_events)
        self.pending_events.clear()
        self.view.num_events += len(events)
        return events

    def flush(self, now: float) -> DashboardView:
        """Fold the backlog into the rolling state and return the updated view."""
        view = self.view
        while self.pending_stats:
            self._fold(self.pending_stats.popleft(), view)
        horizon = now - self.window_s
        while self._steps and self._steps[0][0] < horizon:
            self._steps.popleft()
        span = self.window_s
        view.prompt_tps = sum(s[2] for s in self._steps) / span
        view.gen_tps = sum(s[3] for s in self._steps) / span
        view.steps_per_s = sum(s[5] for s in self._steps) / span
        view.num_preempted_recent = sum(s[4] for s in self._steps)
        if not self._steps:
            view.scheduled_tokens = 0
        self._prompt_hist.append(view.prompt_tps)
        self._gen_hist.append(view.gen_tps)
        view.prompt_history = list(self._prompt_hist)
        view.gen_history = list(self._gen_hist)
        self._kv_hist.append(view.kv_usage)
        view.kv_history = list(self._kv_hist)
        view.tokens_per_step = list(self._tokens_per_step)
        if view.hit_rate_recent is not None:
            self._hit_hist.append(view.hit_rate_recent)
        view.hit_rate_history = list(self._hit_hist)
        server = self.server
        if server is not None:  # the server serves others too: its own figures, not this console's
            view.figures_source, view.missing_histograms = "server", list(server.missing)
            view.num_finished, view.num_failed = server.num_finished, server.num_failed
            view.ttft_p50, view.ttft_p95 = server.ttft_p50, server.ttft_p95
            view.tpot_p50, view.tpot_p95 = server.tpot_p50, server.tpot_p95
            view.itl_p50, view.itl_p95 = server.itl_p50, server.itl_p95
            view.hit_rate_all = server.prefix_hits / server.prefix_queries if server.prefix_queries else None
        else:
            view.num_finished, view.num_failed = self.book.num_finished, self.book.num_failed
            ttfts, tpots = list(self.book.ttft_samples), list(self.book.tpot_samples)
            view.ttft_p50, view.ttft_p95 = percentile(ttfts, 50), percentile(ttfts, 95)
            view.tpot_p50, view.tpot_p95 = percentile(tpots, 50), percentile(tpots, 95)
        if not self.chart or now - self.chart[-1].ts >= self.chart_step_s:
            self.chart.append(ChartPoint(now, view.prompt_tps, view.gen_tps, view.kv_usage,
                                         view.ttft_p50, view.tpot_p50))
        return view

    def next_core(self) -> int:
        """Show the next engine core (data parallelism); its latest block map at once."""
        view = self.view
        indices = sorted(view.cores) or [0]
        later = [i for i in indices if i > view.selected_core]
        view.selected_core = later[0] if later else indices[0]
        latest = self._core_latest.get(view.selected_core)
        if latest is not None:  # its gauges and map now, not at its next step
            view.num_running, view.num_waiting = latest.num_running_reqs, latest.num_waiting_reqs
            view.kv_usage, view.num_total_blocks = latest.kv_cache_usage, latest.num_total_blocks
            view.num_free_blocks = latest.num_free_blocks
            view.num_used_blocks = max(latest.num_total_blocks - latest.num_free_blocks, 0)
            view.num_cached_blocks = None
        states, ref_counts = self._core_maps.get(view.selected_core, (None, None))
        view.block_states, view.block_ref_counts = states, ref_counts
        self._block_array = np.zeros(0, dtype=np.uint8)  # block ages are per core: they restart
        if states is not None:
            view.num_cached_blocks = states.count(BLOCK_STATE_CACHED)
            view.num_used_blocks = states.count(BLOCK_STATE_IN_USE)
            view.num_free_blocks = states.count(BLOCK_STATE_FREE) + view.num_cached_blocks
        return view.selected_core

    def _fold(self, sample: SchedulerStats, view: DashboardView) -> None:
        is_step = not isinstance(sample, StatsSnapshot)
        from_events = isinstance(sample, StatsSnapshot) and sample.block_map_from_events
        if isinstance(sample, StatsSnapshot) and sample.server is not None:
            self.server = sample.server
        view.num_stats += 1
        core = sample.engine_index
        view.cores[core] = (sample.num_running_reqs, sample.num_waiting_reqs, sample.kv_cache_usage)
        self._core_latest[core] = sample
        view.num_cores = max(view.num_cores, len(view.cores))
        if sample.block_states is not None:
            self._core_maps[core] = (sample.block_states, sample.block_ref_counts)
        if core != view.selected_core:  # another core: its tokens count in the rates, nothing else
            self._steps.append((sample.timestamp, 0, sample.num_prompt_tokens, sample.num_generation_tokens,
                                sample.num_preempted_reqs, 0))
            return
        view.num_running = sample.num_running_reqs
        view.num_waiting = sample.num_waiting_reqs
        view.num_preempted_total = sample.num_preemptions_total  # exact even when samples were dropped
        view.scheduled_tokens = sample.num_scheduled_tokens
        view.token_budget = sample.token_budget or view.token_budget
        if is_step:  # a snapshot ran no step: the last step's time stays
            view.step_ms = sample.step_time_s * 1000
        view.num_steps = sample.num_steps
        view.kv_usage = sample.kv_cache_usage
        view.num_total_blocks = sample.num_total_blocks
        view.num_free_blocks = sample.num_free_blocks
        view.num_used_blocks = max(sample.num_total_blocks - sample.num_free_blocks, 0)
        if is_step:
            self._tokens_per_step.append(float(sample.num_scheduled_tokens))
        self._steps.append((sample.timestamp, sample.num_scheduled_tokens, sample.num_prompt_tokens,
                            sample.num_generation_tokens, sample.num_preempted_reqs, int(is_step)))
        if sample.block_states is not None:
            view.block_states = sample.block_states
            self._track_block_ages(sample.block_states, sample.timestamp)
            view.block_ref_counts = sample.block_ref_counts
            states = sample.block_states
            view.num_cached_blocks = states.count(BLOCK_STATE_CACHED)
            if not from_events:  # a map drawn from KV events knows cached blocks only: the gauges count the rest
                view.num_used_blocks = states.count(BLOCK_STATE_IN_USE)
                view.num_free_blocks = states.count(BLOCK_STATE_FREE) + view.num_cached_blocks
        if sample.prefix_cache.queries:
            self._fold_prefix(sample, view)
        if sample.encoder_cache is not None:
            view.encoder_cache = sample.encoder_cache
        spec = getattr(sample, "spec_decoding", None)
        if spec is not None:
            self._fold_spec_decoding(spec, view)
        if sample.kv_tiers:
            self._fold_tiers(sample, view)
        residency = getattr(sample, "kv_block_residency", None)
        if residency is not None:
            if view.block_residency is None:
                view.block_residency = BlockResidency()
            view.block_residency.add(residency)

    def _fold_tiers(self, sample: SchedulerStats, view: DashboardView) -> None:
        tiers = sample.kv_tiers or []
        view.kv_tiers = list(tiers)
        point = {t.medium: (t.bytes_in, t.bytes_out) for t in tiers}
        ts = sample.timestamp
        self._tier_points.append((ts, point))
        while len(self._tier_points) > 2 and self._tier_points[0][0] < ts - self.window_s:
            self._tier_points.popleft()
        first_ts, first = self._tier_points[0]
        span = max(ts - first_ts, 1e-3)
        view.kv_tier_rates = {
            medium: ((now_in - first.get(medium, (now_in, now_out))[0]) / span,
                     (now_out - first.get(medium, (now_in, now_out))[1]) / span)
            for medium, (now_in, now_out) in point.items()
        }

    def _fold_prefix(self, sample: SchedulerStats, view: DashboardView) -> None:
        prefix = sample.prefix_cache
        entry = (max(prefix.requests, 1), prefix.queries, prefix.hits)
        self._prefix_recent.append(entry)
        for i in range(3):
            self._prefix_sums[i] += entry[i]
        while len(self._prefix_recent) > 1 and self._prefix_sums[0] - self._prefix_recent[0][0] >= self.recent_requests:
            old = self._prefix_recent.popleft()
            for i in range(3):
                self._prefix_sums[i] -= old[i]
        self._prefix_all[0] += prefix.queries
        self._prefix_all[1] += prefix.hits
        view.hit_rate_recent = self._prefix_sums[2] / self._prefix_sums[1] if self._prefix_sums[1] else None
        view.hit_rate_all = self._prefix_all[1] / self._prefix_all[0] if self._prefix_all[0] else None
