"""Telemetry and RequestBook: rates, windows, hit rates, percentiles, request states."""

from __future__ import annotations

from lm_console.engine.metrics.stats import (
    BLOCK_STATE_CACHED, BLOCK_STATE_FREE, BLOCK_STATE_IN_USE, PrefixCacheStatsSnapshot, SchedulerStats,
)
from lm_console.client.types import StreamChunk
from lm_console.request_book import FINISHED, RUNNING, WAITING, RequestBook, percentile
from lm_console.tui.render import bar, sparkline
from lm_console.tui.telemetry import Telemetry


def test_rates_and_block_counts() -> None:
    book = RequestBook()
    telemetry = Telemetry(book, window_s=2.0, recent_requests=4)
    for i in range(20):  # 10 steps a second for 2 s
        prefix = PrefixCacheStatsSnapshot(requests=1, queries=100, hits=50 if i < 16 else 100)
        telemetry.add_stats(SchedulerStats(
            timestamp=100.0 + i * 0.1, num_scheduled_tokens=50, token_budget=64, num_prompt_tokens=40,
            num_generation_tokens=10, num_steps=i + 1, prefix_cache=prefix,
            block_states=bytes([3, BLOCK_STATE_IN_USE, BLOCK_STATE_CACHED, BLOCK_STATE_FREE])))
    view = telemetry.flush(101.95)
    assert view.steps_per_s == 10.0
    assert view.prompt_tps == 400.0 and view.gen_tps == 100.0
    assert view.num_used_blocks == 1 and view.num_cached_blocks == 1 and view.num_free_blocks == 2
    assert view.hit_rate_recent == 1.0  # the last 4 requests all hit fully
    assert abs(view.hit_rate_all - (16 * 50 + 4 * 100) / 2000) < 1e-9
    assert telemetry.flush(110.0).steps_per_s == 0.0  # the window emptied


def test_a_snapshot_counts_its_tokens_but_is_not_a_step() -> None:
    from lm_console.client.types import StatsSnapshot

    telemetry = Telemetry(RequestBook(), window_s=2.0)
    for i in range(4):  # 4 engine steps, then 2 snapshots (an idle server, a /metrics poll)
        telemetry.add_stats(SchedulerStats(timestamp=100.0 + i * 0.1, num_scheduled_tokens=32, num_prompt_tokens=30,
                                           num_generation_tokens=2, step_time_s=0.02, num_steps=i + 1))
    telemetry.add_stats(StatsSnapshot(timestamp=100.5, num_running_reqs=3, num_steps=4))
    telemetry.add_stats(StatsSnapshot(timestamp=100.6, num_prompt_tokens=100, num_generation_tokens=40))
    view = telemetry.flush(101.0)
    assert view.steps_per_s == 2.0  # 4 steps in 2 s; the snapshots are not steps
    assert view.tokens_per_step == [32.0] * 4 and view.step_ms == 20.0  # the last step's, not a snapshot's 0
    assert view.prompt_tps == (4 * 30 + 100) / 2 and view.gen_tps == (4 * 2 + 40) / 2  # a poll's deltas count
    assert view.num_stats == 6 and view.num_running == 0  # the newest sample's gauges


def test_request_book_states_and_latency() -> None:
    book = RequestBook(linger_s=5.0)
    book.submit("a", "load", 10.0, 32)
    assert book.rows(10.0)[0].state == WAITING
    book.on_chunk(StreamChunk("a", "x", 1, 32, 16), 10.5)
    assert book.active["a"].state == RUNNING and book.active["a"].ttft_s == 0.5
    book.on_chunk(StreamChunk("a", "y", 2, 32, 16, finished=True, finish_reason="length"), 11.5)
    assert "a" not in book.active and book.done[-1].state == FINISHED
    assert book.ttft_samples[-1] == 0.5 and abs(book.tpot_samples[-1] - 0.5) < 1e-9
    assert book.num_finished == 1 and book.done[-1].num_generated == 3
    assert book.rows(20.0) == []  # lingered out
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5 and percentile([], 50) is None


def test_render_helpers() -> None:
    assert sparkline([0, 1, 2], 5) == "  ▁▅█"
    assert bar(0.5, 4) == "██  " and bar(1.5, 2) == "██"


def test_spec_decoding_rates_between_samples() -> None:
    from lm_console.engine.metrics.stats import SpecDecodingStats

    telemetry = Telemetry(RequestBook(), window_s=2.0)
    assert telemetry.flush(100.0).spec_decoding is None  # an engine that does not speculate
    first = SpecDecodingStats(num_spec_tokens=3, num_drafts=10, num_draft_tokens=30, num_accepted_tokens=15,
                              num_accepted_tokens_per_pos=[7, 5, 3])
    second = SpecDecodingStats(num_spec_tokens=3, num_drafts=20, num_draft_tokens=60, num_accepted_tokens=42,
                               num_accepted_tokens_per_pos=[16, 14, 12])
    telemetry.add_stats(SchedulerStats(timestamp=100.0, spec_decoding=first))
    view = telemetry.flush(100.1)
    assert view.spec_acceptance_recent is None and view.spec_decoding.acceptance_rate == 0.5
    telemetry.add_stats(SchedulerStats(timestamp=100.2, spec_decoding=second))
    telemetry.add_stats(SchedulerStats(timestamp=100.3, spec_decoding=second))  # no new drafts: no new point
    view = telemetry.flush(100.4)
    assert view.spec_acceptance_recent == 27 / 30 and view.spec_mean_length_recent == 1 + 27 / 10
    assert view.spec_acceptance_history == [27 / 30]
    assert view.spec_decoding.mean_acceptance_length == 1 + 42 / 20
