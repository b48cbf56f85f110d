"""lm-console's engine: a small vLLM-v1-style inference engine."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lm_console.engine.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams

if TYPE_CHECKING:
    from lm_console.engine.config import EngineArgs
    from lm_console.engine.frontend.async_llm import AsyncLLM
    from lm_console.engine.frontend.llm import LLM
    from lm_console.engine.outputs import CompletionOutput, RequestOutput

__all__ = ["LLM", "AsyncLLM", "SamplingParams", "StructuredOutputsParams", "RequestOutputKind", "EngineArgs", "RequestOutput",
           "CompletionOutput"]


def __getattr__(name: str) -> Any:
    # Lazy: `import lm_console.engine` stays cheap for the console, which must not pay for torch.
    if name == "LLM":
        from lm_console.engine.frontend.llm import LLM

        return LLM
    if name == "AsyncLLM":
        from lm_console.engine.frontend.async_llm import AsyncLLM

        return AsyncLLM
    if name == "EngineArgs":
        from lm_console.engine.config import EngineArgs

        return EngineArgs
    if name in ("RequestOutput", "CompletionOutput"):
        from lm_console.engine import outputs

        return getattr(outputs, name)
    raise AttributeError(f"module 'lm_console.engine' has no attribute {name!r}")
