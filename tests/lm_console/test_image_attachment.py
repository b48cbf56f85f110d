"""An image attached in the chat: drawn by textual-image (half cells off a terminal) with its size and hash."""

from __future__ import annotations

import asyncio
import hashlib

from mm_factory import make_image
from textual.app import App, ComposeResult
from textual_image.widget import HalfcellImage

from lm_console.tui.widgets.image_attachment import ImageAttachment, cell_size


def test_caption_and_picture(tmp_path) -> None:  # noqa: ANN001
    path = tmp_path / "picture.png"
    image = make_image(5, 64, 32)
    image.save(path)
    digest = hashlib.sha256(path.read_bytes()).hexdigest()

    class One(App[None]):
        def compose(self) -> ComposeResult:
            yield ImageAttachment(str(path), image)

    async def scenario() -> tuple[str, object, tuple[int, int]]:
        app = One()
        async with app.run_test(size=(60, 20)) as pilot:
            await pilot.pause()
            caption = str(app.query_one(".image-caption").render())
            picture = app.query_one(".image-picture")
            return caption, picture, (picture.size.width, picture.size.height)

    caption, picture, size = asyncio.run(scenario())
    assert caption.startswith("picture.png · 64x32 px · ") and f"sha256 {digest[:12]}…" in caption
    assert isinstance(picture, HalfcellImage)  # tests run off a terminal: half cells, reproducible
    assert size == cell_size(image) == (32, 8)  # 32 cells wide, aspect kept with 2:1 cells
