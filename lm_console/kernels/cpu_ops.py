"""Fused bf16 elementwise ops for the CPU forward pass: C kernels (lm_console/kernels/cpu/fused_ops.c) via ctypes.

In bf16, torch runs RMSNorm, SwiGLU and rotary as chains of elementwise ops, each a pass over
memory that rounds to bf16; on CPU those passes cost about a third as much as the matmuls in a
small model's prefill, and their dispatch dominates a decode step's non-matmul time. Each kernel
here is one pass, computing in float32 and rounding once (so it is at least as accurate as the
torch sequence, not bit-identical to it):

- `silu_and_mul`: [T, 2I] gate|up -> [T, I] silu(gate) * up
- `rms_norm` / `add_rms_norm_`: RMSNorm, optionally fused with the residual add before it
  (vLLM's fused_add_rms_norm idea: the decoder layers carry the residual stream)
- `rms_norm_heads_`: per-head RMSNorm in place (Qwen3's q/k norm inside the qkv buffer)
- `rotary_neox_`: rotate-halves rope in place on the q/k heads of a fused qkv buffer

Only bf16 CPU tensors go through them (`enabled`); float32 keeps the exact torch path that the
greedy-vs-HF tests compare. Compiled on first use by lm_console/kernels/cpu_build.py; with no compiler, or
LMC_CPU_KERNELS=0, `load()` returns None and callers keep torch.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch
from torch import Tensor

from lm_console.kernels.cpu_build import CpuKernelBuildError, load_library

SOURCE = Path(__file__).parent / "cpu" / "fused_ops.c"
_P, _I64, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
_SIGNATURES = {
    "silu_and_mul_bf16": [_P, _I64, _P, _I64, _I64, _I64],
    "rms_norm_bf16": [_P, _I64, _P, _I64, _P, _I64, _I64, _F],
    "add_rms_norm_bf16": [_P, _I64, _P, _I64, _P, _I64, _P, _I64, _I64, _F],
    "rms_norm_heads_bf16": [_P, _I64, _P, _I64, _I64, _I64, _F],
    "rotary_neox_bf16": [_P, _I64, _P, _P, _I64, _I64, _I64],
}


def bind(library: ctypes.CDLL) -> ctypes.CDLL:
    """Declare the kernels' C signatures on a loaded library (returns it)."""
    for name, argtypes in _SIGNATURES.items():
        fn = getattr(library, name)
        fn.argtypes, fn.restype = argtypes, None
    return library


@functools.cache
def load() -> ctypes.CDLL | None:
    """The compiled fused-op library, or None (no compiler, disabled, or the build failed)."""
    library = load_library(SOURCE, "CPU fused elementwise kernels")
    return None if library is None else bind(library)


def enabled(x: Tensor) -> bool:
    """Whether the fused kernels serve this tensor (bf16 on CPU, library available)."""
    return x.dtype == torch.bfloat16 and x.device.type == "cpu" and load() is not None


def _library() -> ctypes.CDLL:
    library = load()
    if library is None:
        raise CpuKernelBuildError("the CPU fused elementwise kernels are not available")
    return library


def _check_rows(**tensors: Tensor) -> None:
    for name, t in tensors.items():
        if t.dim() != 2 or t.dtype != torch.bfloat16 or t.device.type != "cpu" or t.stride(1) != 1:
            raise ValueError(f"{name} must be a 2-D bf16 CPU tensor contiguous along its last "
                             f"axis, got {t.dtype} {tuple(t.shape)} strides {t.stride()}")


def silu_and_mul(x: Tensor) -> Tensor:
    """x [T, 2I] (gate, then up) -> silu(gate) * up [T, I], one pass in float32."""
    _check_rows(x=x)
    rows, width = x.shape
    if width % 2:
        raise ValueError(f"silu_and_mul needs an even last axis (gate | up), got {width}")
    out = x.new_empty(rows, width // 2)
    _library().silu_and_mul_bf16(x.data_ptr(), x.stride(0), out.data_ptr(), out.stride(0),
                                 rows, width // 2)
    return out


def _check_weight(weight: Tensor, x: Tensor) -> None:
    if weight.shape != (x.shape[1],) or weight.dtype != torch.bfloat16 or not weight.is_contiguous():
        raise ValueError(f"weight must be a contiguous bf16 [{x.shape[1]}], got "
                         f"{weight.dtype} {tuple(weight.shape)}")


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """x [T, d] -> x / sqrt(mean(x^2) + eps) * weight (a new tensor)."""
    _check_rows(x=x)
    _check_weight(weight, x)
    out = x.new_empty(x.shape)
    _library().rms_norm_bf16(x.data_ptr(), x.stride(0), out.data_ptr(), out.stride(0),
                             weight.data_ptr(), x.shape[0], x.shape[1], eps)
    return out


def add_rms_norm_(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> Tensor:
    """x <- x + residual (in place: the new residual stream); returns rms_norm(x) * weight.

    The sum is rounded to bf16 as torch's add would store it, and the norm is taken of that.
    """
    _check_rows(x=x, residual=residual)
    if residual.shape != x.shape:
        raise ValueError(f"residual {tuple(residual.shape)} must match x {tuple(x.shape)}")
    _check_weight(weight, x)
    out = x.new_empty(x.shape)
    _library().add_rms_norm_bf16(x.data_ptr(), x.stride(0), residual.data_ptr(), residual.stride(0),
                                 out.data_ptr(), out.stride(0), weight.data_ptr(),
                                 x.shape[0], x.shape[1], eps)
    return out


def rms_norm_heads_(x: Tensor, num_heads: int, head_dim: int, weight: Tensor, eps: float) -> None:
    """RMSNorm in place over each of the first `num_heads` heads of the rows x [T, >= H * D]."""
    _check_rows(x=x)
    if x.shape[1] < num_heads * head_dim:
        raise ValueError(f"{num_heads} heads of {head_dim} do not fit rows of {x.shape[1]}")
    if weight.shape != (head_dim,) or weight.dtype != torch.bfloat16 or not weight.is_contiguous():
        raise ValueError(f"weight must be a contiguous bf16 [{head_dim}], got "
                         f"{weight.dtype} {tuple(weight.shape)}")
    _library().rms_norm_heads_bf16(x.data_ptr(), x.stride(0), weight.data_ptr(), x.shape[0],
                                   num_heads, head_dim, eps)


def rotary_neox_(x: Tensor, num_heads: int, head_dim: int, cos: Tensor, sin: Tensor) -> None:
    """Rotate the first `num_heads` heads of each row of x [T, >= num_heads * head_dim] in place.

    cos, sin: [T, head_dim // 2] float32 (the tokens' rows of the rope tables).
    """
    _check_rows(x=x)
    tokens = x.shape[0]
    if head_dim % 2 or x.shape[1] < num_heads * head_dim:
        raise ValueError(f"{num_heads} heads of {head_dim} do not fit rows of {x.shape[1]}")
    for name, t in (("cos", cos), ("sin", sin)):
        if t.dtype != torch.float32 or t.shape != (tokens, head_dim // 2) or not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous float32 [{tokens}, {head_dim // 2}], "
                             f"got {t.dtype} {tuple(t.shape)}")
    _library().rotary_neox_bf16(x.data_ptr(), x.stride(0), cos.data_ptr(), sin.data_ptr(),
                                tokens, num_heads, head_dim)
