"""The worker's side of KV cache groups.

- get_kv_cache_spec: each Attention layer's KVCacheSpec (full, or sliding window);
- allocate_kv_caches: the tensors a KVCacheConfig describes, bound to their layers;
- GroupAttentionMetadataBuilder: per-group AttentionMetadata for hybrid models, each a copy of
  the common (group 0) metadata with the group's own block table and slot mapping.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
from torch import Tensor, nn

from lm_console.engine.attention.layer import Attention, get_kv_cache_shape
from lm_console.engine.attention.metadata import AttentionMetadata
from lm_console.engine.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheSpec, SlidingWindowSpec
from lm_console.engine.worker.block_table import MultiGroupBlockTable
from lm_console.engine.worker.cpu_gpu_buffer import CpuGpuBuffer
from lm_console.kernels.huge_pages import zeros_huge_pages


def get_attention_layers_by_name(model: nn.Module) -> dict[str, Attention]:
    """The model's Attention modules by module name, in layer order."""
    return {name: module for name, module in model.named_modules() if isinstance(module, Attention)}


def get_kv_cache_spec(model: nn.Module, block_size: int) -> dict[str, KVCacheSpec]:
    """What each attention layer needs from the KV cache (after vLLM's get_kv_cache_specs)."""
    specs: dict[str, KVCacheSpec] = {}
    for name, layer in get_attention_layers_by_name(model).items():
        if layer.sliding_window is not None:
            specs[name] = SlidingWindowSpec(block_size=block_size, sliding_window=layer.sliding_window)
        else:
            specs[name] = FullAttentionSpec(block_size=block_size)
    return specs


def allocate_kv_caches(
    model: nn.Module, kv_cache_config: KVCacheConfig, block_size: int, dtype: torch.dtype, device: torch.device,
    prefault: bool = False,
) -> list[Tensor]:
    """Allocate one tensor per KVCacheTensor and bind it to the layers that share it (prefault:
    CacheConfig.kv_cache_prefault, see zeros_huge_pages). dtype is the cache's: the model's, or
    torch.int8 for the int8 cache (lm_console/engine/attention/int8_cache.py).

    Each layer also learns its KV cache group, which picks its block table and slot mapping.
    Returns the tensors in kv_cache_tensors order (one per layer for a single group).
    """
    layers = get_attention_layers_by_name(model)
    group_of = {name: gid for gid, group in enumerate(kv_cache_config.kv_cache_groups) for name in group.layer_names}
    if set(group_of) != set(layers):
        raise ValueError(
            f"the KV cache config covers layers {sorted(group_of)} but the model has {sorted(layers)}"
        )
    for index, layer in enumerate(layers.values()):
        layer.layer_name = f"layer.{index}"  # KV connectors key on it (single group: tensor index)
    kv_caches: list[Tensor] = []
    for tensor_spec in kv_cache_config.kv_cache_tensors:
        sharing = [layers[name] for name in tensor_spec.shared_by]
        shapes = {(layer.num_kv_heads, layer.head_dim) for layer in sharing}
        if len(shapes) != 1:
            raise NotImplementedError(
                f"layers {tensor_spec.shared_by} share a KV cache tensor but have different "
                f"(num_kv_heads, head_dim) {sorted(shapes)}"
            )
        ((num_kv_heads, head_dim),) = shapes
        shape = get_kv_cache_shape(kv_cache_config.num_blocks, block_size, num_kv_heads, head_dim,
                                   int8=dtype == torch.int8)
        kv_cache = zeros_huge_pages(shape, dtype, device, prefault)
        for name, layer in zip(tensor_spec.shared_by, sharing):
            layer.kv_cache = kv_cache
            layer.kv_cache_group_id = group_of[name]
        kv_caches.append(kv_cache)
    return kv_caches


class GroupAttentionMetadataBuilder:
    """Builds groups 1.. of a hybrid model's metadata from group 0's.

    Only the block table and the slot mapping differ between groups: query layout, sequence
    lengths and positions are the same tokens. Each group's slot mapping is staged in its own
    persistent buffer. Each copy gets its own attention plan (plan=None), built on first use.
    """

    def __init__(self, block_table: MultiGroupBlockTable, max_num_tokens: int, device: torch.device) -> None:
        self.block_table = block_table
        self.slot_mappings = [
            CpuGpuBuffer(max_num_tokens, dtype=torch.int64, device=device) for _ in range(len(block_table) - 1)
        ]

    def build(self, common: AttentionMetadata, req_indices: np.ndarray, positions: np.ndarray) -> list[AttentionMetadata]:
        """[group 0's metadata (common), group 1's, ...] for the tokens at req_indices/positions."""
        num_tokens, num_reqs = common.num_actual_tokens, common.num_reqs
        group_metadata = [common]
        for gid, slot_mapping in enumerate(self.slot_mappings, start=1):
            table = self.block_table[gid]
            slot_mapping.np[:num_tokens] = table.compute_slot_mapping(req_indices, positions)
            group_metadata.append(dataclasses.replace(
                common,
                block_table=table.get_device_tensor(num_reqs),
                slot_mapping=slot_mapping.copy_to_gpu(num_tokens),
            ))  # built before the forward: a backend's per-step state (the torch plan) is still unset
        return group_metadata
