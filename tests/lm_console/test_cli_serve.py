"""`lmc serve`: flags reach the engine and the server settings (no engine is started here)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from lm_console.cli import app

runner = CliRunner()


@pytest.fixture
def captured(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """Replace AsyncLLM and run_server with recorders; run_server returns exit code 0."""
    from lm_console import engine
    from lm_console.engine.entrypoints.openai import api_server

    seen: dict[str, Any] = {}

    class FakeAsyncLLM:
        def __init__(self, model: str | None, **args: Any) -> None:
            seen.update(model=model, args=args)

    def fake_run_server(llm: Any, settings: Any, on_ready: Any = None) -> int:
        seen["settings"] = settings
        return 0

    monkeypatch.setattr(engine, "AsyncLLM", FakeAsyncLLM)
    monkeypatch.setattr(api_server, "run_server", fake_run_server)
    return seen


def test_serve_passes_engine_and_server_flags(captured: dict[str, Any], tmp_path: Path) -> None:
    result = runner.invoke(app, [
        "serve", "/models/tiny", "--num-blocks", "300", "--max-num-seqs", "8", "--no-enable-prefix-caching",
        "--port", "0", "--api-key", "k1", "--served-model-name", "a", "--served-model-name", "b",
        "--allowed-local-media-path", str(tmp_path), "--max-request-body", "1000",
        "--kv-events-endpoint", "tcp://127.0.0.1:5557", "--shutdown-timeout", "3"])
    assert result.exit_code == 0, result.output
    assert captured["model"] == "/models/tiny"
    args = captured["args"]
    assert args["num_gpu_blocks_override"] == 300 and args["max_num_seqs"] == 8
    assert args["enable_prefix_caching"] is False
    assert args["enable_kv_cache_events"] is True and args["kv_events_endpoint"] == "tcp://127.0.0.1:5557"
    settings = captured["settings"]
    assert settings.port == 0 and settings.api_key == "k1" and settings.served_model_names == ("a", "b")
    assert settings.allowed_local_media_path == tmp_path and settings.max_request_body == 1000
    assert settings.shutdown_timeout_s == 3.0 and settings.host == "127.0.0.1"


def test_serve_passes_the_hostile_input_limits(captured: dict[str, Any]) -> None:
    result = runner.invoke(app, [
        "serve", "--port", "0", "--header-timeout", "3", "--body-timeout", "7", "--max-request-work", "5000",
        "--max-image-pixels", "1000000", "--allow-private-media-urls", "--max-structured-output-bytes", "2048",
        "--max-structured-output-choices", "16", "--media-fetch-timeout", "4"])
    assert result.exit_code == 0, result.output
    settings = captured["settings"]
    assert settings.header_timeout_s == 3.0 and settings.body_timeout_s == 7.0
    assert settings.max_request_work == 5000 and settings.max_image_pixels == 1_000_000
    assert settings.allow_private_media_urls is True and settings.media_fetch_timeout_s == 4.0
    assert settings.max_structured_output_bytes == 2048 and settings.max_structured_output_choices == 16
    assert runner.invoke(app, ["serve", "--port", "0"]).exit_code == 0
    assert captured["settings"].allow_private_media_urls is False  # refused unless asked for


def test_serve_async_scheduling_flag(captured: dict[str, Any]) -> None:
    from lm_console.bench.launcher import serve_flags

    assert runner.invoke(app, ["serve", "--port", "0"]).exit_code == 0
    assert "async_scheduling" not in captured["args"]  # off unless asked for
    result = runner.invoke(app, ["serve", "--port", "0", "--async-scheduling"])
    assert result.exit_code == 0, result.output
    assert captured["args"]["async_scheduling"] is True
    assert "--async-scheduling" in serve_flags({"async_scheduling": True})


def test_serve_reads_the_api_key_from_the_environment(captured: dict[str, Any]) -> None:
    result = runner.invoke(app, ["serve", "--model", "m"], env={"LMC_API_KEY": "from-env"})
    assert result.exit_code == 0, result.output
    assert captured["model"] == "m" and captured["settings"].api_key == "from-env"
    assert "enable_kv_cache_events" not in captured["args"]


@pytest.mark.parametrize("argv, message", [
    (["serve", "a", "--model", "b"], "disagree"),
    (["serve", "--kv-events-endpoint", "localhost:5557"], "tcp://"),
    (["serve", "--allowed-local-media-path", "/no/such/dir"], "not a directory"),
    (["serve", "--port", "70000"], "port"),
    (["serve", "--max-request-body", "0"], "max_request_body"),
    (["serve", "--header-timeout", "0"], "header_timeout_s"),
    (["serve", "--max-image-pixels", "40000000"], "engine's cap"),
])
def test_serve_refuses_bad_flags(captured: dict[str, Any], argv: list[str], message: str) -> None:
    result = runner.invoke(app, argv)
    assert result.exit_code == 2 and message in result.output, result.output
    assert "model" not in captured  # refused before any engine starts


def test_serve_prefaults_the_kv_cache_unless_told_not_to(captured: dict[str, Any]) -> None:
    assert runner.invoke(app, ["serve", "--port", "0"]).exit_code == 0
    assert captured["args"]["kv_cache_prefault"] is True  # on by default for serve
    result = runner.invoke(app, ["serve", "--port", "0", "--no-kv-cache-prefault"])
    assert result.exit_code == 0, result.output
    assert captured["args"]["kv_cache_prefault"] is False
