"""load_image: every accepted source, and a specific error for each kind of bad input."""

from __future__ import annotations

import base64

import pytest

from lm_console.engine.errors import ImageNotFoundError, InvalidImageError
from lm_console.engine.multimodal.image import load_image
from mm_factory import make_image, png_bytes


def test_sources_decode_to_the_same_rgb_pixels(tmp_path) -> None:
    image = make_image(1)
    raw = png_bytes(image)
    path = tmp_path / "a.png"
    path.write_bytes(raw)
    url = "data:image/png;base64," + base64.b64encode(raw).decode()
    items = [load_image(raw), load_image(str(path)), load_image(path), load_image(url),
             load_image({"type": "image_url", "image_url": {"url": url}}), load_image(image.convert("RGBA"))]
    for item in items:
        assert item.image.mode == "RGB" and item.image.tobytes() == image.tobytes()
    assert all(item.raw == raw for item in items[:5]) and items[5].raw is None


@pytest.mark.parametrize("source, error, message", [
    ("/no/such/file.png", ImageNotFoundError, "does not exist"),
    (b"", InvalidImageError, "empty"),
    (b"GIF89a-broken", InvalidImageError, "corrupt or truncated|not a recognised"),
    ("https://example.com/x.png", InvalidImageError, "remote URLs"),
    ("data:image/png,notbase64", InvalidImageError, "base64"),
    (3.5, InvalidImageError, "cannot use a float"),
])
def test_bad_sources(source, error, message) -> None:
    with pytest.raises(error, match=message):
        load_image(source)


def test_truncated_and_unsupported_formats(tmp_path) -> None:
    raw = png_bytes(make_image(2))
    with pytest.raises(InvalidImageError, match="corrupt or truncated"):
        load_image(raw[: len(raw) // 2])
    path = tmp_path / "a.tga"
    make_image(2).save(path, format="TGA")
    with pytest.raises(InvalidImageError, match="TGA is not supported"):
        load_image(str(path))
