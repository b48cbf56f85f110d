"""Validate a GGUF file before anything is allocated from what it declares.

Two passes, both cheap (no tensor data is read):

- `scan_gguf_layout`: the byte layout, walked with struct over a memory map before the `gguf`
  package parses it. Every declared count and length (strings, arrays, tensor dimensions) is
  checked against the bytes left in the file, so a 14 MB file cannot make us loop 2**31 times or
  allocate for a size it does not hold; magic, version, value types, nesting and every tensor's
  data range are checked too.
- `check_model_tensors`: the architecture's metadata against the tensors actually present
  (block_count against the layers that exist, each layer's tensors and shapes against the head
  counts and sizes, token ids against the vocabulary, context_length > 0, a numeric epsilon), so
  a file that claims a million layers but holds two is refused before a model is built for it.

Each failure is an InvalidGGUFError naming the file and what is wrong.
"""

from __future__ import annotations

import math
import mmap
import os
import re
import struct
from collections.abc import Mapping
from typing import Any

from lm_console.engine.errors import InvalidGGUFError

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_ARRAY_NESTING = 4  # llama.cpp writes flat arrays; deeper nesting is only a way to recurse
MAX_CONTEXT_LENGTH = 1 << 24  # 16M positions: beyond every released model (rope tables scale with it)
_DEFAULT_ALIGNMENT = 32

# GGUF value types: id -> (name, fixed size in bytes, or None for string / array)
_SCALARS = {0: ("uint8", 1), 1: ("int8", 1), 2: ("uint16", 2), 3: ("int16", 2), 4: ("uint32", 4),
            5: ("int32", 4), 6: ("float32", 4), 7: ("bool", 1), 10: ("uint64", 8), 11: ("int64", 8),
            12: ("float64", 8)}
_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
_SMALL_ARRAY = 4096  # scalar arrays returned by the scan (per-layer patterns), not vocabularies
_KV_MIN_BYTES = 8 + 1 + 4 + 1  # key length, a 1-byte key, type, the smallest value
_TENSOR_INFO_MIN_BYTES = 8 + 1 + 4 + 8 + 4 + 8  # name length, name, n_dims, one dim, type, offset


def invalid(path: str | os.PathLike[str], what: str) -> InvalidGGUFError:
    """The error for a file that failed a check: its name, what is wrong, what to do."""
    what = " ".join(str(what).split())  # one line, whatever a library's message held
    return InvalidGGUFError(f"{os.fspath(path)} is not a usable GGUF file: {what}. "
                            "Re-download or re-convert the model (llama.cpp's convert_hf_to_gguf.py).")


class _Cursor:
    """Reads little- (or big-) endian values from a buffer; every read is bounds-checked."""

    def __init__(self, buf: Any, path: str, endian: str) -> None:
        self.buf, self.path, self.endian, self.pos = buf, path, endian, 0
        self.size = len(buf)

    def left(self) -> int:
        return self.size - self.pos

    def need(self, nbytes: int, what: str) -> None:
        if nbytes < 0 or nbytes > self.left():
            raise invalid(self.path, f"{what} declares {nbytes} bytes at offset {self.pos}, but only "
                                     f"{self.left()} remain (truncated or corrupt)")

    def unpack(self, fmt: str, what: str) -> Any:
        st = struct.Struct(self.endian + fmt)
        self.need(st.size, what)
        value = st.unpack_from(self.buf, self.pos)[0]
        self.pos += st.size
        return value

    def string(self, what: str) -> bytes:
        length = self.unpack("Q", f"the length of {what}")
        self.need(length, what)
        data = bytes(self.buf[self.pos:self.pos + length])
        self.pos += length
        return data

    def skip_value(self, vtype: int, what: str, depth: int = 0) -> Any:
        """Step over one value of type vtype; returns it for scalars, strings and arrays of at
        most _SMALL_ARRAY scalars (None for other arrays)."""
        if vtype in _SCALARS:
            return self.unpack(_FORMATS[vtype], what)
        if vtype == _STRING:
            return self.string(what)
        if vtype == _ARRAY:
            if depth >= MAX_ARRAY_NESTING:
                raise invalid(self.path, f"{what} nests arrays deeper than {MAX_ARRAY_NESTING} levels")
            item_type = self.unpack("I", f"the item type of {what}")
            count = self.unpack("Q", f"the length of {what}")
            if item_type in _SCALARS:
                size = _SCALARS[item_type][1]
                self.need(count * size, f"{what} ({count} items)")
                values = None
                if count <= _SMALL_ARRAY:
                    values = list(struct.unpack_from(f"{self.endian}{count}{_FORMATS[item_type]}", self.buf, self.pos))
                self.pos += count * size
                return values
            if item_type not in (_STRING, _ARRAY):
                raise invalid(self.path, f"{what} has items of unknown value type {item_type}")
            # each string or array item takes at least its 8-byte length: a count the file
            # cannot hold is refused before the loop below runs it
            self.need(count * 8, f"{what} ({count} items)")
            if item_type == _STRING:  # a vocabulary: step over each string without copying it
                length_of = struct.Struct(self.endian + "Q").unpack_from
                buf, pos, size = self.buf, self.pos, self.size
                for index in range(count):
                    if pos + 8 > size:
                        raise invalid(self.path, f"the length of {what}[{index}] lies past the end of the file "
                                                 "(truncated or corrupt)")
                    pos += 8 + length_of(buf, pos)[0]
                    if pos > size:
                        raise invalid(self.path, f"{what}[{index}] declares more bytes than remain "
                                                 "(truncated or corrupt)")
                self.pos = pos
                return None
            for index in range(count):
                self.skip_value(item_type, f"{what}[{index}]", depth + 1)
            return None
        raise invalid(self.path, f"{what} has unknown value type {vtype}")


def scan_gguf_layout(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Check the file's header, metadata and tensor table against its size (InvalidGGUFError).

    Returns the metadata read on the way: scalars, strings (decoded), small scalar arrays."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    name = os.fspath(path)
    try:
        with open(name, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < 24:
                raise invalid(name, f"it is {size} bytes, shorter than a GGUF header (24 bytes)")
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                return _scan(buf, name, size, GGML_QUANT_SIZES, GGMLQuantizationType)
    except OSError as error:
        raise invalid(name, f"it cannot be read ({error.strerror or error})") from None


def _scan(buf: Any, name: str, size: int, quant_sizes: Mapping[Any, tuple[int, int]], qtype: Any) -> dict[str, Any]:
    if bytes(buf[:4]) != GGUF_MAGIC:
        raise invalid(name, f"bad magic {bytes(buf[:4])!r} (a GGUF file starts with b'GGUF')")
    (version,) = struct.unpack_from("<I", buf, 4)
    endian = "<"
    if version & 0xFFFF == 0:  # written on a machine of the other byte order (as gguf's reader)
        endian = ">"
        (version,) = struct.unpack_from(">I", buf, 4)
    if version not in SUPPORTED_VERSIONS:
        raise invalid(name, f"GGUF version {version} is not supported (supported: "
                            f"{', '.join(map(str, SUPPORTED_VERSIONS))})")
    cur = _Cursor(buf, name, endian)
    cur.pos = 8
    tensor_count = cur.unpack("Q", "the tensor count")
    kv_count = cur.unpack("Q", "the metadata count")
    if kv_count * _KV_MIN_BYTES + tensor_count * _TENSOR_INFO_MIN_BYTES > cur.left():
        raise invalid(name, f"it declares {kv_count} metadata entries and {tensor_count} tensors, more than "
                            f"its {size} bytes can hold")
    alignment = _DEFAULT_ALIGNMENT
    keys: set[bytes] = set()
    metadata: dict[str, Any] = {}
    for index in range(kv_count):
        key = cur.string(f"metadata key #{index}")
        if key in keys:
            raise invalid(name, f"metadata key {key[:80]!r} appears twice")
        keys.add(key)
        what = f"metadata {key.decode('utf-8', 'replace')[:80]!r}"
        vtype = cur.unpack("I", f"the type of {what}")
        value = cur.skip_value(vtype, what)
        if value is not None:
            metadata[key.decode("utf-8", "replace")] = (value.decode("utf-8", "replace")
                                                        if isinstance(value, bytes) else value)
        if key == b"general.alignment":
            if vtype != 4 or not value or value & (value - 1):
                raise invalid(name, f"general.alignment {value!r} is not a power of two (uint32)")
            alignment = value
    tensors = []
    names: set[bytes] = set()
    for index in range(tensor_count):
        tname = cur.string(f"the name of tensor #{index}")
        if tname in names:
            raise invalid(name, f"tensor {tname[:80]!r} appears twice")
        names.add(tname)
        label = tname.decode("utf-8", "replace")[:80]
        n_dims = cur.unpack("I", f"the dimension count of tensor {label!r}")
        if not 1 <= n_dims <= MAX_DIMS:
            raise invalid(name, f"tensor {label!r} has {n_dims} dimensions (1 to {MAX_DIMS} allowed)")
        dims = [cur.unpack("Q", f"a dimension of tensor {label!r}") for _ in range(n_dims)]
        raw_type = cur.unpack("I", f"the type of tensor {label!r}")
        offset = cur.unpack("Q", f"the data offset of tensor {label!r}")
        try:
            block, type_size = quant_sizes[qtype(raw_type)]
        except (ValueError, KeyError):
            raise invalid(name, f"tensor {label!r} has unknown type {raw_type}") from None
        if min(dims) < 1:
            raise invalid(name, f"tensor {label!r} has a zero dimension {dims}")
        if dims[0] % block:
            raise invalid(name, f"tensor {label!r}'s rows of {dims[0]} are not whole blocks of {block}")
        elements = math.prod(dims)
        tensors.append((label, elements // block * type_size, offset))
    data_start = -(-cur.pos // alignment) * alignment
    for label, nbytes, offset in tensors:
        if offset % alignment or data_start + offset + nbytes > size:
            raise invalid(name, f"tensor {label!r} declares {nbytes} bytes at data offset {offset}, beyond "
                                f"the file's {size} bytes (truncated or corrupt)")
    return metadata


def attention_kinds_of_gguf(path: str | os.PathLike[str]) -> set[str]:
    """The attention kinds of a GGUF model's layers from its metadata alone (the layout scan, no
    tensor or vocabulary parsing): gemma3 files mix sliding-window and global layers as
    gguf_arch's _gemma3_fields reads them; every other architecture we load is full attention."""
    metadata = scan_gguf_layout(path)
    if metadata.get("general.architecture") != "gemma3":
        return {"full_attention"}
    layers = metadata.get("gemma3.block_count")
    if metadata.get("gemma3.attention.sliding_window") is None or not isinstance(layers, int):
        return {"full_attention"}
    pattern = metadata.get("gemma3.attention.sliding_window_pattern")
    if isinstance(pattern, list):
        sliding = [bool(p) for p in pattern]
    else:
        every = pattern if isinstance(pattern, int) and pattern > 0 else 6
        sliding = [(i + 1) % every != 0 for i in range(min(layers, 1 << 16))]
    return {"sliding_attention" if s else "full_attention" for s in sliding}


def open_gguf(path: str | os.PathLike[str]) -> Any:
    """A gguf.GGUFReader of a file that passed scan_gguf_layout; InvalidGGUFError otherwise."""
    from gguf import GGUFReader

    scan_gguf_layout(path)
    try:
        return GGUFReader(os.fspath(path))
    except (ValueError, KeyError, IndexError, TypeError, OverflowError, UnicodeDecodeError) as error:
        raise invalid(path, f"{type(error).__name__}: {error}") from None


# -- metadata against tensors ---------------------------------------------------------------

_LAYER = re.compile(r"blk\.(\d+)\.(.+)")


def _shapes(reader: Any) -> dict[str, tuple[int, ...]]:
    return {t.name: tuple(int(n) for n in reversed(t.shape)) for t in reader.tensors}


def check_model_tensors(reader: Any, config: Mapping[str, Any], path: str | os.PathLike[str]) -> None:
    """Refuse a file whose metadata (as config.json fields) disagrees with its tensors."""
    from lm_console.engine.models.gguf_arch import gguf_architecture

    arch = gguf_architecture(reader)
    shapes = _shapes(reader)
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim"):
        if config[key] < 1:
            raise invalid(path, f"{key} (from the {arch.name}.* metadata) is {config[key]}; it must be >= 1")
    if config["num_attention_heads"] % config["num_key_value_heads"]:
        raise invalid(path, f"head_count {config['num_attention_heads']} is not a multiple of head_count_kv "
                            f"{config['num_key_value_heads']}")
    context = config["max_position_embeddings"]
    if not 1 <= context <= MAX_CONTEXT_LENGTH:
        raise invalid(path, f"{arch.name}.context_length is {context}; it must be in [1, {MAX_CONTEXT_LENGTH}]")
    eps = config["rms_norm_eps"]
    if not (isinstance(eps, float) and math.isfinite(eps) and 0 < eps < 1):
        raise invalid(path, f"{arch.name}.attention.layer_norm_rms_epsilon is {eps!r}; it must be a number "
                            "in (0, 1)")
    layers: dict[int, set[str]] = {}
    for tname in shapes:
        match = _LAYER.fullmatch(tname)
        if match:
            layers.setdefault(int(match.group(1)), set()).add(match.group(2))
    declared = config["num_hidden_layers"]
    if sorted(layers) != list(range(declared)):
        present = f"layers 0-{max(layers)}" if layers else "no layer tensors"
        raise invalid(path, f"{arch.name}.block_count is {declared} but the file holds {present} "
                            f"({len(layers)} layers)")
    hidden, heads, kv_heads = config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"]
    head_dim, inter, vocab = config["head_dim"], config["intermediate_size"], config["vocab_size"]
    expected = {
        "attn_q.weight": (heads * head_dim, hidden), "attn_k.weight": (kv_heads * head_dim, hidden),
        "attn_v.weight": (kv_heads * head_dim, hidden), "attn_output.weight": (hidden, heads * head_dim),
        "ffn_gate.weight": (inter, hidden), "ffn_up.weight": (inter, hidden), "ffn_down.weight": (hidden, inter),
        "attn_q_norm.weight": (head_dim,), "attn_k_norm.weight": (head_dim,),
    }
    needed = {f"{part}.weight" for part in arch.layer_names}
    for index, parts in sorted(layers.items()):
        missing = sorted(needed - parts)
        if missing:
            raise invalid(path, f"layer {index} lacks tensor(s) {', '.join(f'blk.{index}.{m}' for m in missing)}")
        for part in sorted(needed):
            want = expected.get(part, (hidden,) if part.endswith("norm.weight") else None)
            got = shapes[f"blk.{index}.{part}"]
            if want is not None and got != want:
                raise invalid(path, f"tensor blk.{index}.{part} has shape {list(got)}, but the metadata "
                                    f"(hidden {hidden}, heads {heads}/{kv_heads} of {head_dim}, ffn {inter}) "
                                    f"implies {list(want)}")
    globals_expected = {"token_embd.weight": (vocab, hidden), "output_norm.weight": (hidden,)}
    if "output.weight" in shapes:
        globals_expected["output.weight"] = (vocab, hidden)
    for tname, want in globals_expected.items():
        if tname not in shapes:
            raise invalid(path, f"it has no {tname} tensor")
        if shapes[tname] != want:
            raise invalid(path, f"tensor {tname} has shape {list(shapes[tname])}, expected {list(want)}")
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    if tokens is not None and len(tokens.data) != vocab:
        raise invalid(path, f"tokenizer.ggml.tokens has {len(tokens.data)} tokens but token_embd has {vocab} rows")
    for key in ("token_type", "scores"):  # one entry per token
        field = reader.fields.get(f"tokenizer.ggml.{key}")
        if field is not None and tokens is not None and len(field.data) != len(tokens.data):
            raise invalid(path, f"tokenizer.ggml.{key} has {len(field.data)} entries for {len(tokens.data)} tokens")
    for key in ("bos", "eos", "padding", "eot", "eom", "unknown"):
        field = reader.fields.get(f"tokenizer.ggml.{key}_token_id")
        if field is None:
            continue
        value = field.contents()
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < vocab:
            raise invalid(path, f"tokenizer.ggml.{key}_token_id is {value!r}, not a token id in [0, {vocab})")


def check_gguf(path: str | os.PathLike[str]) -> tuple[Any, dict[str, Any]]:
    """Every check of this module on one file: (its GGUFReader, its config.json fields)."""
    from lm_console.engine.errors import UnsupportedArchitectureError
    from lm_console.engine.models.gguf_arch import gguf_config_dict

    reader = open_gguf(path)
    try:
        config = gguf_config_dict(reader)
    except UnsupportedArchitectureError:
        raise  # a valid file of something we do not run: its own error says what is supported
    except InvalidGGUFError as error:
        raise invalid(path, str(error)) from None
    except (ValueError, TypeError, KeyError, IndexError, OverflowError, ZeroDivisionError) as error:
        # a metadata value of the wrong shape (a string window, a list where a number goes)
        raise invalid(path, f"unusable metadata ({type(error).__name__}: {error})") from None
    check_model_tensors(reader, config, path)
    return reader, config


__all__ = ["attention_kinds_of_gguf", "check_gguf", "check_model_tensors", "invalid", "open_gguf", "scan_gguf_layout"]
