"""The request table's engine states and preemption counts, and the request inspector, over the fake engine."""

from __future__ import annotations

import pytest
import asyncio

from lm_console.client.types import RequestTimeline
from lm_console.tui.demo import demo_app, drive_load
from lm_console.tui.screens.request_inspector import RequestInspector, timeline_bar, timeline_labels
from lm_console.tui.widgets.block_map import BlockMap
from lm_console.tui.widgets.request_table import RequestTable

pytestmark = pytest.mark.slow

SIZE = (120, 36)


def test_timeline_bar_and_labels() -> None:
    timeline = RequestTimeline(arrival=100.0, queued=100.0, scheduled=101.0, first_token=102.0,
                               preempted=[103.0], finished=104.0)
    bar = timeline_bar(timeline, now=200.0, width=8)
    cells = bar.replace("[#e5c07b]", "").replace("[#61afef]", "").replace("[#98c379]", "").replace("[b #e06c75]", "")
    assert cells.replace("[/]", "") == "──▒▒██▼█"
    labels = timeline_labels(timeline)
    assert "scheduled +1.0 s" in labels and "first token +2.0 s" in labels and "preempted +3.0 s" in labels
    assert "finished +4.0 s" in labels


def test_table_shows_the_cores_states_and_preemptions_and_enter_inspects() -> None:
    async def scenario() -> None:
        # A small pool under load: the scheduler preempts.
        app, client, clock = demo_app(num_blocks=48, token_budget=128, max_num_seqs=8)
        async with app.run_test(size=SIZE) as pilot:
            preempted: dict[str, int] = {}

            def check() -> None:
                core = client.core.get_request_blocks()
                for row in core.requests:
                    if row.num_preemptions:
                        preempted[row.request_id] = row.num_preemptions

            await drive_load(app, client, clock, num_steps=80, submit_every=2, on_tick=check)
            await pilot.pause()
            app.tick()
            await pilot.pause()
            assert preempted, "the scenario should preempt"
            # The book holds the engine's counts from the polls (at least what it saw).
            core = {r.request_id: r for r in app.core_requests.requests}
            table = app.query_one(RequestTable)
            for key in table.rows:
                request = app.book.get(str(key.value))
                cells = table.get_row(key)
                if request.request_id in core and request.finished_ts is None:
                    assert request.num_preemptions == core[request.request_id].num_preemptions
                    assert core[request.request_id].status in str(cells[1])
                if request.num_preemptions:
                    assert str(cells[-1]).strip() == str(request.num_preemptions)
            # enter on a row opens the inspector for that request, its blocks marked.
            running = next(r for r in core.values() if r.status == "RUNNING" and any(r.block_ids[0]))
            await pilot.press("t")
            table.move_cursor(row=table.get_row_index(running.request_id))
            await pilot.press("enter")
            await pilot.pause()
            app.tick()
            await pilot.pause()
            assert isinstance(app.screen, RequestInspector) and app.screen.request_id == running.request_id
            marked = app.screen.query_one("#inspector-map", BlockMap).highlight
            assert marked == {b for g in app.core_requests.requests
                              if g.request_id == running.request_id for grp in g.block_ids for b in grp}
            head = str(app.screen.query_one("#inspector-head").render())
            assert "prompt" in head and "blocks held" in head
            await pilot.press("escape")
            assert not isinstance(app.screen, RequestInspector)

    asyncio.run(scenario())


def test_a_tick_while_the_widgets_are_gone_skips_the_core_poll() -> None:
    """The UI timer can fire while the app tears down (its widgets unmounted): the core poll,
    which reads the block map's selection, skips that tick instead of raising NoMatches."""
    async def scenario() -> None:
        app, client, clock = demo_app(num_blocks=48, token_budget=128, max_num_seqs=8)
        async with app.run_test(size=SIZE) as pilot:
            await pilot.pause()
            await app.query_one(BlockMap).remove()
            app._core_poll_at = float("-inf")  # a poll is due
            app.tick()
            assert not app._core_polling  # skipped, not left half-started

    asyncio.run(scenario())
