"""POST /v1/responses: OpenAI's Responses API, the subset vLLM serves for text generation.

Input: a string, or a list of messages ({"role", "content"} with an optional "type": "message"),
whose content is a string or typed parts ("input_text", and "output_text" in an assistant's
earlier turn). `instructions` become a system message before them. Sampling: temperature,
top_p, max_output_tokens. The response is stateless: nothing is stored, so `store` true,
`previous_response_id`, `background`, tools, reasoning, `include` and non-text formats are
refused with 400 naming the field rather than accepted and ignored.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field

from lm_console.engine.entrypoints.openai.errors import bad_request
from lm_console.engine.entrypoints.openai.protocol import INT64_MAX, INT64_MIN, RequestModel, ResponseModel


class InputTextPart(RequestModel):
    type: Literal["input_text"]
    text: str


class OutputTextPart(RequestModel):
    type: Literal["output_text"]
    text: str
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


InputPart = Annotated[InputTextPart | OutputTextPart, Field(discriminator="type")]


class InputMessage(RequestModel):
    """One message of a list `input` (EasyInputMessage or a typed message item)."""

    type: Literal["message"] | None = None
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[InputPart]
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None

    def as_chat_message(self) -> dict[str, Any]:
        content = self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)
        return {"role": self.role, "content": content}


class ResponsesRequest(RequestModel):
    """POST /v1/responses."""

    model: str | None = None
    input: str | list[InputMessage]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    stream: bool | None = False
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)  # vLLM's extra
    user: str | None = None
    metadata: dict[str, str] | None = None
    parallel_tool_calls: bool | None = None
    truncation: Literal["disabled"] | None = None
    service_tier: Literal["auto", "default"] | None = None
    # Known fields this stateless, text-only server cannot honour (refused unless neutral).
    store: bool | None = None
    previous_response_id: str | None = None
    background: bool | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    reasoning: dict[str, Any] | None = None
    include: list[str] | None = None
    text: dict[str, Any] | None = None
    top_logprobs: int | None = None
    prompt: dict[str, Any] | None = None

    UNSUPPORTED: ClassVar[dict[str, tuple[tuple[Any, ...], str]]] = {
        "store": ((False,), "responses are not stored (send store: false, or leave it out)"),
        "previous_response_id": ((), "responses are not stored, so none can be continued; send the history "
                                     "in `input`"),
        "background": ((False,), "background responses need storage"),
        "tools": (([],), "tool calling is served on /v1/chat/completions"),
        "tool_choice": (("none", "auto"), "tool calling is served on /v1/chat/completions"),
        "reasoning": ((), "the served models have no reasoning mode"),
        "include": (([],), "no extra output data is available"),
        "top_logprobs": ((0,), "logprobs are served on /v1/chat/completions"),
        "prompt": ((), "prompt templates need storage"),
    }

    def check(self) -> None:
        """Every check that needs no engine (400 on failure)."""
        self.refuse_unsupported()
        if self.text is not None and self.text not in ({}, {"format": {"type": "text"}}):
            raise bad_request(f"text={self.text!r:.100} is not supported: only {{'format': {{'type': 'text'}}}}; "
                              "structured output is served on /v1/chat/completions (response_format).", "text")
        if self.input == "" or self.input == []:
            raise bad_request("input must be a non-empty string or list of messages.", "input")

    def chat_messages(self) -> list[dict[str, Any]]:
        """The conversation for the chat template: instructions first, as a system message."""
        messages: list[dict[str, Any]] = []
        if self.instructions is not None:
            messages.append({"role": "system", "content": self.instructions})
        if isinstance(self.input, str):
            messages.append({"role": "user", "content": self.input})
        else:
            messages.extend(item.as_chat_message() for item in self.input)
        return messages


class OutputText(ResponseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


class OutputMessage(ResponseModel):
    type: Literal["message"] = "message"
    id: str
    status: Literal["in_progress", "completed", "incomplete"]
    role: Literal["assistant"] = "assistant"
    content: list[OutputText]


class InputTokensDetails(ResponseModel):
    cached_tokens: int = 0


class OutputTokensDetails(ResponseModel):
    reasoning_tokens: int = 0


class ResponseUsage(ResponseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int


class IncompleteDetails(ResponseModel):
    reason: Literal["max_output_tokens", "content_filter"]


class ResponsesResponse(ResponseModel):
    id: str
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=lambda: int(time.time()))
    status: Literal["completed", "failed", "in_progress", "cancelled", "queued", "incomplete"]
    model: str
    output: list[OutputMessage]
    usage: ResponseUsage | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    incomplete_details: IncompleteDetails | None = None
    error: dict[str, Any] | None = None
    metadata: dict[str, str] | None = None
    parallel_tool_calls: bool = True
    tool_choice: str = "none"
    tools: list[Any] = Field(default_factory=list)
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    truncation: str = "disabled"
    previous_response_id: str | None = None
    reasoning: dict[str, Any] | None = None
    store: bool = False
    background: bool = False
    service_tier: str = "auto"
    user: str | None = None
