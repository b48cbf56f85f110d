"""Paged attention through the Triton kernels (the CUDA backend; CPU only under the interpreter).

Same contract as torch_backend.paged_attention. Everything here depends on tensor shapes and on
md.max_query_len only, never on the metadata's host-side lists, so a pure-decode step can be
captured in a CUDA graph and replayed with other lengths and block tables.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import Tensor

from lm_console.engine.attention.backend import AttentionBackend
from lm_console.engine.attention.metadata import AttentionMetadata
from lm_console.kernels.paged_attention import paged_attention as _paged_attention
from lm_console.kernels.reshape_and_cache import reshape_and_cache
from lm_console.kernels.split_kv_decode import default_num_splits, split_kv_decode


def paged_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    kv_cache: Tensor,
    md: AttentionMetadata,
    num_kv_heads: int,
    scale: float,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
) -> Tensor:
    """Write k/v into the paged cache, then attend q over each request's context.

    q: [num_tokens, H*D]; k, v: [num_tokens, Hkv*D]; kv_cache: [2, num_blocks, block_size,
    Hkv, D]. Returns [num_tokens, H*D]; rows past num_actual_tokens are zero.
    """
    if kv_cache.dtype == torch.int8:
        raise NotImplementedError("the Triton attention backend has no int8 KV cache: use kv_cache_dtype='auto'")
    num_tokens, head_dim = q.shape[0], kv_cache.shape[-1]
    key_cache, value_cache = kv_cache[0], kv_cache[1]  # [num_blocks, block_size, Hkv, D]
    num_slots = md.slot_mapping.shape[0]
    reshape_and_cache(k.view(num_tokens, num_kv_heads, head_dim)[:num_slots],
                      v.view(num_tokens, num_kv_heads, head_dim)[:num_slots],
                      key_cache, value_cache, md.slot_mapping)
    q3 = q.view(num_tokens, -1, head_dim)  # [T, H, D]
    out = q.new_empty(q3.shape)
    num_reqs = md.seq_lens.shape[0]
    if (md.max_query_len == 1 and num_reqs == num_tokens
            and default_num_splits(num_reqs, num_kv_heads, q.device) > 1):
        # Few decodes: split each context across programs to fill the GPU (flash-decoding).
        split_kv_decode(q3, key_cache, value_cache, md.block_table, md.seq_lens, scale,
                        sliding_window, logits_soft_cap, out=out)
    else:
        _paged_attention(q3, key_cache, value_cache, md.block_table, md.query_start_loc,
                         md.seq_lens, scale, md.max_query_len, sliding_window, logits_soft_cap,
                         out=out)
        if num_tokens > md.num_actual_tokens:
            out[md.num_actual_tokens:] = 0
    return out.view(num_tokens, -1)


class TritonAttentionBackend(AttentionBackend):
    """The Triton kernels: unified paged attention, split-KV decoding for small decode batches."""

    name: ClassVar[str] = "triton"

    def forward(self, q: Tensor, k: Tensor, v: Tensor, kv_cache: Tensor, md: AttentionMetadata,
                num_kv_heads: int, scale: float, sliding_window: int | None = None,
                logits_soft_cap: float | None = None) -> Tensor:
        return paged_attention(q, k, v, kv_cache, md, num_kv_heads, scale, sliding_window, logits_soft_cap)
