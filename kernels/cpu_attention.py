"""Paged attention for the CPU: small C kernels (kernels/cpu/) loaded through ctypes.

- decode rows: the torch path gathers each row's K/V blocks into a padded copy before
  attending; at long contexts that copy is most of a decode step (memory-bound). The C kernel
  reads K/V in place from the paged cache with a per-block online softmax, once.
- prefill chunks (`paged_prefill.c`): torch's CPU SDPA reaches a fraction of the machine's
  FMA rate at head_dim 64. In bf16 on CPUs with AVX512_BF16 the C kernel computes QK^T and PV
  with `vdpbf16ps` (16 queries in the lanes, a GQA group per task, each chunk's K/V repacked
  once per call from the paged cache); otherwise it tiles 16 queries of one head against fp32
  copies of each block. Chunked prefill needs no gather of the cached context either way.

Both files are compiled on first use into one library by kernels/cpu_build.py
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

from kernels.cpu_build import CpuKernelBuildError, load_library

__all__ = ["CpuKernelBuildError", "load", "paged_decode_attention", "paged_prefill_attention",
           "reshape_and_cache", "supports", "supports_cache_write"]

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
    return library


def supports(q: Tensor, kv_cache: Tensor) -> bool:
    """Whether the kernel takes these tensors (CPU, bf16 or fp32, contiguous rows)."""
    return (q.device.type == "cpu" and q.dtype in _DTYPES and kv_cache.dtype == q.dtype
            and q.stride(1) == 1 and kv_cache.is_contiguous() and load() is not None)


def supports_cache_write(key: Tensor, value: Tensor, kv_cache: Tensor) -> bool:
    """Whether reshape_and_cache takes these tensors (CPU, the cache's dtype, contiguous rows)."""
    return (key.device.type == "cpu" and key.dtype == value.dtype == kv_cache.dtype
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
    _, _, block_size, _, head_dim = kv_cache.shape
    _check_int32(block_table=block_table, seq_lens=seq_lens)
    _check_rows(q, out)
    if token_idx is not None and (token_idx.dtype != torch.int64 or not token_idx.is_contiguous()):
        raise TypeError("token_idx must be a contiguous int64 tensor")
    fn = getattr(library, f"paged_decode_attention_{_DTYPES[q.dtype]}")
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
    _, _, block_size, _, head_dim = kv_cache.shape
    _check_int32(block_table=block_table, q_starts=q_starts, q_lens=q_lens, seq_lens=seq_lens)
    _check_rows(q, out)
    if not (q_starts.shape == q_lens.shape == seq_lens.shape) or block_table.shape[0] < q_lens.shape[0]:
        raise ValueError("q_starts, q_lens and seq_lens need one entry per chunk, block_table a row each")
    fn = getattr(library, f"paged_prefill_attention_{_DTYPES[q.dtype]}")
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
    """kv_cache[0/1] slot rows <- key/value rows: one memcpy per token (slots < 0 skipped).

    key, value: [num_tokens, row] (row = Hkv*D) with stride(1) == 1 and any row stride (views
    into the fused qkv output); kv_cache: contiguous [2, num_blocks, block_size, Hkv, D] of
    their dtype; slots: [num_tokens] int64, contiguous.
    """
    library = _library()
    num_slots = kv_cache.shape[1] * kv_cache.shape[2]
    row = kv_cache.shape[3] * kv_cache.shape[4]
    if (key.dim() != 2 or key.shape != value.shape or key.shape[1] != row or key.stride(1) != 1
            or value.stride(1) != 1 or key.dtype != kv_cache.dtype or value.dtype != kv_cache.dtype
            or not kv_cache.is_contiguous()):
        raise ValueError("reshape_and_cache needs [num_tokens, Hkv*D] key/value rows of the cache's "
                         "dtype, contiguous along the row, and a contiguous cache")
    if slots.dtype != torch.int64 or slots.shape != (key.shape[0],) or slots.stride(0) != 1:
        raise ValueError("slots must be a contiguous int64 vector, one entry per key row")
    status = library.reshape_and_cache_rows(
        key.data_ptr(), key.stride(0), value.data_ptr(), value.stride(0),
        kv_cache[0].data_ptr(), kv_cache[1].data_ptr(), num_slots, slots.data_ptr(),
        key.shape[0], row, key.element_size())
    if status != 0:
        raise IndexError(f"a slot is past the cache's {num_slots} slots")
