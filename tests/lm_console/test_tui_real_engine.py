"""`lmc tui` over the real in-process engine (AsyncLLM, tiny Llama): what the dashboard, the request
table, the inspector and the block details show equals the engine's own state at that moment
(the engine frozen with llm.sleep), and the chat streams the model's own reply."""

from __future__ import annotations

import asyncio

import pytest
from console_helpers import SIZE, text_of, until

from lm_console.client.asyncllm import AsyncLLMConsoleClient
from lm_console.client.types import GenParams, hash_hex
from lm_console.load_generator import LoadShape
from lm_console.tui.app import ConsoleApp
from lm_console.tui.screens.request_inspector import RequestInspector
from lm_console.tui.widgets.block_map import BlockMap
from lm_console.tui.widgets.chat_message import ChatMessage
from lm_console.tui.widgets.prompt_input import PromptInput
from lm_console.tui.widgets.request_table import RequestTable
from lm_console.tui.widgets.scheduler_panel import SchedulerPanel

pytestmark = pytest.mark.slow

ENGINE_ARGS = dict(dtype="float32", max_model_len=256, num_gpu_blocks_override=64, max_num_seqs=2, seed=0)


def make_app(model: str, **kwargs) -> tuple[ConsoleApp, AsyncLLMConsoleClient]:  # noqa: ANN003
    client = AsyncLLMConsoleClient(model, **{**ENGINE_ARGS, **kwargs})
    client.idle_snapshot_s = 0.2
    # Every request starts with the same two-block prefix (block 16): the prefix cache hits, and
    # running requests share physical blocks.
    shape = LoadShape(rate=1.0, prompt_len=(40, 48), output_len=(180, 180), shared_prefix_share=1.0,
                      prefix_len=32, num_prefixes=1)
    return ConsoleApp(client, shape=shape, tick_hz=0, seed=3), client


async def engine_holds(llm, *, running: int, waiting: int) -> bool:  # noqa: ANN001
    state = await llm.get_block_pool_state()
    return (state.num_running_reqs, state.num_waiting_reqs) == (running, waiting)


def test_dashboard_table_inspector_and_block_details_equal_the_engines_state(tiny_llama_dir) -> None:  # noqa: ANN001
    async def scenario() -> dict:
        app, client = make_app(str(tiny_llama_dir))
        seen: dict = {}
        async with app.run_test(size=SIZE) as pilot:
            await until(pilot, app, lambda: app.engine_state == "serving")
            for _ in range(4):
                app.load.submit_one()
            llm = client.llm
            # Freeze the engine the moment it holds 2 running and 2 waiting (asked of the engine
            # itself: the tiny model runs the first two out in well under a second, a window the
            # console's 0.4 s polls can miss on a loaded machine), then let the console catch up.
            while not await engine_holds(llm, running=2, waiting=2):
                await pilot.pause(0.002)
            await llm.sleep(1)  # no more steps: the engine's state holds still
            assert await engine_holds(llm, running=2, waiting=2), "the engine moved on before it was frozen"
            await until(pilot, app, lambda: app.telemetry.view.num_running == 2 and app.telemetry.view.num_waiting == 2
                        and app.core_requests is not None and len(app.core_requests.requests) == 4, "2 running, 2 waiting")
            state, core = await llm.get_block_pool_state(), await llm.get_request_blocks()
            asleep = app.clock()
            received = app.telemetry.view.num_stats
            await until(pilot, app, lambda: app.telemetry.view.num_stats >= received + 2 and app._core_poll_at > asleep,
                        "fresh snapshots and a fresh poll")
            app.tick()
            await pilot.pause()
            seen.update(state=state, core=core, view=app.telemetry.view, map=app.query_one(BlockMap).states,
                        scheduler=text_of(app.query_one(SchedulerPanel)), prefix=text_of(app.query_one("#prefix")),
                        pool_title=str(app.query_one("#block-pool").border_title))
            table = app.query_one(RequestTable)
            seen["table"] = {str(row.value): str(table.get_row(row)[1]) for row in table.rows}
            seen["preempt_cells"] = [str(table.get_row(row)[-1]) for row in table.rows]
            # The inspector of a running request: its blocks highlighted, its shared prefix named.
            running = sorted(r.request_id for r in core.requests if r.status == "RUNNING")
            await pilot.press("t")
            table.move_cursor(row=table.get_row_index(running[0]))
            app.tick()
            await pilot.pause()
            seen["dash_highlight"] = set(app.query_one(BlockMap).highlight)
            await pilot.press("enter")
            await until(pilot, app, lambda: isinstance(app.screen, RequestInspector), "the inspector")
            app.tick()
            await pilot.pause()
            inspector = app.screen
            seen["inspected"] = inspector.request_id
            seen["inspector_highlight"] = set(inspector.query_one("#inspector-map", BlockMap).highlight)
            seen["chain"] = text_of(inspector.query_one("#inspector-chain"))
            seen["inspector_head"] = text_of(inspector.query_one("#inspector-head"))
            await pilot.press("escape")
            # The block cursor on the first shared block: its hash, ref count and holders.
            row = next(r for r in core.requests if r.request_id == running[0])
            shared_block = row.block_ids[0][0]
            await pilot.press("m")
            app.query_one(BlockMap).select(shared_block)
            app._core_poll_at = float("-inf")  # poll now (the extra block id rides along)
            app.tick()
            await until(pilot, app, lambda: not app._core_polling)
            app.tick()
            await pilot.pause()
            seen["block_info"] = text_of(app.query_one("#block-info"))
            seen["shared_block"] = shared_block
            await llm.wake_up()
            await app.load.close()
            await until(pilot, app, lambda: not app.book.active, "no requests in flight")
        seen["final"] = await client.llm.get_block_pool_state()
        await client.shutdown()
        return seen

    seen = asyncio.run(scenario())
    state, core, view = seen["state"], seen["core"], seen["view"]
    # Dashboard gauges: the engine's own numbers at the moment it was frozen.
    assert (view.num_running, view.num_waiting) == (state.num_running_reqs, state.num_waiting_reqs) == (2, 2)
    assert "running 2" in seen["scheduler"] and "waiting 2" in seen["scheduler"]
    assert seen["map"] == view.block_states == state.block_states
    used = state.block_states.count(1)
    assert view.num_used_blocks == used > 0 and f"in use {used}" in seen["pool_title"]
    assert view.kv_usage == pytest.approx(1 - state.num_free_blocks / state.num_total_blocks)
    # Prefix hit rate: the running requests' cached tokens over their prompt tokens (the waiting
    # two have not been looked up yet), as the engine counted them.
    scheduled = [r for r in core.requests if r.num_cached_tokens >= 0]
    expected = sum(r.num_cached_tokens for r in scheduled) / sum(r.num_prompt_tokens for r in scheduled)
    assert expected > 0 and view.hit_rate_all == pytest.approx(expected)
    assert f"{expected * 100:.0f}%" in seen["prefix"]
    # The table: the scheduler's state per request; nothing was preempted.
    assert {rid: cell.split("]")[1].split("[")[0] if "]" in cell else cell for rid, cell in seen["table"].items()} \
        == {r.request_id: r.status for r in core.requests}
    assert all(cell.strip() == "-" for cell in seen["preempt_cells"])
    # The inspector and the highlight: exactly the inspected request's blocks.
    inspected = next(r for r in core.requests if r.request_id == seen["inspected"])
    blocks = {b for group in inspected.block_ids for b in group}
    assert seen["dash_highlight"] == seen["inspector_highlight"] == blocks
    other = next(r.request_id for r in core.requests if r.status == "RUNNING" and r.request_id != inspected.request_id)
    assert f"shared with {other}" in seen["chain"]
    assert hash_hex(core.block_hashes[inspected.block_ids[0][0]])[:12] in seen["chain"]
    assert f"prompt {inspected.num_prompt_tokens}" in seen["inspector_head"].replace("[b]", "").replace("[/]", "")
    # Its timeline: the engine's own timestamps (AsyncLLM's RequestMetrics), in order.
    assert "queued +" in seen["inspector_head"] and "scheduled +" in seen["inspector_head"]
    assert "first token +" in seen["inspector_head"]
    # Block details: the engine's hash, ref count and holders of the first shared block.
    info, block = seen["block_info"], seen["shared_block"]
    holders = sorted(r.request_id for r in core.requests if any(block in g for g in r.block_ids))
    assert f"block #{block}" in info and hash_hex(core.block_hashes[block])[:12] in info
    assert f"ref {state.block_ref_counts[block]}" in info and f"held by {', '.join(holders)}" in info
    assert state.block_ref_counts[block] == len(holders) == 2
    assert seen["final"].all_free


def test_chat_streams_the_models_own_reply(tiny_llama_dir) -> None:  # noqa: ANN001
    async def scenario() -> tuple[str, str, str]:
        app, client = make_app(str(tiny_llama_dir))
        async with app.run_test(size=SIZE) as pilot:
            await until(pilot, app, lambda: app.engine_state == "serving")
            app.action_show_tab("chat")
            app.session.params = GenParams(temperature=0.0, max_tokens=12, ignore_eos=True)
            app.query_one(PromptInput).post_message(PromptInput.Submitted("Tell me about tea."))
            await until(pilot, app, lambda: app.session.last_stats is not None and app.session.current_request_id is None
                        and app.query_one("#chat").streaming is None, "the finished reply")
            app.tick()
            await pilot.pause()
            reply = [m for m in app.query(ChatMessage) if m.role == "assistant"][-1]
            footer = text_of(reply.query_one(".chat-footer"))
            # The same conversation straight through the engine (the session's system prompt
            # first, as the chat sends it): greedy, so the same text.
            conversation = [{"role": "system", "content": app.session.system_prompt},
                            {"role": "user", "content": "Tell me about tea."}]
            direct = ""
            async for chunk in client.chat(conversation,
                                           GenParams(temperature=0.0, max_tokens=12, ignore_eos=True), "direct"):
                direct += chunk.text
        await client.shutdown()
        return reply.text, direct, footer

    shown, direct, footer = asyncio.run(scenario())
    assert shown == direct and shown  # the tiny model's random weights say little, but the same
    assert footer.startswith("12 tokens"), footer


@pytest.mark.slow
def test_tui_over_the_embedded_model() -> None:
    """`lmc tui` with no model: the embedded SmolLM2; a chat reply streams and the dashboard shows its pool."""
    async def scenario() -> tuple[str, object, object]:
        # Dense bf16: on this chat question the Q4_1 file with int8 activations (the default)
        # answers "L'Étoile, la Mars..." exactly as llama.cpp does on the same file; the dense
        # weights (the file's own precision) say "Paris", which this test uses as its sanity check.
        client = AsyncLLMConsoleClient(None, max_model_len=512, num_gpu_blocks_override=128,
                                       quantization="none")
        client.idle_snapshot_s = 0.2
        app = ConsoleApp(client, tick_hz=0)
        async with app.run_test(size=SIZE) as pilot:
            await until(pilot, app, lambda: app.engine_state == "serving")
            app.session.params = GenParams(temperature=0.0, max_tokens=8)
            app.action_show_tab("chat")
            app.query_one(PromptInput).post_message(PromptInput.Submitted("What is the capital of France?"))
            await until(pilot, app, lambda: app.session.last_stats is not None and app.session.current_request_id is None
                        and app.query_one("#chat").streaming is None, "the finished reply")
            await until(pilot, app, lambda: app.telemetry.view.block_states is not None, "a block map")
            reply = [m for m in app.query(ChatMessage) if m.role == "assistant"][-1].text
            state = await client.llm.get_block_pool_state()
            received = app.telemetry.view.num_stats
            await until(pilot, app, lambda: app.telemetry.view.num_stats >= received + 1)
            view = app.telemetry.view
        await client.shutdown()
        return reply, state, view

    reply, state, view = asyncio.run(scenario())
    assert "Paris" in reply
    assert view.block_states == state.block_states and view.num_total_blocks == state.num_total_blocks
