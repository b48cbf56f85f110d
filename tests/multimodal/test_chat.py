"""Chat content parts -> template messages + images."""

from __future__ import annotations

import pytest

from lm_console.engine.errors import InvalidPromptError, MultiModalNotSupportedError
from lm_console.engine.multimodal.chat import split_chat_messages


def test_parts_become_template_parts_and_images_keep_their_order() -> None:
    conversation = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "a.png"}},
                                     {"type": "text", "text": "vs"},
                                     {"type": "image", "image": "b.png"}]},
    ]
    messages, images = split_chat_messages(conversation, multimodal=True)
    assert images == ["a.png", "b.png"]
    assert messages[0]["content"] == [{"type": "text", "text": "Be brief."}]
    assert messages[1]["content"] == [{"type": "image"}, {"type": "text", "text": "vs"}, {"type": "image"}]


def test_text_only_models_get_strings_and_reject_images() -> None:
    messages, images = split_chat_messages([{"role": "user", "content": [{"type": "text", "text": "hi"}]}], False)
    assert messages == [{"role": "user", "content": "hi"}] and images == []
    with pytest.raises(MultiModalNotSupportedError):
        split_chat_messages([{"role": "user", "content": [{"type": "image", "image": "a.png"}]}], False)
    with pytest.raises(InvalidPromptError, match="unsupported content part"):
        split_chat_messages([{"role": "user", "content": [{"type": "audio"}]}], True)
