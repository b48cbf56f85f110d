"""AttentionBackend: one way of running paged attention, as a class.

A backend says how the KV cache of a layer is laid out, what per-step metadata it needs (its own
metadata class, built by the model runner for each step) and how a layer attends over the
cache. The model runner picks one per engine (attention/selector.py) and gives it to every
Attention layer. Like vLLM's `AttentionBackend` (vllm/v1/attention/backends/), with our three:

- TorchAttentionBackend ("torch"): plain torch, the reference; any device.
- CpuAttentionBackend ("cpu"): the C kernels (lm_console/kernels/cpu_attention.py) for the
  decodes and prefills whose shapes they take, the torch backend's paths for the rest. The
  default on a CPU.
- TritonAttentionBackend ("triton"): the Triton kernels, the default on CUDA (CPU only under
  Triton's interpreter, for tests).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

from torch import Tensor

from lm_console.engine.attention.int8_cache import INT8_SCALE_BYTES
from lm_console.engine.attention.metadata import AttentionMetadata
from lm_console.engine.attention.sdpa import causal_attention


class AttentionBackend(ABC):
    """Writes a layer's new K/V into its paged cache and attends the queries over the cache."""

    name: ClassVar[str]
    # The metadata class the model runner builds for this backend each step.
    metadata_cls: ClassVar[type[AttentionMetadata]] = AttentionMetadata
    # Whether forward honours AttentionMetadata.bidirectional_spans (image tokens attending both
    # ways, Gemma3); a step with such spans runs through the torch backend otherwise.
    supports_bidirectional_spans: ClassVar[bool] = False
    # Whether the cache may hold int8 rows with their scales (kv_cache_dtype="int8").
    supports_int8_cache: ClassVar[bool] = False

    @staticmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                           int8: bool = False) -> tuple[int, int, int, int, int]:
        """Shape of one layer's cache: K and V stacked on the first axis, [2, num_blocks,
        block_size, num_kv_heads, head_dim] (int8: each row followed by its float32 scale)."""
        return (2, num_blocks, block_size, num_kv_heads, head_dim + (INT8_SCALE_BYTES if int8 else 0))

    @abstractmethod
    def forward(self, q: Tensor, k: Tensor, v: Tensor, kv_cache: Tensor, md: AttentionMetadata,
                num_kv_heads: int, scale: float, sliding_window: int | None = None,
                logits_soft_cap: float | None = None) -> Tensor:
        """Write k/v into the paged cache, then attend q over each request's context.

        q: [num_tokens, H*D]; k, v: [num_tokens, Hkv*D]; kv_cache: get_kv_cache_shape's layout.
        Returns [num_tokens, H*D]; rows past md.num_actual_tokens are zero.
        """

    def forward_no_cache(self, q: Tensor, k: Tensor, v: Tensor, num_kv_heads: int, scale: float,
                         sliding_window: int | None = None, logits_soft_cap: float | None = None) -> Tensor:
        """All tokens as one causal sequence, no cache (the memory-profiling dummy run)."""
        return causal_attention(q, k, v, num_kv_heads, scale, sliding_window, logits_soft_cap)

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"
