"""The `--url` commands (tui, chat, batch, events, bench serve) against a stand-in OpenAI server."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from console_helpers import kv_event_publisher, publishing
from http_helpers import ServerThread
from openai_standin import MODEL, WORDS, StandinState, standin_app
from typer.testing import CliRunner

from lm_console.cli import app

pytestmark = pytest.mark.slow

runner = CliRunner()
STANDIN_SCRIPT = Path(__file__).with_name("openai_standin.py")


def flat(output: str) -> str:
    """CLI output with rich's error box and line wrapping taken out."""
    return " ".join(output.replace("│", " ").split())


def test_tui_url_attaches_with_the_key_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from lm_console.client.remote import RemoteConsoleClient
    from lm_console.tui import app as app_module

    seen = {}
    monkeypatch.setattr(app_module.ConsoleApp, "run", lambda self: seen.update(app=self))
    monkeypatch.setenv("LMC_API_KEY", "from-env")
    result = runner.invoke(app, ["tui", "--url", "http://127.0.0.1:9", "--load",
                                 "--kv-events-endpoint", "tcp://127.0.0.1:5557"])
    assert result.exit_code == 0, result.output
    client = seen["app"].client
    assert isinstance(client, RemoteConsoleClient) and seen["app"].start_load
    assert (client.url, client.api_key, client.zmq_endpoint) == ("http://127.0.0.1:9", "from-env", "tcp://127.0.0.1:5557")
    explicit = runner.invoke(app, ["tui", "--url", "http://127.0.0.1:9", "--api-key", "flag"])
    assert explicit.exit_code == 0 and seen["app"].client.api_key == "flag"
    for bad, message in ((["--url", "http://h:1", "--fake"], "--fake"),
                         (["--url", "http://h:1", "--num-blocks", "64", "--no-enable-prefix-caching"],
                          "--enable-prefix-caching, --num-blocks configure(s) an engine of this console's own"),
                         (["--url", "h:1"], "http://HOST:PORT"),
                         (["--kv-events-endpoint", "tcp://h:1", "--fake"], "goes with --url")):
        refused = runner.invoke(app, ["tui", *bad])
        assert refused.exit_code != 0 and message in flat(refused.output)


def test_chat_plain_over_http(standin) -> None:  # noqa: ANN001
    result = runner.invoke(app, ["chat", "--plain", "--url", standin.url, "--max-tokens", "16"],
                           input="hello there\n")
    assert result.exit_code == 0, result.output
    assert result.stdout.strip() == "".join(WORDS)
    body = standin.state.bodies[0]
    assert body["messages"][-1] == {"role": "user", "content": "hello there"} and body["model"] == MODEL


def test_chat_reports_a_refused_key() -> None:
    with ServerThread(standin_app(StandinState(api_key="sesame"))) as server:
        result = runner.invoke(app, ["chat", "--plain", "--url", server.url], input="hi\n")
    assert result.exit_code == 2 and "refused the API key" in result.stderr and "--api-key" in result.stderr


def test_batch_url_keeps_order_and_concurrency(standin, tmp_path: Path) -> None:  # noqa: ANN001
    standin.state.chunk_delay_s = 0.05
    lines = [json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
                         "body": {"prompt": f"p{i}", "max_tokens": 4}}) for i in range(6)]
    lines.insert(2, json.dumps({"custom_id": "bad", "method": "POST", "url": "/v1/embeddings", "body": {}}))
    lines.append(json.dumps({"custom_id": "zero", "method": "POST", "url": "/v1/chat/completions",
                             "body": {"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}}))
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text("\n".join(lines) + "\n")
    result = runner.invoke(app, ["batch", "-i", str(source), "-o", str(out), "--url", standin.url,
                                 "--concurrency", "2", "--no-progress"])
    assert result.exit_code == 0, result.output
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["custom_id"] for r in records] == ["r0", "r1", "bad", "r2", "r3", "r4", "r5", "zero"]
    ok = records[0]["response"]
    assert ok["status_code"] == 200 and ok["body"]["choices"][0]["text"] == "".join(WORDS[:4])
    assert records[2]["error"] and "/v1/embeddings" in records[2]["error"]
    assert records[-1]["response"]["status_code"] == 400 and "max_tokens" in records[-1]["error"]
    assert standin.state.max_in_flight == 2 and standin.state.bodies[0]["model"] == MODEL


def test_events_url_reads_the_zmq_publisher_or_says_there_is_none(standin) -> None:  # noqa: ANN001
    from lm_console.engine.metrics.kv_events import BlockStored

    none = runner.invoke(app, ["events", "--url", standin.url, "--count", "1"])
    assert none.exit_code != 0 and "--kv-events-endpoint" in none.output
    events = [BlockStored([b"\x07" * 32], None, list(range(16)), 16)]
    with kv_event_publisher() as publisher, publishing(publisher, events, 0.05):
        result = runner.invoke(app, ["events", "--url", standin.url, "--kv-events-endpoint", publisher.endpoint,
                                     "--count", "3", "--duration", "60"])
    assert result.exit_code == 0, result.output
    events = [json.loads(line) for line in result.stdout.splitlines()]
    assert len(events) == 3 and events[0]["type"] == "BlockStored" and events[0]["block_hashes"] == ["07" * 32]
    assert not standin.state.bodies  # no --load by default against a server


BENCH_KEYS = ("date", "endpoint_type", "backend", "model_id", "tokenizer_id", "num_prompts", "request_rate",
              "burstiness", "max_concurrency", "duration", "completed", "failed", "total_input_tokens",
              "total_output_tokens", "request_throughput", "request_goodput", "output_throughput",
              "total_token_throughput", "input_lens", "output_lens", "ttfts", "itls", "latencies", "start_times",
              "queue_times", "generated_texts", "errors", "max_output_tokens_per_s", "max_concurrent_requests",
              "mean_ttft_ms", "median_ttft_ms", "std_ttft_ms", "p50_ttft_ms", "p99_ttft_ms", "mean_tpot_ms",
              "p99_tpot_ms", "mean_itl_ms", "median_itl_ms", "p99_itl_ms", "mean_e2el_ms", "median_e2el_ms",
              "p99_e2el_ms")


def test_bench_serve_url_writes_vllms_keys(standin, tmp_path: Path) -> None:  # noqa: ANN001
    out = tmp_path / "serve.json"
    result = runner.invoke(app, ["bench", "serve", "--url", standin.url, "--num-prompts", "6",
                                 "--random-input-len", "16", "--random-output-len", "5", "--random-range-ratio", "0",
                                 "--request-rate", "40", "--max-concurrency", "3", "--metric-percentiles", "50,99",
                                 "--save-result", str(out), "--no-progress"])
    assert result.exit_code == 0, result.output
    for label in ("Serving Benchmark Result", "Mean TTFT (ms):", "P99 ITL (ms):", "Median TPOT (ms):",
                  "P50 E2EL (ms):", "Maximum request concurrency:"):
        assert label in result.stdout
    data = json.loads(out.read_text())
    missing = [key for key in BENCH_KEYS if key not in data]
    assert not missing, missing
    assert data["completed"] == 6 and data["failed"] == 0 and data["model_id"] == MODEL
    assert data["output_lens"] == [5] * 6  # from the final usage chunk
    assert all(len(itl) == 4 for itl in data["itls"]) and data["backend"] == "openai"
    body = standin.state.bodies[-1]
    assert isinstance(body["prompt"], list) and body["ignore_eos"] and body["stream_options"]["include_usage"]
    both = runner.invoke(app, ["bench", "serve", "--url", standin.url, "--in-process"])
    assert both.exit_code != 0 and "Pick one" in both.output
    engine_flag = runner.invoke(app, ["bench", "serve", "--url", standin.url, "--max-num-seqs", "4"])
    assert engine_flag.exit_code != 0 and "--max-num-seqs configure(s)" in flat(engine_flag.output)


def test_bench_serve_without_url_needs_lmc_serve(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    from lm_console.bench import launcher

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(launcher.importlib.util, "find_spec",
                        lambda name, *a: None if name == "lm_console.cli_serve" else real_find_spec(name, *a))
    result = runner.invoke(app, ["bench", "serve", "--num-prompts", "2", "--no-progress"])
    assert result.exit_code == 2
    assert "`lmc serve` is not available" in result.stderr and "--url" in result.stderr


def test_bench_serve_without_url_launches_a_server_and_stops_it(monkeypatch: pytest.MonkeyPatch,
                                                                 tmp_path: Path) -> None:
    from lm_console.bench import launcher

    launched = []

    def standin_command(model, port, engine_args):  # noqa: ANN001, ANN202
        launched.append((model, port, launcher.serve_flags(engine_args)))
        return [sys.executable, str(STANDIN_SCRIPT), str(port)]

    stopped = []
    real_stop = launcher.ServeProcess.stop

    def stop(self) -> None:  # noqa: ANN001
        process = self.process
        real_stop(self)
        stopped.append(process.returncode if process is not None else None)

    monkeypatch.setattr(launcher, "serve_command", standin_command)
    monkeypatch.setattr(launcher.ServeProcess, "stop", stop)
    monkeypatch.setenv("PYTHONPATH", f"{Path(__file__).parents[1]}:{Path(__file__).parents[2]}")
    out = tmp_path / "serve.json"
    result = runner.invoke(app, ["bench", "serve", "--num-prompts", "4", "--random-input-len", "8",
                                 "--random-output-len", "3", "--num-blocks", "128", "--no-enable-prefix-caching",
                                 "--save-result", str(out), "--no-progress"])
    assert result.exit_code == 0, result.output
    assert json.loads(out.read_text())["completed"] == 4
    (model, _, flags), = launched
    assert model is None and flags[flags.index("--num-blocks") + 1] == "128"
    assert "--no-enable-prefix-caching" in flags and stopped and stopped[-1] is not None


def test_bench_serve_launches_lmc_serve_with_its_own_options() -> None:
    """Every engine flag `lmc bench serve` hands its launched server is a real `lmc serve` option."""
    import typer

    from lm_console.bench.launcher import serve_command
    args = {"dtype": "float32", "max_model_len": 256, "num_gpu_blocks_override": 64, "block_size": 32,
            "max_num_seqs": 4, "max_num_batched_tokens": 512, "enable_prefix_caching": False, "num_threads": 2}
    command = serve_command("some-model", 8123, args)
    argv = command[command.index("serve") + 1:]
    serve = typer.main.get_command(app).commands["serve"]  # type: ignore[attr-defined]
    params = serve.make_context("serve", argv).params  # click refuses an unknown option here
    assert params["model_arg"] == "some-model" and (params["host"], params["port"]) == ("127.0.0.1", 8123)
    assert (params["dtype"], params["max_model_len"], params["num_blocks"], params["block_size"]) == ("float32", 256, 64, 32)
    assert (params["max_num_seqs"], params["max_num_batched_tokens"], params["num_threads"]) == (4, 512, 2)
    assert params["enable_prefix_caching"] is False
