"""The console's image features: /image and --image, previews, the encoder-cache panel, the
adapter's conversion, and a real chat with an image through AsyncLLM on the tiny VLM."""

from __future__ import annotations

import asyncio
import pytest

from lm_console.chat_session import ChatSession
from lm_console.engine.metrics.stats import EncoderCacheStats, SchedulerStats
from lm_console.client import FakeConsoleClient
from lm_console.client.types import GenParams
from lm_console.tui.app import ConsoleApp
from lm_console.tui.widgets.chat_message import ChatMessage
from lm_console.tui.widgets.encoder_cache_panel import EncoderCachePanel
from mm_factory import make_image

pytestmark = pytest.mark.slow

SIZE = (120, 36)


@pytest.fixture
def png(tmp_path) -> str:
    path = tmp_path / "cat.png"
    make_image(3, 40, 24).save(path)
    return str(path)


def multimodal_fake(**kwargs) -> FakeConsoleClient:
    client = FakeConsoleClient(**kwargs)
    client.info.multimodal = True
    client.info.notice = "untrained vision tower: answers ignore the image"
    return client


def test_session_attaches_images_to_the_next_message(png) -> None:
    session = ChatSession(multimodal_fake())
    assert "Attached" in session.command(f"/image {png}") and session.pending_images == [png]
    assert "Cannot attach" in session.command("/image /no/such.png")
    assert "Usage" in session.command("/image")

    async def send() -> None:
        await session.client.start()  # the fake steps itself once started
        async for _ in session.send("what is this?"):
            pass
        await session.client.shutdown()

    asyncio.run(send())
    assert session.messages[0]["content"] == [{"type": "image", "image": png},
                                              {"type": "text", "text": "what is this?"}]
    assert session.pending_images == []
    text_only = ChatSession(FakeConsoleClient())
    assert "text-only" in text_only.command(f"/image {png}") and text_only.pending_images == []


def test_half_block_preview_keeps_the_aspect_within_bounds() -> None:
    from lm_console.image_preview import half_block_preview

    text = half_block_preview(make_image(1, 200, 100), max_width=20, max_height=8)
    lines = text.plain.split("\n")
    assert len(lines) == 5 and all(len(line) == 20 for line in lines)  # 20 x 10 px -> 20 x 5 cells
    assert set(text.plain) <= {"▀", "\n"}


@pytest.mark.slow
def test_tui_image_preview_capabilities_and_encoder_panel(png) -> None:
    async def scenario() -> None:
        client = multimodal_fake(auto_step=False)
        app = ConsoleApp(client, tick_hz=20)
        app.initial_images = [png]
        async with app.run_test(size=SIZE) as pilot:
            await pilot.pause()
            await pilot.pause()
            panel = app.query_one(EncoderCachePanel)
            assert not panel.display  # nothing reported yet
            client.push_stats(SchedulerStats(timestamp=1.0, encoder_cache=EncoderCacheStats(
                num_entries=3, num_slots=400, num_used_slots=100, num_freeable_slots=60, num_free_slots=240,
                num_lookups=10, num_hits=7, num_encoder_runs=3, num_evictions=1)))
            for _ in range(20):
                await pilot.pause(0.05)
                if panel.display:
                    break
            text = str(panel.render())
            assert panel.display and "3 entries" in text and "hits 7 (70%)" in text and "encoder runs 3" in text
            assert "untrained vision tower" in str(app.query_one("#engine-status").render())
            app.action_show_tab("chat")
            await pilot.pause()
            assert app.session.pending_images == [png]
            assert app.query(".image-preview")  # the preview of the --image attachment
            assert "Vision-language model" in str(app.query_one("#capabilities").render())
            await pilot.press(*f"/image {png}", "enter")
            await pilot.pause()
            assert "Attached" in list(app.query(ChatMessage))[-1].text
            assert len(app.query(".image-preview")) == 2 and len(app.session.pending_images) == 2

    asyncio.run(scenario())


def test_chat_with_an_image_through_asyncllm(tiny_idefics3_dir, png) -> None:
    from lm_console.client.asyncllm import AsyncLLMConsoleClient

    async def scenario() -> tuple[int, int, EncoderCacheStats | None]:
        client = AsyncLLMConsoleClient(str(tiny_idefics3_dir), max_model_len=512, kv_cache_memory=1 << 24)
        info = await client.start()
        try:
            assert info.multimodal and info.notice is None
            session = ChatSession(client, system_prompt="", params=GenParams(temperature=0.0, max_tokens=5))
            session.attach_image(png)
            num_tokens, prompt_tokens = 0, 0
            async for chunk in session.send("Describe it."):
                num_tokens += chunk.num_new_tokens
                prompt_tokens = chunk.num_prompt_tokens or prompt_tokens
            stats = await client.llm.get_stats()
            return num_tokens, prompt_tokens, stats.encoder_cache
        finally:
            await client.shutdown()

    num_tokens, prompt_tokens, encoder_cache = asyncio.run(scenario())
    assert prompt_tokens > 20  # the image's placeholder expansion is in the prompt
    assert encoder_cache is not None and encoder_cache.num_encoder_runs == 1
    assert 1 <= num_tokens <= 5


def test_cli_chat_image_option_and_models_listing(png) -> None:
    from typer.testing import CliRunner

    from lm_console.cli import app

    runner = CliRunner()
    result = runner.invoke(app, ["chat", "--plain", "--fake", "--image", png], input="hello\n")
    assert result.exit_code == 0, result.output
    assert "text-only" in result.stderr and "hello" in result.stdout  # the fake engine has no vision
    listing = runner.invoke(app, ["models"])
    assert listing.exit_code == 0 and "demo-vlm" in listing.stdout and "synthetic pictures" in listing.stdout
