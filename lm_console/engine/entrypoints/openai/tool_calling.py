"""Tool calling for /v1/chat/completions: what `tools` and `tool_choice` make of a request.

As vLLM does: `tool_choice` defaults to "auto" when `tools` are given and to "none" otherwise.
- "none": the tools still reach the chat template; the output is plain content.
- "auto": the model decides; the server's --tool-call-parser reads its calls out of the text
  (400 unless the server runs with --enable-auto-tool-choice and a parser).
- "required": the output is constrained (structured outputs) to a JSON array of one or more
  {"name": <one of the tools>, "parameters": <that tool's parameter schema>} objects, vLLM's
  format, so it parses deterministically; finish_reason "tool_calls".
- a named function: the output is constrained to that function's parameter schema and becomes
  its arguments; finish_reason stays the engine's ("stop"), as in vLLM and OpenAI.
parallel_tool_calls=false allows one call ("required": the array holds at most one; "auto":
calls after the first are dropped).
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from lm_console.engine.entrypoints.openai.errors import bad_request
from lm_console.engine.entrypoints.openai.tool_parsers import (
    ParsedToolCall, RequiredStreamParser, ToolParser, ToolStreamParser, parse_required_calls,
)
from lm_console.engine.sampling_params import StructuredOutputsParams

if TYPE_CHECKING:
    from lm_console.engine.entrypoints.openai.protocol_chat import ChatCompletionRequest

ToolMode = Literal["none", "auto", "required", "named"]
EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


@dataclass
class ToolPlan:
    """How one request uses its tools."""

    mode: ToolMode
    tools: list[dict[str, Any]] | None  # as the chat template takes them (None: no tools)
    named: str | None = None
    parallel: bool = True
    parser: ToolParser | None = None
    constraint: StructuredOutputsParams | None = None

    def streamer(self) -> ToolStreamParser | None:
        """A fresh per-choice stream parser (None: the text streams as plain content)."""
        if self.mode == "required":
            return RequiredStreamParser()
        if self.mode == "auto" and self.parser is not None:
            return self.parser.streamer()
        return None

    def parse(self, text: str) -> tuple[str | None, list[ParsedToolCall]]:
        """(content, calls) of a finished choice's text."""
        if self.mode == "named":
            assert self.named is not None
            return None, [ParsedToolCall(self.named, text)]
        if self.mode == "required":
            calls = parse_required_calls(text)
            if calls is None:  # cut short (max_tokens): nothing parses, the text is returned as is
                return text, []
            return None, calls[:1] if not self.parallel else calls
        if self.mode == "auto" and self.parser is not None:
            extracted = self.parser.extract_tool_calls(text)
            if extracted.tools_called:
                calls = extracted.tool_calls if self.parallel else extracted.tool_calls[:1]
                return extracted.content, calls
        return text, []

    def finish_reason(self, engine_reason: str | None, called: bool) -> str | None:
        """vLLM's rule: "tool_calls" when auto called a tool or required finished its array."""
        if engine_reason is not None and called and (
                self.mode == "auto" or (self.mode == "required" and engine_reason == "stop")):
            return "tool_calls"
        return engine_reason


def plan_tools(request: ChatCompletionRequest, enable_auto_tool_choice: bool, parser: ToolParser | None,
               other_constraint: bool, max_constraint_bytes: int) -> ToolPlan:
    """The request's ToolPlan; 400 for a tool_choice that cannot apply, a malformed tool, or a
    constraint over max_constraint_bytes (--max-structured-output-bytes). Serialises the tools'
    schemas: run it in the serving pool."""
    plan = _plan(request, enable_auto_tool_choice, parser, other_constraint)
    if plan.constraint is not None:
        size = len(json.dumps(plan.constraint.json, ensure_ascii=False).encode("utf-8", "surrogatepass"))
        if size > max_constraint_bytes:
            raise bad_request(f"the tools' parameter schemas make a {size}-byte output constraint; at most "
                              f"{max_constraint_bytes} bytes are allowed (--max-structured-output-bytes).", "tools",
                              "constraint_too_large")
    return plan


def _plan(request: ChatCompletionRequest, enable_auto_tool_choice: bool, parser: ToolParser | None,
          other_constraint: bool) -> ToolPlan:
    tools = request.tools
    choice = request.tool_choice
    if choice is None:
        choice = "auto" if tools else "none"
    if not tools:
        if choice != "none":
            raise bad_request("When using `tool_choice`, `tools` must be set.", "tool_choice")
        return ToolPlan("none", None)
    names: list[str] = []
    for position, tool in enumerate(tools):
        parameters = tool.function.parameters
        if parameters is not None and (not isinstance(parameters, dict) or parameters.get("type", "object") != "object"):
            raise bad_request(f"tools[{position}] ({tool.function.name!r}): `parameters` must be a JSON schema of "
                              f"type 'object' (the call's arguments are an object); got {parameters!r:.100}.", "tools")
        if tool.function.name in names:
            raise bad_request(f"tools[{position}]: the function name {tool.function.name!r} is used twice.", "tools")
        names.append(tool.function.name)
    template_tools = [tool.model_dump(exclude_none=True) for tool in tools]
    parallel = request.parallel_tool_calls is not False
    if isinstance(choice, str):
        if choice == "none":
            return ToolPlan("none", template_tools, parallel=parallel)
        if choice == "auto":
            if not enable_auto_tool_choice or parser is None:
                raise bad_request('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to '
                                  'be set (or send tool_choice "required", "none" or a named function).',
                                  "tool_choice")
            return ToolPlan("auto", template_tools, parallel=parallel, parser=parser)
        if choice != "required":
            raise bad_request(f"tool_choice={choice!r} is not one of 'none', 'auto', 'required' or "
                              "{'type': 'function', 'function': {'name': ...}}.", "tool_choice")
        if other_constraint:
            raise bad_request("tool_choice 'required' constrains the output itself; drop response_format / "
                              "structured_outputs / guided_*.", "tool_choice")
        schema = required_schema(tools, parallel)
        return ToolPlan("required", template_tools, parallel=parallel,
                        constraint=StructuredOutputsParams(json=schema, disable_any_whitespace=True))
    name = choice.function.name
    if name not in names:
        raise bad_request(f"Tool {name!r} has not been passed in `tools` (known: {', '.join(names)}).", "tool_choice")
    if other_constraint:
        raise bad_request("a named tool_choice constrains the output itself; drop response_format / "
                          "structured_outputs / guided_*.", "tool_choice")
    parameters = tools[names.index(name)].function.parameters or EMPTY_PARAMETERS
    return ToolPlan("named", template_tools, named=name, parallel=parallel,
                    constraint=StructuredOutputsParams(json=copy.deepcopy(parameters), disable_any_whitespace=True))


def required_schema(tools: list[Any], parallel: bool) -> dict[str, Any]:
    """The JSON schema of a "required" output: [{"name": <tool>, "parameters": <its schema>}, ...].

    Each tool's own `$defs` move to the top level, where its "#/$defs/..." references point.
    """
    defs: dict[str, Any] = {}
    alternatives = []
    for tool in tools:
        parameters = copy.deepcopy(tool.function.parameters or EMPTY_PARAMETERS)
        for def_name, definition in parameters.pop("$defs", {}).items():
            if def_name in defs and defs[def_name] != definition:
                raise bad_request(f"Tools define $defs {def_name!r} differently; the 'required' schema joins "
                                  "their definitions, so give them distinct names.", "tools")
            defs[def_name] = definition
        alternatives.append({
            "type": "object",
            "properties": {"name": {"type": "string", "enum": [tool.function.name]}, "parameters": parameters},
            "required": ["name", "parameters"],
            "additionalProperties": False,
        })
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": alternatives}}
    if not parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


# A ChatML template with Hermes-style tools, for models whose own ChatML template has no notion
# of tools (the embedded SmolLM2's drops them, and an assistant's calls with them): the tools
# are listed in the system turn, an assistant's calls are written as <tool_call> blocks (what
# the hermes parser reads back) and tool results as <tool_response> blocks in a user turn.
HERMES_CHATML_TEMPLATE = """\
{%- set system = messages[0].content if messages and messages[0].role == 'system' else none -%}
{%- if tools %}<|im_start|>system
{{ system if system is not none else 'You are a helpful assistant.' }}

# Tools

You may call the functions described in <tools></tools>:
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>

To call a function, answer with a JSON object of its name and arguments in <tool_call></tool_call> tags:
<tool_call>
{"name": <function-name>, "arguments": <arguments-json-object>}
</tool_call><|im_end|>
{% elif system is not none %}<|im_start|>system
{{ system }}<|im_end|>
{% endif -%}
{%- for message in messages -%}
{%- if loop.first and message.role == 'system' -%}
{%- elif message.role == 'assistant' %}<|im_start|>assistant
{% if message.content %}{{ message.content }}{% endif -%}
{%- for call in message.tool_calls or [] %}{% if not loop.first or message.content %}{{ '\n' }}{% endif %}<tool_call>
{"name": {{ call.function.name | tojson }}, "arguments": {{ call.function.arguments | tojson }}}
</tool_call>{% endfor %}<|im_end|>
{% elif message.role == 'tool' -%}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user{% endif %}
{{- '\n<tool_response>\n' }}{{ message.content }}{{ '\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>{{ '\n' }}{% endif -%}
{%- else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif -%}
{%- endfor -%}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif -%}
"""


def needs_tool_template(model_template: Any, tools: list[dict[str, Any]] | None,
                        messages: list[dict[str, Any]]) -> bool:
    """Whether to render with HERMES_CHATML_TEMPLATE: the conversation has tools, calls or tool
    results, and the model's template is ChatML that never mentions tools."""
    if not isinstance(model_template, str) or "<|im_start|>" not in model_template or "tools" in model_template:
        return False
    return bool(tools) or any(m.get("tool_calls") or m["role"] == "tool" for m in messages)
