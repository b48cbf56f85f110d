"""On-disk chunk format: magic, a JSON header (key, dtype, shape, size, CRC-32), then the raw KV bytes.

The checksum catches truncated and corrupted files; the key catches a file under the wrong name;
dtype and shape catch a layout that changed.
"""

from __future__ import annotations

import json
import math
import struct
import zlib

import torch

MAGIC = b"LMCKVC01"
_LEN = struct.Struct("<I")


class CorruptChunkError(ValueError):
    """A stored chunk failed its checks (magic, header, size or checksum)."""


def _as_bytes(tensor: torch.Tensor) -> memoryview:
    return memoryview(tensor.contiguous().view(torch.uint8).numpy()).cast("B")


def encode_header(key: bytes, tensor: torch.Tensor) -> tuple[bytes, memoryview]:
    """(header bytes, payload view) of one chunk; write them back to back."""
    payload = _as_bytes(tensor.reshape(-1))
    header = json.dumps({
        "key": key.hex(), "dtype": str(tensor.dtype).removeprefix("torch."), "shape": list(tensor.shape),
        "nbytes": payload.nbytes, "crc32": zlib.crc32(payload),
    }).encode()
    return MAGIC + _LEN.pack(len(header)) + header, payload


def decode(data: bytes | bytearray | memoryview, key: bytes, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """The chunk tensor stored in data; CorruptChunkError when any check fails."""
    view = memoryview(data)
    if len(view) < len(MAGIC) + _LEN.size or bytes(view[:len(MAGIC)]) != MAGIC:
        raise CorruptChunkError("bad magic or truncated header")
    (header_len,) = _LEN.unpack_from(view, len(MAGIC))
    start = len(MAGIC) + _LEN.size + header_len
    try:
        header = json.loads(bytes(view[len(MAGIC) + _LEN.size:start]))
    except (ValueError, UnicodeDecodeError) as exc:
        raise CorruptChunkError(f"unreadable header: {exc}") from None
    if not isinstance(header, dict):  # valid JSON, but not the header's object
        raise CorruptChunkError(f"the header is a JSON {type(header).__name__}, not an object")
    payload = view[start:]
    expected_dtype = str(dtype).removeprefix("torch.")
    if header.get("key") != key.hex():
        raise CorruptChunkError("the file holds another chunk")
    stored_shape = header.get("shape")
    if header.get("dtype") != expected_dtype or not isinstance(stored_shape, list) or stored_shape != list(shape):
        raise CorruptChunkError(f"layout {header.get('dtype')}{stored_shape} != {expected_dtype}{list(shape)}")
    expected_nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if header.get("nbytes") != payload.nbytes or payload.nbytes != expected_nbytes:
        raise CorruptChunkError(f"truncated: {payload.nbytes} of {header.get('nbytes')} bytes ({expected_nbytes} expected)")
    if zlib.crc32(payload) != header.get("crc32"):
        raise CorruptChunkError("checksum mismatch")
    return torch.frombuffer(payload, dtype=torch.uint8).view(dtype).reshape(shape)
