"""Sampling kernels for CPU float32 logits via ctypes: the exponential race (random rows) and
the argmax (greedy rows).

See lm_console/kernels/cpu/sampling.c: each row's Exp(1) noise is a counter-based hash of one 64-bit key
per row and step, so the vocabulary-sized draw is vectorised instead of coming one value at a
time from torch's Mersenne Twister. Compiled on first use by lm_console/kernels/cpu_build.py; None from
`load()` (no compiler, LMC_CPU_KERNELS=0) keeps the torch path.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch
from torch import Tensor

from lm_console.kernels.cpu_build import CpuKernelBuildError, load_library

SOURCE = Path(__file__).parent / "cpu" / "sampling.c"
_ARGTYPES = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
             ctypes.c_void_p]


@functools.cache
def load() -> ctypes.CDLL | None:
    """The compiled sampling library, or None (no compiler, disabled, or the build failed)."""
    library = load_library(SOURCE, "CPU sampling kernel")
    if library is not None:
        for name in ("exponential_race_f32", "exponential_race_f32_scalar"):
            fn = getattr(library, name)
            fn.argtypes, fn.restype = _ARGTYPES, None
        for name in ("argmax_f32", "argmax_f32_scalar"):
            fn = getattr(library, name)
            fn.argtypes, fn.restype = _ARGTYPES[:5], None
    return library


def supports(logits: Tensor) -> bool:
    """Whether the kernel takes these logits: float32 on the CPU, rows contiguous."""
    return (logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() == 2
            and logits.stride(1) == 1 and load() is not None)


def exponential_race(logits: Tensor, keys: Tensor, vectorized: bool = True) -> Tensor:
    """[B] int64 tokens: argmax_v softmax(logits)_v / E_v, E_v ~ Exp(1) hashed from keys[row].

    logits: [B, V] float32 (filters applied: removed tokens are -inf); keys: [B] int64, one
    fresh random key per row and step. `vectorized=False` runs the scalar reference.
    """
    library = load()
    if library is None:
        raise CpuKernelBuildError("the CPU sampling kernel is not available")
    if not supports(logits):
        raise ValueError("logits must be a [B, V] float32 CPU tensor, contiguous along V")
    if keys.dtype != torch.int64 or keys.shape != (logits.shape[0],) or not keys.is_contiguous():
        raise ValueError(f"keys must be a contiguous int64 tensor of shape ({logits.shape[0]},)")
    out = torch.empty(logits.shape[0], dtype=torch.int64)
    fn = library.exponential_race_f32 if vectorized else library.exponential_race_f32_scalar
    fn(logits.data_ptr(), logits.stride(0), logits.shape[0], logits.shape[1], keys.data_ptr(),
       out.data_ptr())
    return out


def argmax(logits: Tensor, vectorized: bool = True) -> Tensor:
    """[B] int64: each row's argmax as torch.argmax(dim=-1) gives it (the first maximum; a row
    holding a NaN, its first NaN). logits: [B, V] float32, V > 0, contiguous along V."""
    library = load()
    if library is None:
        raise CpuKernelBuildError("the CPU sampling kernel is not available")
    if not supports(logits) or logits.shape[1] == 0:
        raise ValueError("logits must be a [B, V] float32 CPU tensor, V > 0, contiguous along V")
    out = torch.empty(logits.shape[0], dtype=torch.int64)
    fn = library.argmax_f32 if vectorized else library.argmax_f32_scalar
    fn(logits.data_ptr(), logits.stride(0), logits.shape[0], logits.shape[1], out.data_ptr())
    return out
