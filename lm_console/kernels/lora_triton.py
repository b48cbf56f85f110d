"""Batched LoRA for GPUs as two Triton kernels (punica's shrink and expand).

shrink: h[t, :] = A[slot[t]] x[t]          (float32 buffer [T, R])
expand: y[t, :] += scaling[slot[t]] * B[slot[t]] h[t]
Tokens with slot -1 load and store nothing. One program per (token, block of R) and per
(token, block of out); accumulation in float32, y read and written in its own dtype. The
contract is lora_ops.add_lora_torch's; tests run it under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lm_console.kernels.common import check_same_device, is_interpreted, next_pow2


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, slots_ptr, h_ptr, in_features, rank,
                   BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    t = tl.program_id(0)
    rb = tl.program_id(1)
    slot = tl.load(slots_ptr + t)
    # A token of the base model (slot -1) sees zero-length rows: every mask is empty.
    live_rank = tl.where(slot >= 0, rank, 0)
    live_in = tl.where(slot >= 0, in_features, 0)
    slot = tl.maximum(slot, 0)
    r = rb * BLOCK_R + tl.arange(0, BLOCK_R)
    r_mask = r < live_rank
    acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for k0 in range(0, in_features, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_mask = k < live_in
        x = tl.load(x_ptr + t * in_features + k, mask=k_mask, other=0.0).to(tl.float32)
        a = tl.load(a_ptr + (slot * rank + r[:, None]) * in_features + k[None, :],
                    mask=r_mask[:, None] & k_mask[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(a * x[None, :], axis=1)
    tl.store(h_ptr + t * rank + r, acc, mask=r_mask)


@triton.jit
def _expand_kernel(y_ptr, b_ptr, slots_ptr, scalings_ptr, h_ptr, out_features, rank,
                   BLOCK_O: tl.constexpr, BLOCK_R: tl.constexpr):
    t = tl.program_id(0)
    ob = tl.program_id(1)
    slot = tl.load(slots_ptr + t)
    live_out = tl.where(slot >= 0, out_features, 0)
    live_rank = tl.where(slot >= 0, rank, 0)
    slot = tl.maximum(slot, 0)
    o = ob * BLOCK_O + tl.arange(0, BLOCK_O)
    o_mask = o < live_out
    acc = tl.zeros((BLOCK_O,), dtype=tl.float32)
    for r0 in range(0, rank, BLOCK_R):
        r = r0 + tl.arange(0, BLOCK_R)
        r_mask = r < live_rank
        h = tl.load(h_ptr + t * rank + r, mask=r_mask, other=0.0)
        b = tl.load(b_ptr + (slot * out_features + o[:, None]) * rank + r[None, :],
                    mask=o_mask[:, None] & r_mask[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(b * h[None, :], axis=1)
    scaling = tl.load(scalings_ptr + slot)
    y = tl.load(y_ptr + t * out_features + o, mask=o_mask, other=0.0)
    tl.store(y_ptr + t * out_features + o, (y.to(tl.float32) + acc * scaling).to(y.dtype), mask=o_mask)


def lora_shrink_expand(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                       token_slots: torch.Tensor, scalings: torch.Tensor) -> torch.Tensor:
    """y [T, out] += scalings[s] * (x A[s]^T) B[s]^T per token (slot -1: unchanged); returns y.
    The shapes are the caller's to check (lora_ops.add_lora_triton does)."""
    num_tokens, out_features = y.shape
    rank, in_features = a.shape[1:]
    if not all(t.is_contiguous() for t in (y, x, a, b, token_slots, scalings)):
        raise ValueError("lora_shrink_expand: every tensor must be contiguous")
    interpreting = is_interpreted(_shrink_kernel)
    check_same_device(interpreting, y=y, x=x, a=a, b=b, token_slots=token_slots, scalings=scalings)
    if num_tokens == 0:
        return y
    h = torch.empty(num_tokens, rank, dtype=torch.float32, device=y.device)
    slots = token_slots.to(torch.int64)
    block_r = min(next_pow2(rank), 64)
    block_k = min(next_pow2(in_features), 128)
    _shrink_kernel[(num_tokens, triton.cdiv(rank, block_r))](
        x, a, slots, h, in_features, rank, BLOCK_R=block_r, BLOCK_K=block_k)
    block_o = min(next_pow2(out_features), 128)
    _expand_kernel[(num_tokens, triton.cdiv(out_features, block_o))](
        y, b, slots, scalings.float(), h, out_features, rank, BLOCK_O=block_o, BLOCK_R=block_r)
    return y
