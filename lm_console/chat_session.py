"""ChatSession: a multi-turn conversation over a ConsoleClient (shared by the TUI and the REPL)."""

from __future__ import annotations

import itertools
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from lm_console.client.protocol import ConsoleClient
from lm_console.client.types import GenParams, StreamChunk
from lm_console.request_book import RequestBook

DEFAULT_SYSTEM_PROMPT = "You are a helpful, concise assistant."
TEXT_ONLY_NOTICE = ("This model is text-only: it cannot take images. Start the console with "
                    "--model demo-vlm (or a vision-language model directory) to attach them with /image PATH.")
MULTIMODAL_NOTICE = "Vision-language model: /image PATH attaches an image to your next message."
COMMANDS_HELP = ("/clear starts over · /system TEXT sets the system prompt · "
                 "/temp X, /top_p X, /max N change sampling · /image PATH attaches an image")


@dataclass(slots=True)
class ReplyStats:
    """The footer of one reply: tokens, TTFT, tok/s, cached tokens, why it ended."""

    num_tokens: int = 0
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    ttft_s: float | None = None
    elapsed_s: float = 0.0
    finish_reason: str | None = None

    def tokens_per_s(self) -> float:
        decode = self.elapsed_s - (self.ttft_s or 0.0)
        return (self.num_tokens - 1) / decode if self.num_tokens > 1 and decode > 0 else 0.0

    def describe(self) -> str:
        ttft = "-" if self.ttft_s is None else f"{self.ttft_s * 1000:.0f} ms"
        end = "" if self.finish_reason in (None, "stop") else f" · {self.finish_reason}"
        return (f"{self.num_tokens} tokens · TTFT {ttft} · {self.tokens_per_s():.1f} tok/s · "
                f"prompt {self.num_prompt_tokens} ({self.num_cached_tokens} cached){end}")


@dataclass
class ChatSession:
    """The conversation, its system prompt and sampling settings; one reply streams at a time."""

    client: ConsoleClient
    book: RequestBook | None = None
    system_prompt: str = DEFAULT_SYSTEM_PROMPT
    params: GenParams = field(default_factory=lambda: GenParams(temperature=0.7, top_p=0.95, max_tokens=256))
    clock: Callable[[], float] = time.time
    messages: list[dict[str, Any]] = field(default_factory=list)
    current_request_id: str | None = None
    pending_images: list[str] = field(default_factory=list)  # attached, sent with the next message
    last_stats: ReplyStats | None = None
    _ids: Any = field(default_factory=lambda: itertools.count(1))

    def clear(self) -> None:
        self.messages.clear()

    def command(self, text: str) -> str | None:
        """Handle a /command; returns the notice to show, or None when text is a message."""
        if not text.startswith("/"):
            return None
        name, _, arg = text[1:].partition(" ")
        arg = arg.strip()
        try:
            if name == "clear":
                self.clear()
                return "Conversation cleared."
            if name == "image":
                return self.attach_image(arg)
            if name == "system":
                self.system_prompt = arg
                return f"System prompt set to: {arg or '(none)'}"
            if name in ("temp", "temperature"):
                self.params.temperature = max(float(arg), 0.0)
                return f"temperature = {self.params.temperature}"
            if name == "top_p":
                self.params.top_p = min(max(float(arg), 0.01), 1.0)
                return f"top_p = {self.params.top_p}"
            if name == "max":
                self.params.max_tokens = max(int(arg), 1)
                return f"max_tokens = {self.params.max_tokens}"
        except ValueError:
            return f"Not a number: {arg!r}. {COMMANDS_HELP}"
        return f"Unknown command /{name}. {COMMANDS_HELP}"

    @property
    def multimodal(self) -> bool:
        return self.client.info.multimodal

    def attach_image(self, path: str) -> str:
        """Attach an image file to the next message; returns the notice to show."""
        if not self.multimodal:
            return TEXT_ONLY_NOTICE
        if not path:
            return "Usage: /image PATH (a PNG, JPEG, GIF, BMP, WEBP or TIFF file)."
        try:
            from lm_console.image_preview import describe_image

            description, _ = describe_image(path)
        except Exception as error:  # noqa: BLE001 - the engine's image errors: show, keep chatting
            return f"Cannot attach {path}: {error}"
        self.pending_images.append(path)
        return f"Attached {description}; it goes with your next message."

    def conversation(self) -> list[dict[str, Any]]:
        """The messages sent to the model: the system prompt first, when there is one."""
        system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return system + self.messages

    async def send(self, text: str) -> AsyncIterator[StreamChunk]:
        """Add a user turn and stream the assistant's reply (kept even when stopped early)."""
        if self.pending_images:
            parts: list[dict[str, Any]] = [{"type": "image", "image": path} for path in self.pending_images]
            self.messages.append({"role": "user", "content": [*parts, {"type": "text", "text": text}]})
            self.pending_images = []
        else:
            self.messages.append({"role": "user", "content": text})
        request_id = f"chat-{next(self._ids):04d}"
        self.current_request_id = request_id
        start = self.clock()
        stats = ReplyStats()
        self.last_stats = stats
        reply: list[str] = []
        if self.book is not None:
            self.book.submit(request_id, "chat", start, prompt=text)
        try:
            async for chunk in self.client.chat(self.conversation(), self.params, request_id):
                now = self.clock()
                if self.book is not None:
                    self.book.on_chunk(chunk, now)
                if chunk.num_new_tokens and stats.ttft_s is None:
                    stats.ttft_s = chunk.ttft_s if chunk.ttft_s is not None else now - start
                stats.num_tokens += chunk.num_new_tokens
                stats.num_prompt_tokens = chunk.num_prompt_tokens or stats.num_prompt_tokens
                stats.num_cached_tokens = max(stats.num_cached_tokens, chunk.num_cached_tokens)
                stats.elapsed_s = now - start
                stats.finish_reason = chunk.finish_reason or stats.finish_reason
                reply.append(chunk.text)
                yield chunk
        except Exception as error:
            if self.book is not None:
                self.book.on_error(request_id, str(error), self.clock())
            raise
        finally:
            self.current_request_id = None
            self.messages.append({"role": "assistant", "content": "".join(reply)})

    async def stop(self) -> bool:
        """Abort the reply in progress; False when none is."""
        if self.current_request_id is None:
            return False
        await self.client.abort(self.current_request_id)
        return True
