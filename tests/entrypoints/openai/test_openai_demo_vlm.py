"""Image chats with `demo-vlm` through the openai client against the `lmc serve` app, sync and
async (slow: the demo VLM is built once, ~30 s, and is the 135M embedded model with a small
trained vision tower). The replies must describe the picture: colour and shape named in >= 80%
of 50 held-out synthetic pictures sent as data: URLs. That greedy image chats equal LLM.chat is
shown on a tiny VLM in test_openai_errors.py."""

from __future__ import annotations

import asyncio
import base64
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from demo_vlm_helpers import MAX_TOKENS, accuracy, chat_messages, held_out, judge
from mm_factory import png_bytes
from openai_server_helpers import ThreadServer


def data_url(image) -> str:
    return "data:image/png;base64," + base64.b64encode(png_bytes(image)).decode()


@pytest.mark.slow
def test_image_chats_with_demo_vlm_describe_the_picture() -> None:
    pictures = held_out(50)
    (image, scene), rest = pictures[0], pictures[1:]
    messages = chat_messages(data_url(image), part="image_url")
    server = ThreadServer("demo-vlm", max_model_len=1024, num_gpu_blocks_override=512, stat_loggers=[])
    try:
        with openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=300) as client:
            def ask(messages: list[dict]):
                return client.chat.completions.create(model="demo-vlm", messages=messages, max_tokens=MAX_TOKENS,
                                                      temperature=0.0)

            reply = ask(messages)
            text_only = client.chat.completions.create(
                model="demo-vlm", messages=[{"role": "user", "content": "Describe the picture."}], max_tokens=1)
            with ThreadPoolExecutor(8) as pool:
                others = list(pool.map(ask, [chat_messages(data_url(im), part="image_url") for im, _ in rest]))
        answer = reply.choices[0].message.content
        assert judge(answer, scene).colour_and_shape, (answer, scene)
        assert reply.usage.prompt_tokens >= text_only.usage.prompt_tokens + 16  # the image's placeholder tokens
        answers = [answer] + [r.choices[0].message.content for r in others]
        got = accuracy(answers, [s for _, s in pictures])
        assert got >= 0.8, f"colour and shape right in {got:.0%} of {len(pictures)} pictures"

        async def streamed() -> str:
            async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0,
                                          timeout=300) as client:
                stream = await client.chat.completions.create(model="demo-vlm", messages=messages,
                                                              max_tokens=MAX_TOKENS, temperature=0.0, stream=True)
                return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

        assert asyncio.run(streamed()) == answer
        assert server.wait_idle().all_free
    finally:
        server.stop()
