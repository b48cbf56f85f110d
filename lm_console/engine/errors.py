"""Specific exception types: each message says what was wrong and what is allowed."""

from __future__ import annotations


class EngineError(Exception):
    """Base class of every error the engine raises on purpose."""


class InvalidRequestError(EngineError, ValueError):
    """One request is invalid and was refused; other requests and the engine are unaffected.

    The base of every per-request refusal (an HTTP server answers it with a 400).
    """


class InvalidSamplingParamsError(InvalidRequestError):
    """A SamplingParams field is out of range or of the wrong type."""


class InvalidPromptError(InvalidRequestError):
    """A prompt is empty, malformed, or too long for max_model_len."""


class InvalidPriorityError(InvalidRequestError):
    """A request's priority is not an int, or is not 0 while scheduling_policy is "fcfs"."""


class InvalidRequestIdError(InvalidRequestError):
    """A request id is not a non-empty str of at most MAX_REQUEST_ID_CHARS characters."""


class InvalidLoRARequestError(InvalidRequestError):
    """A request's LoRA adapter cannot run: LoRA is off, the adapter is unknown, its files are
    bad, its rank exceeds max_lora_rank, or it was trained for another base model."""


class ModelNotFoundError(EngineError, FileNotFoundError):
    """The model path or name does not resolve to a model directory or GGUF file."""


class UnsupportedArchitectureError(EngineError, ValueError):
    """config.architectures names a model class this engine does not implement."""


class InvalidGGUFError(EngineError, ValueError):
    """A GGUF file lacks a metadata key or tensor its architecture needs, or holds an unusable one."""


class InvalidModelConfigError(EngineError, ValueError):
    """A model directory's config.json holds a value no model can run with (e.g. 0 positions)."""


class InsufficientKVCacheError(EngineError, ValueError):
    """The KV cache budget cannot hold even one request of max_model_len tokens."""


class InvalidEngineArgsError(EngineError, ValueError):
    """An engine argument is out of range or inconsistent with another."""


class EngineDeadError(EngineError, RuntimeError):
    """The engine core stopped; no further requests can be served."""


class EngineUnresponsiveError(EngineDeadError):
    """The engine core sent no heartbeat for engine_liveness_timeout_s (e.g. it is stopped or hung)."""


class EngineStartupError(EngineError, RuntimeError):
    """The engine core process failed to start for a reason not covered by a specific error."""


class DuplicateRequestError(InvalidRequestError):
    """A request id is already in flight; request ids must be unique among live requests."""


def fresh_error(error: BaseException) -> BaseException:
    """A new instance of `error` to raise in one more place (a shared instance would pile up
    the tracebacks of every task that re-raised it)."""
    try:
        copy = type(error)(*error.args)
    except Exception:  # noqa: BLE001 - an exception type with an unusual constructor
        return error
    copy.__cause__ = error.__cause__
    return copy


class MultiModalInputError(InvalidRequestError):
    """A multimodal input (image) of a request could not be used; the request is rejected."""


class ImageNotFoundError(MultiModalInputError, FileNotFoundError):
    """An image path does not name a readable file."""


class InvalidImageError(MultiModalInputError):
    """Image data is corrupt, truncated, of an unsupported format, or not an image source."""


class MultiModalNotSupportedError(MultiModalInputError):
    """An image was sent to a text-only model."""


class TooManyMultiModalItemsError(MultiModalInputError, InvalidPromptError):
    """The images of a prompt do not fit max_model_len or the encoder cache."""


class MultiModalCacheMissError(MultiModalInputError):
    """The engine core's processor cache lacks an item the frontend sent without data."""


class RequestRejectedError(InvalidRequestError):
    """The engine core refused a request the frontend had accepted (its message says why).

    Defence in depth: the frontend validates every request against what the core decodes, so
    this means a frontend bug or a message that did not come from this frontend.
    """


class InvalidStructuredOutputError(InvalidSamplingParamsError):
    """A structured-output constraint (JSON schema, regex, choice, grammar) cannot be compiled.

    Raised for that one request (at submission for a malformed value, or by the engine core's
    grammar compiler); other requests and the engine are unaffected.
    """


def error_type_named(name: str) -> type[EngineError]:
    """The engine.errors class called `name` (an error sent over the wire); EngineError if unknown."""
    cls = globals().get(name)
    if isinstance(cls, type) and issubclass(cls, EngineError):
        return cls
    return EngineError
