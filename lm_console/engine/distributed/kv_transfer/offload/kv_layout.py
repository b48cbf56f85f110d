"""Copies between the paged per-layer KV caches and one contiguous chunk tensor.

Paged cache (one per layer): [2, num_blocks, block_size, num_kv_heads, head_dim].
Chunk: [num_layers, 2, chunk_size, num_kv_heads, head_dim] on the CPU.
"""

from __future__ import annotations

import torch


def gather_chunk(kv_caches: list[torch.Tensor], block_ids: list[int], chunk_size: int) -> torch.Tensor:
    """A CPU copy of the KV held in block_ids (in order) across every layer."""
    first = kv_caches[0]
    _, _, block_size, num_heads, head_dim = first.shape
    num_blocks = len(block_ids)
    assert num_blocks * block_size == chunk_size, (num_blocks, block_size, chunk_size)
    index = torch.tensor(block_ids, dtype=torch.long, device=first.device)
    out = torch.empty((len(kv_caches), 2, num_blocks, block_size, num_heads, head_dim), dtype=first.dtype)
    for layer, kv_cache in enumerate(kv_caches):
        if kv_cache.device.type == "cpu":
            torch.index_select(kv_cache, 1, index, out=out[layer])
        else:
            out[layer].copy_(kv_cache.index_select(1, index))
    return out.view(len(kv_caches), 2, chunk_size, num_heads, head_dim)


def scatter_chunk(kv_caches: list[torch.Tensor], chunk: torch.Tensor, token_offset: int, block_ids: list[int]) -> None:
    """Write chunk tokens [token_offset, token_offset + len(block_ids) * block_size) into block_ids."""
    for layer, kv_cache in enumerate(kv_caches):
        scatter_chunk_layer(kv_cache, chunk[layer], token_offset, block_ids)


def scatter_chunk_layer(kv_cache: torch.Tensor, chunk_layer: torch.Tensor, token_offset: int, block_ids: list[int]) -> None:
    """One layer of scatter_chunk: chunk_layer [2, chunk_size, num_kv_heads, head_dim]."""
    _, _, block_size, num_heads, head_dim = kv_cache.shape
    num_blocks = len(block_ids)
    index = torch.tensor(block_ids, dtype=torch.long, device=kv_cache.device)
    part = chunk_layer[:, token_offset:token_offset + num_blocks * block_size]
    kv_cache[:, index] = part.reshape(2, num_blocks, block_size, num_heads, head_dim).to(kv_cache.device)
