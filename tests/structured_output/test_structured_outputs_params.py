"""StructuredOutputsParams: exactly one constraint, clear errors, and the trip to the engine core."""

from __future__ import annotations

import msgspec
import pytest

from lm_console.engine.admission import check_decodable
from lm_console.engine.errors import InvalidSamplingParamsError, InvalidStructuredOutputError
from lm_console.engine.protocol import EngineCoreRequest
from lm_console.engine.sampling_params import SamplingParams, StructuredOutputsParams


@pytest.mark.parametrize("fields, words", [
    ({}, ["exactly one", "none"]),
    ({"json": {}, "regex": "a"}, ["exactly one", "json, regex"]),
    ({"choice": ["a"], "json_object": True}, ["choice, json_object"]),
    ({"choice": []}, ["choice", "non-empty list"]),
    ({"choice": ["a", 1]}, ["choice"]),
    ({"json": "{not json"}, ["not valid JSON"]),
    ({"json": "[1, 2]"}, ["JSON schema object"]),
    ({"regex": ""}, ["regex", "non-empty"]),
    ({"grammar": 5}, ["grammar"]),
    ({"json_object": 1}, ["json_object"]),
    ({"json_object": True, "disable_any_whitespace": "yes"}, ["disable_any_whitespace"]),
])
def test_invalid_params_name_the_problem(fields, words) -> None:
    with pytest.raises(InvalidStructuredOutputError) as info:
        StructuredOutputsParams(**fields)
    assert all(word in str(info.value) for word in words), str(info.value)
    assert isinstance(info.value, InvalidSamplingParamsError)  # a 400 in the server


def test_sampling_params_take_a_dict_and_refuse_unknown_keys() -> None:
    params = SamplingParams(structured_outputs={"regex": "a+"})
    assert params.structured_outputs == StructuredOutputsParams(regex="a+")
    with pytest.raises(InvalidSamplingParamsError, match="regexp"):
        SamplingParams(structured_outputs={"regexp": "a+"})
    with pytest.raises(InvalidSamplingParamsError, match="structured_outputs"):
        SamplingParams(structured_outputs="a+")
    clone = params.clone()
    clone.structured_outputs.regex = "b"
    assert params.structured_outputs.regex == "a+"  # each n > 1 child owns its copy


@pytest.mark.parametrize("constraint", [
    StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "integer"}}}),
    StructuredOutputsParams(json='{"type": "string"}'),
    StructuredOutputsParams(regex=r"\d+"),
    StructuredOutputsParams(choice=["a", 'b "quoted"', "☃"]),
    StructuredOutputsParams(grammar='root ::= "x"'),
    StructuredOutputsParams(json_object=True, disable_any_whitespace=True),
])
def test_constraint_survives_the_msgspec_trip(constraint) -> None:
    request = EngineCoreRequest("r", [1, 2], SamplingParams(structured_outputs=constraint), 2, 0.0)
    check_decodable(request)  # what the frontend checks before sending
    decoded = msgspec.msgpack.Decoder(EngineCoreRequest).decode(msgspec.msgpack.encode(request))
    assert decoded.sampling_params.structured_outputs == constraint
    assert decoded.sampling_params.structured_outputs.grammar_key() == constraint.grammar_key()


def test_grammar_keys_separate_whitespace_modes_and_normalise_dicts() -> None:
    schema = {"b": 1, "a": 2}
    assert StructuredOutputsParams(json=schema).grammar_key() == ("json", '{"a": 2, "b": 1}')
    assert StructuredOutputsParams(json=schema, disable_any_whitespace=True).grammar_key()[0] == "json:compact"
    assert StructuredOutputsParams(choice=["x"]).grammar_key() == ("choice", '["x"]')


def test_a_choice_with_a_min_tokens_it_cannot_reach_is_refused() -> None:
    """The stop token comes after at most one token per byte of the longest choice; min_tokens masks
    it until then, so more than that can never be met (["yes"] with min_tokens 6 was "an engine bug")."""
    choice = StructuredOutputsParams(choice=["yes", "no"])
    SamplingParams(structured_outputs=choice, min_tokens=3, max_tokens=16)
    with pytest.raises(InvalidSamplingParamsError, match=r"min_tokens.*<= 3"):
        SamplingParams(structured_outputs=StructuredOutputsParams(choice=["yes", "no"]), min_tokens=4, max_tokens=16)
