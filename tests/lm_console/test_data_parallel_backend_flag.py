"""--data-parallel-backend reaches EngineArgs from `lmc tui` and `lmc serve` (the engine side: tests/frontend/test_dp_ray.py)."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from lm_console.cli import app as cli_app
from lm_console.engine_options import engine_kwargs


def test_parallel_args_pass_a_non_default_backend_only() -> None:
    assert "data_parallel_backend" not in engine_kwargs({"data_parallel_size": 2, "data_parallel_backend": "mp"})
    assert engine_kwargs({"data_parallel_size": 2, "data_parallel_backend": "ray"}) == {
        "data_parallel_size": 2, "data_parallel_backend": "ray"}


def test_lmc_tui_and_serve_take_the_data_parallel_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    from lm_console.tui import app as app_module

    seen = {}
    monkeypatch.setattr(app_module.ConsoleApp, "run", lambda self: seen.update(app=self))
    result = CliRunner().invoke(cli_app, ["tui", "--model", "/m", "--data-parallel-size", "2",
                                          "--data-parallel-backend", "ray"])
    assert result.exit_code == 0, result.output
    args = seen["app"].client.engine_args
    assert (args["data_parallel_size"], args["data_parallel_backend"]) == (2, "ray")
    result = CliRunner().invoke(cli_app, ["serve", "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0 and "--data-parallel-backend" in result.output
