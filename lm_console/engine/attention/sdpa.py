"""Scaled dot-product attention over gathered K/V, and the cache-less causal pass.

Shared by every backend: the torch backend's prefill and decode paths call `_sdpa`, and
`causal_attention` is AttentionBackend's default for a forward without a KV cache (the
memory-profiling dummy run).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def _causal_allowed(num_context: int, seq_len: int, window: int | None,
                    device: torch.device) -> Tensor:
    """[seq_len - num_context, seq_len] bool: query i (at num_context + i) may see key j."""
    q_pos = torch.arange(num_context, seq_len, device=device)[:, None]
    k_pos = torch.arange(seq_len, device=device)[None, :]
    allowed = k_pos <= q_pos  # bottom-right-aligned causal
    if window is not None:
        allowed &= k_pos > q_pos - window
    return allowed


def _sdpa(q: Tensor, k: Tensor, v: Tensor, allowed: Tensor | None, scale: float,
          soft_cap: float | None) -> Tensor:
    """Attention of q [Hkv*G, T, D] over k/v [Hkv, S, D]; `allowed` None means causal."""
    if soft_cap is None:
        return F.scaled_dot_product_attention(
            q[None], k[None], v[None], attn_mask=allowed, is_causal=allowed is None,
            scale=scale, enable_gqa=True,
        )[0]
    group = q.shape[0] // k.shape[0]
    k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
    scores = torch.matmul(q, k.transpose(1, 2)) * scale  # [H, T, S]
    scores = soft_cap * torch.tanh(scores / soft_cap)
    if allowed is None:
        allowed = torch.ones(q.shape[1], k.shape[1], dtype=torch.bool, device=q.device).tril()
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype), v)


def causal_attention(q: Tensor, k: Tensor, v: Tensor, num_kv_heads: int, scale: float,
                     sliding_window: int | None = None,
                     logits_soft_cap: float | None = None) -> Tensor:
    """All tokens as one causal sequence, no cache (the cache-less dummy/profiling run)."""
    num_tokens, head_dim = q.shape[0], k.shape[1] // num_kv_heads
    qp = q.view(num_tokens, -1, head_dim).transpose(0, 1)
    kp = k.view(num_tokens, num_kv_heads, head_dim).transpose(0, 1)
    vp = v.view(num_tokens, num_kv_heads, head_dim).transpose(0, 1)
    allowed = None
    if sliding_window is not None and num_tokens > sliding_window:
        allowed = _causal_allowed(0, num_tokens, sliding_window, q.device)
    o = _sdpa(qp, kp, vp, allowed, scale, logits_soft_cap)
    return o.transpose(0, 1).reshape(num_tokens, -1)
