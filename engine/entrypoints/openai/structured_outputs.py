"""The request fields that constrain the output, mapped to StructuredOutputsParams.

OpenAI's `response_format` ({"type": "text" | "json_object" | "json_schema"}), vLLM's
`structured_outputs` object (json, regex, choice, grammar, json_object, disable_any_whitespace)
and vLLM's legacy `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar`. At most
one of them may constrain a request; a malformed one is a 400 naming the field.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from engine.entrypoints.openai.errors import bad_request
from engine.errors import InvalidStructuredOutputError
from engine.sampling_params import StructuredOutputsParams

if TYPE_CHECKING:
    from engine.entrypoints.openai.protocol import SamplingFields

_LEGACY = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def to_structured_outputs_params(request: SamplingFields) -> StructuredOutputsParams | None:
    """The request's output constraint (None: free text); 400 for a malformed or doubled one."""
    given: list[tuple[str, StructuredOutputsParams]] = []
    if request.response_format is not None:
        params = _from_response_format(request.response_format)
        if params is not None:
            given.append(("response_format", params))
    if request.structured_outputs is not None:
        given.append(("structured_outputs", _build("structured_outputs", **request.structured_outputs)))
    for field, key in _LEGACY.items():
        value = getattr(request, field)
        if value is not None:
            given.append((field, _build(field, **{key: value})))
    if len(given) > 1:
        names = ", ".join(name for name, _ in given)
        raise bad_request(f"Only one output constraint may be given per request; got {names}.", given[1][0])
    return given[0][1] if given else None


def _from_response_format(response_format: dict[str, Any]) -> StructuredOutputsParams | None:
    kind = response_format.get("type")
    if kind == "text" and len(response_format) == 1:
        return None
    if kind == "json_object" and len(response_format) == 1:
        return StructuredOutputsParams(json_object=True)
    if kind == "json_schema":
        json_schema = response_format.get("json_schema")
        if not isinstance(json_schema, dict) or not isinstance(json_schema.get("schema"), dict):
            raise bad_request("response_format of type json_schema needs json_schema.schema, a JSON schema "
                              "object (json_schema: {name, schema, strict}).", "response_format")
        return _build("response_format", json=json_schema["schema"])
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
