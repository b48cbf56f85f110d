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
    from lm_console.engine.config.engine_args import EngineArgs
    from lm_console.engine.frontend.async_llm import AsyncLLM
    from lm_console.engine.frontend.llm import LLM
    from lm_console.engine.outputs import CompletionOutput, RequestOutput
    from lm_console.engine.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams

__all__ = ["LLM", "AsyncLLM", "SamplingParams", "StructuredOutputsParams", "RequestOutputKind", "EngineArgs",
           "RequestOutput", "CompletionOutput"]

__getattr__ = lazy_exports(__name__, {
    "LLM": "lm_console.engine.frontend.llm",
    "AsyncLLM": "lm_console.engine.frontend.async_llm",
    "EngineArgs": "lm_console.engine.config.engine_args",
    "RequestOutput": "lm_console.engine.outputs",
    "CompletionOutput": "lm_console.engine.outputs",
    "SamplingParams": "lm_console.engine.sampling_params",
    "StructuredOutputsParams": "lm_console.engine.sampling_params",
    "RequestOutputKind": "lm_console.engine.sampling_params",
})
