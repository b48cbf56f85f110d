"""CacheConfig: the paged KV cache's geometry, prefix caching and memory budget."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache: block geometry, prefix caching and the memory budget."""

    block_size: int = 16  # tokens per block
    enable_prefix_caching: bool = True
    prefix_caching_hash_algo: str = "sha256_cbor"  # engine/kv_cache_hashing.py
    kv_cache_memory: int | None = None  # bytes of KV cache on CPU (None: 1 GiB)
    # Touch every page of the CPU KV cache at start-up, as vLLM's torch.zeros cache does. Off,
    # pages are faulted in (and zeroed by the kernel) when first written: a cold start pays
    # nothing for the cache, but the first passes over it pay that zeroing inside the steps
    # (about 0.4 s of a 4 s batched run where the VM backs memory lazily; on CUDA and off Linux
    # the cache is torch.zeros, every page written already; README "KV cache pages").
    kv_cache_prefault: bool = False
    gpu_memory_utilization: float = 0.9  # CUDA: the share of device memory the engine may use
    num_gpu_blocks_override: int | None = None  # skip the memory budget, use this many blocks
    enable_kv_cache_events: bool = False
    kv_cache_metrics: bool = False  # sampled block lifetimes (engine/core/kv_cache/block_metrics.py)
    kv_cache_metrics_sample: float = 0.01  # the fraction of allocated blocks that record them
    # Blocks in the pool (the null block included). None in the config the workers start with:
    # the core decides it once from their memory budget, and the config it hands on (scheduler,
    # KV connector, ready handshake, frontend) carries it.
    num_blocks: int | None = None
