"""Offload tiers without an engine: chunk codec checks, CPU LRU with pins, disk tier (atomic files,
LRU eviction, sharing, unwritable paths), the tiered store's write-through, events and stats."""

from __future__ import annotations

import errno
import logging
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from lm_console.engine.config import CacheConfig, EngineConfig, ModelConfig
from lm_console.engine.config.kv_transfer import KVTransferConfig
from lm_console.engine.distributed.kv_transfer.offload import disk_tier as disk_tier_module
from lm_console.engine.distributed.kv_transfer.offload.chunk_codec import CorruptChunkError, decode, encode_header
from lm_console.engine.distributed.kv_transfer.offload.chunk_hash import ChunkHasher
from lm_console.engine.distributed.kv_transfer.offload.cpu_tier import CPUTier
from lm_console.engine.distributed.kv_transfer.offload.disk_tier import DiskTier
from lm_console.engine.distributed.kv_transfer.offload.settings import OffloadSettings
from lm_console.engine.distributed.kv_transfer.offload.store import TieredKVStore
from lm_console.engine.errors import InvalidEngineArgsError
from lm_console.engine.kv_cache_hashing import sha256_cbor
from lm_console.engine.metrics.kv_events import BlockRemoved, BlockStored

SHAPE = (2, 2, 8, 2, 4)  # [layers, K/V, chunk tokens, kv heads, head dim]


def chunk(value: float) -> torch.Tensor:
    return torch.full(SHAPE, value, dtype=torch.float32) + torch.arange(SHAPE[-1], dtype=torch.float32)


def key(i: int) -> bytes:
    return bytes([i]) * 32


def encoded(k: bytes, tensor: torch.Tensor) -> bytes:
    header, payload = encode_header(k, tensor)
    return header + bytes(payload)


def test_codec_roundtrip_and_every_check() -> None:
    data = encoded(key(1), chunk(3.0))
    assert torch.equal(decode(bytearray(data), key(1), torch.float32, SHAPE), chunk(3.0))
    flipped = bytearray(data)
    flipped[-5] ^= 0xFF
    with pytest.raises(CorruptChunkError, match="checksum"):
        decode(flipped, key(1), torch.float32, SHAPE)
    with pytest.raises(CorruptChunkError, match="truncated"):
        decode(bytearray(data[:-16]), key(1), torch.float32, SHAPE)
    with pytest.raises(CorruptChunkError, match="another chunk"):
        decode(bytearray(data), key(2), torch.float32, SHAPE)
    with pytest.raises(CorruptChunkError, match="layout"):
        decode(bytearray(data), key(1), torch.bfloat16, SHAPE)
    with pytest.raises(CorruptChunkError, match="magic"):
        decode(bytearray(b"garbage"), key(1), torch.float32, SHAPE)


@pytest.mark.parametrize("header", [b"[1, 2]", b'"text"', b"7", b"null",
                                    b'{"key": "%s", "dtype": "float32", "shape": 5}',
                                    b'{"key": "%s", "dtype": "float32", "shape": [1]}'])
def test_a_header_of_the_wrong_shape_is_a_corrupt_chunk(tmp_path: Path, header: bytes) -> None:
    """Issue 18 item 11: on main a JSON list header raised AttributeError (not counted, not deleted)."""
    import struct

    from lm_console.engine.distributed.kv_transfer.offload.chunk_codec import MAGIC

    header = header.replace(b"%s", key(1).hex().encode()) if b"%s" in header else header
    tier = DiskTier(tmp_path, capacity_bytes=1 << 20)
    tier.write(key(1), chunk(1))
    file = tmp_path / (key(1).hex() + ".kvchunk")
    file.write_bytes(MAGIC + struct.pack("<I", len(header)) + header + bytes(chunk(1).numpy().tobytes()))
    with pytest.raises(CorruptChunkError):
        tier.read(key(1), torch.float32, SHAPE)
    assert not file.exists() and tier.counters.errors == 1


def test_cpu_tier_lru_byte_limit_and_pins() -> None:
    size = chunk(0).nbytes
    tier = CPUTier(capacity_bytes=2 * size)
    assert tier.put(key(1), chunk(1)) == (True, [])
    assert tier.put(key(2), chunk(2)) == (True, [])
    tier.get(key(1))  # 1 is now the most recently used
    assert tier.put(key(3), chunk(3)) == (True, [key(2)])
    assert tier.pin(key(1)) and tier.pin(key(3))
    assert tier.put(key(4), chunk(4)) == (False, [])  # everything pinned: refuse, do not evict
    tier.unpin(key(3))
    assert tier.put(key(4), chunk(4)) == (True, [key(3)])
    assert tier.used_bytes == 2 * size and len(tier) == 2 and tier.counters.evictions == 2
    assert not tier.pin(key(9))


def test_disk_tier_atomic_files_lru_and_sharing(tmp_path: Path) -> None:
    size = len(encoded(key(1), chunk(1)))
    tier = DiskTier(tmp_path, capacity_bytes=2 * size)
    assert tier.write(key(1), chunk(1)) == []
    assert tier.write(key(2), chunk(2)) == []
    assert tier.read(key(1), torch.float32, SHAPE) is not None  # 1 becomes most recent
    assert tier.write(key(3), chunk(3)) == [key(2)]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(k.hex() + ".kvchunk" for k in (key(1), key(3)))
    other = DiskTier(tmp_path, capacity_bytes=2 * size)  # another process, or a restart
    assert len(other) == 2 and torch.equal(other.read(key(3), torch.float32, SHAPE), chunk(3))
    tier.write(key(4), chunk(4))
    assert other.contains(key(4))  # written after `other` scanned the directory
    assert other.read(key(9), torch.float32, SHAPE) is None


def test_disk_tier_corrupt_file_is_reported_and_removed(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, capacity_bytes=1 << 20)
    tier.write(key(1), chunk(1))
    file = tmp_path / (key(1).hex() + ".kvchunk")
    file.write_bytes(file.read_bytes()[:-3])
    with pytest.raises(CorruptChunkError):
        tier.read(key(1), torch.float32, SHAPE)
    assert not file.exists() and not tier.contains(key(1)) and tier.counters.errors == 1


def test_disk_tier_unusable_path_warns_once(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with caplog.at_level(logging.WARNING):
        tier = DiskTier(blocker / "sub", capacity_bytes=1 << 20)
        assert tier.write(key(1), chunk(1)) == [] and tier.write(key(2), chunk(2)) == []
    assert not tier.writable and len([r for r in caplog.records if "KV offload" in r.message]) == 1


def test_disk_full_disables_storing_with_one_warning(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    def full(*args: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(disk_tier_module.os, "replace", full)
    tier = DiskTier(tmp_path, capacity_bytes=1 << 20)
    with caplog.at_level(logging.WARNING):
        tier.write(key(1), chunk(1))
        tier.write(key(2), chunk(2))
    assert not tier.writable and tier.counters.errors == 1 and list(tmp_path.iterdir()) == []
    assert len([r for r in caplog.records if "No space" in r.message]) == 1


def test_store_write_through_events_and_stats(tmp_path: Path) -> None:
    size = chunk(0).nbytes
    store = TieredKVStore(cpu_bytes=2 * size, disk_path=str(tmp_path), disk_bytes=1 << 20,
                          chunk_shape=SHAPE, dtype=torch.float32, chunk_size=8)
    for i in (1, 2, 3):
        store.put(key(i), chunk(i), key(i - 1) if i > 1 else None, list(range(8)))
    assert store.flush(10.0)
    assert store.lookup_prefix([key(1), key(2), key(3), key(4)]) == (3, 1)  # key(1) only on disk now
    assert torch.equal(store.get(key(1)), chunk(1))  # read from disk, promoted to CPU
    events = store.take_events()
    stored = {(e.medium, e.block_hashes[0]) for e in events if isinstance(e, BlockStored)}
    assert stored == {(m, key(i)) for m in ("CPU", "DISK") for i in (1, 2, 3)}
    assert any(isinstance(e, BlockRemoved) and e.medium == "CPU" for e in events)
    cpu, disk = store.make_stats()
    assert (cpu.medium, disk.medium) == ("CPU", "DISK")
    assert disk.num_chunks == 3 and disk.hits == 1 and disk.bytes_out > 0 and cpu.evictions >= 1
    assert cpu.hits == 2 and cpu.misses == 2 and disk.misses == 1
    store.close()
    store.put(key(5), chunk(5), None, [])  # after close: CPU only, nothing hangs


def test_chunk_hasher_is_deterministic_and_chained() -> None:
    request = SimpleNamespace(all_token_ids=list(range(40)), mm_features=[], cache_salt=None, lora_request=None)
    hasher = ChunkHasher(16, sha256_cbor, "model-a")
    hashes = hasher.extend(request, [], 40)
    assert len(hashes) == 2 and hashes == ChunkHasher(16, sha256_cbor, "model-a").extend(request, [], 40)
    assert hashes[0] != ChunkHasher(16, sha256_cbor, "model-b").extend(request, [], 40)[0]
    changed = SimpleNamespace(all_token_ids=[99] + list(range(1, 40)), mm_features=[], cache_salt=None, lora_request=None)
    assert ChunkHasher(16, sha256_cbor, "model-a").extend(changed, [], 40)[1] != hashes[1]
    salted = SimpleNamespace(all_token_ids=list(range(40)), mm_features=[], cache_salt="s", lora_request=None)
    assert hasher.extend(salted, [], 40)[0] != hashes[0]


def _settings(**extra: object) -> OffloadSettings:
    model = ModelConfig(model_name="tiny", model_dir="/nonexistent", tokenizer_dir="/nonexistent",
                        architectures=("LlamaForCausalLM",), is_multimodal=False, dtype="float32", seed=0,
                        max_model_len=256, max_position_embeddings=256, vocab_size=128, hidden_size=64,
                        num_layers=2, num_attention_heads=4, num_kv_heads=2, head_dim=16)
    config = EngineConfig(model_config=model, cache_config=CacheConfig(block_size=16))
    return OffloadSettings.from_config(config, KVTransferConfig("OffloadConnector", kv_connector_extra_config=extra))


def test_settings_reject_limits_below_one_chunk_and_bad_values() -> None:
    assert _settings().chunk_nbytes == 2 * 2 * 256 * 2 * 16 * 4
    with pytest.raises(InvalidEngineArgsError, match="cpu_bytes=1000 is smaller than one chunk"):
        _settings(cpu_bytes=1000)
    with pytest.raises(InvalidEngineArgsError, match="disk_bytes"):
        _settings(disk_path="/tmp/x", disk_bytes=1000)
    with pytest.raises(InvalidEngineArgsError, match="multiple of block_size"):
        _settings(chunk_size=24)
    with pytest.raises(InvalidEngineArgsError, match="unknown"):
        _settings(cpu_gb=1)
    with pytest.raises(InvalidEngineArgsError, match="integer"):
        _settings(chunk_size="256")
    with pytest.raises(InvalidEngineArgsError, match="load_mode"):
        _settings(load_mode="eager")


def test_kv_transfer_config_parsing() -> None:
    parsed = KVTransferConfig.parse('{"kv_connector": "OffloadConnector", "kv_role": "kv_consumer"}')
    assert parsed is not None and parsed.is_kv_consumer and not parsed.is_kv_producer
    for bad, match in (("{not json", "JSON"), ({"kv_role": "kv_both"}, "needs 'kv_connector'"),
                       ({"kv_connector": "X", "kv_role": "sender"}, "kv_role"), ({"kv_connector": "X", "zz": 1}, "unknown"),
                       (42, "dict")):
        with pytest.raises(InvalidEngineArgsError, match=match):
            KVTransferConfig.parse(bad)
