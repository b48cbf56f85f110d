"""The int8 KV cache format in torch: the reference the C kernels are tested against, and the
torch backend's path where they do not serve (lm_console/kernels/cpu_attention.py, kv_cache_dtype="int8").

Each kv head's row of a token (head_dim values) is stored as head_dim int8 values
q = round(x * 127 / amax) (to nearest even; amax = max |x| of the row) followed by the float32
scale amax * (1 / 127) as four bytes: a layer's cache is int8 [2, num_blocks, block_size, Hkv,
head_dim + 4], and x ~ q * scale (error at most scale / 2 per element, about 0.4% of the row's
largest value). One tensor holds values and scales, so whatever moves blocks moves both.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lm_console.kernels.cpu_attention import INT8_SCALE_BYTES


def quantize_rows(x: Tensor, num_kv_heads: int) -> Tensor:
    """[num_tokens, Hkv * D] (any float dtype) -> int8 [num_tokens, Hkv, D + 4], the cache's rows."""
    rows = x.float().reshape(x.shape[0], num_kv_heads, -1)
    amax = rows.abs().amax(dim=-1, keepdim=True)
    # A tensor / tensor division (one IEEE rounding; `127.0 / amax` would round twice, as a
    # reciprocal and a product) and a product by float32(1 / 127): the bytes the C writer
    # stores (lm_console/kernels/cpu/cache_write.c).
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    values = torch.round(rows * inv).to(torch.int8)
    scale = (amax * torch.full_like(amax, 1.0 / 127.0)).contiguous().view(torch.int8)  # the float32's 4 bytes
    return torch.cat([values, scale], dim=-1)


def dequantize(rows: Tensor, dtype: torch.dtype) -> Tensor:
    """int8 [..., D + 4] cache rows -> [..., D] values q * scale in `dtype`."""
    head_dim = rows.shape[-1] - INT8_SCALE_BYTES
    scale = rows[..., head_dim:].contiguous().view(torch.float32)  # [..., 1]
    return (rows[..., :head_dim].float() * scale).to(dtype)


def round_trip(x: Tensor, num_kv_heads: int) -> Tensor:
    """x [num_tokens, Hkv * D] as the cache gives it back (quantized, then dequantized), x's dtype."""
    return dequantize(quantize_rows(x, num_kv_heads), x.dtype).reshape(x.shape)
