"""An image chat with `demo-vlm` through the openai client, sync and async (slow: the demo VLM is
built once, ~30 s, and is the 135M embedded model with a random vision tower). That greedy
image chats equal LLM.chat is shown on a tiny VLM in test_openai_errors.py."""

from __future__ import annotations

import asyncio
import base64

import openai
import pytest

from mm_factory import make_image, png_bytes
from openai_server_helpers import ThreadServer


@pytest.mark.slow
def test_image_chat_with_demo_vlm_sync_and_async() -> None:
    url = "data:image/png;base64," + base64.b64encode(png_bytes(make_image(11, width=64, height=48))).decode()
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                             {"type": "text", "text": "Describe the picture."}]}]
    server = ThreadServer("demo-vlm", max_model_len=1024, num_gpu_blocks_override=256, stat_loggers=[])
    try:
        with openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=300) as client:
            reply = client.chat.completions.create(model="demo-vlm", messages=messages, max_tokens=12,
                                                   temperature=0.0)
            text_only = client.chat.completions.create(
                model="demo-vlm", messages=[{"role": "user", "content": "Describe the picture."}], max_tokens=1)
        assert reply.choices[0].message.content and reply.choices[0].finish_reason in ("stop", "length")
        assert reply.usage.prompt_tokens > text_only.usage.prompt_tokens + 50  # the image's placeholder tokens

        async def streamed() -> str:
            async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0,
                                          timeout=300) as client:
                stream = await client.chat.completions.create(model="demo-vlm", messages=messages, max_tokens=12,
                                                              temperature=0.0, stream=True)
                return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

        assert asyncio.run(streamed()) == reply.choices[0].message.content
        assert server.wait_idle().all_free
    finally:
        server.stop()
