"""Structured outputs: mask CPU float32 logits rows with grammar bitmasks, a C kernel via ctypes.

See lm_console/kernels/cpu/grammar_bitmask.c. Compiled on first use by lm_console/kernels/cpu_build.py; None from
`load()` (no compiler, LMC_CPU_KERNELS=0) leaves the caller to its fallback.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch
from torch import Tensor

from lm_console.kernels.cpu_build import load_library

SOURCE = Path(__file__).parent / "cpu" / "grammar_bitmask.c"


@functools.cache
def load() -> ctypes.CDLL | None:
    """The compiled library, or None (no compiler, disabled, or the build failed)."""
    library = load_library(SOURCE, "CPU grammar bitmask kernel")
    if library is not None:
        fn = library.apply_token_bitmask_f32
        fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                       ctypes.c_void_p, ctypes.c_int64]
        fn.restype = None
    return library


def supports(logits: Tensor) -> bool:
    """Whether the kernel takes these logits: float32 on the CPU, rows contiguous."""
    return (logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() == 2
            and logits.stride(1) == 1 and load() is not None)


def apply_token_bitmask(logits: Tensor, bitmask: Tensor, rows: Tensor) -> None:
    """logits[rows[i]] keeps only the tokens bitmask[i] allows; the rest (and the columns past
    the bitmask's 32 * num_words) become -inf. In place.

    logits: [B, V] float32 CPU, contiguous along V; bitmask: [R, W] int32 contiguous; rows: [R]
    int64 in [0, B).
    """
    library = load()
    if library is None or not supports(logits):
        raise ValueError("the kernel needs [B, V] float32 CPU logits, contiguous along V, and a C compiler")
    if bitmask.dtype != torch.int32 or bitmask.dim() != 2 or not bitmask.is_contiguous():
        raise ValueError("bitmask must be a contiguous [R, W] int32 tensor")
    if rows.dtype != torch.int64 or rows.shape != (bitmask.shape[0],) or not rows.is_contiguous():
        raise ValueError(f"rows must be a contiguous int64 tensor of shape ({bitmask.shape[0]},)")
    if rows.numel() and not (0 <= int(rows.min()) and int(rows.max()) < logits.shape[0]):
        raise ValueError(f"rows must lie in [0, {logits.shape[0]})")
    library.apply_token_bitmask_f32(logits.data_ptr(), logits.stride(0), rows.data_ptr(), bitmask.shape[0],
                                    logits.shape[1], bitmask.data_ptr(), bitmask.shape[1])
