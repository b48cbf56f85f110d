"""A safetensors file's header, read without trusting it (torch-free).

safetensors' own loaders allocate whatever a header declares. Files we did not write (a LoRA
adapter a client names, a connector's stored tensors in a shared directory) are read here
first: only the 8-byte length and the header, the length bounded by the file's size and a cap,
the JSON's nesting bounded before `json` recurses into it. The callers then check the entries
against what they expect.
"""

from __future__ import annotations

import json
import struct
from typing import IO, Any


class SafetensorsHeaderError(ValueError):
    """The header is unreadable or out of bounds; the message reads after the file's name."""


def read_header(f: IO[bytes], size: int, max_bytes: int, max_depth: int, subject: str = "it",
                possessive: str = "its") -> tuple[Any, int]:
    """(the header's JSON value, its length) from `f` at offset 0, a file of `size` bytes.
    Messages name the file as `subject` ("it is 3 bytes, ...") and `possessive` ("its header ...")."""
    prefix = f.read(8)
    if len(prefix) != 8:
        raise SafetensorsHeaderError(f"{subject} is {size} bytes, shorter than a safetensors header")
    (header_len,) = struct.unpack("<Q", prefix)
    if header_len > min(max_bytes, size - 8):
        raise SafetensorsHeaderError(f"{possessive} header declares {header_len} bytes (file {size} bytes, "
                                     f"at most {max_bytes})")
    raw = f.read(header_len)
    depth = 0
    for char in raw:  # bound the nesting before json recurses into it
        depth += char in b"[{"
        depth -= char in b"]}"
        if depth > max_depth:
            raise SafetensorsHeaderError(f"{possessive} header nests JSON deeper than {max_depth} levels")
    try:
        return json.loads(raw), header_len
    except (ValueError, RecursionError) as error:
        raise SafetensorsHeaderError(f"{possessive} header is not JSON ({error})") from None
