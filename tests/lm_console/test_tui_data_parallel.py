"""The console over several engine cores (data parallelism): per-core gauges and block maps, `c` cycles."""

from __future__ import annotations

import asyncio

import pytest
from typer.testing import CliRunner

from lm_console.cli import app as cli_app
from lm_console.client import FakeConsoleClient
from lm_console.client.types import GenParams
from lm_console.tui.app import ConsoleApp
from lm_console.tui.widgets.block_pool_panel import BlockPoolPanel


def test_the_dashboard_shows_one_core_at_a_time_and_c_cycles(clock) -> None:  # noqa: ANN001
    async def scenario() -> None:
        client = FakeConsoleClient(auto_step=False, clock=clock, num_blocks=128, data_parallel_size=2)
        app = ConsoleApp(client, clock=clock, tick_hz=0)
        async with app.run_test(size=(130, 40)) as pilot:
            async def consume(i: int) -> None:
                async for _ in client.generate(list(range(10 + i, 10 + i + 16 * (i + 1))),
                                               GenParams(max_tokens=40, ignore_eos=True), f"r{i}"):
                    pass

            tasks = [asyncio.ensure_future(consume(i)) for i in range(3)]  # 1, 2 and 3 blocks of prompt
            await asyncio.sleep(0)
            for _ in range(3):
                client.step()
                clock.advance(0.1)
            await pilot.pause()
            app.tick()
            view = app.telemetry.view
            assert view.num_cores == 2 and sorted(view.cores) == [0, 1]
            core_usage = {i: client.cores[i].kv_cache_manager.usage for i in (0, 1)}
            assert core_usage[0] != core_usage[1]  # r0 and r2 on core 0, r1 on core 1
            assert view.selected_core == 0 and view.kv_usage == pytest.approx(core_usage[0])
            await pilot.press("c")
            assert view.selected_core == 1 and view.kv_usage == pytest.approx(core_usage[1])
            used_1 = client.cores[1].kv_cache_manager.get_block_states()
            assert view.block_states == used_1
            app.tick()
            assert "core 2/2" in str(app.query_one(BlockPoolPanel).border_title)
            await pilot.press("c")
            assert view.selected_core == 0
            while client.has_unfinished_requests():
                client.step()
                await asyncio.sleep(0)
            await asyncio.gather(*tasks)
            assert [core["num_routed"] for core in client.router.snapshot()] == [2, 1]
            assert all(core.kv_cache_manager.block_pool.get_num_free_blocks() == 127 for core in client.cores)

    asyncio.run(scenario())


def test_lmc_tui_fake_takes_the_data_parallel_size(monkeypatch: pytest.MonkeyPatch) -> None:
    from lm_console.tui import app as app_module

    seen = {}
    monkeypatch.setattr(app_module.ConsoleApp, "run", lambda self: seen.update(app=self))
    result = CliRunner().invoke(cli_app, ["tui", "--fake", "--data-parallel-size", "2"])
    assert result.exit_code == 0, result.output
    assert len(seen["app"].client.cores) == 2
    result = CliRunner().invoke(cli_app, ["tui", "--model", "/m", "--data-parallel-size", "2",
                                          "--distributed-executor-backend", "ray", "--tensor-parallel-size", "2"])
    assert result.exit_code == 0, result.output
    args = seen["app"].client.engine_args
    assert (args["data_parallel_size"], args["distributed_executor_backend"], args["tensor_parallel_size"]) == (2, "ray", 2)
