"""RMSNorm, optionally fused with the residual add that precedes it in a pre-norm decoder.

fused_add_rms_norm(x, residual, w): residual <- x + residual, then x <- rms_norm(residual) * w,
both in place: one read of each input and one write of each output instead of three passes.
The math follows the model code (lm_console/engine/models/layers.py RMSNorm): the sum is rounded to the
activation dtype, normalised in float32, rounded again, then scaled by the weight.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lm_console.kernels.common import check_float, check_same_device, is_interpreted, next_pow2


# ---------------------------------------------------------------------------------------------
# Reference
# ---------------------------------------------------------------------------------------------
def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Out-of-place (normalised, new residual); x [num_tokens, hidden], weight [hidden]."""
    if residual is not None:
        residual = (x + residual).to(x.dtype)
        x = residual
    h = x.double()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.double() * h.to(x.dtype).double()).to(x.dtype), residual


# ---------------------------------------------------------------------------------------------
# Kernel
# ---------------------------------------------------------------------------------------------
@triton.jit
def _rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr,
    stride_x, stride_r, stride_o, hidden_size, eps,
    BLOCK_N: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < hidden_size
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    dtype = x.dtype
    x = x.to(tl.float32)  # upcast at once (the interpreter's bf16 arithmetic is unreliable)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
        x = (x + r).to(dtype)
        tl.store(residual_ptr + row * stride_r + cols, x, mask=mask)
        x = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, 0) / hidden_size + eps)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = (x * rstd).to(dtype).to(tl.float32) * w
    tl.store(out_ptr + row * stride_o + cols, y.to(dtype), mask=mask)


# ---------------------------------------------------------------------------------------------
# Launchers
# ---------------------------------------------------------------------------------------------
def _launch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
            out: torch.Tensor, eps: float) -> None:
    for name, t in (("x", x), ("weight", weight), ("out", out)):
        check_float(name, t)
    if x.dim() != 2 or weight.shape != (x.shape[1],) or out.shape != x.shape:
        raise ValueError(f"want x [num_tokens, hidden], weight [hidden]; got {tuple(x.shape)}, "
                         f"{tuple(weight.shape)}")
    if residual is not None:
        check_float("residual", residual)
        if residual.shape != x.shape or residual.dtype != x.dtype:
            raise ValueError(f"residual {tuple(residual.shape)} {residual.dtype} must match x")
    interpreting = is_interpreted(_rms_norm_kernel)
    check_same_device(interpreting, x=x, weight=weight, out=out)
    if x.shape[0] == 0:
        return
    block_n = next_pow2(x.shape[1])
    num_warps = 1 if interpreting else min(max(block_n // 256, 1), 16)
    _rms_norm_kernel[(x.shape[0],)](
        x, residual if residual is not None else x, weight, out,
        x.stride(0), residual.stride(0) if residual is not None else 0, out.stride(0),
        x.shape[1], eps, BLOCK_N=block_n, HAS_RESIDUAL=residual is not None, num_warps=num_warps,
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [num_tokens, hidden] -> rms_norm(x) * weight (a new tensor)."""
    out = torch.empty_like(x)
    _launch(x, None, weight, out, eps)
    return out


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> None:
    """In place: residual <- x + residual; x <- rms_norm(residual) * weight."""
    _launch(x, residual, weight, x, eps)
