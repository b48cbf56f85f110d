"""lm-console's engine: a small vLLM-v1-style inference engine.

The public API (`LLM`, `AsyncLLM`, `SamplingParams`, ...) loads on first use: importing any module
of the engine runs this file first, and it must not load the frontend (or torch) for a boundary
type. Users usually import it from the package root: `from lm_console import LLM`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lm_console._lazy import lazy_exports

if TYPE_CHECKING:
    from lm_console.engine.config.engine_args import EngineArgs
    from lm_console.engine.frontend.async_llm import AsyncLLM
    from lm_console.engine.frontend.beam_search import BeamSearchParams
    from lm_console.engine.frontend.llm import LLM
    from lm_console.engine.outputs import CompletionOutput, RequestOutput
    from lm_console.engine.sampling_params import PoolingParams, RequestOutputKind, SamplingParams, StructuredOutputsParams

__all__ = ["LLM", "AsyncLLM", "SamplingParams", "StructuredOutputsParams", "RequestOutputKind", "EngineArgs",
           "RequestOutput", "CompletionOutput", "BeamSearchParams", "PoolingParams"]

__getattr__ = lazy_exports(__name__, {
    "LLM": "lm_console.engine.frontend.llm",
    "AsyncLLM": "lm_console.engine.frontend.async_llm",
    "EngineArgs": "lm_console.engine.config.engine_args",
    "RequestOutput": "lm_console.engine.outputs",
    "CompletionOutput": "lm_console.engine.outputs",
    "SamplingParams": "lm_console.engine.sampling_params",
    "StructuredOutputsParams": "lm_console.engine.sampling_params",
    "RequestOutputKind": "lm_console.engine.sampling_params",
    "BeamSearchParams": "lm_console.engine.frontend.beam_search",
    "PoolingParams": "lm_console.engine.sampling_params",
})
