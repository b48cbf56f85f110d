"""AsyncLLMConsoleClient's conversions from the engine's own structures."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from lm_console.engine.metrics.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, encode_kv_event_batch
from lm_console.engine.metrics.stats import SchedulerStats
from lm_console.client.asyncllm import AsyncLLMConsoleClient, chunk_of, kv_records_of
from lm_console.client.types import hash_hex
from lm_console.events import records_of_message

SUMMARY = {"model": "m", "model_dir": "/nowhere", "device": "cpu", "dtype": "float32", "block_size": 16,
           "num_blocks": 65, "max_model_len": 512, "max_num_batched_tokens": 256, "max_num_seqs": 8,
           "enable_prefix_caching": True, "vocab_size": 900, "kv_events_endpoint": None, "multimodal": False}


def test_info_from_the_engines_summary_and_stats_pass_through(fake_async_llm, monkeypatch) -> None:  # noqa: ANN001
    stats = SchedulerStats(num_running_reqs=2, num_steps=5)

    async def stats_stream(self):  # noqa: ANN001, ANN202
        yield stats

    monkeypatch.setattr(fake_async_llm, "model_config_summary", dict(SUMMARY), raising=False)
    monkeypatch.setattr(fake_async_llm, "stats_stream", stats_stream, raising=False)

    async def scenario() -> tuple:
        client = AsyncLLMConsoleClient("m")
        info = await client.start()
        received = [s async for s in client.stats_stream()]
        await client.shutdown()
        return info, received

    info, received = asyncio.run(scenario())
    assert (info.model, info.num_blocks, info.max_num_seqs, info.vocab_size) == ("m", 65, 8, 900)  # 900 < len(tok)
    assert received == [stats] and received[0] is stats  # the engine's own SchedulerStats
    # A field the engine stops reporting is an error, not a silent default.
    monkeypatch.setattr(fake_async_llm, "model_config_summary", {k: v for k, v in SUMMARY.items() if k != "num_blocks"})
    with pytest.raises(KeyError, match="num_blocks"):
        asyncio.run(AsyncLLMConsoleClient("m").start())


def test_kv_records_hold_the_engines_events() -> None:
    batch = KVEventBatch(ts=12.5, events=[
        BlockStored([b"\x01" * 4, b"\x02" * 4], None, list(range(8)), 4),
        BlockRemoved([b"\x03" * 4]), AllBlocksCleared()])
    records = kv_records_of(batch)
    assert [r.kind for r in records] == ["BlockStored", "BlockRemoved", "AllBlocksCleared"]
    assert records[0].event is batch.events[0]
    assert records[0].block_hashes == ["01010101", "02020202"] and records[0].num_tokens == 8
    assert records[0].ts == 12.5 and records[1].block_hashes == ["03030303"] and records[2].block_hashes == []
    frames = [b"kv-events", (7).to_bytes(8, "big"), encode_kv_event_batch(batch)]
    decoded = records_of_message(frames)
    assert [r.seq for r in decoded] == [7, 7, 7]
    row = decoded[0].to_json_dict()
    assert row["block_size"] == 4 and row["type"] == "BlockStored" and row["parent_block_hash"] is None
    assert decoded[2].to_json_dict()["medium"] == "GPU"


def test_chunk_of_request_output() -> None:
    from lm_console.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput

    metrics = RequestMetrics(arrival_time=1.0, first_token_time=1.5, last_token_time=2.5,
                             finished_time=2.5, num_generation_tokens=3)
    completion = CompletionOutput(index=0, text="hi", token_ids=[9], cumulative_logprob=None, logprobs=None,
                                  finish_reason="stop")
    output = RequestOutput(request_id="r1", prompt=None, prompt_token_ids=[1, 2, 3, 4], outputs=[completion],
                           finished=True, num_cached_tokens=2, metrics=metrics)
    chunk = chunk_of(output)
    assert (chunk.text, chunk.num_new_tokens, chunk.num_prompt_tokens, chunk.num_cached_tokens) == ("hi", 1, 4, 2)
    assert chunk.finished and chunk.finish_reason == "stop" and chunk.ttft_s == 0.5 and chunk.tpot_s == 0.5
    assert hash_hex(255) == "00000000000000ff" and hash_hex(SimpleNamespace).startswith("<class")


def test_an_unresponsive_engine_shows_as_unavailable() -> None:
    """Issue 18 item 4: the console's engine-dead panel also covers a missed heartbeat."""
    import pytest

    from lm_console.engine.errors import EngineDeadError, EngineUnresponsiveError
    from lm_console.client.asyncllm import _dead_as_unavailable
    from lm_console.client.types import EngineUnavailable

    for error in (EngineDeadError("gone"), EngineUnresponsiveError("unresponsive for 30.0 s")):
        with pytest.raises(EngineUnavailable, match=str(error)):
            with _dead_as_unavailable(None):
                raise error


def test_every_client_declares_what_it_can_do() -> None:
    """The console asks `capabilities`, never probes attributes: each client has every member of
    the ConsoleClient protocol, and a member whose ability is off answers as the protocol says."""
    import ast
    from pathlib import Path

    from lm_console.client.fake import FakeConsoleClient
    from lm_console.client.protocol import ClientCapabilities, ConsoleClient
    from lm_console.client.remote import RemoteConsoleClient

    fake = FakeConsoleClient(auto_step=False)
    remote = RemoteConsoleClient("http://127.0.0.1:9")
    for client in (fake, remote):
        assert isinstance(client, ConsoleClient), type(client).__name__
        assert isinstance(client.capabilities, ClientCapabilities)
    assert fake.capabilities.request_blocks and fake.capabilities.decode_prompt
    assert not remote.capabilities.request_blocks and not remote.capabilities.server_requests
    assert remote.decode_prompt([1, 2]) == ""
    with pytest.raises(NotImplementedError):
        asyncio.run(remote.request_blocks())
    # No getattr/hasattr probing of a client anywhere in the console.
    root = Path(__file__).resolve().parents[2] / "lm_console"
    probes = []
    for path in root.rglob("*.py"):
        if "engine" in path.relative_to(root).parts[:1] or "kernels" in path.relative_to(root).parts[:1]:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr")
                    and node.args and "client" in ast.unparse(node.args[0])):
                probes.append(f"{path.relative_to(root)}:{node.lineno}")
    assert not probes, probes
