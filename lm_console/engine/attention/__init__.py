"""Paged attention: metadata, the Attention layer, and backends.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lm_console._lazy import lazy_exports

if TYPE_CHECKING:
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

__getattr__ = lazy_exports(__name__, {
    "Attention": "lm_console.engine.attention.layer",
    "bind_kv_caches": "lm_console.engine.attention.layer",
    "get_attention_layers": "lm_console.engine.attention.layer",
    "get_kv_cache_shape": "lm_console.engine.attention.layer",
    "set_attention_backend": "lm_console.engine.attention.layer",
    "AttentionMetadata": "lm_console.engine.attention.metadata",
})
