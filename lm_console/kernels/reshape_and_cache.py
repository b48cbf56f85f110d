"""reshape_and_cache: write each new token's K/V into its slot of the paged cache.

slot = block_number * block_size + position % block_size (the runner's slot_mapping); a slot of
-1 (PAD_SLOT_ID: a padding token of a CUDA-graph batch) is skipped. One program per token.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lm_console.kernels.common import check_float, check_same_device, is_interpreted, next_pow2

PAD_SLOT_ID = -1


# ---------------------------------------------------------------------------------------------
# Reference
# ---------------------------------------------------------------------------------------------
def reshape_and_cache_ref(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                          value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """In place: cache[slot // block_size, slot % block_size] = row, for every slot != -1."""
    block_size = key_cache.shape[1]
    for token, slot in enumerate(slot_mapping.tolist()):
        if slot == PAD_SLOT_ID:
            continue
        key_cache[slot // block_size, slot % block_size] = key[token]
        value_cache[slot // block_size, slot % block_size] = value[token]


# ---------------------------------------------------------------------------------------------
# Kernel
# ---------------------------------------------------------------------------------------------
@triton.jit
def _reshape_and_cache_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kb, stride_ks, stride_kch, stride_vb, stride_vs, stride_vch,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    HEADS_P2: tl.constexpr, HEAD_DIM_P2: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return  # PAD_SLOT_ID: nothing to write
    block = slot // BLOCK_SIZE
    in_block = slot % BLOCK_SIZE
    offs_h = tl.arange(0, HEADS_P2)[:, None]
    offs_d = tl.arange(0, HEAD_DIM_P2)[None, :]
    mask = (offs_h < NUM_KV_HEADS) & (offs_d < HEAD_DIM)  # [Hkv, D]
    k = tl.load(key_ptr + token * stride_kt + offs_h * stride_kh + offs_d, mask=mask)
    v = tl.load(value_ptr + token * stride_vt + offs_h * stride_vh + offs_d, mask=mask)
    tl.store(k_cache_ptr + block * stride_kb + in_block * stride_ks + offs_h * stride_kch + offs_d,
             k, mask=mask)
    tl.store(v_cache_ptr + block * stride_vb + in_block * stride_vs + offs_h * stride_vch + offs_d,
             v, mask=mask)


# ---------------------------------------------------------------------------------------------
# Launcher
# ---------------------------------------------------------------------------------------------
def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                      value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write key/value [num_tokens, Hkv, D] into the caches [num_blocks, block_size, Hkv, D].

    slot_mapping: [num_tokens] int32/int64; tokens whose slot is -1 are skipped. key and value
    may be strided views (e.g. slices of a fused qkv output) with a contiguous last axis.
    """
    for name, t in (("key", key), ("value", value), ("key_cache", key_cache),
                    ("value_cache", value_cache)):
        check_float(name, t)
    if key.dim() != 3 or key.shape != value.shape:
        raise ValueError(f"key/value must be [num_tokens, Hkv, D], got {tuple(key.shape)}, "
                         f"{tuple(value.shape)}")
    if key_cache.dim() != 4 or key_cache.shape != value_cache.shape \
            or tuple(key_cache.shape[2:]) != tuple(key.shape[1:]):
        raise ValueError(f"caches {tuple(key_cache.shape)}, {tuple(value_cache.shape)} do not fit "
                         f"key rows {tuple(key.shape[1:])}")
    if key.dtype != key_cache.dtype or value.dtype != value_cache.dtype:
        raise TypeError(f"dtypes differ: key {key.dtype} vs cache {key_cache.dtype}")
    if slot_mapping.dim() != 1 or slot_mapping.dtype not in (torch.int32, torch.int64):
        raise TypeError("slot_mapping must be a 1-D int32/int64 tensor")
    num_tokens = slot_mapping.shape[0]
    if num_tokens > key.shape[0]:
        raise ValueError(f"slot_mapping has {num_tokens} slots for {key.shape[0]} tokens")
    check_same_device(is_interpreted(_reshape_and_cache_kernel), key=key, key_cache=key_cache,
                      slot_mapping=slot_mapping)
    if num_tokens == 0:
        return
    num_kv_heads, head_dim = key.shape[1], key.shape[2]
    _reshape_and_cache_kernel[(num_tokens,)](
        key, value, key_cache, value_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=key_cache.shape[1],
        HEADS_P2=next_pow2(num_kv_heads), HEAD_DIM_P2=next_pow2(head_dim), num_warps=4,
    )
