"""RemoteConsoleClient against a stand-in OpenAI server: detection, /metrics, chat, abort, auth, failures."""

from __future__ import annotations

import asyncio
import base64
import socket
from pathlib import Path

import pytest
from console_helpers import kv_event_publisher
from http_helpers import ServerThread
from openai_standin import MODEL, WORDS, StandinState, set_metrics, standin_app

from lm_console.client.openai_http import RemoteRequestError
from lm_console.client.remote import RemoteConsoleClient
from lm_console.client.sse import iter_sse
from lm_console.client.types import (
    UNAVAILABLE_BLOCK_MAP,
    UNAVAILABLE_KV_EVENTS,
    UNAVAILABLE_STEPS,
    EngineUnavailable,
    GenParams,
    StatsSnapshot,
)
from lm_console.client.vllm_metrics import MetricsSampler, parse_metrics

pytestmark = pytest.mark.slow


def run(coro):  # noqa: ANN001, ANN201
    return asyncio.run(asyncio.wait_for(coro, 60))


def test_sse_reader_follows_the_spec() -> None:
    async def lines():  # noqa: ANN202
        for line in [": comment", "event: stats", "data: {\"a\":", "data: 1}", "", "data: plain\r", "", "data: last"]:
            yield line

    async def collect():  # noqa: ANN202
        return [(e.event, e.data) async for e in iter_sse(lines())]

    assert run(collect()) == [("stats", '{"a":\n1}'), ("message", "plain"), ("message", "last")]


def test_metrics_become_snapshots_with_counter_deltas(standin) -> None:  # noqa: ANN001
    import httpx

    app = standin.app
    set_metrics(app, running=3, waiting=1, usage=0.25, prompt_tokens=100, generation_tokens=10,
                prefix_cache_queries=80, prefix_cache_hits=60, num_preemptions=2)
    sampler = MetricsSampler()
    first = sampler.sample(parse_metrics(httpx.get(standin.url + "/metrics").text), now=1.0)
    set_metrics(app, prompt_tokens=50, generation_tokens=20, prefix_cache_queries=40, prefix_cache_hits=10,
                num_preemptions=1)
    second = sampler.sample(parse_metrics(httpx.get(standin.url + "/metrics").text), now=2.0)
    assert (first.num_running_reqs, first.num_waiting_reqs, first.kv_cache_usage) == (3, 1, 0.25)
    assert first.num_prompt_tokens == first.prefix_cache.queries == 0  # the first poll is the baseline
    assert first.num_total_blocks == 2048 and first.num_free_blocks == 1536
    assert isinstance(first, StatsSnapshot) and first.timestamp == 1.0  # a poll is not an engine step
    assert (second.num_prompt_tokens, second.num_generation_tokens) == (50, 20)
    assert (second.prefix_cache.queries, second.prefix_cache.hits) == (40, 10)
    assert second.num_preempted_reqs == 1 and second.num_preemptions_total == 3


def test_detects_another_server_and_lists_what_it_does_not_publish(standin) -> None:  # noqa: ANN001
    set_metrics(standin.app, running=2, waiting=5, usage=0.5)

    async def scenario():  # noqa: ANN202
        client = RemoteConsoleClient(standin.url, poll_interval_s=0.05)
        info = await client.start()
        stream = client.stats_stream()
        sample = await stream.__anext__()
        await stream.aclose()
        await client.shutdown()
        return client, info, sample

    client, info, sample = run(scenario())
    assert client.mode == "openai" and info.model == MODEL and info.max_model_len == 2048
    assert info.num_blocks == 2048 and info.url == standin.url
    assert {UNAVAILABLE_BLOCK_MAP, UNAVAILABLE_STEPS, UNAVAILABLE_KV_EVENTS} <= set(info.unavailable)
    assert "--kv-events-endpoint" in info.unavailable[UNAVAILABLE_KV_EVENTS]
    assert (sample.num_running_reqs, sample.num_waiting_reqs, sample.kv_cache_usage) == (2, 5, 0.5)


def test_chat_streams_and_sends_images_as_data_urls(standin, tmp_path: Path) -> None:  # noqa: ANN001
    image = tmp_path / "cat.png"
    image.write_bytes(b"\x89PNG\r\n\x1a\nnot-really-pixels")

    async def scenario():  # noqa: ANN202
        client = RemoteConsoleClient(standin.url)
        await client.start()
        messages = [{"role": "user", "content": [{"type": "image", "image": str(image)},
                                                 {"type": "text", "text": "What is this?"}]}]
        chunks = [c async for c in client.chat(messages, GenParams(max_tokens=16, seed=7), "chat-0001")]
        prompt_chunks = [c async for c in client.generate([101, 102, 103], GenParams(max_tokens=3), "load-0001")]
        await client.shutdown()
        return chunks, prompt_chunks

    chunks, prompt_chunks = run(scenario())
    assert "".join(c.text for c in chunks) == "".join(WORDS)
    assert sum(c.num_new_tokens for c in chunks) == len(WORDS)
    final = chunks[-1]
    assert final.finished and final.finish_reason == "length" and final.num_cached_tokens == 3
    chat_body, completion_body = standin.state.bodies
    part = chat_body["messages"][0]["content"][0]
    assert part["type"] == "image_url"
    assert base64.b64decode(part["image_url"]["url"].split(",", 1)[1]) == image.read_bytes()
    assert part["image_url"]["url"].startswith("data:image/png;base64,")
    assert chat_body["stream"] and chat_body["stream_options"]["include_usage"] and chat_body["seed"] == 7
    assert completion_body["prompt"] == [101, 102, 103] and completion_body["model"] == MODEL
    assert standin.state.headers[0]["x-request-id"] == "chat-0001"
    assert sum(c.num_new_tokens for c in prompt_chunks) == 3


def test_abort_closes_the_stream(standin) -> None:  # noqa: ANN001
    standin.state.chunk_delay_s = 0.05
    standin.state.num_words = 1000

    async def scenario():  # noqa: ANN202
        client = RemoteConsoleClient(standin.url)
        await client.start()
        chunks = []
        async for chunk in client.generate("tell me everything", GenParams(max_tokens=1000), "load-0007"):
            chunks.append(chunk)
            if len(chunks) == 2:
                await client.abort("load-0007")
        while standin.state.num_closed_early == 0:
            await asyncio.sleep(0.02)
        await client.shutdown()
        return chunks

    chunks = run(scenario())
    assert chunks[-1].finished and chunks[-1].finish_reason == "abort" and len(chunks) <= 4
    assert standin.state.num_closed_early == 1


def test_a_refused_key_and_an_unreachable_server_are_clear() -> None:
    state = StandinState(api_key="sesame")
    with ServerThread(standin_app(state)) as server:
        for key in (None, "wrong"):
            with pytest.raises(EngineUnavailable) as refused:
                run(RemoteConsoleClient(server.url, api_key=key).start())
            assert "401" in str(refused.value) and "--api-key" in refused.value.hint
            assert refused.value.during_start
        async def attach():  # noqa: ANN202
            client = RemoteConsoleClient(server.url, api_key="sesame")
            info = await client.start()
            await client.shutdown()
            return info

        assert run(attach()).model == MODEL
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()
    with pytest.raises(EngineUnavailable) as unreachable:
        run(RemoteConsoleClient(f"http://127.0.0.1:{port}").start())
    assert "Cannot reach" in str(unreachable.value) and "--url" in unreachable.value.hint


def test_bad_requests_and_a_dying_server(standin) -> None:  # noqa: ANN001
    async def scenario():  # noqa: ANN202
        client = RemoteConsoleClient(standin.url)
        await client.start()
        with pytest.raises(RemoteRequestError) as refused:
            async for _ in client.generate("x", GenParams(max_tokens=0), "bad-1"):
                pass
        standin.state.fail_stream_after = 2
        with pytest.raises(EngineUnavailable) as died:
            async for _ in client.chat([{"role": "user", "content": "hi"}], GenParams(), "chat-2"):
                pass
        await client.shutdown()
        return refused.value, died.value

    refused, died = run(scenario())
    assert "max_tokens must be at least 1" in str(refused) and refused.status_code == 400
    assert standin.url in str(died)


def test_kv_events_from_a_zmq_publisher(standin) -> None:  # noqa: ANN001
    from lm_console.engine.metrics.kv_events import BlockStored

    async def scenario(publisher):  # noqa: ANN001, ANN202
        client = RemoteConsoleClient(standin.url, kv_events_endpoint=publisher.endpoint)
        info = await client.start()
        stream = client.kv_events_stream()
        got = asyncio.ensure_future(stream.__anext__())
        while not got.done():  # PUB/SUB: publish until the subscription has joined
            publisher.publish([BlockStored([b"\x01" * 32], None, list(range(16)), 16)])
            await asyncio.sleep(0.05)
        records = got.result()
        await stream.aclose()
        await client.shutdown()
        return info, records

    with kv_event_publisher() as publisher:
        info, records = run(scenario(publisher))
    assert UNAVAILABLE_KV_EVENTS not in info.unavailable
    assert records[0].kind == "BlockStored" and records[0].block_hashes == ["01" * 32]
    assert records[0].num_tokens == 16


def test_stats_stream_ends_with_engine_unavailable_when_the_server_goes() -> None:
    state = StandinState()
    server = ServerThread(standin_app(state)).start()

    async def scenario():  # noqa: ANN202
        client = RemoteConsoleClient(server.url, poll_interval_s=0.05)
        await client.start()
        seen = 0
        with pytest.raises(EngineUnavailable) as lost:
            async for _ in client.stats_stream():
                seen += 1
                if seen == 2:
                    await asyncio.to_thread(server.stop)
        await client.shutdown()
        return lost.value

    lost = run(scenario())
    assert "stopped answering" in str(lost) or "Cannot reach" in str(lost)


def test_kv_gaps_are_counted_from_the_batch_numbers() -> None:
    client = RemoteConsoleClient("http://127.0.0.1:1")
    for last, seq in ((-1, 7), (7, 8), (8, 12)):  # the first batch seen starts the count; 9-11 were lost
        client._count_gap(last, seq)
    assert client.num_kv_gaps == 3
