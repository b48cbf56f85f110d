"""StructuredOutputsConfig: the constrained-decoding grammar backend."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StructuredOutputsConfig:
    """Constrained decoding (lm_console/engine/structured_output/): the grammar backend."""

    backend: str = "xgrammar"  # the only backend
    # A constraint still compiling after this fails its request (and frees its compile slot).
    compile_timeout_s: float = 30.0
    # The compiled-grammar cache's bound (least recently used grammars are evicted beyond it).
    cache_bytes: int = 64 << 20
