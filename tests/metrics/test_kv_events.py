"""KV cache events on the PUB socket: vLLM's wire shape, gap-free seqs, hashes = the prefix cache."""

from __future__ import annotations

import asyncio
import time

import msgspec
import pytest
import zmq

from lm_console.engine import AsyncLLM, LLM, SamplingParams
from lm_console.engine.metrics.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from lm_console.engine.kv_cache_hashing import sha256_cbor
from lm_console.engine.metrics.kv_events import (
    KVEventBatch, KVEventPublisher, KVEventSubscriber, decode_kv_event_message, encode_kv_event_batch,
)

pytestmark = pytest.mark.slow

BLOCK_SIZE = 16


def test_wire_shape_is_vllms() -> None:
    batch = KVEventBatch(ts=1.5, events=[
        BlockStored(block_hashes=[b"h1", b"h2"], parent_block_hash=None, token_ids=list(range(32)), block_size=16),
        BlockRemoved(block_hashes=[b"h1"]), AllBlocksCleared()])
    raw = msgspec.msgpack.decode(encode_kv_event_batch(batch))
    assert raw[0] == 1.5 and raw[2] is None  # the batch: an array [ts, events, data_parallel_rank]
    # Each event: a map tagged by "type" with every field, defaults included (vLLM's own decoder
    # requires lora_id, medium and lora_name).
    assert raw[1][0] == {"type": "BlockStored", "block_hashes": [b"h1", b"h2"], "parent_block_hash": None,
                         "token_ids": list(range(32)), "block_size": 16, "lora_id": None, "medium": "GPU",
                         "lora_name": None, "extra_keys": None, "group_idx": None, "kv_cache_spec_kind": None,
                         "kv_cache_spec_sliding_window": None, "locality": None, "ownership": None,
                         "session_id": None}
    assert raw[1][1] == {"type": "BlockRemoved", "block_hashes": [b"h1"], "medium": "GPU", "group_idx": None,
                         "locality": None, "ownership": None}
    assert raw[1][2] == {"type": "AllBlocksCleared", "medium": "GPU"}
    context = zmq.Context()
    publisher = KVEventPublisher(context, "inproc://kv-test")
    subscriber = KVEventSubscriber(publisher.endpoint, context=context)
    time.sleep(0.05)  # let the subscription reach the publisher
    publisher.publish(batch.events, ts=1.5)
    publisher.publish([])  # nothing to send: no message, no seq used
    publisher.publish([AllBlocksCleared()])
    assert subscriber.receive(2) == (0, batch)
    seq, second = subscriber.receive(2)
    assert seq == 1 and second.events == [AllBlocksCleared()]
    with pytest.raises(ValueError, match="3 frames"):
        decode_kv_event_message([b"topic", b"\x00" * 8])
    subscriber.close()
    publisher.close()
    context.term()


def _drain(subscriber: KVEventSubscriber, quiet_s: float = 0.3) -> list[tuple[int, KVEventBatch]]:
    received = []
    while (message := subscriber.receive(quiet_s)) is not None:
        received.append(message)
    return received


def test_subscriber_sees_the_prefix_cache(tiny_llama_dir) -> None:
    # 24 usable blocks: the second wave of prompts must evict the first wave's cached blocks.
    llm = LLM(str(tiny_llama_dir), dtype="float32", max_model_len=256, num_gpu_blocks_override=25,
              enable_kv_cache_events=True)
    assert llm.kv_events_endpoint and llm.kv_events_endpoint.startswith("ipc://")
    subscriber = KVEventSubscriber(llm.kv_events_endpoint)
    time.sleep(0.2)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    shared = list(range(100, 100 + 3 * BLOCK_SIZE))
    for wave in range(3):
        prompts = [{"prompt_token_ids": shared + [1000 + 50 * wave + i] * (BLOCK_SIZE + 3)} for i in range(4)]
        llm.generate(prompts, params, use_tqdm=False)
    messages = _drain(subscriber)
    assert [seq for seq, _ in messages] == list(range(len(messages)))  # gap-free from 0
    stored: dict[bytes, BlockStored] = {}
    live: set[bytes] = set()
    removed = 0
    for _, batch in messages:
        for event in batch.events:
            if isinstance(event, BlockStored):
                assert len(event.token_ids) == len(event.block_hashes) * event.block_size == len(event.block_hashes) * 16
                for block_hash in event.block_hashes:
                    stored[block_hash] = event
                    live.add(block_hash)
                _check_chain(event)
            elif isinstance(event, BlockRemoved):
                removed += len(event.block_hashes)
                live.difference_update(event.block_hashes)
    assert removed > 0, "the small pool should have evicted cached blocks"
    assert live == set(llm.engine_core.call_utility("get_prefix_cache_hashes"))
    assert llm.reset_prefix_cache()
    (_, batch), = _drain(subscriber)
    assert batch.events == [AllBlocksCleared()]
    subscriber.close()
    llm.shutdown()


def _check_chain(event: BlockStored) -> None:
    """Each hash is sha256_cbor((parent, block tokens, None)) of the block before it."""
    parent = event.parent_block_hash
    for i, block_hash in enumerate(event.block_hashes):
        tokens = tuple(event.token_ids[i * event.block_size:(i + 1) * event.block_size])
        if parent is not None:
            assert block_hash == sha256_cbor((parent, tokens, None))
        parent = block_hash


def test_async_llm_kv_events_stream_matches_the_pub_socket(tiny_llama_dir) -> None:
    async def main():
        async with AsyncLLM(str(tiny_llama_dir), dtype="float32", max_model_len=128, num_gpu_blocks_override=64,
                            enable_kv_cache_events=True, stat_loggers=[]) as llm:
            subscriber = KVEventSubscriber(llm.kv_events_endpoint)
            batches = []

            async def watch():
                async for batch in llm.kv_events_stream():
                    batches.append(batch)

            watcher = asyncio.create_task(watch())
            await asyncio.sleep(0.2)
            prompt = {"prompt_token_ids": list(range(200, 240))}
            async for _ in llm.generate(prompt, SamplingParams(max_tokens=4, ignore_eos=True)):
                pass
            await asyncio.sleep(0.2)
            published = [batch for _, batch in _drain(subscriber)]
            subscriber.close()
            watcher.cancel()
            return batches, published

    batches, published = asyncio.run(main())
    assert batches and batches == published
    assert sum(len(e.block_hashes) for b in batches for e in b.events) == 2  # 40 prompt tokens: 2 full blocks
