"""Paged attention: metadata, the Attention layer, and backends."""

from lm_console.engine.attention.layer import (
    Attention, bind_kv_caches, get_attention_layers, get_kv_cache_shape, set_attention_backend,
)
from lm_console.engine.attention.metadata import AttentionMetadata

__all__ = [
    "Attention",
    "AttentionMetadata",
    "bind_kv_caches",
    "get_attention_layers",
    "get_kv_cache_shape",
    "set_attention_backend",
]
