"""The Attention layer: writes K/V into its paged cache and attends per the forward context."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from lm_console.engine.attention.backend import AttentionBackend
from lm_console.engine.attention.torch_backend import CpuAttentionBackend
from lm_console.engine.forward_context import get_forward_context
from lm_console.kernels.cpu_attention import INT8_SCALE_BYTES

# Layers built outside an engine (tests, the HF comparison harness) attend as a CPU engine does;
# the model runner sets the engine's backend on every layer (set_attention_backend).
DEFAULT_BACKEND: AttentionBackend = CpuAttentionBackend()
# Steps that prefill image tokens attending both ways (Gemma3) run through a backend that builds
# those masks, when the engine's own cannot (the layout of the cache is the same).
_SPANS_BACKEND: AttentionBackend = CpuAttentionBackend()


def get_kv_cache_shape(
    num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, int8: bool = False
) -> tuple[int, int, int, int, int]:
    """Shape of one layer's cache (every backend shares AttentionBackend's layout)."""
    return AttentionBackend.get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_dim, int8)


class Attention(nn.Module):
    """Multi-head (grouped-query) attention over a paged KV cache.

    The model computes q/k/v (with rotary embeddings applied); this layer owns no weights.
    `kv_cache` ([2, num_blocks, block_size, num_kv_heads, head_dim], model dtype, or the int8
    cache's layout, lm_console/engine/attention/int8_cache.py) is assigned by
    `bind_kv_caches`; `backend` (an AttentionBackend; set_attention_backend sets the engine's)
    writes the cache and attends. Without a forward context's metadata (a dummy profiling run)
    the tokens are attended as one causal sequence and nothing is cached.
    """

    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        scale: float,
        num_kv_heads: int,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
    ) -> None:
        super().__init__()
        assert num_heads % num_kv_heads == 0, (num_heads, num_kv_heads)
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.scale = scale
        self.num_kv_heads = num_kv_heads
        self.sliding_window = sliding_window
        self.logits_soft_cap = logits_soft_cap
        self.kv_cache: Tensor | None = None  # a plain attribute: not saved, not moved by .to()
        self.kv_cache_group_id = 0  # set with the cache (hybrid models: the layer's KV cache group)
        self.layer_name = ""  # "layer.{i}", set by bind_kv_caches (KV connectors key on it)
        self.backend: AttentionBackend = DEFAULT_BACKEND

    def forward(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """q [num_tokens, H*D], k/v [num_tokens, Hkv*D] -> [num_tokens, H*D]."""
        forward_context = get_forward_context()
        attn_metadata = forward_context.attn_metadata
        if self.kv_cache_group_id and attn_metadata is not None:
            assert forward_context.group_attn_metadata is not None, "hybrid KV cache groups need per-group metadata"
            attn_metadata = forward_context.group_attn_metadata[self.kv_cache_group_id]
        if attn_metadata is None:
            return self.backend.forward_no_cache(q, k, v, self.num_kv_heads, self.scale, self.sliding_window,
                                                 self.logits_soft_cap)
        if self.kv_cache is None:
            raise RuntimeError(
                "Attention layer has no KV cache: call bind_kv_caches(model, kv_caches) before "
                "running with attention metadata (or set_forward_context(None) for a dummy run)"
            )
        connector = forward_context.kv_connector
        if connector is not None:  # layer-by-layer KV transfer: wait for this layer's load, then save it
            connector.wait_for_layer_load(self.layer_name)
        backend = self.backend
        if attn_metadata.bidirectional_spans and not backend.supports_bidirectional_spans:
            backend = _SPANS_BACKEND
        out = backend.forward(
            q, k, v, self.kv_cache, attn_metadata, self.num_kv_heads, self.scale,
            self.sliding_window, self.logits_soft_cap,
        )
        if connector is not None:
            connector.save_kv_layer(self.layer_name, self.kv_cache, attn_metadata)
        return out

    def extra_repr(self) -> str:
        return (
            f"num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, "
            f"head_dim={self.head_dim}, sliding_window={self.sliding_window}"
        )


def get_attention_layers(model: nn.Module) -> list[Attention]:
    """The model's Attention modules in layer order (registration order)."""
    return [m for m in model.modules() if isinstance(m, Attention)]


def set_attention_backend(model: nn.Module, backend: AttentionBackend) -> None:
    """Route every Attention layer of `model` through `backend` (see attention/selector.py)."""
    for layer in get_attention_layers(model):
        layer.backend = backend


def bind_kv_caches(model: nn.Module, kv_caches: list[Tensor]) -> None:
    """Give the i-th Attention layer of `model` the cache kv_caches[i]."""
    layers = get_attention_layers(model)
    if len(layers) != len(kv_caches):
        raise ValueError(f"model has {len(layers)} attention layers, got {len(kv_caches)} caches")
    for index, (layer, kv_cache) in enumerate(zip(layers, kv_caches)):
        layer.layer_name = f"layer.{index}"
        int8 = kv_cache.dtype == torch.int8
        expected = (2, layer.num_kv_heads, layer.head_dim + (INT8_SCALE_BYTES if int8 else 0))
        got = (kv_cache.shape[0], kv_cache.shape[3], kv_cache.shape[4])
        if kv_cache.dim() != 5 or got != expected:
            raise ValueError(
                f"KV cache of shape {tuple(kv_cache.shape)} does not fit a layer with "
                f"num_kv_heads={layer.num_kv_heads}, head_dim={layer.head_dim}; expected "
                f"get_kv_cache_shape(num_blocks, block_size, {layer.num_kv_heads}, "
                f"{layer.head_dim}, int8={int8})"
            )
        layer.kv_cache = kv_cache
