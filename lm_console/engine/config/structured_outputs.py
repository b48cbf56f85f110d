"""StructuredOutputsConfig: the constrained-decoding grammar backend."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from lm_console.engine.config.fields import DeclaredConfig, knob


@dataclass(frozen=True)
class StructuredOutputsConfig(DeclaredConfig):
    """Constrained decoding (lm_console/engine/structured_output/): the grammar backend.

    Its fields are the engine's own settings (no EngineArgs keyword), checked like knobs.
    """

    backend: Literal["xgrammar"] = knob("xgrammar", user=False, help="The grammar backend (the only one).")
    compile_timeout_s: float = knob(
        30.0, gt=0.0, user=False,
        help="A constraint still compiling after this many seconds fails its request (and frees its compile slot).")
    cache_bytes: int = knob(64 << 20, ge=0, user=False,
                            help="The compiled-grammar cache's bound (least recently used grammars beyond it).")
