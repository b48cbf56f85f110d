"""OpenAI-shaped errors: {"error": {"message", "type", "param", "code"}} with the right status.

Every failure of a request becomes an OpenAIError: the engine's own exceptions keep their
message (lm_console/engine/errors.py says what was wrong and what is allowed), pydantic's validation
errors name the field. The status table (docs/serving.md):
400 invalid request, 401 missing or wrong API key, 404 unknown model or route, 413 body too
large, 422 body is not JSON, 503 engine dead or server draining, 500 a bug.
"""

from __future__ import annotations

import logging
import re
from http import HTTPStatus
from typing import Any

from lm_console.engine.errors import (
    DuplicateRequestError, EngineDeadError, EngineError, InvalidPriorityError, InvalidPromptError,
    InvalidSamplingParamsError,
    MultiModalInputError,
)

logger = logging.getLogger(__name__)

_SAMPLING_PARAM = re.compile(r"SamplingParams\.(\w+)=")

# Fields that accept several shapes: pydantic reports each failed alternative; we say what fits.
UNION_FIELDS = {
    "prompt": "a string, a list of strings, a list of token ids, or a list of token-id lists",
    "stop": "a string or a list of strings",
    "messages": "a list of {role, content} messages; content is a string or a list of "
                "{type: text, text} / {type: image_url, image_url: {url}} parts",
}


class OpenAIError(Exception):
    """An error response: HTTP status, message, and OpenAI's type / param / code fields."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 error_type: str | None = None) -> None:
        super().__init__(message)
        self.status = int(status)
        self.message = message
        self.param = param
        self.code = code
        self.error_type = error_type or default_error_type(self.status)

    def body(self) -> dict[str, Any]:
        """The JSON body OpenAI sends."""
        return {"error": {"message": self.message, "type": self.error_type, "param": self.param,
                          "code": self.code}}


def default_error_type(status: int) -> str:
    """OpenAI's error type for a status: client errors are invalid requests."""
    if status >= 500:
        return "server_error"
    return "invalid_request_error"


def bad_request(message: str, param: str | None = None, code: str | None = "invalid_value") -> OpenAIError:
    return OpenAIError(HTTPStatus.BAD_REQUEST, message, param=param, code=code)


def unsupported(param: str, why: str) -> OpenAIError:
    """A field this server knows but cannot honour: refused, never ignored."""
    return OpenAIError(HTTPStatus.BAD_REQUEST, f"'{param}' is not supported by this server: {why}",
                       param=param, code="unsupported_parameter")


def model_not_found(name: str, served: list[str]) -> OpenAIError:
    return OpenAIError(HTTPStatus.NOT_FOUND,
                       f"The model '{name}' does not exist; this server serves {', '.join(served)}.",
                       param="model", code="model_not_found")


def engine_dead(detail: str = "") -> OpenAIError:
    message = "The engine is dead; the server is exiting so that its supervisor restarts it."
    return OpenAIError(HTTPStatus.SERVICE_UNAVAILABLE, f"{message} {detail}".strip(), code="engine_dead")


def draining() -> OpenAIError:
    return OpenAIError(HTTPStatus.SERVICE_UNAVAILABLE,
                       "The server is shutting down and accepts no new requests; retry on another replica.",
                       code="server_shutting_down")


def from_exception(error: BaseException, prompt_param: str = "prompt") -> OpenAIError:
    """Map any exception raised while serving a request to its OpenAIError."""
    if isinstance(error, OpenAIError):
        return error
    if isinstance(error, EngineDeadError):
        return engine_dead(str(error))
    if isinstance(error, InvalidSamplingParamsError):
        match = _SAMPLING_PARAM.search(str(error))
        return bad_request(str(error), param=match.group(1) if match else None)
    if isinstance(error, MultiModalInputError):
        return bad_request(str(error), param="messages", code="invalid_image")
    if isinstance(error, InvalidPromptError):
        return bad_request(str(error), param=prompt_param)
    if isinstance(error, InvalidPriorityError):
        return bad_request(str(error), param="priority")
    if isinstance(error, DuplicateRequestError):
        return bad_request(str(error), code="duplicate_request")
    if isinstance(error, EngineError) and isinstance(error, ValueError):
        return bad_request(str(error))
    logger.error("Unexpected error while serving a request", exc_info=error)
    return OpenAIError(HTTPStatus.INTERNAL_SERVER_ERROR,
                       f"Internal server error ({type(error).__name__}): {error}", code="internal_error")


def from_validation_error(error: Any) -> OpenAIError:
    """A pydantic ValidationError -> 422 when the body is not JSON, else 400 naming the field."""
    details = error.errors(include_url=False)
    if any(d.get("type") == "json_invalid" for d in details):
        return OpenAIError(HTTPStatus.UNPROCESSABLE_ENTITY,
                           f"The request body is not valid JSON: {details[0].get('msg')}.",
                           code="invalid_json")
    messages = []
    param = None
    seen_union_fields: set[str] = set()
    fields = [str(d["loc"][0]) if d.get("loc") else "" for d in details]
    for detail, field in zip(details[:5], fields):
        if field in UNION_FIELDS and fields.count(field) > 1:  # one line when every alternative failed
            if field not in seen_union_fields:
                seen_union_fields.add(field)
                param = param or field
                messages.append(f"{field}: must be {UNION_FIELDS[field]}")
            continue
        loc = ".".join(str(part) for part in detail.get("loc", ()) if not _is_union_tag(part))
        param = param or (str(detail["loc"][0]) if detail.get("loc") else None)
        message = detail.get("msg", "invalid")
        if detail.get("type") == "extra_forbidden":
            message = "unknown field (not part of this API; check its spelling)"
        elif detail.get("type") == "model_type" and not loc:
            message = "the request body must be a JSON object"
        elif "input" in detail and detail.get("type") not in ("missing",):
            message = f"{message} (got {_short(detail['input'])})"
        messages.append(f"{loc}: {message}" if loc else message)
    if len(details) > 5:
        messages.append(f"... and {len(details) - 5} more")
    return bad_request("Invalid request: " + "; ".join(messages), param=param)


def _is_union_tag(part: Any) -> bool:
    # pydantic names the union member it tried (e.g. "list[int]", "str"); not a field name.
    return isinstance(part, str) and ("[" in part or part in ("str", "int", "float", "bool", "function-after"))


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."
