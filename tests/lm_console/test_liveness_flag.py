"""--liveness-timeout: every `lmc` command that starts an engine core process takes it and hands
it to EngineArgs.liveness_timeout_s (0: never); `lmc serve` with a stopped core exits 1 after it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

from lm_console.cli import app

runner = CliRunner()


@pytest.fixture
def seen(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """Record the engine arguments each command builds, without starting an engine."""
    from lm_console import cli_console, engine
    from lm_console.bench import offload, runner as bench_runner
    from lm_console.engine.entrypoints.openai import api_server

    calls: list[dict[str, Any]] = []

    class Recorder:
        def __init__(self, model: str | None = None, **args: Any) -> None:
            calls.append(args)

    def make_client(fake: bool, model: Any, args: dict, *rest: Any, **kwargs: Any) -> Any:
        calls.append(args)
        raise typer.Exit(0)

    def bench(model: Any, args: dict, *rest: Any, **kwargs: Any) -> int:
        calls.append(args)
        return 0

    monkeypatch.setattr(engine, "AsyncLLM", Recorder)
    monkeypatch.setattr(api_server, "run_server", lambda *a, **k: 0)
    monkeypatch.setattr(cli_console, "make_client", make_client)
    def pd(model: Any, args: dict, *rest: Any, **kwargs: Any) -> dict[str, Any]:
        calls.append(args)
        return {"same_tokens": True}

    for name in ("bench_throughput", "bench_prefix", "bench_serve"):
        monkeypatch.setattr(bench_runner, name, bench)
    monkeypatch.setattr(offload, "bench_pd", pd)
    monkeypatch.setattr(offload, "pd_lines", lambda result: [])
    return calls


COMMANDS = [["serve", "--port", "0"], ["tui"], ["chat"], ["events"], ["bench", "throughput"],
            ["bench", "prefix"], ["bench", "serve", "--in-process"], ["bench", "pd"]]


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: " ".join(c[:2]))
def test_every_engine_command_passes_the_liveness_timeout(seen: list[dict[str, Any]], command: list[str]) -> None:
    result = runner.invoke(app, [*command, "--liveness-timeout", "2.5"])
    assert result.exit_code == 0, result.output
    assert seen[-1]["liveness_timeout_s"] == 2.5
    assert runner.invoke(app, [*command, "--liveness-timeout", "0"]).exit_code == 0
    assert seen[-1]["liveness_timeout_s"] is None  # 0: never
    assert runner.invoke(app, command).exit_code == 0
    assert "liveness_timeout_s" not in seen[-1]  # the engine's default (30 s)
    refused = runner.invoke(app, [*command, "--liveness-timeout", "-1"])
    assert refused.exit_code == 2 and "liveness-timeout" in refused.output


def test_batch_passes_it_and_refuses_it_with_url(tmp_path: Path, fake_async_llm) -> None:  # noqa: ANN001
    source = tmp_path / "in.jsonl"
    source.write_text('{"custom_id": "a", "url": "/v1/completions", "body": {"prompt": "x", "max_tokens": 1}}\n')
    out = tmp_path / "out.jsonl"
    result = runner.invoke(app, ["batch", "-i", str(source), "-o", str(out), "--no-progress", "--liveness-timeout", "4"])
    assert result.exit_code == 0, result.output
    assert fake_async_llm.instances[-1].engine_args["liveness_timeout_s"] == 4.0
    remote = runner.invoke(app, ["batch", "-i", str(source), "-o", str(out), "--url", "http://127.0.0.1:9",
                                 "--liveness-timeout", "4"])
    assert remote.exit_code == 2 and "--liveness-timeout" in remote.output


def test_bench_serve_hands_it_to_the_server_it_starts() -> None:
    from lm_console.bench.launcher import serve_flags

    assert serve_flags({"liveness_timeout_s": 2.5})[-2:] == ["--liveness-timeout", "2.5"]
    assert serve_flags({"liveness_timeout_s": None})[-2:] == ["--liveness-timeout", "0"]
    assert "--liveness-timeout" not in serve_flags({})


@pytest.mark.slow
def test_lmc_serve_exits_after_the_liveness_timeout_of_a_stopped_core(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """The flag reaches the frontend's heartbeat watch: a SIGSTOPped core ends `lmc serve` (exit 1)."""
    log = tmp_path / "serve.log"
    with open(log, "w") as out:
        server = subprocess.Popen(
            [sys.executable, "-m", "lm_console.cli", "serve", str(tiny_llama_dir), "--port", "0", "--dtype", "float32",
             "--max-model-len", "256", "--num-blocks", "64", "--liveness-timeout", "2"],
            stdout=out, stderr=subprocess.STDOUT, cwd=Path(__file__).parents[2])
    pid = None
    try:
        deadline = time.monotonic() + 180
        while pid is None and time.monotonic() < deadline and server.poll() is None:
            text = log.read_text()
            if "engine core pid" in text:
                pid = int(text.split("engine core pid")[1].split(")")[0])
            time.sleep(0.2)
        assert pid is not None, log.read_text()
        os.kill(pid, signal.SIGSTOP)
        stopped = time.monotonic()
        code = server.wait(timeout=60)
        assert code == 1, log.read_text()
        assert time.monotonic() - stopped < 30, "the default 30 s timeout was used, not the flag's 2 s"
        assert "liveness_timeout_s=2" in log.read_text()
    finally:
        if pid is not None:
            try:
                os.kill(pid, signal.SIGCONT)
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if server.poll() is None:
            server.kill()
