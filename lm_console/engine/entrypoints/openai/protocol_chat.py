"""Chat models: POST /v1/chat/completions and the chat form of POST /tokenize (vLLM's shapes).

Message content is a string or a list of parts: {"type": "text", "text"} and
{"type": "image_url", "image_url": {"url"}} where url is a data: URL, an http(s) URL (fetched
by the server) or a file:// URL under --allowed-local-media-path. Tool calling: `tools`,
`tool_choice`, `parallel_tool_calls`, assistant messages with `tool_calls` and `tool` messages
(tool_calling.py). The deprecated `functions` / `function_call` and audio are refused with 400.
"""

from __future__ import annotations

import json
import time
from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field

from lm_console.engine.entrypoints.openai.errors import bad_request
from lm_console.engine.entrypoints.openai.protocol import (
    SAMPLING_UNSUPPORTED, PromptLogprobs, RequestModel, ResponseModel, SamplingFields, UsageInfo,
)


class ImageURL(RequestModel):
    url: str
    detail: Literal["auto"] | None = None  # "low" / "high" would change the resolution: not supported


class TextPart(RequestModel):
    type: Literal["text"]
    text: str


class ImagePart(RequestModel):
    type: Literal["image_url"]
    image_url: ImageURL


ContentPart = Annotated[TextPart | ImagePart, Field(discriminator="type")]


class FunctionCallParam(RequestModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCallParam(RequestModel):
    """A call an earlier assistant turn made (sent back in the history)."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCallParam


class FunctionDefinition(RequestModel):
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of type object
    strict: bool | None = None


class ChatCompletionToolParam(RequestModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class FunctionName(RequestModel):
    name: str


class NamedToolChoice(RequestModel):
    type: Literal["function"] = "function"
    function: FunctionName


class ChatMessageParam(RequestModel):
    """One message of the conversation; a role other than OpenAI's goes to the chat template as it is
    (vLLM's custom roles: the template decides what it means, or refuses it with a 400)."""

    role: str = Field(min_length=1, max_length=64)
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallParam] | None = None  # an assistant's calls
    tool_call_id: str | None = None  # a tool message: the call it answers

    def as_template_message(self) -> dict[str, Any]:
        """The dict engine.multimodal.chat expects (image parts keep their URL for now)."""
        content: Any = self.content if self.content is not None else ""
        if isinstance(content, list):
            content = [part.model_dump(exclude_none=True) for part in content]
        message: dict[str, Any] = {"role": self.role, "content": content}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_calls:
            message["tool_calls"] = template_tool_calls(self.tool_calls)
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


def template_tool_calls(tool_calls: list[Any]) -> list[dict[str, Any]]:
    """An assistant message's tool_calls as chat templates read them: arguments as an object
    (vLLM's normalisation; templates write them with `tojson`)."""
    calls = []
    for call in tool_calls:
        arguments: Any = call.function.arguments
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            pass  # not JSON: the template gets the text
        calls.append({"id": call.id, "type": "function",
                      "function": {"name": call.function.name, "arguments": arguments}})
    return calls


class ChatTemplateFields(RequestModel):
    """How the conversation becomes a prompt (shared by chat completions and /tokenize)."""

    messages: list[ChatMessageParam] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template_kwargs: dict[str, Any] | None = None

    def check_template(self) -> None:
        if self.continue_final_message and self.add_generation_prompt:
            raise bad_request("Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
                              "continue_final_message")
        if self.continue_final_message and self.messages[-1].role != "assistant":
            raise bad_request("continue_final_message needs the last message to be the assistant's.",
                              "continue_final_message")

    def template_kwargs(self) -> dict[str, Any]:
        kwargs = dict(self.chat_template_kwargs or {})
        for reserved in ("tokenize", "add_generation_prompt", "continue_final_message", "messages"):
            if reserved in kwargs:
                raise bad_request(f"chat_template_kwargs may not set '{reserved}'; use the request field.",
                                  "chat_template_kwargs")
        if self.continue_final_message:
            kwargs["continue_final_message"] = True
        return kwargs


class ChatCompletionRequest(SamplingFields, ChatTemplateFields):
    """POST /v1/chat/completions."""

    logprobs: bool | None = False
    top_logprobs: int | None = 0
    echo: bool = False  # vLLM's: the reply starts with the last message's text when that is the assistant's
    max_tokens: int | None = None  # deprecated by OpenAI in favour of max_completion_tokens
    max_completion_tokens: int | None = None
    tools: list[ChatCompletionToolParam] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    functions: list[Any] | None = None
    function_call: Any = None

    UNSUPPORTED: ClassVar[dict[str, tuple[tuple[Any, ...], str]]] = {
        **SAMPLING_UNSUPPORTED,
        "functions": (([],), "`functions` is deprecated: send `tools`"),
        "function_call": (("none", "auto"), "`function_call` is deprecated: send `tool_choice`"),
    }

    def check(self, max_logprobs: int, max_stop_strings: int, max_n: int) -> None:
        """Every check that needs no engine (400 on failure)."""
        self.check_common(max_stop_strings, max_n)
        self.check_template()
        if self.top_logprobs is not None:
            if not 0 <= self.top_logprobs <= max_logprobs:
                raise bad_request(f"top_logprobs must be in [0, {max_logprobs}], got {self.top_logprobs}.",
                                  "top_logprobs")
            if self.top_logprobs > 0 and not self.logprobs:
                raise bad_request("when using `top_logprobs`, `logprobs` must be set to true.", "top_logprobs")

    def echo_text(self) -> str:
        """What echo puts before each choice's text: the final message's text if it is the assistant's."""
        if not self.echo or self.messages[-1].role != "assistant":
            return ""
        content = self.messages[-1].content
        if content is None:
            return ""
        if isinstance(content, str):
            return content
        return "\n".join(part.text for part in content if isinstance(part, TextPart))

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class TokenizeChatRequest(ChatTemplateFields):
    """POST /tokenize with messages (text parts only), and the tools the template lists (vLLM's)."""

    model: str | None = None
    return_token_strs: bool | None = False
    tools: list[ChatCompletionToolParam] | None = None


class ChatCompletionLogProb(ResponseModel):
    token: str
    logprob: float = -9999.0
    bytes: list[int] | None = None


class ChatCompletionLogProbsContent(ChatCompletionLogProb):
    top_logprobs: list[ChatCompletionLogProb] = Field(default_factory=list)


class ChatCompletionLogProbs(ResponseModel):
    content: list[ChatCompletionLogProbsContent] | None = None


class FunctionCall(ResponseModel):
    name: str
    arguments: str


class ToolCall(ResponseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(ResponseModel):
    role: str
    content: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)


class ChatCompletionResponseChoice(ResponseModel):
    index: int
    message: ChatMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = "stop"
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None


class ChatCompletionResponse(ResponseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo
    system_fingerprint: str | None = None
    prompt_token_ids: list[int] | None = None
    prompt_logprobs: PromptLogprobs | None = None  # vLLM's extra: with the request's prompt_logprobs


class DeltaFunctionCall(ResponseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(ResponseModel):
    """A streamed piece of call `index`: id, type and name first, then arguments' characters."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None


class DeltaMessage(ResponseModel):
    role: str | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatCompletionResponseStreamChoice(ResponseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None


class ChatCompletionStreamResponse(ResponseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionResponseStreamChoice]
    usage: UsageInfo | None = None
    prompt_token_ids: list[int] | None = None
