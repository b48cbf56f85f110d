"""Tool calling over HTTP with the official openai client: required, named, none and auto, whole
and streamed, and a round trip (a call, its result sent back as a tool message, a final answer).

The server runs a tiny random Llama with the embedded SmolLM2's tokenizer and ChatML template
(which knows no tools, so the server's Hermes ChatML template renders them). A random model
calls no tool by itself, so each test makes the output certain: "required" and named choices
are constrained by the server itself; `auto` is tested end to end by constraining the output
with a regex to a given text (a Hermes block, plain text, a malformed block), which the
server's hermes parser must then read as a model's text would be read.
"""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from transformers import AutoTokenizer

from openai_server_helpers import ThreadServer

pytestmark = pytest.mark.slow

ENGINE_ARGS = dict(dtype="float32", max_model_len=1024, num_gpu_blocks_override=256, num_threads=1, stat_loggers=[])
WEATHER_PARAMS = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]},
                   "unit": {"type": "string", "enum": ["C", "F"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME_PARAMS = {"type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
               "required": ["zone"], "additionalProperties": False}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                      "parameters": WEATHER_PARAMS}},
    {"type": "function", "function": {"name": "get_time", "description": "The time in a zone.",
                                      "parameters": TIME_PARAMS}},
]
SCHEMAS = {"get_weather": WEATHER_PARAMS, "get_time": TIME_PARAMS}
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]
HERMES_BLOCK = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "C"}}\n</tool_call>'


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    from lm_console.engine.entrypoints.openai.settings import ServerSettings

    settings = ServerSettings(served_model_names=("tiny",), enable_auto_tool_choice=True, tool_call_parser="hermes")
    srv = ThreadServer(str(tiny_llama_dir), settings, **ENGINE_ARGS)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir):
    return AutoTokenizer.from_pretrained(tiny_llama_dir)


def regex_for(text: str) -> str:
    """A regex that matches exactly `text` (the output is forced to it)."""
    return "".join("\\" + c if c in r"\.^$*+?{}[]|()" else ("\\n" if c == "\n" else c) for c in text)


def check_calls(calls: list[tuple[str, str]]) -> None:
    """Each call names a tool and its arguments are JSON valid under that tool's schema."""
    assert calls
    for name, arguments in calls:
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def collect_stream(stream) -> tuple[str, list[tuple[str, str]], list[str], str | None]:  # noqa: ANN001
    """(content, [(name, arguments)], ids, finish_reason) from a streamed chat completion,
    checking vLLM's delta order: a call's first delta has its index, id, type and name."""
    content, calls, ids, finish = "", {}, {}, None
    for chunk in stream:
        for choice in chunk.choices:
            delta = choice.delta
            content += delta.content or ""
            for call in delta.tool_calls or []:
                if call.index not in calls:
                    assert call.id and call.id.startswith("call_") and call.type == "function"
                    assert call.function.name
                    calls[call.index] = [call.function.name, call.function.arguments or ""]
                    ids[call.index] = call.id
                else:
                    assert call.id is None and call.function.name is None
                    calls[call.index][1] += call.function.arguments or ""
            if choice.finish_reason is not None:
                finish = choice.finish_reason
    assert sorted(calls) == list(range(len(calls)))
    return content, [tuple(calls[i]) for i in sorted(calls)], [ids[i] for i in sorted(ids)], finish


def test_required_round_trip(client, tokenizer) -> None:
    first = client.chat.completions.create(model="tiny", messages=QUESTION, tools=TOOLS, tool_choice="required",
                                           max_tokens=400, temperature=1.0, seed=2)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    calls = choice.message.tool_calls
    check_calls([(c.function.name, c.function.arguments) for c in calls])
    assert all(c.id.startswith("call_") and c.type == "function" for c in calls)
    # The assistant's message goes back as the SDK returned it, then one tool message per call.
    history = [*QUESTION, choice.message]
    history += [{"role": "tool", "tool_call_id": c.id, "content": f"result {i}: sunny, 21 C"} for i, c in enumerate(calls)]
    final = client.chat.completions.create(model="tiny", messages=history, tools=TOOLS, tool_choice="none",
                                           max_tokens=8, temperature=0.0, extra_body={"return_token_ids": True})
    answer = final.choices[0]
    assert isinstance(answer.message.content, str) and answer.message.content
    assert not answer.message.tool_calls and answer.finish_reason in ("stop", "length")
    prompt = tokenizer.decode(final.prompt_token_ids)
    first_call = calls[0].function
    assert (f'<tool_call>\n{{"name": "{first_call.name}", "arguments": '
            f'{json.dumps(json.loads(first_call.arguments))}}}\n</tool_call>') in prompt
    assert "<tool_response>\nresult 0: sunny, 21 C\n</tool_response>" in prompt
    assert "# Tools" in prompt and '"name": "get_time"' in prompt  # tool_choice none still shows the tools


def test_required_streamed_equals_whole(client) -> None:
    kwargs = dict(model="tiny", messages=QUESTION, tools=TOOLS, tool_choice="required", max_tokens=400,
                  temperature=1.0, seed=3)  # a seed whose array ends within max_tokens
    whole = client.chat.completions.create(**kwargs).choices[0]
    content, calls, ids, finish = collect_stream(client.chat.completions.create(stream=True, **kwargs))
    assert content == "" and finish == "tool_calls" == whole.finish_reason
    check_calls(calls)
    assert [(n, json.loads(a)) for n, a in calls] == [
        (c.function.name, json.loads(c.function.arguments)) for c in whole.message.tool_calls]
    assert len(set(ids)) == len(ids)


def test_required_single_call_without_parallel(client) -> None:
    for seed in range(3):
        response = client.chat.completions.create(model="tiny", messages=QUESTION, tools=TOOLS, tool_choice="required",
                                                  parallel_tool_calls=False, max_tokens=300, temperature=1.0, seed=seed)
        assert len(response.choices[0].message.tool_calls) == 1


def test_named_function(client) -> None:
    named = {"type": "function", "function": {"name": "get_time"}}
    response = client.chat.completions.create(model="tiny", messages=QUESTION, tools=TOOLS, tool_choice=named,
                                              max_tokens=100, temperature=1.0, seed=2)
    choice = response.choices[0]
    assert choice.finish_reason == "stop"  # vLLM's (and OpenAI's) finish reason for a named choice
    [call] = choice.message.tool_calls
    assert call.function.name == "get_time"
    check_calls([("get_time", call.function.arguments)])
    content, calls, _, finish = collect_stream(client.chat.completions.create(
        model="tiny", messages=QUESTION, tools=TOOLS, tool_choice=named, max_tokens=100, temperature=1.0, seed=2,
        stream=True))
    assert content == "" and finish == "stop"
    assert [(n, json.loads(a)) for n, a in calls] == [("get_time", json.loads(call.function.arguments))]


def test_auto_reads_a_hermes_block(client) -> None:
    forced = {"structured_outputs": {"regex": regex_for("I will check. " + HERMES_BLOCK)}}
    response = client.chat.completions.create(model="tiny", messages=QUESTION, tools=TOOLS, max_tokens=100,
                                              temperature=1.0, seed=0, extra_body=forced)  # tool_choice: auto
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "I will check. "
    [call] = choice.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Oslo", "unit": "C"})
    content, calls, _, finish = collect_stream(client.chat.completions.create(
        model="tiny", messages=QUESTION, tools=TOOLS, tool_choice="auto", max_tokens=100, temperature=1.0, seed=0,
        extra_body=forced, stream=True))
    assert (content, finish) == ("I will check. ", "tool_calls")
    assert [(n, json.loads(a)) for n, a in calls] == [("get_weather", {"city": "Oslo", "unit": "C"})]


@pytest.mark.parametrize("text", ["Hello there, no tools needed.", '<tool_call>{"name": 3}</tool_call> odd'])
def test_auto_plain_or_malformed_text_stays_content(client, text: str) -> None:
    forced = {"structured_outputs": {"regex": regex_for(text)}}
    response = client.chat.completions.create(model="tiny", messages=QUESTION, tools=TOOLS, tool_choice="auto",
                                              max_tokens=100, temperature=1.0, extra_body=forced)
    choice = response.choices[0]
    assert (choice.message.content, choice.message.tool_calls, choice.finish_reason) == (text, [], "stop")
    content, calls, _, finish = collect_stream(client.chat.completions.create(
        model="tiny", messages=QUESTION, tools=TOOLS, tool_choice="auto", max_tokens=100, temperature=1.0,
        extra_body=forced, stream=True))
    assert (content, calls, finish) == (text, [], "stop")


def test_none_is_plain_content(client) -> None:
    forced = {"structured_outputs": {"regex": regex_for(HERMES_BLOCK)}}
    response = client.chat.completions.create(model="tiny", messages=QUESTION, tools=TOOLS, tool_choice="none",
                                              max_tokens=100, temperature=1.0, extra_body=forced)
    choice = response.choices[0]  # none: even a block stays text
    assert (choice.message.content, choice.message.tool_calls, choice.finish_reason) == (HERMES_BLOCK, [], "stop")


@pytest.mark.parametrize("body, param, message", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "Tool 'nope' has not been passed in `tools`"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}],
      "tool_choice": "required"}, "tools", "must be a JSON schema of type 'object'"),
    ({"tool_choice": "required"}, "tool_choice", "When using `tool_choice`, `tools` must be set."),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice",
     "constrains the output itself"),
    ({"tools": [TOOLS[0], TOOLS[0]]}, "tools", "is used twice"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", ""),
    ({"functions": [{"name": "f"}]}, "functions", "deprecated"),
])
def test_tool_errors(client, body: dict, param: str, message: str) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="tiny", messages=QUESTION, max_tokens=4, extra_body=body)
    error = caught.value.body
    assert caught.value.status_code == 400 and message in error["message"]
    assert param in (error.get("param") or "") + error["message"]


def test_round_trip_streamed(client, tokenizer) -> None:
    """The round trip with both turns streamed: the calls are rebuilt from their deltas."""
    content, calls, ids, finish = collect_stream(client.chat.completions.create(
        model="tiny", messages=QUESTION, tools=TOOLS, tool_choice="required", max_tokens=400, temperature=1.0,
        seed=3, stream=True))
    assert finish == "tool_calls" and content == ""
    check_calls(calls)
    history = [*QUESTION, {"role": "assistant", "content": None, "tool_calls": [
        {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
        for call_id, (name, arguments) in zip(ids, calls)]}]
    history += [{"role": "tool", "tool_call_id": call_id, "content": "cloudy"} for call_id in ids]
    answer, more_calls, _, finish = collect_stream(client.chat.completions.create(
        model="tiny", messages=history, tools=TOOLS, tool_choice="none", max_tokens=8, temperature=0.0, stream=True,
        extra_body={"return_token_ids": True}))
    assert answer and more_calls == [] and finish in ("stop", "length")
    rendered = client.post("/../tokenize", body={"model": "tiny", "messages": history, "tools": TOOLS}, cast_to=object)
    prompt = tokenizer.decode(rendered["tokens"])  # /tokenize renders the same template, tools included
    assert prompt.count("<tool_response>\ncloudy\n</tool_response>") == len(ids) and "# Tools" in prompt


def test_required_cut_by_max_tokens(client) -> None:
    response = client.chat.completions.create(model="tiny", messages=QUESTION, tools=TOOLS, tool_choice="required",
                                              max_tokens=5, temperature=1.0, seed=2)
    choice = response.choices[0]
    assert (choice.finish_reason, choice.message.tool_calls) == ("length", [])
    assert choice.message.content.startswith('[{"name')  # the constrained text, unparsed
