"""Image previews in the terminal with half-cell blocks: each cell shows two pixels, the upper
one as the foreground of "▀" and the lower one as its background (works in any truecolor
terminal, no graphics protocol needed)."""

from __future__ import annotations

from typing import Any


def half_block_preview(image: Any, max_width: int = 32, max_height: int = 12) -> Any:
    """A rich Text of at most max_width x max_height cells showing the image (aspect kept)."""
    from rich.style import Style
    from rich.text import Text

    image = image.convert("RGB")
    scale = min(max_width / image.width, (2 * max_height) / image.height, 1.0)
    width = max(int(image.width * scale), 1)
    height = max(int(image.height * scale), 2)
    height += height % 2
    small = image.resize((width, height))
    pixels = small.load()
    text = Text()
    for y in range(0, height, 2):
        for x in range(width):
            top, bottom = pixels[x, y], pixels[x, y + 1]
            text.append("▀", Style(color=f"rgb({top[0]},{top[1]},{top[2]})",
                                   bgcolor=f"rgb({bottom[0]},{bottom[1]},{bottom[2]})"))
        if y + 2 < height:
            text.append("\n")
    return text


def describe_image(path: str) -> tuple[str, Any]:
    """(one-line description, decoded PIL image) of an image file; raises the engine's
    ImageNotFoundError / InvalidImageError (torch-free) on bad input."""
    from lm_console.engine.multimodal.image import load_image

    item = load_image(path)
    return f"{path} ({item.image.width}x{item.image.height})", item.image
