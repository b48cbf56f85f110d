"""Type-safe admission (issue 18 item 1): what the frontend accepts, the core's typed decode accepts.

No engine needed: these check SamplingParams' strict types, the codec round trip of a whole
EngineCoreRequest, and the loose reading of ids from a request the core cannot decode.
"""

from __future__ import annotations

import math

import msgspec
import pytest

from lm_console.engine.admission import check_decodable, check_request_id, error_for_path, read_request_ids
from lm_console.engine.errors import (
    InvalidPromptError, InvalidRequestIdError, InvalidSamplingParamsError, error_type_named,
)
from lm_console.engine.protocol import EngineCoreRequest
from lm_console.engine.sampling_params import SamplingParams


def _request(**fields) -> EngineCoreRequest:
    base = dict(request_id="r", prompt_token_ids=[1, 2], sampling_params=SamplingParams(),
                eos_token_id=None, arrival_time=0.0)
    base.update(fields)
    return EngineCoreRequest(**base)


# The triggers, each of which the core's decode refused (a silent hang on main).
@pytest.mark.parametrize("kwargs", [
    dict(temperature=True), dict(ignore_eos="yes"), dict(extra_args={1: 2}), dict(top_k=2**70),
    dict(seed=10**30), dict(temperature=math.nan), dict(temperature=math.inf), dict(top_p=math.nan),
    dict(repetition_penalty=math.inf), dict(stop=5), dict(stop=["ok", 3]), dict(stop="\udc80"),
    dict(max_tokens=True), dict(n=True), dict(logprobs=False), dict(skip_special_tokens=1),
    dict(extra_args={"kv_transfer_params": "not a dict"}), dict(stop_token_ids=[True]), dict(n=10**6),
])
def test_bad_sampling_params_are_refused_at_construction(kwargs) -> None:
    with pytest.raises(InvalidSamplingParamsError):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("field,value", [
    ("temperature", -1.0), ("temperature", True), ("ignore_eos", "yes"), ("extra_args", {1: 2}),
    ("stop", 5), ("n", "3"), ("seed", 2**64), ("extra_args", {"x": object()}), ("extra_args", {"x": 2**70}),
    ("extra_args", {"x": "\ud800"}), ("all_stop_token_ids", {True}), ("output_kind", 7),
])
def test_a_field_changed_after_construction_is_caught_at_submission(field, value) -> None:
    params = SamplingParams()
    setattr(params, field, value)
    with pytest.raises(InvalidSamplingParamsError):
        copy = params.clone()
        copy.verify()
        check_decodable(_request(sampling_params=copy))


def test_round_trip_names_the_failing_field() -> None:
    with pytest.raises(InvalidRequestIdError):
        check_decodable(_request(request_id=123))
    with pytest.raises(InvalidPromptError):
        check_decodable(_request(prompt_token_ids=[True, 5]))
    with pytest.raises(InvalidPromptError):
        check_decodable(_request(prompt_token_ids=[2**70]))
    params = SamplingParams()
    params.extra_args = {1: 2}
    with pytest.raises(InvalidSamplingParamsError, match="extra_args"):
        check_decodable(_request(sampling_params=params))
    check_decodable(_request(sampling_params=SamplingParams(extra_args={"a": [1, {"b": None}]}, seed=-5)))


@pytest.mark.parametrize("request_id", [123, None, b"id", "", "x" * 2000, "\udc80", True])
def test_request_ids_must_be_text(request_id) -> None:
    with pytest.raises(InvalidRequestIdError):
        check_request_id(request_id)


def test_the_core_reads_ids_from_a_request_it_cannot_decode() -> None:
    raw = msgspec.msgpack.encode(["id-7", [True], {}, None, 0.0, None, 0])
    assert read_request_ids(raw) == ("id-7", 0)
    assert read_request_ids(msgspec.msgpack.encode(["id-8", [1]])) == ("id-8", 0)  # defaults omitted
    assert read_request_ids(msgspec.msgpack.encode([5, [1]])) == (None, None)
    assert read_request_ids(b"\xc1 not msgpack") == (None, None)
    error = error_for_path("Expected `int`, got `bool` - at `$[1][0]`")
    assert isinstance(error, InvalidPromptError) and "prompt_token_ids" in str(error)


def test_errors_travel_by_name() -> None:
    assert error_type_named("InvalidPromptError") is InvalidPromptError
    assert error_type_named("os.system").__name__ == "EngineError"
