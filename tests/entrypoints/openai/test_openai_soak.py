"""A soak of `lmc serve` under hostile traffic: 1,000 requests (two rounds of 500) at concurrency 32,
a fifth of them abandoned mid-stream, while a hostile request of a rotating kind arrives every
second. Every normal request is answered in full, every hostile one gets its 4xx (or its
connection closed), /health answers within 1 s throughout, and the server's RSS stays flat
between the rounds.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import psutil
import pytest

from openai_server_helpers import ServeProcess

pytestmark = pytest.mark.slow

NUM_REQUESTS = 500  # per round
CONCURRENCY = 32
MAX_TOKENS = 8
HEALTH_BOUND_S = 1.0
HOSTILE_BODIES = [
    ("huge-prompt", {"prompt": "hello world " * 400_000, "max_tokens": 4}),
    ("deep-json", b'{"prompt": ' + b"[" * 50_000 + b"]" * 50_000 + b"}"),
    ("lone-surrogate", b'{"prompt": "abc \\ud800", "max_tokens": 2}'),
    ("10000-choices", {"prompt": "x", "guided_choice": [f"c{i}" for i in range(10_000)]}),
    ("over-budget", {"prompt": ["a", "b", "c", "d"], "n": 64, "max_tokens": 500, "logprobs": 20}),
    ("5000-digits", b'{"prompt": "x", "max_tokens": ' + b"7" * 5000 + b"}"),
]


async def normal(http: httpx.AsyncClient, index: int) -> str:
    """A streamed completion; every fifth is abandoned after its first event."""
    abandon = index % 5 == 0
    body = {"prompt": f"Request {index}: once upon a time", "max_tokens": MAX_TOKENS, "temperature": 0.0,
            "ignore_eos": True, "stream": True}
    text, done = "", False
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
            text += "".join(choice["text"] for choice in chunk["choices"])
            if abandon:
                return "abandoned"
    assert done, text
    return "answered"


async def hostile(http: httpx.AsyncClient, url: str, stop: asyncio.Event, seen: list[str]) -> None:
    """One hostile request a second, of a rotating kind (and a slow-header connection now and then)."""
    index = 0
    while not stop.is_set():
        kind, body = HOSTILE_BODIES[index % len(HOSTILE_BODIES)]
        if index % 4 == 3:
            await slow_headers(url)
            seen.append("slow-headers")
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        response = await http.post("/v1/completions", content=content, headers={"content-type": "application/json"})
        assert 400 <= response.status_code < 500, (kind, response.status_code, response.text[:300])
        assert set(response.json()) == {"error"}, (kind, response.text[:300])
        seen.append(kind)
        index += 1
        try:
            await asyncio.wait_for(stop.wait(), 1.0)
        except asyncio.TimeoutError:
            pass


async def slow_headers(url: str) -> None:
    """Half a request's headers, then silence: the server closes the connection (--header-timeout 1)."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n")
    await writer.drain()
    assert await asyncio.wait_for(reader.read(), 10) == b""  # closed by the server
    writer.close()


async def health_probe(url: str, stop: asyncio.Event, latencies: list[float]) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=30, limits=httpx.Limits(keepalive_expiry=0.5)) as http:
        while not stop.is_set():
            start = time.monotonic()
            assert (await http.get("/health")).status_code == 200
            latencies.append(time.monotonic() - start)
            await asyncio.sleep(0.1)


async def run_round(url: str) -> tuple[list[str], list[str], list[float]]:
    stop = asyncio.Event()
    seen: list[str] = []
    latencies: list[float] = []
    semaphore = asyncio.Semaphore(CONCURRENCY)
    # Idle connections are dropped client-side after 0.5 s: the server's 1 s header timeout closes
    # an idle keep-alive connection, which a client reusing it at that moment reads as an error.
    limits = httpx.Limits(max_connections=CONCURRENCY + 8, max_keepalive_connections=CONCURRENCY,
                          keepalive_expiry=0.5)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as http, \
            httpx.AsyncClient(base_url=url, timeout=120,  # a new connection each time: the server's 1 s
                              # header timeout closes an idle keep-alive one just as the next request
                              # (a second later) would reuse it
                              limits=httpx.Limits(max_keepalive_connections=0)) as attacker:
        async def bounded(index: int) -> str:
            async with semaphore:
                return await normal(http, index)

        background = [asyncio.ensure_future(hostile(attacker, url, stop, seen)),
                      asyncio.ensure_future(health_probe(url, stop, latencies))]
        try:
            results = await asyncio.gather(*(bounded(i) for i in range(NUM_REQUESTS)))
        finally:
            stop.set()
            await asyncio.gather(*background)
    return results, seen, latencies


def test_soak_with_aborts_and_hostile_requests_keeps_serving_and_rss_flat(tiny_llama_dir) -> None:
    server = ServeProcess(str(tiny_llama_dir), "--dtype", "float32", "--max-model-len", "1024", "--num-blocks", "2048",
                          "--num-threads", "1", "--log-level", "warning", "--header-timeout", "1",
                          "--max-request-body", str(16 << 20))
    try:
        frontend = psutil.Process(server.proc.pid)
        rss: list[float] = []
        for round_index in range(2):
            started = time.perf_counter()
            results, seen, latencies = asyncio.run(run_round(server.url))
            assert results.count("answered") == NUM_REQUESTS - NUM_REQUESTS // 5
            assert results.count("abandoned") == NUM_REQUESTS // 5
            assert seen and max(latencies) < HEALTH_BOUND_S, (max(latencies), len(latencies))
            rss.append(frontend.memory_info().rss / 2**20)
            print(f"\nround {round_index + 1}: {time.perf_counter() - started:.1f} s, {len(seen)} hostile "
                  f"requests, /health max {max(latencies) * 1000:.0f} ms, server RSS {rss[-1]:.1f} MiB")
        assert rss[1] <= rss[0] * 1.10, rss  # flat: within 10% of the first round's
    finally:
        server.stop()

