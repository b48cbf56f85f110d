"""ImageAttachment: an image attached in the chat, drawn with textual-image, with its size and hash.

textual-image picks the terminal's best way (Kitty's graphics protocol or Sixel where the terminal
answers for them, colored half cells elsewhere); off a terminal (tests, screenshots) it draws half
cells, so pictures are reproducible. It queries the terminal once, when imported: this module is
imported with the app, before Textual takes the terminal over.
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path
from typing import Any

from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import Static

try:
    from textual_image.widget import HalfcellImage
    from textual_image.widget import Image as AutoImage

    _ON_TTY = bool(sys.__stdout__ and sys.__stdout__.isatty())
    IMAGE_WIDGET: Any = AutoImage if _ON_TTY else HalfcellImage
except ImportError:  # an install without the console's image extra: the console's own half cells
    IMAGE_WIDGET = None

MAX_WIDTH, MAX_HEIGHT = 32, 12  # cells


def image_caption(path: str, image: Any) -> str:
    """'cat.png · 320x240 px · 12.3 KB · sha256 1a2b3c4d5e6f…' (the file's bytes)."""
    data = Path(path).read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    return (f"{Path(path).name} · {image.width}x{image.height} px · {len(data) / 1024:,.1f} KB"
            f" · sha256 {digest[:12]}…")


def cell_size(image: Any) -> tuple[int, int]:
    """Width and height in cells, aspect kept (a cell is about twice as tall as wide)."""
    scale = min(MAX_WIDTH / image.width, (2 * MAX_HEIGHT) / image.height)
    width = max(min(int(image.width * scale), MAX_WIDTH), 1)
    height = max(min(round(image.height * scale / 2), MAX_HEIGHT), 1)
    return width, height


class ImageAttachment(Vertical):
    """The caption line and the picture."""

    DEFAULT_CSS = """
    ImageAttachment { height: auto; margin: 0 0 1 0; }
    ImageAttachment .image-caption { color: $text-muted; }
    """

    def __init__(self, path: str, image: Any, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.path = path
        self.image = image.convert("RGB")
        self.caption = image_caption(path, image)

    def compose(self) -> ComposeResult:
        yield Static(self.caption, classes="image-caption", markup=False)
        width, height = cell_size(self.image)
        if IMAGE_WIDGET is not None:
            picture = IMAGE_WIDGET(self.image, classes="image-picture")
            picture.styles.width, picture.styles.height = width, height
            yield picture
        else:
            from lm_console.image_preview import half_block_preview

            yield Static(half_block_preview(self.image, MAX_WIDTH, MAX_HEIGHT), classes="image-picture")
