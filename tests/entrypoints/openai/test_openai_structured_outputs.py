"""Structured outputs over HTTP with the official openai client: response_format (json_object,
json_schema), vLLM's structured_outputs and guided_* fields, and per-request errors.

The server runs a tiny random Llama (engine core in its own process, so the constraint crosses
the msgspec boundary); only the grammar keeps its output valid.
"""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import openai
import pytest

from openai_server_helpers import ThreadServer

pytestmark = pytest.mark.slow

ENGINE_ARGS = dict(dtype="float32", max_model_len=512, num_gpu_blocks_override=256, num_threads=1, stat_loggers=[])
SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 6},
        "population": {"type": "integer", "minimum": 0, "maximum": 5000},
        "tags": {"type": "array", "items": {"enum": ["old", "new", "big"]}, "maxItems": 2},
    },
    "required": ["city", "population", "tags"],
    "additionalProperties": False,
}
MESSAGES = [{"role": "user", "content": "Describe a city as JSON."}]


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    from lm_console.engine.entrypoints.openai.settings import ServerSettings

    srv = ThreadServer(str(tiny_llama_dir), ServerSettings(served_model_names=("tiny",)), **ENGINE_ARGS)
    yield srv
    srv.stop()


def test_chat_response_format_json_schema_and_json_object(client) -> None:
    response = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=200, temperature=1.0, seed=3,
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA, "strict": True}},
        extra_body={"structured_outputs": {"disable_any_whitespace": True}})  # vLLM's way to add options
    jsonschema.validate(json.loads(response.choices[0].message.content), SCHEMA)
    assert response.choices[0].finish_reason == "stop"
    # json_object: any object; the random model may stay in a string, so only its start is certain.
    response = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=16, temperature=0.0,
                                              response_format={"type": "json_object"})
    assert response.choices[0].message.content.lstrip().startswith("{")
    text = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4, temperature=0.0,
                                          response_format={"type": "text"}).choices[0].message.content
    assert isinstance(text, str)


def test_completions_structured_outputs_and_guided_fields(client) -> None:
    bodies = [
        ({"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}}, "json"),
        ({"structured_outputs": {"regex": r"[a-z]{3}-\d{2}"}}, r"[a-z]{3}-\d{2}"),
        ({"structured_outputs": {"choice": ["alpha", "beta"]}}, "alpha|beta"),
        ({"guided_regex": r"\d{4}"}, r"\d{4}"),
        ({"guided_choice": ["left", "right"]}, "left|right"),
        ({"guided_json": {"enum": ["up", "down"]}}, '"up"|"down"'),  # no room for whitespace
        ({"guided_grammar": 'root ::= "ab" | "cd"'}, "ab|cd"),
    ]
    for body, expected in bodies:
        response = client.completions.create(model="tiny", prompt="Answer:", max_tokens=200, temperature=1.0,
                                             seed=1, extra_body=body)
        text = response.choices[0].text
        if expected == "json":
            jsonschema.validate(json.loads(text), SCHEMA)
        else:
            assert re.fullmatch(expected, text), (body, text)
    # Streaming: the deltas join into a valid document.
    stream = client.completions.create(model="tiny", prompt="Stream:", max_tokens=200, temperature=0.0, stream=True,
                                       extra_body={"structured_outputs": {"json": SCHEMA,
                                                                          "disable_any_whitespace": True}})
    jsonschema.validate(json.loads("".join(chunk.choices[0].text for chunk in stream if chunk.choices)), SCHEMA)


@pytest.mark.parametrize("body, words", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, ["json_schema.schema"]),
    ({"response_format": {"type": "yaml"}}, ["response_format", "not supported"]),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, ["exactly one"]),
    ({"structured_outputs": {"regexp": "a"}}, ["regexp"]),
    ({"guided_regex": "a", "response_format": {"type": "json_object"}}, ["Only one output constraint"]),
    ({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}}, ["Only one output"]),
    ({"structured_outputs": {"regex": "(unclosed"}}, ["does not compile", "parenthesis"]),
    ({"guided_json": {"type": "objec"}}, ["does not compile"]),
])
def test_bad_constraints_are_400_and_others_are_served(server, client, body, words) -> None:
    def bad() -> openai.BadRequestError:
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(model="tiny", prompt="Bad:", max_tokens=8, extra_body=body)
        return info.value

    def good() -> str:
        return client.completions.create(model="tiny", prompt="Good:", max_tokens=20, temperature=0.0,
                                         extra_body={"guided_choice": ["ok", "fine"]}).choices[0].text

    with ThreadPoolExecutor(2) as pool:  # a bad request next to a good one: only the bad one fails
        bad_future, good_future = pool.submit(bad), pool.submit(good)
        error, text = bad_future.result(), good_future.result()
    assert all(word in error.message for word in words), error.message
    assert text in ("ok", "fine")
    with httpx.Client(base_url=server.url) as http:
        assert http.get("/health").status_code == 200
