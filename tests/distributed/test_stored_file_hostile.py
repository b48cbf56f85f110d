"""Stored files the engine reads back (KV-offload disk chunks, encoder-cache files, the KV
ExampleConnector's layer files, quantization="gguf"'s packed-weight cache): a file whose declared
sizes or header are hostile is a counted corrupt entry and is deleted, and reading it allocates
nothing near its size (a 1 TiB sparse file, a 100k-deep JSON header)."""

from __future__ import annotations

import json
import struct
import tracemalloc
from pathlib import Path

import pytest
import torch

from lm_console.engine.distributed.ec_transfer import ECTransferConfig
from lm_console.engine.distributed.ec_transfer.example_connector import (
    ECExampleConnector, ECExampleConnectorMetadata, MMMeta,
)
from lm_console.engine.distributed.ec_transfer.base import ECConnectorRole
from lm_console.engine.distributed.kv_transfer.offload.chunk_codec import MAGIC, CorruptChunkError, encode_header
from lm_console.engine.distributed.kv_transfer.offload.disk_tier import DiskTier

pytestmark = pytest.mark.hostile

SHAPE = (2, 2, 8, 2, 4)
KEY = bytes([7]) * 32


def _chunk() -> torch.Tensor:
    return torch.arange(torch.Size(SHAPE).numel(), dtype=torch.float32).reshape(SHAPE)


def _sparse(file: Path, head: bytes, size: int) -> None:
    with open(file, "wb") as f:
        f.write(head)
        f.truncate(size)  # a hole: no disk blocks, but stat says `size`


def _peak_bytes(read) -> int:  # noqa: ANN001
    tracemalloc.start()
    try:
        read()
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    return peak


def _valid_header() -> bytes:
    header, _ = encode_header(KEY, _chunk())
    return header


@pytest.mark.parametrize("case", ["sparse_1tib_after_a_valid_header", "sparse_256mib_after_a_valid_header",
                                  "deep_header", "huge_header_length", "wrong_size"])
def test_a_hostile_chunk_file_is_a_counted_corrupt_chunk_and_deleted(tmp_path: Path, case: str) -> None:
    tier = DiskTier(tmp_path, capacity_bytes=1 << 20)
    tier.write(KEY, _chunk())
    file = tmp_path / (KEY.hex() + ".kvchunk")
    if case == "sparse_1tib_after_a_valid_header":
        _sparse(file, _valid_header(), 1 << 40)
    elif case == "sparse_256mib_after_a_valid_header":
        _sparse(file, _valid_header(), 256 << 20)
    elif case == "deep_header":
        deep = b"[" * 100_000 + b"]" * 100_000
        file.write_bytes(MAGIC + struct.pack("<I", len(deep)) + deep)
    elif case == "huge_header_length":
        _sparse(file, MAGIC + struct.pack("<I", 0xFFFFFFFF), 1 << 33)
    else:
        file.write_bytes(file.read_bytes() + b"\0" * 4096)  # a valid chunk with trailing bytes

    def read() -> None:
        with pytest.raises(CorruptChunkError):
            tier.read(KEY, torch.float32, SHAPE)

    assert _peak_bytes(read) < 1 << 20  # nothing near the declared size is allocated
    assert not file.exists() and tier.counters.errors == 1
    tier.write(KEY, _chunk())  # the tier still works
    assert torch.equal(tier.read(KEY, torch.float32, SHAPE), _chunk())


def _ec_connector(storage: Path) -> ECExampleConnector:
    config = ECTransferConfig(ec_role="ec_consumer", ec_connector_extra_config={"shared_storage_path": str(storage)})
    return ECExampleConnector(config, ECConnectorRole.WORKER)


def _safetensors_file(file: Path, header: dict | bytes, size: int | None = None) -> None:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    head = struct.pack("<Q", len(raw)) + raw
    file.parent.mkdir(parents=True, exist_ok=True)
    _sparse(file, head, size if size is not None else len(head))


@pytest.mark.parametrize("case", ["sparse_huge_tensor", "wide_tensor", "deep_header", "huge_header_length",
                                  "two_tensors"])
def test_a_hostile_encoder_cache_file_is_deleted_and_recomputed(tmp_path: Path, case: str) -> None:
    connector = _ec_connector(tmp_path)
    file = connector._file("img")
    rows = 4
    if case == "sparse_huge_tensor":  # a consistent header and size, but 1 TiB of rows
        rows_huge = (1 << 40) // (64 * 4)
        _safetensors_file(file, {"ec_cache": {"dtype": "F32", "shape": [rows_huge, 64],
                                              "data_offsets": [0, rows_huge * 64 * 4]}})
        with open(file, "r+b") as f:
            f.truncate(f.seek(0, 2) + rows_huge * 64 * 4)
    elif case == "wide_tensor":  # the right row count, an absurd width, a consistent size
        _safetensors_file(file, {"ec_cache": {"dtype": "F32", "shape": [rows, 1 << 28],
                                              "data_offsets": [0, rows * (1 << 28) * 4]}})
        with open(file, "r+b") as f:
            f.truncate(f.seek(0, 2) + rows * (1 << 28) * 4)
    elif case == "deep_header":
        _safetensors_file(file, b"[" * 100_000 + b"]" * 100_000)
    elif case == "huge_header_length":
        file.parent.mkdir(parents=True)
        _sparse(file, struct.pack("<Q", 1 << 40), 1 << 33)
    else:
        header = {"ec_cache": {"dtype": "F32", "shape": [rows, 64], "data_offsets": [0, rows * 256]},
                  "other": {"dtype": "F32", "shape": [1], "data_offsets": [rows * 256, rows * 256 + 4]}}
        _safetensors_file(file, header, 8 + len(json.dumps(header)) + rows * 256 + 4)  # a loadable file
    connector.bind_connector_metadata(ECExampleConnectorMetadata([MMMeta("img", rows)]))
    cache: dict = {}
    peak = _peak_bytes(lambda: connector.start_load_caches(cache, device="cpu", hidden_size=64))
    assert peak < 1 << 20 and cache == {}
    assert connector.take_failed_loads() == {"img"} and connector.num_load_failures == 1
    assert not file.exists()


def test_a_valid_encoder_cache_file_still_loads(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    connector = _ec_connector(tmp_path)
    file = connector._file("img")
    file.parent.mkdir(parents=True)
    save_file({"ec_cache": torch.ones(4, 64)}, str(file))
    connector.bind_connector_metadata(ECExampleConnectorMetadata([MMMeta("img", 4)]))
    cache: dict = {}
    connector.start_load_caches(cache, device="cpu", hidden_size=64)
    assert torch.equal(cache["img"], torch.ones(4, 64)) and connector.num_load_failures == 0


def test_a_hostile_example_connector_file_is_never_loaded(make_llm, tiny_qwen3_dir, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The KV ExampleConnector's per-layer files: a header declaring a huge tensor over a sparse
    file is refused before safetensors' load_file would allocate it; the request recomputes."""
    import safetensors.torch

    from lm_console.engine import SamplingParams

    def config(role: str) -> dict:
        return {"kv_connector": "ExampleConnector", "kv_role": role,
                "kv_connector_extra_config": {"storage_path": str(tmp_path)}}

    engine = dict(dtype="float32", max_model_len=256, multiprocess=False)
    prompt = {"prompt_token_ids": list(range(10, 80))}
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    expected = make_llm(str(tiny_qwen3_dir), **engine, kv_transfer_config=config("kv_producer")).generate(
        [prompt], greedy, use_tqdm=False)[0].outputs[0].token_ids
    (file,) = tmp_path.glob("*/layer.1.safetensors")
    rows = 1 << 30
    header = {"kv": {"dtype": "F32", "shape": [2, rows, 2, 16], "data_offsets": [0, 2 * rows * 2 * 16 * 4]}}
    _safetensors_file(file, header, 8 + len(json.dumps(header)) + 2 * rows * 2 * 16 * 4)  # 256 GiB, sparse
    loaded: list[str] = []
    real_load = safetensors.torch.load_file

    def recording_load(path, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        loaded.append(str(path))
        return real_load(path, *args, **kwargs)

    monkeypatch.setattr(safetensors.torch, "load_file", recording_load)
    consumer = make_llm(str(tiny_qwen3_dir), **engine, kv_transfer_config=config("kv_consumer"))
    assert consumer.generate([prompt], greedy, use_tqdm=False)[0].outputs[0].token_ids == expected
    assert str(file) not in loaded and not file.exists()


def test_a_packed_gguf_cache_declaring_more_than_its_file_is_removed(tmp_path: Path) -> None:
    """quantization="gguf"'s packed-weight cache: a file declaring terabytes (sparse) is deleted
    before any tensor is read, and the caller repacks (None)."""
    pytest.importorskip("gguf")
    from lm_console.engine.models.quant import _load_packed

    cache = tmp_path / "gguf-v2.safetensors"
    rows = 1 << 38
    header = {"__metadata__": {"index": "{}"},
              "m.qweight": {"dtype": "U8", "shape": [rows, 16], "data_offsets": [0, rows * 16]}}
    _safetensors_file(cache, header, 8 + len(json.dumps(header)) + rows * 16)
    assert _peak_bytes(lambda: _load_packed(cache, max_bytes=1 << 30)) < 1 << 20
    assert not cache.exists()
    cache.write_bytes(b"garbage")
    assert _load_packed(cache, max_bytes=1 << 30) is None and not cache.exists()
