"""Streaming /v1/completions and /v1/chat/completions over httpx, as the console's StreamChunks.

Works against any OpenAI-compatible server (ours, vLLM): requests `stream_options.include_usage`
(token counts and cached tokens in a last chunk). A chunk with usage gives exact counts (vLLM's
`continuous_usage_stats` puts it on every chunk); otherwise each chunk with text counts as one
token and the final usage chunk corrects the total.
"""

from __future__ import annotations

import base64
import json
import mimetypes
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx

from lm_console.client.sse import iter_sse
from lm_console.client.types import EngineUnavailable, GenParams, StreamChunk

KEY_HINT = "Pass the server's key with --api-key KEY (or set LMC_API_KEY)."


class RemoteRequestError(ValueError):
    """The server refused one request (HTTP 4xx, or an error event); the message is the server's."""

    def __init__(self, message: str, status_code: int = 400) -> None:
        super().__init__(message)
        self.status_code = status_code


def auth_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def error_message(body: bytes | str, status_code: int) -> str:
    """The message of an OpenAI-shaped error body ({"error": {"message": ...}}), or the raw text."""
    text = body.decode(errors="replace") if isinstance(body, bytes) else body
    try:
        data = json.loads(text)
    except ValueError:
        return text.strip()[:300] or f"HTTP {status_code}"
    error = data.get("error", data) if isinstance(data, dict) else data
    if isinstance(error, dict):
        return str(error.get("message") or error.get("detail") or error)
    return str(data.get("detail", error)) if isinstance(data, dict) else str(error)


def raise_for_status(url: str, status_code: int, body: bytes | str) -> None:
    """401/403 and 5xx become EngineUnavailable with a hint; other 4xx a RemoteRequestError."""
    if status_code < 400:
        return
    message = error_message(body, status_code)
    if status_code in (401, 403):
        raise EngineUnavailable(f"The server at {url} refused the API key (HTTP {status_code}): {message}",
                                KEY_HINT)
    if status_code >= 500:
        raise EngineUnavailable(f"The server at {url} failed (HTTP {status_code}): {message}",
                                "The server's engine may be dead or overloaded; check its log and /health.")
    raise RemoteRequestError(message, status_code)


def unreachable(url: str, error: BaseException) -> EngineUnavailable:
    return EngineUnavailable(
        f"Cannot reach the server at {url}: {type(error).__name__}: {error}",
        "Check --url (http://HOST:PORT) and that the server is running (`lmc serve` prints its URL).")


def image_data_url(path: str) -> str:
    """A local image file as a data: URL (what the chat tab sends for /image PATH)."""
    data = Path(path).expanduser().read_bytes()
    mime = mimetypes.guess_type(path)[0] or "image/png"
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def openai_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The console's messages with image parts ({"type": "image", "image": PATH}) as image_url parts."""
    converted = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, list):
            parts = []
            for part in content:
                if isinstance(part, dict) and part.get("type") == "image":
                    image = str(part.get("image", ""))
                    url = image if image.startswith(("data:", "http://", "https://")) else image_data_url(image)
                    parts.append({"type": "image_url", "image_url": {"url": url}})
                else:
                    parts.append(part)
            message = {**message, "content": parts}
        converted.append(message)
    return converted


def sampling_body(params: GenParams, model: str) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model, "max_tokens": params.max_tokens, "temperature": params.temperature,
        "top_p": params.top_p, "stream": True,
        "stream_options": {"include_usage": True},
    }
    if params.seed is not None:
        body["seed"] = params.seed
    if params.ignore_eos:
        body["ignore_eos"] = True  # vLLM's extra field; OpenAI itself has none
    return body


class ChunkCounter:
    """Turns OpenAI stream chunks of one request into StreamChunks with token counts."""

    def __init__(self, request_id: str, chat: bool) -> None:
        self.request_id = request_id
        self.chat = chat
        self.num_counted = 0  # completion tokens reported so far
        self.num_prompt_tokens = 0
        self.num_cached_tokens = 0
        self.finish_reason: str | None = None

    def chunk_of(self, data: dict[str, Any]) -> StreamChunk | None:
        """The StreamChunk of one `data:` object; None when it carries nothing new."""
        if "error" in data:
            error = data["error"] if isinstance(data["error"], dict) else {"message": str(data["error"])}
            code = int(error.get("code") or 500) if str(error.get("code", "")).isdigit() else 500
            if code >= 500:
                raise EngineUnavailable(f"The server ended the stream: {error.get('message')}",
                                        "The server's engine may have died; check its log and /health.")
            raise RemoteRequestError(str(error.get("message")), code)
        text = ""
        for choice in data.get("choices") or []:
            piece = (choice.get("delta") or {}).get("content") if self.chat else choice.get("text")
            text += piece or ""
            self.finish_reason = choice.get("finish_reason") or self.finish_reason
        usage = data.get("usage")
        if usage:
            self.num_prompt_tokens = int(usage.get("prompt_tokens") or 0)
            details = usage.get("prompt_tokens_details") or {}
            self.num_cached_tokens = int(details.get("cached_tokens") or 0)
            new_tokens = max(int(usage.get("completion_tokens") or 0) - self.num_counted, 0)
        else:
            new_tokens = 1 if text else 0
        self.num_counted += new_tokens
        if not text and not new_tokens and not usage:
            return None
        return StreamChunk(self.request_id, text=text, num_new_tokens=new_tokens,
                           num_prompt_tokens=self.num_prompt_tokens, num_cached_tokens=self.num_cached_tokens)

    def final(self) -> StreamChunk:
        return StreamChunk(self.request_id, num_prompt_tokens=self.num_prompt_tokens,
                           num_cached_tokens=self.num_cached_tokens, finished=True,
                           finish_reason=self.finish_reason or "stop")


async def stream_openai(http: httpx.AsyncClient, base_url: str, path: str, body: dict[str, Any],
                        request_id: str, headers: dict[str, str]) -> AsyncIterator[StreamChunk]:
    """POST a streaming request and yield its StreamChunks; the last one has finished=True.

    Leaving the iteration early closes the connection, which makes the server abort the request.
    """
    counter = ChunkCounter(request_id, chat=path.endswith("/chat/completions"))
    url = base_url + path
    try:
        async with http.stream("POST", url, json=body, headers={**headers, "X-Request-Id": request_id}) as response:
            if response.status_code >= 400:
                raise_for_status(base_url, response.status_code, await response.aread())
            async for event in iter_sse(response.aiter_lines()):
                if event.data.strip() == "[DONE]":
                    break
                try:
                    data = json.loads(event.data)
                except ValueError:
                    raise RemoteRequestError(f"the server sent a malformed stream event: {event.data[:200]!r}",
                                             502) from None
                chunk = counter.chunk_of(data)
                if chunk is not None:
                    yield chunk
            else:
                if counter.finish_reason is None:
                    raise EngineUnavailable(f"The server at {base_url} ended the stream before the reply finished.",
                                            "The server may have stopped; check its log.")
    except httpx.TransportError as error:
        raise unreachable(base_url, error) from error
    yield counter.final()
