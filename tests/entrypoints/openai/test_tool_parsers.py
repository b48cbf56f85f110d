"""The Hermes tool-call parser and the "required" array's stream parser, on fixed texts.

Whole-text parsing follows vLLM's hermes rules; streaming is checked against it at every split
of the text into chunks (the joined deltas must give the same calls). A malformed block stays
content and never raises. Negative control: a streamer that loses the last chunk must fail
the stream-equals-whole comparison.
"""

from __future__ import annotations

import json

import pytest

from lm_console.engine.entrypoints.openai.tool_parsers import (
    HermesToolParser, IncrementalToolJson, RequiredStreamParser, ToolStreamParser, get_tool_parser,
    parse_required_calls,
)

TWO_CALLS = ('Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris \\"Nord\\"", '
             '"days": [1, {"unit": "C"}]}}\n</tool_call>\n<tool_call>{"arguments": {"q": "}{"}, "name": "search"}'
             '</tool_call>')
MALFORMED = [
    'hi <tool_call>{"name": 3, "arguments": {}}</tool_call> bye',  # name not a string
    'hi <tool_call>{"name": "f", "arguments": [1]}</tool_call>',  # arguments not an object
    'hi <tool_call>not json at all</tool_call>',
    '<tool_call></tool_call>',
    '<tool_call>["f", {}]</tool_call>',
]


def streamed(parser: ToolStreamParser, text: str, step: int) -> tuple[str, dict[int, list[str]]]:
    """(content, {index: [name, arguments]}) joined from feeding text in chunks of `step`."""
    content, calls = "", {}
    pieces = [parser.feed(text[i:i + step]) for i in range(0, len(text), step)] + [parser.finish()]
    for piece in pieces:
        content += piece.content
        for delta in piece.tool_calls:
            call = calls.setdefault(delta.index, ["", ""])
            if delta.name is not None:
                assert call[0] == "" and call[1] == "", "the name comes first, once"
                call[0] = delta.name
            call[1] += delta.arguments
    return content, calls


def whole(text: str) -> tuple[str | None, dict[int, list[str]]]:
    extracted = HermesToolParser().extract_tool_calls(text)
    return extracted.content, {i: [c.name, c.arguments] for i, c in enumerate(extracted.tool_calls)}


def same_calls(a: dict[int, list[str]], b: dict[int, list[str]]) -> bool:
    return a.keys() == b.keys() and all(a[i][0] == b[i][0] and json.loads(a[i][1]) == json.loads(b[i][1]) for i in a)


def test_hermes_whole_text() -> None:
    extracted = HermesToolParser().extract_tool_calls(TWO_CALLS)
    assert extracted.tools_called
    assert extracted.content == "Let me check. "
    assert [c.name for c in extracted.tool_calls] == ["get_weather", "search"]
    assert json.loads(extracted.tool_calls[0].arguments) == {"city": 'Paris "Nord"', "days": [1, {"unit": "C"}]}
    assert json.loads(extracted.tool_calls[1].arguments) == {"q": "}{"}
    assert all(c.id.startswith("call_") and len(c.id) == 29 for c in extracted.tool_calls)
    assert extracted.tool_calls[0].id != extracted.tool_calls[1].id
    # No block: plain content; only blocks: no content; an unclosed last block still parses (vLLM).
    assert HermesToolParser().extract_tool_calls("just text").tool_calls == []
    assert HermesToolParser().extract_tool_calls('<tool_call>{"name": "f", "arguments": {}}</tool_call>').content is None
    unclosed = HermesToolParser().extract_tool_calls('<tool_call>{"name": "f", "arguments": {"a": 1}}')
    assert [(c.name, json.loads(c.arguments)) for c in unclosed.tool_calls] == [("f", {"a": 1})]


@pytest.mark.parametrize("text", MALFORMED)
def test_hermes_malformed_stays_content(text: str) -> None:
    extracted = HermesToolParser().extract_tool_calls(text)
    assert not extracted.tools_called and extracted.tool_calls == [] and extracted.content == text
    for step in (1, 3, len(text)):
        parser = HermesToolParser().streamer()
        content, calls = streamed(parser, text, step)
        assert calls == {} and content == text and not parser.tools_called


@pytest.mark.parametrize("step", [1, 2, 3, 5, 11, 1000])
def test_hermes_stream_equals_whole(step: int) -> None:
    content, calls = streamed(HermesToolParser().streamer(), TWO_CALLS, step)
    want_content, want_calls = whole(TWO_CALLS)
    assert content == want_content and same_calls(calls, want_calls), (step, content, calls)
    plain = "No tools needed <tool_ but a partial tag and < signs."
    assert streamed(HermesToolParser().streamer(), plain, step) == (plain, {})


def test_hermes_cut_arguments() -> None:
    """A block cut inside its arguments: the whole text is content (vLLM's rule); a stream has
    announced the call by then (its arguments had begun as an object) and cannot take it back."""
    text = 'hi <tool_call>{"name": "f", "arguments": {"a": </tool_call>'
    assert HermesToolParser().extract_tool_calls(text).content == text
    content, calls = streamed(HermesToolParser().streamer(), text, 2)
    assert content == "hi " and calls == {0: ["f", '{"a": ']}


def test_hermes_stream_negative_control() -> None:
    """A streamer that drops the final flush (the held-back end) must fail the comparison."""

    class Lossy(ToolStreamParser):
        def __init__(self) -> None:
            self.inner = HermesToolParser().streamer()

        def feed(self, text: str):  # noqa: ANN201
            return self.inner.feed(text)

        def finish(self):  # noqa: ANN201
            self.inner.finish()
            return type(self.inner.finish())()

    text = "Answer: 2 < 3 <tool_"  # the end could begin a tag: held back until finish()
    assert streamed(HermesToolParser().streamer(), text, 4) == (text, {})
    content, calls = streamed(Lossy(), text, 4)
    assert calls == {} and content != whole(text)[0]


def test_required_array() -> None:
    text = '[{"name": "a", "parameters": {"x": "]}"}}, {"name": "b", "parameters": {}}]'
    calls = parse_required_calls(text)
    assert calls is not None and [(c.name, json.loads(c.arguments)) for c in calls] == [("a", {"x": "]}"}), ("b", {})]
    for step in (1, 2, 7, 100):
        content, streamed_calls = streamed(RequiredStreamParser(), text, step)
        assert content == "" and streamed_calls == {0: ["a", '{"x": "]}"}'], 1: ["b", "{}"]}
    for bad in ('[]', '[{"name": "a"', '{"name": "a", "parameters": {}}', '[{"name": 1, "parameters": {}}]'):
        assert parse_required_calls(bad) is None


def test_incremental_json_holds_arguments_until_the_name() -> None:
    scanner = IncrementalToolJson("arguments", array=False)
    deltas = scanner.feed('{"arguments": {"k": 1}, ')
    assert deltas == []  # no name yet: nothing to announce
    deltas = scanner.feed('"name": "f"}')
    assert [(d.index, d.name, d.arguments) for d in deltas] == [(0, "f", ""), (0, None, '{"k": 1}')]
    assert scanner.closed and not scanner.bad


def test_get_tool_parser() -> None:
    assert isinstance(get_tool_parser("hermes"), HermesToolParser)
    with pytest.raises(ValueError, match="unknown tool call parser 'llama3_json'; known: hermes"):
        get_tool_parser("llama3_json")
