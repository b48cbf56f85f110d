"""Pilot tests of the console: bindings, panels fed by a fake stream, engine-dead and start-failure panels."""

from __future__ import annotations

import pytest
import asyncio

from console_helpers import SIZE, text_of, until

from lm_console.engine.metrics.kv_events import BlockRemoved, BlockStored
from lm_console.engine.metrics.stats import (
    BLOCK_STATE_CACHED, BLOCK_STATE_FREE, BLOCK_STATE_IN_USE, BLOCK_STATE_NULL, PrefixCacheStatsSnapshot,
    SchedulerStats,
)
from lm_console.client import FakeConsoleClient, KVEventRecord
from lm_console.tui.app import ConsoleApp
from lm_console.tui.screens.engine_dead import EngineDeadScreen
from lm_console.tui.screens.help import HelpScreen
from lm_console.tui.screens.load_shape import LoadShapeScreen
from lm_console.tui.widgets.block_map import BlockMap
from lm_console.tui.widgets.chat_message import ChatMessage
from lm_console.tui.widgets.kv_event_log import KVEventLog
from lm_console.tui.widgets.scheduler_panel import SchedulerPanel

pytestmark = pytest.mark.slow

def run(coro) -> None:  # noqa: ANN001
    asyncio.run(coro)


def sample(clock, **fields) -> SchedulerStats:  # noqa: ANN001
    states = bytes([BLOCK_STATE_NULL] + [BLOCK_STATE_IN_USE] * 10 + [BLOCK_STATE_CACHED] * 5
                   + [BLOCK_STATE_FREE] * 48)
    refs = bytes([0] + [1] * 8 + [3] * 2 + [0] * 53)
    base = dict(timestamp=clock(), num_running_reqs=3, num_waiting_reqs=2, num_preempted_reqs=1,
                num_preemptions_total=1, num_scheduled_tokens=96, token_budget=256, kv_cache_usage=10 / 63,
                num_free_blocks=53, num_total_blocks=63,
                prefix_cache=PrefixCacheStatsSnapshot(requests=2, queries=200, hits=150),
                step_time_s=0.05, num_steps=7, block_states=states, block_ref_counts=refs)
    base.update(fields)
    return SchedulerStats(**base)


def test_panels_show_the_fake_stream(clock) -> None:  # noqa: ANN001
    async def scenario() -> None:
        client = FakeConsoleClient(auto_step=False, clock=clock, num_blocks=64)
        app = ConsoleApp(client, clock=clock, tick_hz=0)
        async with app.run_test(size=SIZE) as pilot:
            await pilot.pause()
            client.push_stats(sample(clock))
            client.push_events([KVEventRecord(clock(), BlockStored([b"\xab" * 8], None, list(range(16)), 16), seq=1),
                                KVEventRecord(clock(), BlockRemoved([b"\xcd" * 8]), seq=2)])
            await pilot.pause()
            app.tick()
            await pilot.pause()
            scheduler = text_of(app.query_one(SchedulerPanel))
            assert "running 3" in scheduler and "waiting 2" in scheduler and "preempt 1 (+1)" in scheduler
            assert "96/256" in scheduler
            block_map = app.query_one(BlockMap)
            assert len(block_map.states) == 64 and block_map.states[0] == BLOCK_STATE_NULL
            pool_title = str(app.query_one("#block-pool").border_title)
            assert "in use 10" in pool_title and "cached 5" in pool_title
            assert "75%" in text_of(app.query_one("#prefix"))  # 150 of 200 tokens hit
            log = app.query_one(KVEventLog)
            assert log.num_received == 2 and len(log._visible) == 2
            assert app.engine_state == "serving"

    run(scenario())


def test_bindings_help_load_pause_and_filter(clock) -> None:  # noqa: ANN001
    async def scenario() -> None:
        client = FakeConsoleClient(auto_step=False, clock=clock)
        app = ConsoleApp(client, clock=clock, tick_hz=0)
        async with app.run_test(size=SIZE) as pilot:
            await pilot.pause()
            await pilot.press("question_mark")
            assert isinstance(app.screen, HelpScreen)
            await pilot.press("escape")
            assert not isinstance(app.screen, HelpScreen)
            await pilot.press("l")
            assert app.load is not None and app.load.running
            rate = app.shape.rate
            await pilot.press("plus")
            assert app.load.shape.rate > rate
            await pilot.press("minus", "minus")
            assert app.load.shape.rate < rate
            share = app.load.shape.shared_prefix_share
            await pilot.press("s")
            assert app.load.shape.shared_prefix_share != share
            await pilot.press("l")
            assert not app.load.running
            await pilot.press("p")
            assert app.display_paused
            await pilot.press("p")
            await pilot.press("space")
            assert app.query_one(KVEventLog).paused
            client.push_events([KVEventRecord(clock(), BlockRemoved([b"\xef" * 8]), seq=1)])
            await pilot.pause()
            app.tick()
            assert len(app.query_one(KVEventLog).held) == 1
            await pilot.press("space")
            assert len(app.query_one(KVEventLog).events) == 1
            await pilot.press("slash")
            await pilot.press(*"Stored", "enter")
            assert app.query_one(KVEventLog).filter_text == "Stored"
            assert app.query_one(KVEventLog)._visible == []
            await pilot.press("L")
            assert isinstance(app.screen, LoadShapeScreen)
            await pilot.press("escape")
            await pilot.press("r")
            await pilot.pause()
            await pilot.press("2")
            assert app.query_one("#tabs").active == "chat-tab"
            await pilot.press("f2")
            assert app.query_one("#tabs").active == "dashboard"
            await pilot.press("q")
        assert app.return_code == 0 or app.return_code is None

    run(scenario())


def test_load_generator_fills_the_request_table() -> None:
    async def scenario() -> None:
        client = FakeConsoleClient(step_interval=0.01)
        app = ConsoleApp(client, load=True, tick_hz=20)
        app.shape.rate = 40.0
        async with app.run_test(size=SIZE) as pilot:
            await until(pilot, app, lambda: app.book.num_finished >= 2, "two finished requests", tick=False)
            assert app.load is not None and app.load.num_submitted >= 2
            assert app.book.num_finished >= 1
            assert app.telemetry.view.num_stats > 0
            assert app.query_one("#requests").row_count >= 1

    run(scenario())


def test_engine_dead_panel(clock) -> None:  # noqa: ANN001
    async def scenario() -> None:
        client = FakeConsoleClient(auto_step=False, clock=clock)
        app = ConsoleApp(client, clock=clock, tick_hz=0)
        async with app.run_test(size=SIZE) as pilot:
            await pilot.pause()
            client.kill("engine core exited with code -9")
            await pilot.pause()
            await pilot.pause()
            assert isinstance(app.screen, EngineDeadScreen)
            panel_text = text_of(app.screen.query_one("#engine-error"))
            assert "engine core exited with code -9" in panel_text and "What to do" in panel_text
            assert app.engine_state == "dead"
            await pilot.press("q")

    run(scenario())


def test_start_failure_panel() -> None:
    async def scenario() -> None:
        client = FakeConsoleClient(fail_start="ModelNotFoundError: no model at /nope")
        app = ConsoleApp(client, tick_hz=0)
        async with app.run_test(size=SIZE) as pilot:
            await pilot.pause()
            await pilot.pause()
            assert isinstance(app.screen, EngineDeadScreen)
            assert "failed to start" in str(app.screen.query_one("#engine-error").border_title)

    run(scenario())


def test_chat_streams_and_stops() -> None:
    async def scenario() -> None:
        client = FakeConsoleClient(step_interval=0.01)
        app = ConsoleApp(client, chat_only=True, tick_hz=20)
        async with app.run_test(size=SIZE) as pilot:
            await pilot.pause(0.1)
            await pilot.press(*"hi there", "enter")
            await until(pilot, app, lambda: app.query_one("ChatView").streaming is None
                        and len(app.session.messages) == 2, "the first reply", tick=False)
            messages = list(app.query(ChatMessage))
            assert [m.role for m in messages][-2:] == ["user", "assistant"]
            assert "fake engine" in messages[-1].text and "hi there" in messages[-1].text
            assert app.session.messages[1]["role"] == "assistant"
            assert app.book.num_finished == 1
            # A second turn, stopped with escape: the partial reply is kept, the stream ends.
            client.step_interval = 0.2
            await pilot.press(*"again", "enter")
            await pilot.pause(0.3)
            await pilot.press("escape")
            await until(pilot, app, lambda: app.query_one("ChatView").streaming is None, "the stream stopped",
                        tick=False)
            assert app.query_one("ChatView").streaming is None
            assert len(app.session.messages) == 4
            await pilot.press(*"/image cat.png", "enter")
            await pilot.pause()
            assert "text-only" in list(app.query(ChatMessage))[-1].text
            await pilot.press("ctrl+l")
            await pilot.pause()
            assert app.session.messages == []

    run(scenario())
