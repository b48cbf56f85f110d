"""Tool-call parsers: a model's text -> OpenAI tool calls, whole or as it streams.

`--tool-call-parser hermes` reads the Hermes format the shipped ChatML templates (SmolLM2, Qwen)
describe: each call is a `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` block.
vLLM's rule for a whole text: the calls are every block; the content is the text before the
first block; a block that is not a JSON object with a string "name" and an object "arguments"
makes the whole text plain content (never an error).

IncrementalToolJson follows a JSON document as its characters arrive (the body of one Hermes
block, or the array that `tool_choice="required"` constrains the model to) and reports each
call's name once it is complete and then its arguments' characters, so a stream sends them as
the model writes them.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any


def tool_call_id() -> str:
    """An OpenAI-style tool call id (call_ + 24 hex digits)."""
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ParsedToolCall:
    """One call: the function's name and its arguments as JSON text."""

    name: str
    arguments: str
    id: str = field(default_factory=tool_call_id)


@dataclass
class ExtractedToolCalls:
    """A whole text, parsed: tools_called is False when the text is plain content."""

    tools_called: bool
    tool_calls: list[ParsedToolCall]
    content: str | None


@dataclass
class ToolCallDelta:
    """One streamed piece of call `index`: its name (first, once) or a run of argument characters."""

    index: int
    name: str | None = None
    arguments: str = ""


class IncrementalToolJson:
    """Follows the JSON of tool calls character by character.

    array=True: `[{"name": ..., <args_key>: {...}}, ...]` (tool_choice="required");
    array=False: one such object (a Hermes block's body). Argument characters that arrive before
    their call's name are held until the name is known.
    """

    def __init__(self, args_key: str, array: bool) -> None:
        self.args_key = args_key
        self.level = 2 if array else 1  # the depth at which the call objects' keys live
        self.depth = 0
        self.in_string = False
        self.escape = False
        self.index = -1
        self.key: str | None = None
        self.expect_key = False
        self.expect_value = False
        self.key_buf: str | None = None
        self.name_buf: str | None = None
        self.in_args = False
        self.names: dict[int, str] = {}
        self.announced: set[int] = set()  # calls whose name was sent
        self.args_started: set[int] = set()
        self.pending_args: dict[int, str] = {}
        self.started = False
        self.closed = False  # the outermost value closed
        self.bad = False  # something that is not a call object (arguments not an object, ...)

    def feed(self, text: str) -> list[ToolCallDelta]:
        """The deltas the characters of `text` complete, in order (consecutive arguments merged)."""
        out: list[ToolCallDelta] = []
        for char in text:
            self._char(char, out)
        merged: list[ToolCallDelta] = []
        for delta in out:
            if merged and delta.name is None and merged[-1].index == delta.index and merged[-1].name is None:
                merged[-1].arguments += delta.arguments
            else:
                merged.append(delta)
        return merged

    def _args(self, text: str, out: list[ToolCallDelta]) -> None:
        if self.index in self.announced:
            out.append(ToolCallDelta(self.index, arguments=text))
        else:
            self.pending_args[self.index] = self.pending_args.get(self.index, "") + text

    def _announce(self, out: list[ToolCallDelta], empty_arguments: bool = False) -> None:
        """Send call `index`'s name (and the arguments held for it) once both are known to be
        well-formed: its name a string, its arguments begun as an object (or absent: {})."""
        self.announced.add(self.index)
        out.append(ToolCallDelta(self.index, name=self.names[self.index]))
        held = self.pending_args.pop(self.index, "") or ("{}" if empty_arguments else "")
        if held:
            out.append(ToolCallDelta(self.index, arguments=held))

    def _char(self, char: str, out: list[ToolCallDelta]) -> None:
        if self.closed:
            if not char.isspace():
                self.bad = True
            return
        if self.in_string:
            ended = False
            if self.escape:
                self.escape = False
            elif char == "\\":
                self.escape = True
            elif char == '"':
                self.in_string = False
                ended = True
            if self.key_buf is not None:
                self.key_buf += char
                if ended:
                    self.key = _loads(self.key_buf)
                    self.key_buf = None
            elif self.name_buf is not None:
                self.name_buf += char
                if ended:
                    name = _loads(self.name_buf)
                    self.name_buf = None
                    if not isinstance(name, str) or self.index in self.names:
                        self.bad = True
                        return
                    self.names[self.index] = name
                    if self.index in self.args_started:
                        self._announce(out)
            elif self.in_args:
                self._args(char, out)
            return
        if self.in_args:
            if char.isspace() and self.depth == self.level:
                return  # whitespace between the key's colon and the arguments' brace
            self._args(char, out)
            if char == '"':
                self.in_string = True
            elif char in "{[":
                self.depth += 1
            elif char in "}]":
                self.depth -= 1
                if self.depth == self.level:
                    self.in_args = False
            return
        if char.isspace():
            return
        self.started = True
        at_level = self.depth == self.level
        if char == '"':
            self.in_string = True
            if at_level and self.expect_key:
                self.key_buf = '"'
                self.expect_key = False
            elif at_level and self.expect_value:
                self.expect_value = False
                if self.key == "name":
                    self.name_buf = '"'
            return
        if at_level and self.expect_value:
            self.expect_value = False
            if self.key == self.args_key:
                if char != "{":
                    self.bad = True
                    return
                self.in_args = True
                self.args_started.add(self.index)
                if self.index in self.names:
                    self._announce(out)
                self._args(char, out)
                self.depth += 1
                return
        if char in "{[":
            self.depth += 1
            if self.depth == self.level:
                if char != "{":
                    self.bad = True
                self.index += 1
                self.key = None
                self.expect_key = True
            elif self.depth == 1 and self.level == 2 and char != "[":
                self.bad = True
        elif char in "}]":
            if at_level and char == "}" and self.index not in self.announced:
                if self.index in self.names and self.index not in self.args_started:
                    self._announce(out, empty_arguments=True)  # {"name": ...} alone: no arguments
                else:
                    self.bad = True
            self.depth -= 1
            if self.depth == 0:
                self.closed = True
        elif at_level and char == ":":
            self.expect_value = True
        elif at_level and char == ",":
            self.expect_key = True


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


def _call_from_object(value: Any, args_key: str) -> ParsedToolCall | None:
    """A call from a decoded {"name": str, args_key: object}, or None when it is not one."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get(args_key, {})
    if not isinstance(arguments, dict):
        return None
    return ParsedToolCall(value["name"], json.dumps(arguments, ensure_ascii=False))


def parse_required_calls(text: str) -> list[ParsedToolCall] | None:
    """The calls of a tool_choice="required" output (a JSON array of {"name", "parameters"});
    None when the text is not one (e.g. cut by max_tokens)."""
    value = _loads(text)
    if not isinstance(value, list) or not value:
        return None
    calls = [_call_from_object(item, "parameters") for item in value]
    return None if any(call is None for call in calls) else calls  # type: ignore[return-value]


class ToolParser:
    """Base of the parsers `--tool-call-parser` selects: a whole text, or a stream of deltas."""

    name = ""

    def extract_tool_calls(self, text: str) -> ExtractedToolCalls:  # pragma: no cover - abstract
        raise NotImplementedError

    def streamer(self) -> ToolStreamParser:  # pragma: no cover - abstract
        raise NotImplementedError


@dataclass
class StreamPiece:
    """What one chunk of model text becomes: content and/or tool-call deltas."""

    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)


class ToolStreamParser:
    """Per-choice streaming state (feed each text delta, then finish())."""

    def feed(self, text: str) -> StreamPiece:  # pragma: no cover - abstract
        raise NotImplementedError

    def finish(self) -> StreamPiece:  # pragma: no cover - abstract
        raise NotImplementedError

    @property
    def tools_called(self) -> bool:  # pragma: no cover - abstract
        raise NotImplementedError


class HermesToolParser(ToolParser):
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks (Hermes, Qwen, SmolLM2)."""

    name = "hermes"
    START = "<tool_call>"
    END = "</tool_call>"
    _BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)\Z", re.DOTALL)

    def extract_tool_calls(self, text: str) -> ExtractedToolCalls:
        if self.START not in text:
            return ExtractedToolCalls(False, [], text)
        calls = []
        for match in self._BLOCK.finditer(text):
            body = match.group(1) if match.group(1) is not None else match.group(2)
            call = _call_from_object(_loads(body.strip()), "arguments")
            if call is None:  # vLLM's rule: one bad block and the whole text is content
                return ExtractedToolCalls(False, [], text)
            calls.append(call)
        content = text[:text.index(self.START)]
        return ExtractedToolCalls(True, calls, content if content.strip() else None)

    def streamer(self) -> HermesStreamParser:
        return HermesStreamParser()


def _partial_suffix(text: str, tag: str) -> int:
    """How many characters at the end of text could begin `tag` (held back until they are known)."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0


class HermesStreamParser(ToolStreamParser):
    """Hermes blocks as they stream: content outside them, each call's name then its arguments.

    A call is announced (its name sent) once its arguments have begun as an object, so a block
    that is not a call (a name that is no string, arguments that are no object, not JSON) is sent
    as content, as a whole text with it would be. A call already announced stays a call (a block
    cut inside its arguments, as vLLM's stream does too). Text after the first call is not content.
    """

    def __init__(self) -> None:
        self.buffer = ""  # text not yet sent (a possible tag's beginning, or a block's body)
        self.in_block = False
        self.block = ""
        self.json: IncrementalToolJson | None = None
        self.base = 0  # calls of earlier blocks
        self.emitted_in_block = False
        self._called = False

    @property
    def tools_called(self) -> bool:
        return self._called

    def feed(self, text: str) -> StreamPiece:
        piece = StreamPiece()
        self.buffer += text
        while self.buffer:
            if not self.in_block:
                start = self.buffer.find(HermesToolParser.START)
                if start < 0:
                    keep = _partial_suffix(self.buffer, HermesToolParser.START)
                    self._content(piece, self.buffer[:len(self.buffer) - keep])
                    self.buffer = self.buffer[len(self.buffer) - keep:]
                    break
                self._content(piece, self.buffer[:start])
                self.buffer = self.buffer[start + len(HermesToolParser.START):]
                self.in_block, self.block, self.emitted_in_block = True, "", False
                self.json = IncrementalToolJson("arguments", array=False)
                continue
            end = self.buffer.find(HermesToolParser.END)
            body = self.buffer if end < 0 else self.buffer[:end]
            if end < 0:
                keep = _partial_suffix(body, HermesToolParser.END)
                body = body[:len(body) - keep]
            self._block_text(body, piece)
            if end < 0:
                self.buffer = self.buffer[len(body):]
                break
            self.buffer = self.buffer[end + len(HermesToolParser.END):]
            self._close_block(piece, HermesToolParser.END)
        return piece

    def _content(self, piece: StreamPiece, text: str) -> None:
        if not self._called:  # as in a whole text: what follows the first call is not content
            piece.content += text

    def _block_text(self, body: str, piece: StreamPiece) -> None:
        assert self.json is not None
        self.block += body
        for delta in self.json.feed(body):
            delta.index += self.base
            piece.tool_calls.append(delta)
            self.emitted_in_block = True
            self._called = True

    def _close_block(self, piece: StreamPiece, end_tag: str) -> None:
        assert self.json is not None
        if not self.emitted_in_block:
            self._content(piece, HermesToolParser.START + self.block + end_tag)
        else:
            self.base += self.json.index + 1
        self.in_block, self.json = False, None

    def finish(self) -> StreamPiece:
        piece = StreamPiece()
        if self.in_block:
            self._block_text(self.buffer, piece)
            self.buffer = ""
            self._close_block(piece, "")
        else:
            self._content(piece, self.buffer)
            self.buffer = ""
        return piece


class RequiredStreamParser(ToolStreamParser):
    """tool_choice="required": the constrained array's calls as they stream (no content)."""

    def __init__(self) -> None:
        self.json = IncrementalToolJson("parameters", array=True)

    @property
    def tools_called(self) -> bool:
        return bool(self.json.names)

    def feed(self, text: str) -> StreamPiece:
        return StreamPiece(tool_calls=self.json.feed(text))

    def finish(self) -> StreamPiece:
        return StreamPiece()


TOOL_PARSERS: dict[str, type[ToolParser]] = {HermesToolParser.name: HermesToolParser}


def get_tool_parser(name: str) -> ToolParser:
    """The parser `--tool-call-parser NAME` selects (ValueError naming the known ones)."""
    try:
        return TOOL_PARSERS[name]()
    except KeyError:
        raise ValueError(f"unknown tool call parser {name!r}; known: {', '.join(sorted(TOOL_PARSERS))}.") from None
