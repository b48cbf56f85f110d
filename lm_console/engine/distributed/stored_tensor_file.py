"""Check a connector's stored safetensors file before its data is read.

safetensors' load_file allocates whatever the header declares; a file in a shared directory may
be truncated, sparse (a 1 TiB hole), or written by someone else. check_single_tensor_file reads
only the 8-byte length and the header (bounded in size and JSON nesting) and checks that the file
holds exactly one tensor of the expected name, dtype family and shape, and is exactly as long as
that tensor needs; only then may the caller load it.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lm_console.engine.safetensors_header import SafetensorsHeaderError, read_header

MAX_HEADER_BYTES = 64 << 10  # a one-tensor header is ~120 bytes
_MAX_HEADER_DEPTH = 3  # {"name": {"shape": [...]}}
DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I8": 1, "U8": 1}


class InvalidStoredFileError(ValueError):
    """A stored tensor file does not hold what its reader needs (the message says what)."""


def check_single_tensor_file(file: str | os.PathLike[str], name: str, shape_ok: Callable[[list[int]], bool],
                             expected: str, dtypes: tuple[str, ...] = ("F64", "F32", "F16", "BF16")) -> list[int]:
    """The shape of the file's one tensor `name` once every check passed; InvalidStoredFileError
    (or OSError) otherwise. shape_ok judges the declared shape; `expected` describes it."""
    with open(Path(file), "rb") as f:
        size = os.fstat(f.fileno()).st_size
        try:
            header, header_len = read_header(f, size, MAX_HEADER_BYTES, _MAX_HEADER_DEPTH)
        except SafetensorsHeaderError as error:
            raise InvalidStoredFileError(str(error)) from None
    entry = header.get(name) if isinstance(header, dict) else None
    if not isinstance(entry, dict) or set(header) - {name, "__metadata__"}:
        raise InvalidStoredFileError(f"it does not hold exactly one tensor named {name}")
    shape: Any = entry.get("shape")
    dtype, offsets = entry.get("dtype"), entry.get("data_offsets")
    if not (isinstance(shape, list) and all(type(n) is int and n >= 0 for n in shape) and shape_ok(shape)):
        raise InvalidStoredFileError(f"it holds shape {shape!r:.80}, expected {expected}")
    if dtype not in dtypes:
        raise InvalidStoredFileError(f"its dtype {dtype!r:.40} is not one of {', '.join(dtypes)}")
    nbytes = math.prod(shape) * DTYPE_BYTES[dtype]
    if offsets != [0, nbytes] or size != 8 + header_len + nbytes:
        raise InvalidStoredFileError(f"it is {size} bytes with data offsets {offsets!r:.60}; a {shape} {dtype} "
                                     f"tensor needs {8 + header_len + nbytes}")
    return shape
