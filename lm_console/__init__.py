"""lm-console: a small vLLM-v1-style inference engine with a terminal operator console.

One import root holds everything: the engine (`lm_console.engine`), its C and Triton kernels
(`lm_console.kernels`) and the console (`lm_console.tui`, the `lmc` CLI). The engine's public API
is re-exported here, lazily, so that `import lm_console` stays cheap for the console, which must
not pay for torch::

    from lm_console import LLM, SamplingParams
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lm_console._lazy import lazy_exports

if TYPE_CHECKING:
    from lm_console.engine import (
        LLM,
        AsyncLLM,
        BeamSearchParams,
        CompletionOutput,
        EngineArgs,
        RequestOutput,
        RequestOutputKind,
        SamplingParams,
        StructuredOutputsParams,
        PoolingParams,
    )

__all__ = ["LLM", "AsyncLLM", "SamplingParams", "StructuredOutputsParams", "RequestOutputKind", "EngineArgs",
           "RequestOutput", "CompletionOutput", "BeamSearchParams", "PoolingParams"]

# The engine package resolves each name (lazily too): one table of where they live, there.
__getattr__ = lazy_exports(__name__, dict.fromkeys(__all__, "lm_console.engine"))
