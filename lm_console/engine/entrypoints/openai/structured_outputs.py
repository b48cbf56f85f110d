"""The request fields that constrain the output, mapped to StructuredOutputsParams.

OpenAI's `response_format` ({"type": "text" | "json_object" | "json_schema"}), vLLM's
`structured_outputs` object (json, regex, choice, grammar, json_object, disable_any_whitespace)
and vLLM's legacy `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar`. At most
one of them may constrain a request (structured_outputs may add options to a response_format);
a malformed one is a 400 naming the field.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from lm_console.engine.entrypoints.openai.errors import bad_request
from lm_console.engine.errors import InvalidStructuredOutputError
from lm_console.engine.sampling_params import StructuredOutputsParams

if TYPE_CHECKING:
    from lm_console.engine.entrypoints.openai.protocol import SamplingFields

_LEGACY = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def to_structured_outputs_params(request: SamplingFields) -> StructuredOutputsParams | None:
    """The request's output constraint (None: free text); 400 for a malformed or doubled one.

    As in vLLM, `structured_outputs` may carry options alone (disable_any_whitespace) next to a
    `response_format` that names the constraint.
    """
    given: list[tuple[str, StructuredOutputsParams]] = []
    fields = dict(request.structured_outputs or {})
    if request.response_format is not None:
        constraint = _from_response_format(request.response_format)
        if constraint:
            doubled = sorted(k for k in fields if k in ("json", "regex", "choice", "grammar", "json_object"))
            if doubled:
                raise bad_request(f"Only one output constraint may be given per request; got response_format "
                                  f"and structured_outputs.{doubled[0]}.", "structured_outputs")
            given.append(("response_format", _build("response_format", **constraint, **fields)))
            fields = {}
    if fields:
        given.append(("structured_outputs", _build("structured_outputs", **fields)))
    for field, key in _LEGACY.items():
        value = getattr(request, field)
        if value is not None:
            given.append((field, _build(field, **{key: value})))
    if len(given) > 1:
        names = ", ".join(name for name, _ in given)
        raise bad_request(f"Only one output constraint may be given per request; got {names}.", given[1][0])
    return given[0][1] if given else None


def has_constraint(request: SamplingFields) -> bool:
    return any(getattr(request, name) is not None for name in ("response_format", "structured_outputs", *_LEGACY))


def check_constraint_size(request: SamplingFields, max_bytes: int, max_choices: int) -> None:
    """Refuse (400 naming the limit) a constraint too large to compile in bounded time and memory:
    compile time grows faster than its size (10,000 choices took over a minute). Serialises JSON
    schemas to measure them: run it in the serving pool."""
    constraints: list[tuple[str, Any]] = []
    if isinstance(request.response_format, dict):
        constraints.append(("response_format", request.response_format.get("json_schema")))
    for key, value in (request.structured_outputs or {}).items():
        constraints.append((f"structured_outputs.{key}", value))
    for field in _LEGACY:
        constraints.append((field, getattr(request, field)))
    for field, value in constraints:
        if value is None or isinstance(value, bool):
            continue
        if isinstance(value, list) and len(value) > max_choices:
            raise bad_request(f"{field} has {len(value)} choices; at most {max_choices} are allowed "
                              "(--max-structured-output-choices).", field.split(".")[0], "constraint_too_large")
        size = len(value.encode("utf-8", "surrogatepass")) if isinstance(value, str) else len(
            json.dumps(value, ensure_ascii=False).encode("utf-8", "surrogatepass"))
        if size > max_bytes:
            raise bad_request(f"{field} is {size} bytes; a constraint may have at most {max_bytes} bytes "
                              "(--max-structured-output-bytes).", field.split(".")[0], "constraint_too_large")


def _from_response_format(response_format: dict[str, Any]) -> dict[str, Any]:
    """The StructuredOutputsParams fields of an OpenAI response_format ({} for text)."""
    kind = response_format.get("type")
    if kind == "text" and len(response_format) == 1:
        return {}
    if kind == "json_object" and len(response_format) == 1:
        return {"json_object": True}
    if kind == "json_schema":
        json_schema = response_format.get("json_schema")
        if not isinstance(json_schema, dict) or not isinstance(json_schema.get("schema"), dict):
            raise bad_request("response_format of type json_schema needs json_schema.schema, a JSON schema "
                              "object (json_schema: {name, schema, strict}).", "response_format")
        return {"json": json_schema["schema"]}
    raise bad_request(
        f"response_format={response_format!r:.120} is not supported: use {{'type': 'text'}}, "
        "{'type': 'json_object'} or {'type': 'json_schema', 'json_schema': {'name': ..., 'schema': {...}}}.",
        "response_format")


def _build(field: str, **fields: Any) -> StructuredOutputsParams:
    try:
        return StructuredOutputsParams(**fields)
    except TypeError as error:
        raise bad_request(f"{field}: {error}; allowed keys: json, regex, choice, grammar, json_object, "
                          "disable_any_whitespace.", field) from None
    except InvalidStructuredOutputError as error:
        raise bad_request(f"{field}: {error}", field) from None
