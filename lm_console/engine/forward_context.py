"""The forward context: per-step state the attention layers read (the one piece of module state).

The model runner wraps each model call in `set_forward_context(attn_metadata)`; every Attention
layer then reads the same metadata via `get_forward_context()` instead of threading it through
each model's forward signature.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lm_console.engine.attention.metadata import AttentionMetadata


@dataclass(slots=True)
class ForwardContext:
    """State of one model forward pass.

    attn_metadata is None for a run without a KV cache (e.g. the memory-profiling dummy run):
    attention then treats all tokens as one causal sequence and writes no cache. With several
    KV cache groups (hybrid models), group_attn_metadata[g] is group g's metadata (its own
    block table and slot mapping; group 0's is attn_metadata itself).
    """

    attn_metadata: AttentionMetadata | None
    group_attn_metadata: list[AttentionMetadata] | None = None
    kv_connector: Any = None  # the worker-side KV connector: per-layer load/save hooks


_forward_context: ForwardContext | None = None


def get_forward_context() -> ForwardContext:
    """The context of the forward pass in progress; raises if none is set."""
    if _forward_context is None:
        raise RuntimeError(
            "no forward context is set: call the model inside "
            "`with set_forward_context(attn_metadata):` (attn_metadata may be None for a "
            "cache-less dummy run)"
        )
    return _forward_context


def has_forward_context() -> bool:
    """True while a forward context is set."""
    return _forward_context is not None


@contextmanager
def set_forward_context(
    attn_metadata: AttentionMetadata | None,
    group_attn_metadata: list[AttentionMetadata] | None = None,
    kv_connector: Any = None,
) -> Iterator[ForwardContext]:
    """Make `attn_metadata` visible to every attention layer for the duration of the block."""
    global _forward_context
    previous = _forward_context
    _forward_context = ForwardContext(attn_metadata=attn_metadata, group_attn_metadata=group_attn_metadata,
                                      kv_connector=kv_connector)
    try:
        yield _forward_context
    finally:
        _forward_context = previous
