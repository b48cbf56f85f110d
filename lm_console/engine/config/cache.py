"""CacheConfig: the paged KV cache's geometry, prefix caching and memory budget."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from lm_console.engine.config.fields import DeclaredConfig, knob

logger = logging.getLogger(__name__)

KVCacheDtype = Literal["auto", "int8", "bfloat16", "float16", "float32"]
PrefixCachingHashAlgo = Literal["sha256_cbor", "sha256"]


@dataclass(frozen=True)
class CacheConfig(DeclaredConfig):
    """The paged KV cache: block geometry, prefix caching and the memory budget."""

    block_size: int = knob(16, ge=1, power_of_two=True, help="Tokens per KV block.")
    enable_prefix_caching: bool = knob(True, help="Share the KV blocks of common prefixes.")
    prefix_caching_hash_algo: PrefixCachingHashAlgo = knob(
        "sha256_cbor", cli=None,
        help="The block hash of prefix caching (lm_console/engine/kv_cache_hashing.py).")
    kv_cache_memory: int | None = knob(
        None, ge=1, cli=None, help="Bytes of KV cache on the CPU (None: 1 GiB); at most the machine's memory.")
    # Off, pages are faulted in (and zeroed by the kernel) when first written: a cold start pays
    # nothing for the cache, but the first passes over it pay that zeroing inside the steps
    # (about 0.4 s of a 4 s batched run where the VM backs memory lazily; on CUDA and off Linux
    # the cache is torch.zeros, every page written already; docs/serving.md, "KV cache pages").
    kv_cache_prefault: bool = knob(
        False, help="Touch every page of the CPU KV cache at start-up (steady speed from the first request; "
                    "off: pages are faulted in when first written). `lmc serve` turns it on.")
    gpu_memory_utilization: float = knob(
        0.9, gt=0.0, le=1.0, cli=None, help="CUDA: the share of device memory the engine may use.")
    num_gpu_blocks_override: int | None = knob(
        None, ge=1, cli="--num-blocks",
        help="KV cache blocks (overrides the memory budget; the block map shows each).")
    enable_kv_cache_events: bool = knob(
        False, cli=None, help="Publish BlockStored / BlockRemoved events (lmc serve: --kv-events-endpoint).")
    kv_cache_metrics: bool = knob(False, help="Sample KV block lifetimes, idle and reuse times.")
    kv_cache_metrics_sample: float = knob(
        0.01, gt=0.0, le=1.0, help="Fraction of KV blocks sampled by --kv-cache-metrics.")
    # The KV cache's element type: the model's dtype name, or "int8" (each kv head's row of a
    # token as int8 values and a float32 scale: lm_console/engine/attention/int8_cache.py).
    # EngineArgs resolves "auto" before the config is made (resolve_kv_cache_dtype); "fp8" has
    # no cache here.
    kv_cache_dtype: KVCacheDtype = knob(
        "auto", advice=lambda v: ("; there is no fp8 KV cache here: 'int8' is the quantized one"
                                  if isinstance(v, str) and v.startswith("fp8") else ""),
        help="auto | int8 | the model's dtype. auto: int8 (half the bytes per cached token) where the "
                     "weights run quantized on the CPU, the model's dtype elsewhere.")
    # Blocks in the pool (the null block included). None in the config the workers start with:
    # the core decides it once from their memory budget, and the config it hands on (scheduler,
    # KV connector, ready handshake, frontend) carries it.
    num_blocks: int | None = knob(None, ge=1, user=False, help="Blocks in the pool, decided by the engine core.")

    @classmethod
    def verify_relations(cls, values: Mapping[str, Any]) -> None:
        """kv_cache_memory within this machine's memory."""
        from lm_console.engine.errors import InvalidEngineArgsError

        memory = values.get("kv_cache_memory")
        total = _physical_memory_bytes()
        if memory is not None and total is not None and memory > total:
            raise InvalidEngineArgsError(
                f"kv_cache_memory={memory} is invalid: it exceeds this machine's memory ({total} bytes).")


# kv_cache_dtype values EngineArgs accepts: auto, int8, or the model's own dtype by name.
KV_CACHE_DTYPE_CHOICES: tuple[str, ...] = KVCacheDtype.__args__  # type: ignore[attr-defined]


def _physical_memory_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def int8_kernels_serve(head_dim: int, num_heads: int, num_kv_heads: int, block_size: int) -> bool:
    """Whether the C kernels take an int8 cache of this shape on this machine (AVX512-BF16,
    head_dim 64 or 128, ...; lm_console/kernels/cpu_attention.py supports_int8). Loads (or builds) the
    attention kernels: it runs where the engine core runs, which loads them anyway."""
    from lm_console.kernels.cpu_attention import supports_int8

    return supports_int8(head_dim, num_heads, num_kv_heads, block_size)


def resolve_kv_cache_dtype(requested: str, *, dtype: str, device: str, quantization: str | None,
                           head_dim: int, num_heads: int, num_kv_heads: int, block_size: int,
                           attention_backend: str) -> str:
    """The KV cache's element type: "int8" or the model's dtype name (InvalidEngineArgsError for
    a combination that cannot run).

    "auto" takes the int8 cache where the weights run quantized on the CPU (quantization "gguf"
    or "int8", bf16 activations): there its kernels read half the bytes of a bf16 cache per
    decode step (the step's attention is memory-bound), at +0.1% perplexity on the embedded
    model (docs/quantized-cpu.md), when the C kernels take the model's shape on this
    machine (int8_kernels_serve; elsewhere the torch path would dequantize every step).
    Everything else keeps the model's dtype, as vLLM's "auto" does. An explicit "int8" the
    kernels cannot serve runs on the torch path, with a warning. KV connectors move the cache's
    own bytes (the OffloadConnector's chunks and fingerprint name the cache's type, so chunks of
    an int8 and a bf16 engine never mix).
    """
    from lm_console.engine.errors import InvalidEngineArgsError

    shape = (head_dim, num_heads, num_kv_heads, block_size)
    if requested == "auto":
        if (quantization is not None and device == "cpu" and dtype == "bfloat16"
                and attention_backend in ("auto", "cpu") and int8_kernels_serve(*shape)):
            return "int8"
        return dtype
    if requested == "int8":
        if device != "cpu":
            raise InvalidEngineArgsError(f"kv_cache_dtype='int8' runs on the CPU only (device={device!r}).")
        if attention_backend == "triton":
            raise InvalidEngineArgsError("kv_cache_dtype='int8' needs the cpu (or torch) attention backend; "
                                         "attention_backend='triton' has no int8 cache.")
        if attention_backend == "torch":
            logger.warning("kv_cache_dtype='int8' with attention_backend='torch': the torch paths dequantize the "
                           "cache every step (the C kernels read it in place with attention_backend='cpu' or 'auto').")
        elif dtype != "bfloat16" or not int8_kernels_serve(*shape):
            logger.warning(
                "kv_cache_dtype='int8': the C kernels do not take this model here (%s, head_dim %d, %d heads over "
                "%d kv heads, block_size %d; they need bf16 on AVX512-BF16, head_dim 64 or 128, at most 64 heads "
                "and 16 per kv head): attention runs on the torch path, dequantizing the cache every step, "
                "slower than kv_cache_dtype='auto'.", dtype, *shape)
        return "int8"
    if requested != dtype:
        raise InvalidEngineArgsError(
            f"kv_cache_dtype={requested!r} differs from the model's dtype {dtype!r}: the KV cache holds the model's "
            "dtype, or 'int8' (quantized per token and kv head); use 'auto', 'int8' or the model's dtype.")
    return dtype
