"""KV cache specs, KV cache groups and the KVCacheConfig.

A KVCacheSpec says how one attention layer uses its cache (full attention, or a sliding window);
a KV cache group is a set of layers that share one spec, and so one block table: the scheduler
allocates blocks per group, never per layer. The worker reports the specs and the core decides the
KVCacheConfig, so this module sits at the bottom, below both, and imports no torch (vLLM:
kv_cache_interface.py).

Memory layout of a hybrid model (several groups): every group has at most `group_size` layers;
KV cache tensor j is shared by layer j of every group, and one block pool hands out block ids to
all groups. A block id belongs to one group at a time, so the layers sharing a tensor never
touch the same block, and one block costs `group_size` layers of memory whatever its group.
A model whose layers all share one spec has a single group and one tensor per layer.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol


class AllocatedBlocks(Protocol):
    """What a KV connector sees of the blocks the scheduler allocated for a request: their ids.

    The core's KVCacheBlocks (lm_console/engine/core/kv_cache/manager.py) is the one
    implementation; the connectors sit below the core and type against this instead.
    """

    def get_block_ids(self) -> tuple[list[int], ...]:
        """Block ids per KV cache group."""
        ...

    def get_unhashed_block_ids(self) -> list[int]:
        """Ids of the blocks not yet in the prefix cache (one group only)."""
        ...


def cdiv(a: int, b: int) -> int:
    """Ceiling division."""
    return -(-a // b)


@dataclass(frozen=True, slots=True)
class KVCacheSpec:
    """The manager-side part of a layer's cache spec: what the block managers need to know."""

    block_size: int  # tokens per block

    def max_num_blocks_per_request(self, max_model_len: int, max_num_batched_tokens: int) -> int:
        """Most blocks one request of max_model_len tokens holds at once in a group of this spec."""
        return cdiv(max_model_len, self.block_size)


@dataclass(frozen=True, slots=True)
class FullAttentionSpec(KVCacheSpec):
    """Every token attends to every earlier token (after vLLM's FullAttentionSpec)."""


@dataclass(frozen=True, slots=True)
class SlidingWindowSpec(KVCacheSpec):
    """A token attends to itself and the sliding_window - 1 tokens before it."""

    sliding_window: int

    def max_num_blocks_per_request(self, max_model_len: int, max_num_batched_tokens: int) -> int:
        # The window behind the first new token plus one step's chunk; +1 for a window that
        # straddles a block boundary. Never more than full attention would hold.
        num_tokens = min(self.sliding_window - 1 + max_num_batched_tokens, max_model_len)
        return min(cdiv(num_tokens, self.block_size) + 1, cdiv(max_model_len, self.block_size))


@dataclass(frozen=True, slots=True)
class KVCacheGroupSpec:
    """Layers that share one spec and one block table."""

    layer_names: tuple[str, ...]
    kv_cache_spec: KVCacheSpec


@dataclass(frozen=True, slots=True)
class KVCacheTensor:
    """One KV cache tensor of num_blocks blocks, used by the layers in shared_by (one per group)."""

    shared_by: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class KVCacheConfig:
    """How the KV cache is laid out: block count, tensors and groups (after vLLM's get_kv_cache_configs).

    Invariant: every layer is in exactly one group and exactly one tensor's shared_by.
    """

    num_blocks: int
    kv_cache_tensors: tuple[KVCacheTensor, ...]
    kv_cache_groups: tuple[KVCacheGroupSpec, ...]

    @property
    def kv_cache_specs(self) -> list[KVCacheSpec]:
        """The spec of each group, in group order."""
        return [group.kv_cache_spec for group in self.kv_cache_groups]

    @property
    def num_layers_per_block(self) -> int:
        """Layers whose cache one block id spans (the number of tensors)."""
        return len(self.kv_cache_tensors)

    def max_num_blocks_per_request(self, max_model_len: int, max_num_batched_tokens: int) -> int:
        """Blocks one max-length request may hold across all groups at once."""
        return sum(
            spec.max_num_blocks_per_request(max_model_len, max_num_batched_tokens) for spec in self.kv_cache_specs
        )


def get_kv_cache_groups(layer_specs: Mapping[str, KVCacheSpec]) -> list[KVCacheGroupSpec]:
    """Split layers (in model order) into KV cache groups of at most equal size.

    One spec: one group of every layer. Several specs: group_size is the layer count of the
    rarest spec, and each spec's layers are cut into groups of group_size (the last may be
    shorter); full-attention groups come first. For Gemma3-1B (4 global, 22 local layers) that
    is 1 full group and 6 sliding groups of at most 4 layers: 4 tensors in all.
    """
    if not layer_specs:
        raise ValueError("the model has no attention layers")
    layers_by_spec: dict[KVCacheSpec, list[str]] = {}
    for name, spec in layer_specs.items():
        layers_by_spec.setdefault(spec, []).append(name)
    block_sizes = {spec.block_size for spec in layers_by_spec}
    if len(block_sizes) != 1:
        raise NotImplementedError(f"KV cache groups with different block sizes {sorted(block_sizes)}")
    if len(layers_by_spec) == 1:
        ((spec, names),) = layers_by_spec.items()
        return [KVCacheGroupSpec(tuple(names), spec)]
    group_size = min(len(names) for names in layers_by_spec.values())
    ordered = sorted(layers_by_spec.items(), key=lambda item: not isinstance(item[0], FullAttentionSpec))
    groups: list[KVCacheGroupSpec] = []
    for spec, names in ordered:
        for start in range(0, len(names), group_size):
            groups.append(KVCacheGroupSpec(tuple(names[start : start + group_size]), spec))
    return groups


def get_kv_cache_config(
    layer_specs: Mapping[str, KVCacheSpec] | Sequence[KVCacheGroupSpec], num_blocks: int
) -> KVCacheConfig:
    """The KVCacheConfig for num_blocks blocks: groups, and tensor j shared by layer j of each group."""
    if isinstance(layer_specs, Mapping):
        groups = get_kv_cache_groups(layer_specs)
    else:
        groups = list(layer_specs)
    group_size = max(len(group.layer_names) for group in groups)
    tensors = tuple(
        KVCacheTensor(tuple(group.layer_names[j] for group in groups if j < len(group.layer_names)))
        for j in range(group_size)
    )
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=tensors, kv_cache_groups=tuple(groups))
