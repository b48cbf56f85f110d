"""Specific exception types: each message says what was wrong and what is allowed."""

from __future__ import annotations


class EngineError(Exception):
    """Base class of every error the engine raises on purpose."""


class InvalidSamplingParamsError(EngineError, ValueError):
    """A SamplingParams field is out of range or of the wrong type."""


class InvalidPromptError(EngineError, ValueError):
    """A prompt is empty, malformed, or too long for max_model_len."""


class ModelNotFoundError(EngineError, FileNotFoundError):
    """The model path or name does not resolve to a model directory or GGUF file."""


class UnsupportedArchitectureError(EngineError, ValueError):
    """config.architectures names a model class this engine does not implement."""


class InsufficientKVCacheError(EngineError, ValueError):
    """The KV cache budget cannot hold even one request of max_model_len tokens."""


class InvalidEngineArgsError(EngineError, ValueError):
    """An engine argument is out of range or inconsistent with another."""


class EngineDeadError(EngineError, RuntimeError):
    """The engine core stopped; no further requests can be served."""
