"""KV events from other producers: vLLM's current map form, its older array form, unknown types.

The decoder a console uses (decode_kv_event_payload) must read what a real vLLM publishes, must keep
reading when a producer adds fields or event types, and must never take a whole batch down for one
event it cannot read. The strict decoder (our own engine's, decode_kv_event_message) is the negative
control: it refuses what the lenient one has to read.
"""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from lm_console.client.types import KVEventRecord
from lm_console.engine.entrypoints.console_protocol import decode_kv_frame
from lm_console.engine.metrics.kv_events import (
    AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, UnknownKVEvent, decode_kv_event_message,
    decode_kv_event_message_lenient, decode_kv_event_payload, encode_kv_event_batch,
)
from lm_console.events import records_of_message

DATA = Path(__file__).resolve().parent.parent / "data" / "kv_events"
H1, H2, H3 = b"\x01" * 32, b"\x02" * 32, b"\x03" * 32


def _frames(batch: object, seq: int = 7) -> list[bytes]:
    return [b"", seq.to_bytes(8, "big"), msgspec.msgpack.encode(batch)]


def _vllm_stored(**extra: object) -> dict[str, object]:
    """A BlockStored as vLLM 0.32 encodes it: a map with its tag under "type", defaults omitted."""
    return {"type": "BlockStored", "block_hashes": [H1, H2], "parent_block_hash": None,
            "token_ids": list(range(256)), "block_size": 128, "lora_id": None, "medium": "GPU",
            "lora_name": None, "group_idx": 0, "kv_cache_spec_kind": "full_attention", **extra}


def test_reads_vllms_current_map_form_with_fields_it_does_not_know() -> None:
    batch = [1.25, [_vllm_stored(extra_keys=[None, ["salt"]], a_field_from_the_future=[1, 2]),
                    {"type": "BlockRemoved", "block_hashes": [H1], "medium": "GPU", "group_idx": 0},
                    {"type": "AllBlocksCleared"}], 0]
    topic, seq, decoded = decode_kv_event_message_lenient(_frames(batch))
    assert (topic, seq, decoded.ts, decoded.data_parallel_rank) == (b"", 7, 1.25, 0)
    stored, removed, cleared = decoded.events
    assert isinstance(stored, BlockStored) and stored.block_hashes == [H1, H2] and stored.block_size == 128
    assert stored.group_idx == 0 and stored.kv_cache_spec_kind == "full_attention"
    assert stored.extra_keys == [None, ["salt"]]
    assert removed == BlockRemoved(block_hashes=[H1], medium="GPU", group_idx=0)
    assert isinstance(cleared, AllBlocksCleared)
    assert decoded.num_unknown == 0


def test_reads_the_older_array_form() -> None:
    # vLLM before the map form (and lm-console's stream v1): tagged arrays, fields by position;
    # the oldest had no medium.
    batch = [2.0, [["BlockStored", [H1], H3, list(range(16)), 16, None, "GPU"],
                   ["BlockStored", [7, 8], None, list(range(32)), 16],
                   ["BlockRemoved", [H1], "CPU"], ["BlockRemoved", [H2]], ["AllBlocksCleared"]]]
    _, _, decoded = decode_kv_event_message_lenient(_frames(batch))
    assert decoded.events == [
        BlockStored(block_hashes=[H1], parent_block_hash=H3, token_ids=list(range(16)), block_size=16, medium="GPU"),
        BlockStored(block_hashes=[7, 8], parent_block_hash=None, token_ids=list(range(32)), block_size=16,
                    medium=None),
        BlockRemoved(block_hashes=[H1], medium="CPU"), BlockRemoved(block_hashes=[H2], medium=None),
        AllBlocksCleared(medium=None)]
    # Negative control: our engine's strict decoder refuses this form.
    with pytest.raises(msgspec.ValidationError):
        decode_kv_event_message(_frames(batch))


def test_an_unknown_or_broken_event_is_one_row_not_a_dead_stream() -> None:
    batch = [3.0, [{"type": "BlockPinned", "block_hashes": [H1]}, _vllm_stored(),
                   {"type": "BlockStored", "block_hashes": [H1]},  # required fields missing
                   ["SomethingNew", 1, 2], 42]]
    records = records_of_message(_frames(batch))
    assert [record.kind for record in records] == ["BlockPinned", "BlockStored", "BlockStored", "SomethingNew", "?"]
    assert [record.is_unknown for record in records] == [True, False, True, True, True]
    pinned, _, broken, _, untagged = (record.event for record in records)
    assert isinstance(pinned, UnknownKVEvent) and "does not know" in pinned.reason
    assert isinstance(broken, UnknownKVEvent) and broken.reason.startswith("malformed")
    assert isinstance(untagged, UnknownKVEvent) and untagged.event_type == "?"
    assert records[2].to_json_dict()["unknown"].startswith("malformed")
    with pytest.raises(msgspec.ValidationError):  # negative control: the strict decoder fails the batch
        decode_kv_event_message(_frames(batch))


@pytest.mark.parametrize("payload", [b"\xc1", msgspec.msgpack.encode({"ts": 1}), msgspec.msgpack.encode([1.0])])
def test_a_malformed_batch_is_a_value_error(payload: bytes) -> None:
    with pytest.raises(ValueError, match="not a KV event batch"):
        decode_kv_event_payload(payload)


def test_our_batches_round_trip_through_the_lenient_decoder() -> None:
    events = [BlockStored([H1, H2], None, list(range(32)), 16, group_idx=0, kv_cache_spec_kind="full_attention"),
              BlockRemoved([H2], group_idx=0), AllBlocksCleared()]
    decoded = decode_kv_event_payload(encode_kv_event_batch(KVEventBatch(5.0, events, 1)))
    assert decoded.events == events and decoded.data_parallel_rank == 1


def test_a_version_1_console_stream_frame_is_read() -> None:
    # An lm-console server of stream v1 sent its events as arrays inside JSON (hashes as base64).
    frame = msgspec.json.encode([4, [1.0, [["BlockStored", [H1], None, list(range(16)), 16, None, "GPU"],
                                           ["Mystery"]]]])
    decoded = decode_kv_frame(frame)
    assert decoded.seq == 4
    assert decoded.batch.events[0] == BlockStored([H1], None, list(range(16)), 16)
    assert isinstance(decoded.batch.events[1], UnknownKVEvent)


def _captured() -> list[list[bytes]]:
    return msgspec.msgpack.decode((DATA / "vllm-0.32.0-cpu.msgpack").read_bytes())


def test_real_vllm_0_32_events_decode() -> None:
    """Bytes a real vLLM 0.32 CPU server published (tests/data/kv_events/README.md says how they were made)."""
    messages = _captured()
    assert messages, "the fixture holds no message"
    rows: list[KVEventRecord] = []
    seqs = []
    for frames in messages:
        _, seq, _ = decode_kv_event_message_lenient(frames)
        seqs.append(seq)
        rows += records_of_message(frames)
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))  # gap-free
    assert not [row for row in rows if row.is_unknown]
    stored = [row.event for row in rows if isinstance(row.event, BlockStored)]
    assert stored and all(event.block_size == 128 and len(event.token_ids) == 128 * len(event.block_hashes)
                          for event in stored)
    assert all(event.medium == "GPU" and event.group_idx == 0 and event.kv_cache_spec_kind == "full_attention"
               for event in stored)
    kinds = [row.kind for row in rows]
    assert (kinds.count("BlockStored"), kinds.count("BlockRemoved"), kinds.count("AllBlocksCleared")) == (5, 16, 1)
    assert [len(event.block_hashes) for event in stored] == [11, 11, 11, 11, 2]
    assert all(isinstance(h, int) for event in stored for h in event.block_hashes)  # vLLM's default: int hashes
    assert kinds[-2:] == ["AllBlocksCleared", "BlockStored"]  # the reset, then the shared prefix again
    # Negative control: the array form's decoder of before cannot read these bytes.
    with pytest.raises(msgspec.ValidationError):
        msgspec.msgpack.decode(messages[0][2], type=_OldArrayBatch)


class _OldStored(msgspec.Struct, array_like=True, tag="BlockStored"):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None


class _OldArrayBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[_OldStored]
    data_parallel_rank: int | None = None


def test_the_block_map_drawn_from_real_vllm_events() -> None:
    from lm_console.client.event_block_map import EventBlockMap
    from lm_console.engine.metrics.stats import BLOCK_STATE_CACHED

    block_map = EventBlockMap(364)
    per_message = []
    for frames in _captured():
        block_map.apply(records_of_message(frames))
        per_message.append(block_map.num_cached)
    # 11 stored a message; the 16 evictions are of blocks stored before this capture (no cell to free);
    # the reset empties the map and the shared prefix's 2 blocks come back.
    assert per_message == [11, 22, 33, 44, 2]
    assert block_map.num_unmatched_removals == 16 and block_map.num_overflow == 0
    assert block_map.states.count(BLOCK_STATE_CACHED) == 2 and block_map.states[:2] == bytes([BLOCK_STATE_CACHED]) * 2
