"""64 concurrent streaming clients against `lmc serve`, a quarter of them disconnecting mid-stream.

The others complete; afterwards every KV block is free (the engine's get_stats through /metrics)
and the engine ran far fewer steps than the disconnected requests would have needed, so their
aborts reached the core at once; the server's RSS stays flat across two rounds.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import psutil
import pytest

from openai_server_helpers import ServeProcess, parse_metrics, sample_value

NUM_CLIENTS = 64
NUM_DISCONNECTING = NUM_CLIENTS // 4
COMPLETE_TOKENS = 32
ABANDONED_TOKENS = 900  # what a disconnected request asked for; it must not run that long
LABELS = {"engine": "0"}


async def one_client(http: httpx.AsyncClient, index: int, disconnect: bool) -> dict:
    body = {"prompt": f"Request {index}: the history of computing is", "temperature": 0.0, "ignore_eos": True,
            "max_tokens": ABANDONED_TOKENS if disconnect else COMPLETE_TOKENS, "stream": True,
            "stream_options": {"include_usage": True}}
    text, finish, usage, done, events = "", None, None, False, 0
    async with http.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if not line:
                continue
            data = line.removeprefix("data: ")
            if data == "[DONE]":
                done = True
                break
            chunk = json.loads(data)
            events += 1
            if chunk["choices"]:
                text += chunk["choices"][0]["text"]
                finish = chunk["choices"][0]["finish_reason"] or finish
            usage = chunk.get("usage") or usage
            if disconnect and events >= 3:
                break  # leaving the block closes the connection mid-stream
    return {"disconnected": disconnect, "text": text, "finish": finish, "usage": usage, "done": done}


async def run_round(url: str) -> list[dict]:
    limits = httpx.Limits(max_connections=NUM_CLIENTS + 8, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as http:
        return await asyncio.gather(*(one_client(http, i, i % 4 == 0) for i in range(NUM_CLIENTS)))


def wait_until_idle(url: str) -> dict:
    deadline = time.monotonic() + 120
    with httpx.Client(base_url=url, timeout=60) as http:
        while True:
            families = parse_metrics(http.get("/metrics").text)
            idle = (sample_value(families, "vllm:num_requests_running", **LABELS) == 0
                    and sample_value(families, "vllm:num_requests_waiting", **LABELS) == 0)
            if idle or time.monotonic() > deadline:
                return families
            time.sleep(0.1)


@pytest.mark.slow
def test_64_streams_with_disconnects_free_every_block_and_keep_rss_flat(tiny_llama_dir) -> None:
    server = ServeProcess(str(tiny_llama_dir), "--dtype", "float32", "--max-model-len", "1024", "--num-blocks", "4096",
                          "--num-threads", "1", "--log-level", "warning")
    try:
        frontend, core = psutil.Process(server.proc.pid), psutil.Process(server.core_pid)
        rss: list[tuple[float, float]] = []
        steps_before = 0.0
        for round_index in range(2):
            started = time.perf_counter()
            results = asyncio.run(run_round(server.url))
            elapsed = time.perf_counter() - started
            families = wait_until_idle(server.url)
            completed = [r for r in results if not r["disconnected"]]
            assert len(completed) == NUM_CLIENTS - NUM_DISCONNECTING
            for result in completed:
                assert result["done"] and result["finish"] == "length", result
                assert result["usage"]["completion_tokens"] == COMPLETE_TOKENS
            assert all(not r["done"] for r in results if r["disconnected"])
            assert sample_value(families, "vllm:num_requests_running", **LABELS) == 0
            assert sample_value(families, "lmc:num_free_blocks", **LABELS) == \
                sample_value(families, "lmc:num_total_blocks", **LABELS)
            assert sample_value(families, "vllm:kv_cache_usage_perc", **LABELS) == 0
            rounds = round_index + 1
            assert sample_value(families, "vllm:request_success", "_total", finished_reason="abort", **LABELS) == \
                NUM_DISCONNECTING * rounds
            assert sample_value(families, "vllm:request_success", "_total", finished_reason="length", **LABELS) == \
                (NUM_CLIENTS - NUM_DISCONNECTING) * rounds
            steps = sample_value(families, "lmc:engine_steps", "_total", **LABELS)
            # Without the aborts the core would step ABANDONED_TOKENS times for the abandoned requests.
            assert steps - steps_before < ABANDONED_TOKENS // 2, steps - steps_before
            steps_before = steps
            rss.append((frontend.memory_info().rss / 2**20, core.memory_info().rss / 2**20))
            print(f"\nround {round_index + 1}: {elapsed:.2f} s, {steps:.0f} engine steps so far, "
                  f"RSS server {rss[-1][0]:.1f} MiB, engine core {rss[-1][1]:.1f} MiB")
        assert rss[1][0] - rss[0][0] < 32, rss  # the server's RSS is flat across rounds
        with httpx.Client(base_url=server.url, timeout=60) as http:
            assert http.get("/health").status_code == 200
    finally:
        server.signal(__import__("signal").SIGTERM)
        code = server.wait(60)
    assert code == 0, server.output[-3000:]
