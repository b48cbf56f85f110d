"""Paged attention for the CPU: small C kernels (lm_console/kernels/cpu/) loaded through ctypes.

- decode rows: the torch path gathers each row's K/V blocks into a padded copy before
  attending; at long contexts that copy is most of a decode step (memory-bound). The C kernel
  reads K/V in place from the paged cache with a per-block online softmax, once.
- prefill chunks (`paged_prefill.c`): torch's CPU SDPA reaches a fraction of the machine's
  FMA rate at head_dim 64. In bf16 on CPUs with AVX512_BF16 the C kernel computes QK^T and PV
  with `vdpbf16ps` (16 queries in the lanes, a GQA group per task, each chunk's K/V repacked
  once per call from the paged cache); otherwise it tiles 16 queries of one head against fp32
  copies of each block. Chunked prefill needs no gather of the cached context either way.
- the int8 cache (`kv_cache_dtype="int8"`): each kv head's row of a token is head_dim int8
  values and a float32 scale (`INT8_SCALE_BYTES`; `int8_cache_shape`), written by
  `reshape_and_cache` (round to nearest, scale max|x| / 127) and read by the same kernels
  (AVX512-BF16, head_dim 64 or 128: `supports_int8`), which convert the integers as they stream
  them: half the bytes of a bf16 cache per decode step.

Both files are compiled on first use into one library by lm_console/kernels/cpu_build.py
(`cc -O3 -march=native -fopenmp -ffast-math`, cached per sources' hash and machine; torch's
OpenMP runtime, so torch.set_num_threads governs it). Where no compiler is found, or
LMC_CPU_KERNELS=0, `load()` returns None and the engine keeps the torch path.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch
from torch import Tensor

from lm_console.kernels.cpu_build import CpuKernelBuildError, kernels_disabled, load_library

__all__ = ["INT8_SCALE_BYTES", "CpuKernelBuildError", "int8_cache_shape", "load", "paged_decode_attention",
           "paged_prefill_attention", "reshape_and_cache", "supports", "supports_cache_write", "supports_int8"]

INT8_SCALE_BYTES = 4  # the float32 scale after each kv head's head_dim int8 values

SOURCES = (Path(__file__).parent / "cpu" / "paged_attention.c",  # decode rows
           Path(__file__).parent / "cpu" / "paged_prefill.c",  # prefill chunks
           Path(__file__).parent / "cpu" / "cache_write.c")  # reshape_and_cache
_DTYPES = {torch.bfloat16: "bf16", torch.float32: "f32"}
_ARGTYPES = [
    ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,  # q, its row stride, out, its
    ctypes.c_void_p,  # token_idx
    ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,  # k_cache, v_cache, block stride
    ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,  # block_table, its stride, seq_lens
    ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int,  # reqs, heads, kv, D, bs
    ctypes.c_float, ctypes.c_int, ctypes.c_float,  # scale, window, soft_cap
    ctypes.c_int64, ctypes.c_int64,  # the cache's blocks, block_table's entries a row
]


_PREFILL_ARGTYPES = [
    ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,  # q, stride, out, stride
    ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,  # k_cache, v_cache, block stride
    ctypes.c_void_p, ctypes.c_int64,  # block_table, its stride
    ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int,  # q_starts, q_lens, seq_lens, n
    ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int,  # heads, kv heads, D, block size
    ctypes.c_float, ctypes.c_int, ctypes.c_float,  # scale, window, soft_cap
    ctypes.c_int64, ctypes.c_int64,  # the cache's blocks, block_table's entries a row
]


@functools.cache
def load() -> ctypes.CDLL | None:
    """The compiled kernel library, or None (no compiler, disabled, or the build failed)."""
    library = load_library(SOURCES, "CPU attention kernels")
    if library is None:
        return None
    for name in _DTYPES.values():
        fn = getattr(library, f"paged_decode_attention_{name}")
        fn.argtypes, fn.restype = _ARGTYPES, ctypes.c_int
        fn = getattr(library, f"paged_prefill_attention_{name}")
        fn.argtypes, fn.restype = _PREFILL_ARGTYPES, ctypes.c_int
    library.reshape_and_cache_rows.argtypes = [
        ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,  # key, stride, value, stride
        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,  # caches, num_slots, slots
        ctypes.c_int64, ctypes.c_int64, ctypes.c_int64]  # num_tokens, row, element size
    library.reshape_and_cache_rows.restype = ctypes.c_int
    library.paged_decode_attention_int8.argtypes, library.paged_decode_attention_int8.restype = _ARGTYPES, ctypes.c_int
    library.paged_prefill_attention_int8.argtypes = _PREFILL_ARGTYPES
    library.paged_prefill_attention_int8.restype = ctypes.c_int
    library.reshape_and_cache_int8_rows.argtypes = library.reshape_and_cache_rows.argtypes
    library.reshape_and_cache_int8_rows.restype = ctypes.c_int
    library.paged_int8_supported.argtypes = [ctypes.c_int] * 4
    library.paged_int8_supported.restype = ctypes.c_int
    return library


def int8_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
    """The int8 cache of one layer: [2, num_blocks, block_size, Hkv, head_dim + INT8_SCALE_BYTES]."""
    return (2, num_blocks, block_size, num_kv_heads, head_dim + INT8_SCALE_BYTES)


def cache_head_dim(kv_cache: Tensor) -> int:
    """head_dim of a bf16/fp32 cache or of an int8 one (whose rows end in their scale)."""
    return kv_cache.shape[-1] - (INT8_SCALE_BYTES if kv_cache.dtype == torch.int8 else 0)


def supports_int8(head_dim: int, num_heads: int, num_kv_heads: int, block_size: int = 16) -> bool:
    """Whether the kernels serve an int8 cache of this shape (AVX512-BF16, head_dim 64 or 128, at
    most 64 query heads, 16 a kv head, blocks of at most 64 tokens); never under LMC_CPU_KERNELS=0,
    asked now (load() keeps its first answer)."""
    return not kernels_disabled() and _int8_shape_supported(head_dim, num_heads, num_kv_heads, block_size)


@functools.cache
def _int8_shape_supported(head_dim: int, num_heads: int, num_kv_heads: int, block_size: int) -> bool:
    # cached as load() is: the torch backend asks supports() on every layer of every step
    library = load()
    return library is not None and bool(library.paged_int8_supported(head_dim, num_heads, num_kv_heads, block_size))


# paged_attention.c's bounds (the prefill kernel's are wider): a shape past them takes the torch path.
_MAX_HEAD_DIM, _MAX_BLOCK, _MAX_GROUP = 256, 64, 16


def supports(q: Tensor, kv_cache: Tensor) -> bool:
    """Whether the kernels take these tensors (CPU, contiguous rows, a shape within their bounds;
    a bf16 or fp32 cache of q's dtype, or an int8 cache with bf16 q of a shape supports_int8 takes)."""
    if q.device.type != "cpu" or q.stride(1) != 1 or not kv_cache.is_contiguous() or load() is None:
        return False
    head_dim, block_size, num_kv_heads = cache_head_dim(kv_cache), kv_cache.shape[2], kv_cache.shape[3]
    num_heads = q.shape[1] // head_dim
    if kv_cache.dtype == torch.int8:
        return q.dtype == torch.bfloat16 and supports_int8(head_dim, num_heads, num_kv_heads, block_size)
    return (q.dtype in _DTYPES and kv_cache.dtype == q.dtype and head_dim <= _MAX_HEAD_DIM
            and block_size <= _MAX_BLOCK and num_kv_heads > 0 and num_heads % num_kv_heads == 0
            and num_heads // num_kv_heads <= _MAX_GROUP)


def supports_cache_write(key: Tensor, value: Tensor, kv_cache: Tensor) -> bool:
    """Whether reshape_and_cache takes these tensors (CPU, the cache's dtype or bf16 rows into an
    int8 cache, contiguous rows)."""
    dtype = torch.bfloat16 if kv_cache.dtype == torch.int8 else kv_cache.dtype
    return (key.device.type == "cpu" and key.dtype == value.dtype == dtype
            and key.stride(-1) == 1 and value.stride(-1) == 1 and kv_cache.is_contiguous()
            and load() is not None)


def _library() -> ctypes.CDLL:
    library = load()
    if library is None:
        raise CpuKernelBuildError("the CPU attention kernels are not available")
    return library


def _check_int32(**tensors: Tensor) -> None:
    for name, tensor in tensors.items():
        if tensor.dtype != torch.int32:
            raise TypeError(f"{name} must be int32, got {tensor.dtype}")
        if tensor.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous along its last axis")


def _cache_kind(q: Tensor, kv_cache: Tensor) -> str:
    """The kernels' suffix for this q and cache: bf16, f32 or int8 (an int8 cache takes bf16 q)."""
    if kv_cache.dtype == torch.int8:
        if q.dtype != torch.bfloat16:
            raise TypeError(f"an int8 KV cache takes bf16 queries, got {q.dtype}")
        return "int8"
    if q.dtype not in _DTYPES or kv_cache.dtype != q.dtype:
        raise TypeError(f"q ({q.dtype}) and the KV cache ({kv_cache.dtype}) must both be bf16 or float32")
    return _DTYPES[q.dtype]


def _check_rows(q: Tensor, out: Tensor) -> None:
    if out.shape[1] != q.shape[1] or out.dtype != q.dtype or out.stride(1) != 1 or q.stride(1) != 1:
        raise ValueError("q and out must be [num_tokens, H*D] rows of one dtype, contiguous along H*D")


def _block_table_error(kv_cache: Tensor, block_table: Tensor) -> IndexError:
    return IndexError(f"a block_table row names a block outside the cache's {kv_cache.shape[1]} blocks, "
                      f"or its sequence needs more than the row's {block_table.shape[1]} entries")


def paged_decode_attention(
    q: Tensor, out: Tensor, kv_cache: Tensor, block_table: Tensor, seq_lens: Tensor,
    token_idx: Tensor | None, num_kv_heads: int, scale: float, sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
) -> None:
    """out[token_idx[i]] <- attention of q[token_idx[i]] over request i's cached K/V.

    q, out: [num_tokens, H*D], rows contiguous (any row stride); kv_cache: [2, num_blocks, block_size,
    Hkv, D] contiguous; block_table: [num_reqs, max_blocks] int32 (row stride 1 along blocks);
    seq_lens: [num_reqs] int32 (the new token included: its K/V must already be written);
    token_idx: [num_reqs] int64 or None for rows 0..num_reqs-1.
    """
    library = _library()
    block_size, head_dim = kv_cache.shape[2], cache_head_dim(kv_cache)
    _check_int32(block_table=block_table, seq_lens=seq_lens)
    _check_rows(q, out)
    if token_idx is not None and (token_idx.dtype != torch.int64 or not token_idx.is_contiguous()):
        raise TypeError("token_idx must be a contiguous int64 tensor")
    fn = getattr(library, f"paged_decode_attention_{_cache_kind(q, kv_cache)}")
    status = fn(
        q.data_ptr(), q.stride(0), out.data_ptr(), out.stride(0), token_idx.data_ptr() if token_idx is not None else None,
        kv_cache[0].data_ptr(), kv_cache[1].data_ptr(), kv_cache.stride(1),
        block_table.data_ptr(), block_table.stride(0), seq_lens.data_ptr(),
        seq_lens.shape[0], q.shape[1] // head_dim, num_kv_heads, head_dim, block_size,
        scale, sliding_window or 0, logits_soft_cap or 0.0, kv_cache.shape[1], block_table.shape[1],
    )
    if status == -3:
        raise _block_table_error(kv_cache, block_table)
    if status != 0:
        raise ValueError(f"unsupported shape for the CPU decode kernel: head_dim {head_dim} "
                         f"(max 256), block_size {block_size} (max 64), "
                         f"{q.shape[1] // head_dim} heads over {num_kv_heads} kv heads (group max 16)")


def paged_prefill_attention(
    q: Tensor, out: Tensor, kv_cache: Tensor, block_table: Tensor, q_starts: Tensor,
    q_lens: Tensor, seq_lens: Tensor, num_kv_heads: int, scale: float,
    sliding_window: int | None = None, logits_soft_cap: float | None = None,
) -> None:
    """Causal attention of prefill chunks over their requests' paged K/V (chunk included).

    Chunk c is q[q_starts[c] : q_starts[c] + q_lens[c]], the last q_lens[c] tokens of a
    sequence of seq_lens[c]; its K/V (cached context and the chunk itself) must already be in
    kv_cache through block_table[c]. Writes the same rows of out. Index tensors are int32.
    """
    library = _library()
    block_size, head_dim = kv_cache.shape[2], cache_head_dim(kv_cache)
    _check_int32(block_table=block_table, q_starts=q_starts, q_lens=q_lens, seq_lens=seq_lens)
    _check_rows(q, out)
    if not (q_starts.shape == q_lens.shape == seq_lens.shape) or block_table.shape[0] < q_lens.shape[0]:
        raise ValueError("q_starts, q_lens and seq_lens need one entry per chunk, block_table a row each")
    fn = getattr(library, f"paged_prefill_attention_{_cache_kind(q, kv_cache)}")
    status = fn(
        q.data_ptr(), q.stride(0), out.data_ptr(), out.stride(0),
        kv_cache[0].data_ptr(), kv_cache[1].data_ptr(), kv_cache.stride(1),
        block_table.data_ptr(), block_table.stride(0),
        q_starts.data_ptr(), q_lens.data_ptr(), seq_lens.data_ptr(), q_lens.shape[0],
        q.shape[1] // head_dim, num_kv_heads, head_dim, block_size,
        scale, sliding_window or 0, logits_soft_cap or 0.0, kv_cache.shape[1], block_table.shape[1],
    )
    if status == -3:
        raise _block_table_error(kv_cache, block_table)
    if status == -2:
        raise MemoryError("the CPU prefill kernel could not allocate its per-thread scratch")
    if status != 0:
        raise ValueError(f"unsupported shape for the CPU prefill kernel: head_dim {head_dim} "
                         f"(max 256), block_size {block_size} (max 64), "
                         f"{q.shape[1] // head_dim} heads over {num_kv_heads} kv heads")


def reshape_and_cache(key: Tensor, value: Tensor, kv_cache: Tensor, slots: Tensor) -> None:
    """kv_cache[0/1] slot rows <- key/value rows (slots < 0 skipped): one memcpy per token, or
    for an int8 cache each kv head's row quantized (see the module docstring).

    key, value: [num_tokens, row] (row = Hkv*D) with stride(1) == 1 and any row stride (views
    into the fused qkv output); kv_cache: contiguous [2, num_blocks, block_size, Hkv, D] of
    their dtype, or an int8 cache (int8_cache_shape) for bf16 rows; slots: [num_tokens] int64,
    contiguous.
    """
    library = _library()
    num_slots = kv_cache.shape[1] * kv_cache.shape[2]
    int8 = kv_cache.dtype == torch.int8
    head_dim = cache_head_dim(kv_cache)
    row = kv_cache.shape[3] * head_dim
    dtype = torch.bfloat16 if int8 else kv_cache.dtype
    if (key.dim() != 2 or key.shape != value.shape or key.shape[1] != row or key.stride(1) != 1
            or value.stride(1) != 1 or key.dtype != dtype or value.dtype != dtype
            or not kv_cache.is_contiguous()):
        raise ValueError(f"reshape_and_cache needs [num_tokens, Hkv*D] {dtype} key/value rows for a "
                         f"{kv_cache.dtype} cache, contiguous along the row, and a contiguous cache")
    if slots.dtype != torch.int64 or slots.shape != (key.shape[0],) or slots.stride(0) != 1:
        raise ValueError("slots must be a contiguous int64 vector, one entry per key row")
    writer = library.reshape_and_cache_int8_rows if int8 else library.reshape_and_cache_rows
    status = writer(
        key.data_ptr(), key.stride(0), value.data_ptr(), value.stride(0),
        kv_cache[0].data_ptr(), kv_cache[1].data_ptr(), num_slots, slots.data_ptr(),
        key.shape[0], row, head_dim if int8 else key.element_size())
    if status != 0:
        raise IndexError(f"a slot is past the cache's {num_slots} slots")
