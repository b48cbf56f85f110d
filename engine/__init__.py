"""lm-console's engine: a small vLLM-v1-style inference engine."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from engine.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams

if TYPE_CHECKING:
    from engine.config import EngineArgs
    from engine.frontend.async_llm import AsyncLLM
    from engine.frontend.llm import LLM
    from engine.outputs import CompletionOutput, RequestOutput

__all__ = ["LLM", "AsyncLLM", "SamplingParams", "StructuredOutputsParams", "RequestOutputKind", "EngineArgs", "RequestOutput",
           "CompletionOutput"]


def __getattr__(name: str) -> Any:
    # Lazy: `import engine` stays cheap for the console, which must not pay for torch.
    if name == "LLM":
        from engine.frontend.llm import LLM

        return LLM
    if name == "AsyncLLM":
        from engine.frontend.async_llm import AsyncLLM

        return AsyncLLM
    if name == "EngineArgs":
        from engine.config import EngineArgs

        return EngineArgs
    if name in ("RequestOutput", "CompletionOutput"):
        from engine import outputs

        return getattr(outputs, name)
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
