"""GGUF tensors -> our packed quantized layouts (lm_console/kernels/cpu_quant.py), once at load.

The raw blocks are read from the file's memory map (no dequantization for Q8_0, Q4_0 and Q4_1,
so the values are bit-for-bit the file's):

- Q8_0 (34 bytes: fp16 d, 32 int8)          -> b8, q + 128 unsigned, offset -128 d
- Q4_0 (18 bytes: fp16 d, 16 bytes nibbles)  -> b4, offset -8 d
- Q4_1 (20 bytes: fp16 d, fp16 m, nibbles)   -> b4, offset m
- Q4_K (super-blocks of 256 with 6-bit sub-block scales) -> b4, requantized per block of 32
  from the dequantized values (asymmetric min/max: exact where a block spans its 16 levels)
- any other quantized type (Q6_K, Q5_*, ...) -> b8, requantized per block of 32 (symmetric int8)

F32 / F16 / BF16 tensors are left to the dense path. Names follow the file's architecture
(gguf_arch.py); Q and K rows of llama files are un-permuted as in gguf_convert (llama.cpp
interleaves rope halves); a row permutation moves whole rows of blocks.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from lm_console.engine.models.gguf_arch import gguf_architecture, hf_tensor_name, permuted_rope_heads, unpermute_rope_rows
from lm_console.kernels.cpu_quant import BLOCK, QuantWeight, pack_blocks

_DENSE_TYPES = ("F32", "F16", "BF16", "F64")


@dataclass(slots=True)
class Unpacked:
    """One tensor's unsigned values q [N, K] and per-block fp16 scale/offset [N, K / 32]."""

    fmt: str  # b8 | b4
    q: np.ndarray
    d: np.ndarray
    m: np.ndarray
    source: str  # the GGUF type name


def _blocks(data: np.ndarray, rows: int, block_bytes: int) -> np.ndarray:
    return np.ascontiguousarray(data).reshape(rows, -1, block_bytes)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """GGUF's 16 bytes per block (elements j and j + 16 in low/high nibble) -> [.., 32] values."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def unpack_tensor(type_name: str, data: np.ndarray, rows: int, cols: int) -> Unpacked:
    """The unsigned values and block scales of a quantized GGUF tensor [rows, cols]."""
    if type_name == "Q8_0":
        blocks = _blocks(data, rows, 34)
        d = blocks[..., :2].copy().view(np.float16)[..., 0]
        q = (blocks[..., 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        return Unpacked("b8", q.reshape(rows, cols), d, (d.astype(np.float32) * -128).astype(np.float16), type_name)
    if type_name == "Q4_0":
        blocks = _blocks(data, rows, 18)
        d = blocks[..., :2].copy().view(np.float16)[..., 0]
        q = _nibbles(blocks[..., 2:])
        return Unpacked("b4", q.reshape(rows, cols), d, (d.astype(np.float32) * -8).astype(np.float16), type_name)
    if type_name == "Q4_1":
        blocks = _blocks(data, rows, 20)
        d = blocks[..., :2].copy().view(np.float16)[..., 0]
        m = blocks[..., 2:4].copy().view(np.float16)[..., 0]
        q = _nibbles(blocks[..., 4:])
        return Unpacked("b4", q.reshape(rows, cols), d, m, type_name)
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    dense = dequantize(data, GGMLQuantizationType[type_name]).astype(np.float32).reshape(rows, cols)
    return requantize(dense, "b4" if type_name == "Q4_K" else "b8", type_name)


def requantize(dense: np.ndarray, fmt: str, source: str) -> Unpacked:
    """Per-block-of-32 quantization of a float matrix [N, K] (K a multiple of 32)."""
    rows, cols = dense.shape
    if cols % BLOCK:
        raise ValueError(f"{source} tensor rows of {cols} are not whole blocks of {BLOCK}")
    blocks = dense.reshape(rows, cols // BLOCK, BLOCK).astype(np.float32)
    if fmt == "b4":  # asymmetric 4-bit: w = d * q + min
        low, high = blocks.min(axis=-1), blocks.max(axis=-1)
        d = ((high - low) / 15).astype(np.float16)
        m = low.astype(np.float16)
        scale = d.astype(np.float32)[..., None]
        inv = np.divide(1.0, scale, out=np.zeros_like(scale), where=scale > 0)
        q = np.clip(np.rint((blocks - m.astype(np.float32)[..., None]) * inv), 0, 15)
    else:  # symmetric int8, stored + 128
        d = (np.abs(blocks).max(axis=-1) / 127).astype(np.float16)
        scale = d.astype(np.float32)[..., None]
        inv = np.divide(1.0, scale, out=np.zeros_like(scale), where=scale > 0)
        q = np.clip(np.rint(blocks * inv), -127, 127) + 128
        m = (d.astype(np.float32) * -128).astype(np.float16)
    return Unpacked(fmt, q.astype(np.uint8).reshape(rows, cols), d, m, source)


def read_gguf_quantized(gguf_path: Path, hf_config: Any) -> dict[str, Unpacked]:
    """HF-named unpacked tensors for every quantized 2-D tensor of the file (dense ones omitted)."""
    from lm_console.engine.models.gguf_check import open_gguf

    text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    heads = int(text.num_attention_heads)
    kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
    reader = open_gguf(gguf_path)  # sizes checked before its tensors are viewed
    arch = gguf_architecture(reader)
    out: dict[str, Unpacked] = {}
    for t in reader.tensors:
        type_name = t.tensor_type.name
        if type_name in _DENSE_TYPES or len(t.shape) != 2:
            continue
        cols, rows = (int(n) for n in t.shape)  # GGUF lists dims innermost first
        name = hf_tensor_name(t.name, arch)
        unpacked = unpack_tensor(type_name, np.asarray(t.data), rows, cols)
        n_heads = permuted_rope_heads(name, arch, heads, kv_heads)
        if n_heads is not None:
            unpacked.q = unpermute_rope_rows(unpacked.q, n_heads)
            unpacked.d = unpermute_rope_rows(unpacked.d, n_heads)
            unpacked.m = unpermute_rope_rows(unpacked.m, n_heads)
        out[name] = unpacked
    return out


def pack_rows(parts: list[Unpacked]) -> QuantWeight:
    """One QuantWeight from tensors stacked along the output rows (fused qkv / gate_up).

    Parts of different formats (a file may mix them) all go to b8: 4-bit values fit its 8-bit
    container unchanged (w = d * q + m either way)."""
    fmt = parts[0].fmt if all(p.fmt == parts[0].fmt for p in parts) else "b8"
    source = "+".join(sorted({p.source for p in parts}))
    return pack_blocks(fmt, np.concatenate([p.q for p in parts]), np.concatenate([p.d for p in parts]),
                       np.concatenate([p.m for p in parts]), source)
