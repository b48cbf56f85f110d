"""Chat messages with images: OpenAI content parts -> chat-template text + images.

Accepted parts: {"type": "text", "text": ...}, {"type": "image_url", "image_url": {"url": ...}}
(or "image_url": "..."), and {"type": "image", "image": <path | bytes | data URL | PIL>}
(also "url"/"path"). Images keep their order of appearance; each becomes one placeholder.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lm_console.engine.errors import InvalidPromptError, MultiModalNotSupportedError


def split_chat_messages(conversation: list[dict[str, Any]], multimodal: bool
                        ) -> tuple[list[dict[str, Any]], list[Any]]:
    """(messages for the chat template, image sources in order).

    For a multimodal model every content becomes a list of {"type": "text"|"image"} parts (the
    shape HF VLM templates expect); for a text-only model a text-parts list is joined into a
    string and an image part raises MultiModalNotSupportedError.
    """
    messages: list[dict[str, Any]] = []
    images: list[Any] = []
    for message in conversation:
        if not isinstance(message, dict) or "role" not in message or "content" not in message:
            raise InvalidPromptError(f"Each chat message must be a dict with 'role' and 'content'; got {message!r}.")
        content = message["content"]
        if isinstance(content, str):
            parts = [{"type": "text", "text": content}]
        elif isinstance(content, list):
            parts = []
            for part in content:
                kind = part.get("type") if isinstance(part, dict) else None
                if kind == "text":
                    parts.append({"type": "text", "text": str(part.get("text", ""))})
                elif kind in ("image_url", "image", "input_image"):
                    source = _image_source(part)
                    if not multimodal:
                        raise MultiModalNotSupportedError(
                            "this model is text-only: it cannot take image content parts; use a "
                            "vision-language model (e.g. --model demo-vlm).")
                    images.append(source)
                    parts.append({"type": "image"})
                else:
                    raise InvalidPromptError(
                        f"unsupported content part {part!r}; use type 'text', 'image_url' or 'image'.")
        else:
            raise InvalidPromptError(f"message content must be a str or a list of parts, got {type(content).__name__}.")
        if multimodal:
            messages.append({**message, "content": parts})
        else:
            messages.append({**message, "content": "".join(p["text"] for p in parts)})
    return messages, images


def _image_source(part: dict[str, Any]) -> Any:
    for key in ("image_url", "image", "url", "path"):
        value = part.get(key)
        if value is None:
            continue
        if isinstance(value, dict):
            value = value.get("url", value.get("path"))
        if value is not None:
            return value
    raise InvalidPromptError(f"image part {part!r} names no image ('image_url': {{'url': ...}} or 'image': ...).")


def build_chat_prompt(tokenizer: Any, mm_processor: Any, conversation: list[dict[str, Any]],
                      add_generation_prompt: bool = True, chat_template_kwargs: dict[str, Any] | None = None,
                      check_text: Callable[[str], Any] | None = None) -> dict[str, Any]:
    """A prompt dict for InputProcessor: text, token ids and (if any) multi_modal_data.

    check_text sees the rendered text before it is tokenised (InputProcessor.check_prompt_text).
    """
    messages, images = split_chat_messages(conversation, multimodal=mm_processor is not None)
    kwargs = dict(chat_template_kwargs or {})
    template_owner = tokenizer
    if mm_processor is not None and getattr(mm_processor.info.processor, "chat_template", None):
        template_owner = mm_processor.info.processor
    text = template_owner.apply_chat_template(messages, tokenize=False,
                                              add_generation_prompt=add_generation_prompt, **kwargs)
    if check_text is not None:
        check_text(text)
    prompt: dict[str, Any] = {"prompt": text, "prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)}
    if images:
        prompt["multi_modal_data"] = {"image": images}
    return prompt
