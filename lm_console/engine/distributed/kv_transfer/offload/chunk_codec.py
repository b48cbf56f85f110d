"""On-disk chunk format: magic, a JSON header (key, dtype, shape, size, CRC-32), then the raw KV bytes.

The checksum catches truncated and corrupted files; the key catches a file under the wrong name;
dtype and shape catch a layout that changed. A file is read in three steps (read_chunk): the
fixed prefix, then the header (at most MAX_HEADER_BYTES, its JSON nesting bounded), then, only
when the file's size is exactly what the expected layout needs, the payload: a sparse 64 GiB
file or a 100k-deep header is a CorruptChunkError, never an allocation or a RecursionError.
"""

from __future__ import annotations

import json
import math
import struct
import zlib
from io import BufferedIOBase

import torch

MAGIC = b"LMCKVC01"
_LEN = struct.Struct("<I")
PREFIX_BYTES = len(MAGIC) + _LEN.size
MAX_HEADER_BYTES = 4096  # ours is ~250 bytes: key, dtype, a 5-dim shape, size, CRC
_MAX_HEADER_DEPTH = 2  # the header object and its shape list


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


def header_length(prefix: bytes | bytearray | memoryview) -> int:
    """The header's length from a file's first PREFIX_BYTES; CorruptChunkError if bad or too long."""
    if len(prefix) < PREFIX_BYTES or bytes(prefix[:len(MAGIC)]) != MAGIC:
        raise CorruptChunkError("bad magic or truncated header")
    (header_len,) = _LEN.unpack_from(prefix, len(MAGIC))
    if header_len > MAX_HEADER_BYTES:
        raise CorruptChunkError(f"a header of {header_len} bytes (at most {MAX_HEADER_BYTES})")
    return int(header_len)


def parse_header(raw: bytes | bytearray | memoryview) -> dict:
    """The header object; CorruptChunkError for invalid, nested or non-object JSON."""
    raw = bytes(raw)
    depth = 0
    for char in raw:  # at most MAX_HEADER_BYTES: bound the nesting before json recurses into it
        if char in b"[{":
            depth += 1
            if depth > _MAX_HEADER_DEPTH:
                raise CorruptChunkError(f"the header nests JSON deeper than {_MAX_HEADER_DEPTH} levels")
        elif char in b"]}":
            depth -= 1
    try:
        header = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise CorruptChunkError(f"unreadable header: {exc}") from None
    if not isinstance(header, dict):  # valid JSON, but not the header's object
        raise CorruptChunkError(f"the header is a JSON {type(header).__name__}, not an object")
    return header


def expected_nbytes(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    return math.prod(shape) * torch.empty((), dtype=dtype).element_size()


def read_chunk(file: BufferedIOBase, file_size: int, key: bytes, dtype: torch.dtype,
               shape: tuple[int, ...]) -> tuple[torch.Tensor, int]:
    """(the chunk, bytes read) from an open chunk file of file_size bytes; CorruptChunkError when
    a check fails. The payload is read only once the file's size matches the expected layout."""
    prefix = file.read(PREFIX_BYTES)
    header_len = header_length(prefix)
    raw_header = file.read(header_len)
    if len(raw_header) != header_len:
        raise CorruptChunkError("truncated header")
    header = parse_header(raw_header)
    _check_header(header, key, dtype, shape)
    nbytes = expected_nbytes(dtype, shape)
    if file_size != PREFIX_BYTES + header_len + nbytes:
        raise CorruptChunkError(f"the file is {file_size} bytes; its layout needs "
                                f"{PREFIX_BYTES + header_len + nbytes} (truncated or padded)")
    payload = bytearray(nbytes)
    if file.readinto(payload) != nbytes:
        raise CorruptChunkError(f"truncated: fewer than {nbytes} payload bytes")
    return _checked_tensor(header, memoryview(payload), dtype, shape), file_size


def decode(data: bytes | bytearray | memoryview, key: bytes, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """The chunk tensor stored in data; CorruptChunkError when any check fails."""
    view = memoryview(data)
    header_len = header_length(view[:PREFIX_BYTES])
    start = PREFIX_BYTES + header_len
    header = parse_header(view[PREFIX_BYTES:start])
    _check_header(header, key, dtype, shape)
    return _checked_tensor(header, view[start:], dtype, shape)


def _check_header(header: dict, key: bytes, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    expected_dtype = str(dtype).removeprefix("torch.")
    if header.get("key") != key.hex():
        raise CorruptChunkError("the file holds another chunk")
    stored_shape = header.get("shape")
    if header.get("dtype") != expected_dtype or not isinstance(stored_shape, list) or stored_shape != list(shape):
        raise CorruptChunkError(f"layout {header.get('dtype')}{stored_shape} != {expected_dtype}{list(shape)}")


def _checked_tensor(header: dict, payload: memoryview, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    nbytes = expected_nbytes(dtype, shape)
    if header.get("nbytes") != payload.nbytes or payload.nbytes != nbytes:
        raise CorruptChunkError(f"truncated: {payload.nbytes} of {header.get('nbytes')} bytes ({nbytes} expected)")
    if zlib.crc32(payload) != header.get("crc32"):
        raise CorruptChunkError("checksum mismatch")
    return torch.frombuffer(payload, dtype=torch.uint8).view(dtype).reshape(shape)
