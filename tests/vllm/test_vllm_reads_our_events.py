"""Tools written for vLLM's KV events read ours: our engine's published bytes, decoded by vLLM's own classes.

Our engine (a tiny Llama, prefix caching, a pool small enough to evict) publishes on its PUB socket;
the payloads go to a Python in vLLM's venv, which decodes them with vllm.distributed.kv_events'
KVEventBatch and reports what it read. The negative control: the same events in the older array
form, which vLLM's decoder must refuse (so a pass means the format, not a lenient reader).
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import msgspec
import pytest

from lm_console.engine import LLM, SamplingParams
from lm_console.engine.metrics.kv_events import (
    BlockRemoved, BlockStored, KVEventBatch, KVEventSubscriber,
)

# The first test to ask for the server waits for vLLM to start (it compiles its model: up to 20 minutes on a
# busy 2-core machine), beyond the suite's 600 s default.
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(2700)]

DECODE_WITH_VLLM = """
import json, sys
import msgspec
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

decoder = msgspec.msgpack.Decoder(KVEventBatch)
rows = []
for payload in msgspec.msgpack.decode(open(sys.argv[1], "rb").read()):
    try:
        batch = decoder.decode(payload)
    except msgspec.ValidationError as error:
        rows.append({"error": str(error)})
        continue
    for event in batch.events:
        row = {"type": type(event).__name__}
        if isinstance(event, (BlockStored, BlockRemoved)):
            row["block_hashes"] = [h.hex() for h in event.block_hashes]
            row["medium"], row["group_idx"] = event.medium, event.group_idx
        if isinstance(event, BlockStored):
            row.update(parent=event.parent_block_hash.hex() if event.parent_block_hash else None,
                       num_tokens=len(event.token_ids), block_size=event.block_size, lora_name=event.lora_name,
                       kind=event.kv_cache_spec_kind)
        rows.append(row)
print(json.dumps(rows))
"""


def _decode_with_vllm(vllm_python: Path, payloads: list[bytes], tmp_path: Path) -> list[dict]:
    path = tmp_path / "payloads.msgpack"
    path.write_bytes(msgspec.msgpack.encode(payloads))
    done = subprocess.run([str(vllm_python), "-c", DECODE_WITH_VLLM, str(path)], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _ours(event: object) -> dict:
    row: dict = {"type": type(event).__name__}
    if isinstance(event, (BlockStored, BlockRemoved)):
        row["block_hashes"] = [h.hex() for h in event.block_hashes]
        row["medium"], row["group_idx"] = event.medium, event.group_idx
    if isinstance(event, BlockStored):
        row.update(parent=event.parent_block_hash.hex() if event.parent_block_hash else None,
                   num_tokens=len(event.token_ids), block_size=event.block_size, lora_name=event.lora_name,
                   kind=event.kv_cache_spec_kind)
    return row


class _OldStored(msgspec.Struct, array_like=True, tag="BlockStored"):
    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = "GPU"


class _LeanStored(msgspec.Struct, omit_defaults=True, tag="BlockStored"):
    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None


def test_vllms_decoder_reads_what_our_engine_publishes(vllm_python, tiny_llama_dir, tmp_path) -> None:  # noqa: ANN001
    llm = LLM(str(tiny_llama_dir), dtype="float32", max_model_len=256, num_gpu_blocks_override=25,
              enable_kv_cache_events=True)
    subscriber = KVEventSubscriber(llm.kv_events_endpoint)
    time.sleep(0.2)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    shared = list(range(100, 148))
    for wave in range(3):
        llm.generate([{"prompt_token_ids": shared + [1000 + 50 * wave + i] * 19} for i in range(4)], params,
                     use_tqdm=False)
    llm.reset_prefix_cache()
    payloads, ours = [], []
    while subscriber.socket.poll(500):
        frames = subscriber.socket.recv_multipart()
        payloads.append(frames[2])
        ours += [_ours(event) for event in msgspec.msgpack.decode(frames[2], type=KVEventBatch).events]
    subscriber.close()
    llm.shutdown()
    kinds = {row["type"] for row in ours}
    assert kinds == {"BlockStored", "BlockRemoved", "AllBlocksCleared"}, kinds  # every event type was published
    assert all(row["kind"] == "full_attention" and row["group_idx"] == 0 for row in ours if row["type"] == "BlockStored")

    assert _decode_with_vllm(vllm_python, payloads, tmp_path) == ours

    # Negative controls: the array form we published before, and the map form with its defaults left
    # out (msgspec's omit_defaults, as vLLM itself encodes), are both refused by vLLM's decoder.
    old_payload = msgspec.msgpack.encode([1.0, [_OldStored([b"\x01" * 32], None, list(range(16)), 16)]])
    lean_payload = msgspec.msgpack.encode([1.0, [_LeanStored([b"\x01" * 32], None, list(range(16)), 16)]])
    refused_old, refused_lean = _decode_with_vllm(vllm_python, [old_payload, lean_payload], tmp_path)
    assert "Expected `object`" in refused_old.get("error", ""), refused_old
    assert "missing required field" in refused_lean.get("error", ""), refused_lean
