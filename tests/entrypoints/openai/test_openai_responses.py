"""The Responses API (/v1/responses) over HTTP with the official openai client: plain input,
instructions, a message list, typed input items, max_output_tokens, streaming events, refusals.

Greedy output of the tiny random Llama is compared with /v1/chat/completions on the same
conversation: the two routes must build the same prompt and produce the same text (negative
control: a different conversation gives another prompt). Also here: this server runs without
--enable-auto-tool-choice, so a chat request with tools and no tool_choice is refused.
"""

from __future__ import annotations

import openai
import pytest

from openai_server_helpers import ThreadServer

pytestmark = pytest.mark.slow

ENGINE_ARGS = dict(dtype="float32", max_model_len=512, num_gpu_blocks_override=256, num_threads=1, stat_loggers=[])


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    from lm_console.engine.entrypoints.openai.settings import ServerSettings

    srv = ThreadServer(str(tiny_llama_dir), ServerSettings(served_model_names=("tiny",)), **ENGINE_ARGS)
    yield srv
    srv.stop()


def chat(client, messages: list[dict], max_tokens: int = 12):  # noqa: ANN001, ANN201
    return client.chat.completions.create(model="tiny", messages=messages, max_tokens=max_tokens, temperature=0.0,
                                          extra_body={"return_token_ids": True})


def test_plain_input_matches_chat(client) -> None:
    response = client.responses.create(model="tiny", input="Tell me a story.", max_output_tokens=12, temperature=0.0)
    reference = chat(client, [{"role": "user", "content": "Tell me a story."}])
    assert response.id.startswith("resp_") and response.output[0].id.startswith("msg_")
    assert response.object == "response" and response.status == "incomplete"  # 12 tokens cut it
    assert response.incomplete_details.reason == "max_output_tokens"
    [item] = response.output
    assert item.type == "message" and item.role == "assistant" and item.content[0].type == "output_text"
    assert response.output_text == reference.choices[0].message.content
    assert response.usage.input_tokens == reference.usage.prompt_tokens
    assert response.usage.output_tokens == 12 == reference.usage.completion_tokens
    assert response.usage.total_tokens == response.usage.input_tokens + 12
    other = chat(client, [{"role": "user", "content": "Tell me a joke."}])  # negative control
    assert other.prompt_token_ids != reference.prompt_token_ids


def test_instructions_messages_and_typed_items(client) -> None:
    history = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
               {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Name a colour."}]
    reference = chat(client, history).choices[0].message.content
    via_instructions = client.responses.create(model="tiny", instructions="Be brief.", input=[
        {"role": "user", "content": "Hi"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hello!"}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Name a "},
                                                        {"type": "input_text", "text": "colour."}]},
    ], max_output_tokens=12, temperature=0.0)
    assert via_instructions.output_text == reference
    assert via_instructions.instructions == "Be brief."
    as_messages = client.responses.create(model="tiny", input=history, max_output_tokens=12, temperature=0.0)
    assert as_messages.output_text == reference


def test_stream_events(client) -> None:
    whole = client.responses.create(model="tiny", input="Count to five.", max_output_tokens=10, temperature=0.0)
    events = list(client.responses.create(model="tiny", input="Count to five.", max_output_tokens=10,
                                          temperature=0.0, stream=True))
    kinds = [event.type for event in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [event.sequence_number for event in events] == list(range(len(events)))
    text = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    assert text == whole.output_text == events[-4].text
    final = events[-1].response
    assert final.output_text == text and final.usage.output_tokens == 10


def test_finished_status() -> None:
    """A text the model ended itself is completed; one max_output_tokens cut is incomplete."""
    from lm_console.engine.entrypoints.openai.protocol_responses import ResponsesResponse
    from lm_console.engine.entrypoints.openai.serving_responses import _finished

    base = ResponsesResponse(id="resp_x", status="in_progress", model="tiny", output=[])
    done = _finished(base, "msg_x", "hi", "stop", 5, 2, 0)
    assert (done.status, done.incomplete_details, done.output[0].status) == ("completed", None, "completed")
    cut = _finished(base, "msg_x", "hi", "length", 5, 2, 0)
    assert (cut.status, cut.incomplete_details.reason) == ("incomplete", "max_output_tokens")
    assert cut.usage.total_tokens == 7 and base.status == "in_progress"


@pytest.mark.parametrize("body, field", [
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"store": True}, "store"),
    ({"tools": [{"type": "function", "name": "f", "parameters": {}}]}, "tools"),
    ({"reasoning": {"effort": "low"}}, "reasoning"),
    ({"text": {"format": {"type": "json_object"}}}, "text"),
    ({"background": True}, "background"),
    ({"include": ["message.output_text.logprobs"]}, "include"),
])
def test_unsupported_fields_refused(client, body: dict, field: str) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model="tiny", input="x", max_output_tokens=4, extra_body=body)
    assert caught.value.status_code == 400 and field in str(caught.value.body)


def test_unknown_field_ignored_with_a_warning(client, caplog) -> None:
    """A field the Responses API does not define is ignored and logged, as on every route (vLLM's way);
    a field it defines but we cannot honour is refused above."""
    with caplog.at_level("WARNING"):
        response = client.responses.create(model="tiny", input="x", max_output_tokens=4, extra_body={"frobnicate": 1})
    assert response.status in ("completed", "incomplete")
    assert any("frobnicate" in record.getMessage() for record in caplog.records)


def test_bad_input_refused(client) -> None:
    for body in ({"input": ""}, {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
                 {"input": [{"type": "function_call_output", "call_id": "c", "output": "x"}]}):
        with pytest.raises(openai.BadRequestError):
            client.post("/responses", body={"model": "tiny", **body}, cast_to=object)


def test_auto_tool_choice_needs_the_flag(client) -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]
    with pytest.raises(openai.BadRequestError, match="--enable-auto-tool-choice and --tool-call-parser"):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], tools=tools,
                                       max_tokens=4)
    # Without auto, the other choices still work.
    response = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], tools=tools,
                                              tool_choice="required", parallel_tool_calls=False, max_tokens=100,
                                              temperature=0.0)
    assert response.choices[0].message.tool_calls[0].function.name == "f"
