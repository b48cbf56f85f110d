"""CliRunner tests of every `lmc` command (fake engine or tiny models)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from console_helpers import kv_event_publisher, publishing
from typer.testing import CliRunner

from lm_console.cli import app

pytestmark = pytest.mark.slow

runner = CliRunner()


def test_tui_builds_the_app_from_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    from lm_console.tui import app as app_module

    seen = {}
    monkeypatch.setattr(app_module.ConsoleApp, "run", lambda self: seen.update(app=self))
    result = runner.invoke(app, ["tui", "--fake", "--load", "--rate", "3", "--prompt-len", "16-64",
                                 "--shared-prefix", "0.25", "--num-blocks", "256"])
    assert result.exit_code == 0, result.output
    console = seen["app"]
    assert console.start_load and console.shape.rate == 3.0 and console.shape.prompt_len == (16, 64)
    assert console.client.info.num_blocks == 256
    bad = runner.invoke(app, ["tui", "--fake", "--prompt-len", "64-16"])
    assert bad.exit_code != 0 and "min <= max" in bad.output


def test_tui_real_engine_client_gets_engine_args(monkeypatch: pytest.MonkeyPatch) -> None:
    from lm_console.tui import app as app_module

    seen = {}
    monkeypatch.setattr(app_module.ConsoleApp, "run", lambda self: seen.update(app=self))
    result = runner.invoke(app, ["tui", "--model", "/m", "--num-blocks", "300", "--max-num-seqs", "8",
                                 "--no-enable-prefix-caching"])
    assert result.exit_code == 0, result.output
    client = seen["app"].client
    assert client.model == "/m" and client.engine_args["num_gpu_blocks_override"] == 300
    assert client.engine_args["enable_kv_cache_events"] and not client.engine_args["enable_prefix_caching"]


def test_chat_plain_is_a_pipe() -> None:
    result = runner.invoke(app, ["chat", "--plain", "--fake", "--max-tokens", "64"],
                           input="hello there\n/image cat.png\nsecond turn\n")
    assert result.exit_code == 0, result.output
    lines = [line for line in result.stdout.splitlines() if line]
    assert len(lines) == 2 and "hello there" in lines[0] and "second turn" in lines[1]
    assert "text-only" in result.stderr


def test_chat_screen_builds(monkeypatch: pytest.MonkeyPatch) -> None:
    from lm_console.tui import app as app_module

    seen = {}
    monkeypatch.setattr(app_module.ConsoleApp, "run", lambda self: seen.update(app=self))
    result = runner.invoke(app, ["chat", "--fake", "--system", "Be brief.", "--temperature", "0"])
    assert result.exit_code == 0, result.output
    assert seen["app"].chat_only and seen["app"].session.system_prompt == "Be brief."
    assert seen["app"].session.params.temperature == 0.0


def test_events_prints_json_lines() -> None:
    result = runner.invoke(app, ["events", "--fake", "--count", "5", "--rate", "30", "--duration", "20"])
    assert result.exit_code == 0, result.output
    events = [json.loads(line) for line in result.stdout.splitlines()]
    assert len(events) == 5
    assert {"ts", "seq", "type", "block_hashes", "parent_block_hash", "num_tokens"} <= set(events[0])
    assert events[0]["type"] in ("BlockStored", "BlockRemoved", "AllBlocksCleared")


def test_batch_round_trip(tmp_path: Path, fake_async_llm) -> None:  # noqa: ANN001
    from test_batch import batch_lines

    source, target = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text("\n".join(batch_lines(20)) + "\n")
    result = runner.invoke(app, ["batch", "-i", str(source), "-o", str(target), "--no-progress"])
    assert result.exit_code == 0, result.output
    records = [json.loads(line) for line in target.read_text().splitlines()]
    assert len(records) == 20 and sum(r["error"] is not None for r in records) == 2
    assert [r["custom_id"] for r in records][13:] == [f"req-{i}" for i in range(13, 20)]
    assert "18 succeeded, 2 failed" in result.stderr
    missing = runner.invoke(app, ["batch", "-i", str(tmp_path / "nope.jsonl"), "-o", str(target)])
    assert missing.exit_code == 2


def test_bench_serve_summary_and_json(tmp_path: Path, fake_async_llm) -> None:  # noqa: ANN001
    out = tmp_path / "serve.json"
    result = runner.invoke(app, ["bench", "serve", "--in-process", "--num-prompts", "6", "--random-input-len", "16",
                                 "--random-output-len", "4", "--request-rate", "50", "--burstiness", "0.5",
                                 "--max-concurrency", "3", "--metric-percentiles", "50,99",
                                 "--save-result", str(out), "--no-progress"])
    assert result.exit_code == 0, result.output
    for label in ("Serving Benchmark Result", "Successful requests:", "Mean TTFT (ms):", "P99 ITL (ms):",
                  "Median TPOT (ms):", "Mean E2EL (ms):", "Maximum request concurrency:"):
        assert label in result.stdout
    data = json.loads(out.read_text())
    for key in ("duration", "completed", "failed", "total_input_tokens", "total_output_tokens",
                "request_throughput", "output_throughput", "total_token_throughput", "ttfts", "itls",
                "mean_ttft_ms", "median_tpot_ms", "p99_itl_ms", "p50_e2el_ms", "request_rate", "burstiness",
                "max_concurrency", "num_prompts"):
        assert key in data
    assert data["completed"] == 6 and data["failed"] == 0
    plot = tmp_path / "serve.latency.svg"  # the latency histograms, next to the JSON
    assert plot.is_file() and f"Latency plot: {plot}" in result.stdout
    assert "TTFT: time to first token" in plot.read_text() and "(6 samples)" in plot.read_text()


def test_bench_serve_exits_non_zero_on_failures(tmp_path: Path, fake_async_llm,  # noqa: ANN001
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    async def broken(self, prompt, sampling_params=None, request_id=None):  # noqa: ANN001, ANN202
        raise RuntimeError("boom")
        yield  # pragma: no cover

    monkeypatch.setattr(fake_async_llm, "generate", broken)
    result = runner.invoke(app, ["bench", "serve", "--in-process", "--num-prompts", "3", "--random-input-len", "8",
                                 "--random-output-len", "2", "--no-progress"])
    assert result.exit_code == 1 and "3 request(s) failed" in result.stderr


@pytest.mark.slow
def test_bench_throughput_end_to_end_with_hf_baseline(tiny_llama_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "tp.json"
    result = runner.invoke(app, ["bench", "throughput", "--model", str(tiny_llama_dir), "--num-prompts", "6",
                                 "--random-input-len", "24", "--random-output-len", "8", "--baseline", "hf",
                                 "--hf-batch-sizes", "2,6", "--hf-dtypes", "float32", "--dtype", "float32",
                                 "--save-result", str(out)])
    assert result.exit_code == 0, result.output
    assert "Throughput:" in result.stdout and "requests/s" in result.stdout
    assert "ratio vs HF's best" in result.stdout
    data = json.loads(out.read_text())
    for key in ("elapsed_time", "num_requests", "total_num_tokens", "requests_per_second", "tokens_per_second"):
        assert key in data
    assert data["num_requests"] == 6 and data["ratio_vs_baseline"] > 0 and data["baseline"]["batch_size"] in (2, 6)
    assert "Processed prompts" in result.stderr  # the progress bar goes to stderr


@pytest.mark.slow
def test_bench_prefix_on_and_off(tiny_llama_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "prefix.json"
    result = runner.invoke(app, ["bench", "prefix", "--model", str(tiny_llama_dir), "--num-prompts", "6",
                                 "--prefix-len", "64", "--suffix-len", "8", "--num-prefixes", "2",
                                 "--output-len", "4", "--dtype", "float32", "--save-result", str(out),
                                 "--no-progress"])
    assert result.exit_code == 0, result.output
    assert "Prefix Caching Benchmark Result" in result.stdout and "Speedup (off / on):" in result.stdout
    data = json.loads(out.read_text())
    assert data["prefix_caching_on"]["num_cached_tokens"] > 0
    assert data["prefix_caching_off"]["num_cached_tokens"] == 0
    assert "requests_per_second" in data and data["prefix_cache_hit_rate"] > 0.3


def test_generate_and_models(tiny_llama_dir: Path) -> None:
    result = runner.invoke(app, ["generate", "Hello", "--model", str(tiny_llama_dir), "--max-tokens", "4"])
    assert result.exit_code == 0, result.output
    listing = runner.invoke(app, ["models"])
    assert listing.exit_code == 0 and "SmolLM2-135M-Instruct" in listing.stdout


def test_generate_quantized(tiny_llama_dir: Path) -> None:
    from lm_console.kernels import cpu_quant

    if cpu_quant.load() is None:
        pytest.skip("no quantized CPU kernels")
    result = runner.invoke(app, ["generate", "Hello", "--model", str(tiny_llama_dir), "--max-tokens", "2",
                                 "--quantization", "int8"])
    assert result.exit_code == 0, result.output
    bad = runner.invoke(app, ["generate", "Hello", "--model", str(tiny_llama_dir), "--quantization", "gguf"])
    assert bad.exit_code == 2 and "needs a model converted from a GGUF file" in bad.output


def test_events_from_a_zmq_endpoint(tmp_path: Path) -> None:
    from lm_console.engine.metrics.kv_events import BlockRemoved, BlockStored

    events = [BlockStored([b"\x0a" * 8], None, list(range(4)), 4), BlockRemoved([b"\x0b" * 8])]
    with kv_event_publisher(f"ipc://{tmp_path}/kv.sock") as publisher, publishing(publisher, events, 0.02):
        result = runner.invoke(app, ["events", "--endpoint", publisher.endpoint, "--count", "4", "--duration", "20"])
    assert result.exit_code == 0, result.output
    events = [json.loads(line) for line in result.stdout.splitlines()]
    assert len(events) == 4 and events[0]["type"] in ("BlockStored", "BlockRemoved")
    stored = next(e for e in events if e["type"] == "BlockStored")
    assert stored["block_hashes"] == ["0a" * 8] and stored["num_tokens"] == 4 and stored["seq"] >= 0


def test_bench_reports_a_bad_model_cleanly(tmp_path: Path) -> None:
    result = runner.invoke(app, ["bench", "throughput", "--model", str(tmp_path / "nope"), "--num-prompts", "2"])
    assert result.exit_code == 2 and "ModelNotFoundError" in result.stderr


def test_batch_checks_the_output_path_first_and_never_shows_a_traceback(tmp_path: Path, fake_async_llm) -> None:  # noqa: ANN001
    """Issue 18 items 5 and 6: binary input, unwritable output, output over input."""
    source = tmp_path / "in.jsonl"
    source.write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00binary\xff\n" + b'{"custom_id": "a"}\n')
    unwritable = runner.invoke(app, ["batch", "-i", str(source), "-o", str(tmp_path / "no" / "dir" / "out.jsonl")])
    assert unwritable.exit_code == 2 and "cannot write" in unwritable.stderr
    assert not fake_async_llm.instances, "the engine must not start when the output cannot be written"
    same = runner.invoke(app, ["batch", "-i", str(source), "-o", str(source)])
    assert same.exit_code == 2 and "is the input file" in same.stderr
    target = tmp_path / "out.jsonl"
    binary = runner.invoke(app, ["batch", "-i", str(source), "-o", str(target), "--no-progress"])
    assert binary.exit_code == 0, binary.output
    records = [json.loads(line) for line in target.read_text().splitlines()]
    assert len(records) == 4 and all(r["response"]["status_code"] == 400 for r in records)
    assert "not valid UTF-8" in records[0]["error"] and "Traceback" not in binary.output


def test_cli_errors_are_messages_not_tracebacks(tiny_llama_dir) -> None:  # noqa: ANN001
    """Issue 18 item 6: each of these printed a Python traceback on main."""
    for args in (["generate", "hi", "--seed", str(10**30)], ["generate", "hi", "--top-k", str(10**30)],
                 ["generate", "bad \udcff bytes from argv", "--model", str(tiny_llama_dir), "--dtype", "float32",
                  "--max-model-len", "64"],
                 ["events", "--endpoint", "notanendpoint"]):
        result = runner.invoke(app, args)
        assert result.exit_code == 2, (args, result.output)
        assert result.stderr.startswith("error: ") and result.exception is None or isinstance(
            result.exception, SystemExit), (args, result.output)
        assert "Traceback" not in result.output
    binary = runner.invoke(app, ["chat", "--plain", "--fake", "--max-tokens", "8"],
                           input=b"hello\n\xff\xfe binary \x00\nagain\n")
    assert binary.exit_code == 0, binary.output
    assert "not UTF-8" in binary.stderr and len([line for line in binary.stdout.splitlines() if line]) == 2
