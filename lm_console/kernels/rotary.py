"""Rotary position embedding applied in place to q and k (neox and gpt-j pairings).

Each head's first rotary_dim features are rotated by the token's position angles; neox pairs
feature i with i + rotary_dim / 2 (rotate halves, Llama/Qwen), gpt-j pairs 2i with 2i + 1.
cos/sin tables are [max_position, rotary_dim / 2] (float32), gathered by position in-kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lm_console.kernels.common import check_float, check_same_device, is_interpreted, next_pow2


# ---------------------------------------------------------------------------------------------
# Reference
# ---------------------------------------------------------------------------------------------
def rotary_embedding_ref(positions: torch.Tensor, x: torch.Tensor, cos_cache: torch.Tensor,
                         sin_cache: torch.Tensor, is_neox: bool) -> torch.Tensor:
    """x [num_tokens, num_heads, head_dim] -> rotated copy in float64."""
    half = cos_cache.shape[1]
    cos = cos_cache[positions.long()].double()[:, None, :]  # [T, 1, half]
    sin = sin_cache[positions.long()].double()[:, None, :]
    out = x.double().clone()
    if is_neox:
        x1, x2 = out[..., :half].clone(), out[..., half : 2 * half].clone()
        out[..., :half] = x1 * cos - x2 * sin
        out[..., half : 2 * half] = x2 * cos + x1 * sin
    else:
        x1, x2 = out[..., 0 : 2 * half : 2].clone(), out[..., 1 : 2 * half : 2].clone()
        out[..., 0 : 2 * half : 2] = x1 * cos - x2 * sin
        out[..., 1 : 2 * half : 2] = x2 * cos + x1 * sin
    return out


# ---------------------------------------------------------------------------------------------
# Kernel
# ---------------------------------------------------------------------------------------------
@triton.jit
def _rotate_heads(x_ptr, stride_h, num_heads, cos, sin, offs_i,
                  HALF: tl.constexpr, HEADS_P2: tl.constexpr, IS_NEOX: tl.constexpr):
    """Rotate the pairs of every head of one token in place (cos/sin: [1, HALF_P2])."""
    offs_h = tl.arange(0, HEADS_P2)[:, None]
    mask = (offs_h < num_heads) & (offs_i < HALF)  # [Hp2, HALF_P2]
    if IS_NEOX:
        first = offs_i
        second = offs_i + HALF
    else:
        first = 2 * offs_i
        second = 2 * offs_i + 1
    x1 = tl.load(x_ptr + offs_h * stride_h + first, mask=mask, other=0.0)
    x2 = tl.load(x_ptr + offs_h * stride_h + second, mask=mask, other=0.0)
    dtype = x1.dtype
    x1 = x1.to(tl.float32)
    x2 = x2.to(tl.float32)
    tl.store(x_ptr + offs_h * stride_h + first, (x1 * cos - x2 * sin).to(dtype), mask=mask)
    tl.store(x_ptr + offs_h * stride_h + second, (x2 * cos + x1 * sin).to(dtype), mask=mask)


@triton.jit
def _rotary_embedding_kernel(
    positions_ptr, q_ptr, k_ptr, cos_ptr, sin_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_cos,
    num_q_heads, num_k_heads,
    HALF: tl.constexpr, HALF_P2: tl.constexpr, Q_HEADS_P2: tl.constexpr,
    K_HEADS_P2: tl.constexpr, IS_NEOX: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + token).to(tl.int64)
    offs_i = tl.arange(0, HALF_P2)[None, :]
    cos = tl.load(cos_ptr + pos * stride_cos + offs_i, mask=offs_i < HALF, other=0.0)
    sin = tl.load(sin_ptr + pos * stride_cos + offs_i, mask=offs_i < HALF, other=0.0)
    cos = cos.to(tl.float32)
    sin = sin.to(tl.float32)
    _rotate_heads(q_ptr + token * stride_qt, stride_qh, num_q_heads, cos, sin, offs_i,
                  HALF, Q_HEADS_P2, IS_NEOX)
    _rotate_heads(k_ptr + token * stride_kt, stride_kh, num_k_heads, cos, sin, offs_i,
                  HALF, K_HEADS_P2, IS_NEOX)


# ---------------------------------------------------------------------------------------------
# Launcher
# ---------------------------------------------------------------------------------------------
def rotary_embedding(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                     cos_cache: torch.Tensor, sin_cache: torch.Tensor,
                     is_neox: bool = True) -> None:
    """Rotate q [T, H, D] and k [T, Hkv, D] in place by the angles of `positions` [T].

    cos_cache/sin_cache: [max_position, rotary_dim / 2] with rotary_dim <= D; features past
    rotary_dim are left as they are. q and k may be strided views with a contiguous last axis.
    """
    check_float("q", q)
    check_float("k", k)
    if q.dim() != 3 or k.dim() != 3 or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise ValueError(f"want q [T, H, D], k [T, Hkv, D]; got {tuple(q.shape)}, {tuple(k.shape)}")
    if positions.shape != (q.shape[0],) or positions.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"positions must be int32/int64 [{q.shape[0]}]")
    if cos_cache.shape != sin_cache.shape or cos_cache.dim() != 2 or cos_cache.stride(1) != 1 \
            or sin_cache.stride() != cos_cache.stride():
        raise ValueError("cos_cache/sin_cache must be equal-strided [max_position, rotary_dim / 2]")
    half = cos_cache.shape[1]
    if 2 * half > q.shape[2]:
        raise ValueError(f"rotary_dim {2 * half} exceeds head_dim {q.shape[2]}")
    check_same_device(is_interpreted(_rotary_embedding_kernel), positions=positions, q=q, k=k,
                      cos_cache=cos_cache)
    if q.shape[0] == 0:
        return
    _rotary_embedding_kernel[(q.shape[0],)](
        positions, q, k, cos_cache, sin_cache,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos_cache.stride(0),
        q.shape[1], k.shape[1],
        HALF=half, HALF_P2=next_pow2(half), Q_HEADS_P2=next_pow2(q.shape[1]),
        K_HEADS_P2=next_pow2(k.shape[1]), IS_NEOX=is_neox, num_warps=4,
    )
