"""StructuredOutputsConfig: the constrained-decoding grammar backend."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StructuredOutputsConfig:
    """Constrained decoding (lm_console/engine/structured_output/): the grammar backend."""

    backend: str = "xgrammar"  # the only backend
