"""AsyncLLMConsoleClient's conversions from the engine's own structures."""

from __future__ import annotations

from types import SimpleNamespace

from lm_console.client.asyncllm import chunk_of, hash_hex, kv_records_of, stats_sample_of
from lm_console.events import records_of_message, records_of_wire_batch


def test_stats_sample_of_scheduler_stats() -> None:
    from engine.metrics.stats import PrefixCacheStatsSnapshot, SchedulerStats

    stats = SchedulerStats(num_running_reqs=2, num_waiting_reqs=1, num_scheduled_tokens=64, token_budget=128,
                           kv_cache_usage=0.25, num_free_blocks=30, num_total_blocks=40,
                           prefix_cache=PrefixCacheStatsSnapshot(requests=1, queries=32, hits=16),
                           step_time_s=0.02, num_steps=5)
    sample = stats_sample_of(stats)
    assert (sample.num_running_reqs, sample.num_waiting_reqs, sample.token_budget) == (2, 1, 128)
    assert (sample.prefix_queries, sample.prefix_hits, sample.num_steps) == (32, 16, 5)
    assert sample.ts > 0


def test_kv_records_of_engine_events_and_wire_messages() -> None:
    import msgspec

    from engine.core.kv_cache.events import AllBlocksCleared, BlockRemoved, BlockStored
    from engine.metrics.kv_events import KVEventBatch, encode_kv_event_batch

    batch = KVEventBatch(ts=12.5, events=[
        BlockStored([b"\x01" * 4, b"\x02" * 4], None, list(range(8)), 4),
        BlockRemoved([b"\x03" * 4]), AllBlocksCleared()])
    records = kv_records_of(batch)
    assert [r.kind for r in records] == ["BlockStored", "BlockRemoved", "AllBlocksCleared"]
    assert records[0].block_hashes == ["01010101", "02020202"] and records[0].num_tokens == 8
    assert records[0].ts == 12.5 and records[1].block_hashes == ["03030303"]
    frames = [b"kv-events", (7).to_bytes(8, "big"), encode_kv_event_batch(batch)]
    decoded = records_of_message(frames, msgspec)
    assert [r.seq for r in decoded] == [7, 7, 7] and decoded[0].block_size == 4
    generic = records_of_wire_batch(msgspec.msgpack.decode(frames[2]), 7)
    assert [r.kind for r in generic] == [r.kind for r in records]
    assert generic[0].block_hashes == records[0].block_hashes


def test_chunk_of_request_output() -> None:
    from engine.outputs import CompletionOutput, RequestMetrics, RequestOutput

    metrics = RequestMetrics(arrival_time=1.0, first_token_time=1.5, last_token_time=2.5,
                             finished_time=2.5, num_generation_tokens=3)
    completion = CompletionOutput(index=0, text="hi", token_ids=[9], cumulative_logprob=None, logprobs=None,
                                  finish_reason="stop")
    output = RequestOutput(request_id="r1", prompt=None, prompt_token_ids=[1, 2, 3, 4], outputs=[completion],
                           finished=True, num_cached_tokens=2, metrics=metrics)
    chunk = chunk_of(output)
    assert (chunk.text, chunk.num_new_tokens, chunk.num_prompt_tokens, chunk.num_cached_tokens) == ("hi", 1, 4, 2)
    assert chunk.finished and chunk.finish_reason == "stop" and chunk.ttft_s == 0.5 and chunk.tpot_s == 0.5
    assert hash_hex(255) == "00000000000000ff" and hash_hex(SimpleNamespace) .startswith("<class")


def test_an_unresponsive_engine_shows_as_unavailable() -> None:
    """Issue 18 item 4: the console's engine-dead panel also covers a missed heartbeat."""
    import pytest

    from engine.errors import EngineDeadError, EngineUnresponsiveError
    from lm_console.client.asyncllm import _dead_as_unavailable
    from lm_console.client.types import EngineUnavailable

    for error in (EngineDeadError("gone"), EngineUnresponsiveError("unresponsive for 30.0 s")):
        with pytest.raises(EngineUnavailable, match=str(error)):
            with _dead_as_unavailable(None):
                raise error
