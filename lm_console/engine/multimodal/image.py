"""Load an image from a path, bytes, a data: URL or a PIL image.

The original encoded bytes are kept beside the decoded image: the MultiModalHasher hashes
them (cheap) instead of the decoded pixels (after vLLM's MediaWithBytes).
"""

from __future__ import annotations

import base64
import binascii
import io
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lm_console.engine.errors import ImageNotFoundError, InvalidImageError

# Formats PIL decodes that make sense for a vision model (no PDF, EPS, animated-only ones).
SUPPORTED_FORMATS = ("PNG", "JPEG", "GIF", "BMP", "WEBP", "TIFF", "PPM", "ICO")
# The most pixels an image may declare; checked on its header, before a pixel is decoded (a 20 KB
# PNG can declare 13000x13000 pixels: gigabytes once decoded). Vision models resize to well below.
MAX_IMAGE_PIXELS = 6000 * 6000


@dataclass(slots=True)
class ImageItem:
    """A decoded RGB image and, when known, the encoded bytes it came from."""

    image: Any  # PIL.Image.Image, mode RGB
    raw: bytes | None = None
    source: str = "image"  # for error messages: the path or kind of input


def load_image(source: Any) -> ImageItem:
    """Decode one image source; raise ImageNotFoundError or InvalidImageError on bad input."""
    from PIL import Image

    if isinstance(source, ImageItem):
        return source
    if isinstance(source, Image.Image):
        return ImageItem(_to_rgb(source, "PIL image"), None, "PIL image")
    if isinstance(source, dict):  # OpenAI content parts: {"url": ...} or {"image_url": {...}}
        inner = source.get("image_url", source)
        inner = inner.get("url") if isinstance(inner, dict) else inner
        if inner is None:
            raise InvalidImageError(f"image dict {sorted(source)} has no 'url' or 'image_url'.")
        return load_image(inner)
    if isinstance(source, (bytes, bytearray, memoryview)):
        return _decode(bytes(source), "image bytes")
    if isinstance(source, Path):
        return _load_path(source)
    if isinstance(source, str):
        if source.startswith("data:"):
            return _decode(_parse_data_url(source), "data: URL")
        if source.startswith(("http://", "https://")):
            raise InvalidImageError(
                f"image URL {source[:80]!r}: remote URLs are not fetched; pass a local path, "
                "bytes, a data: URL or a PIL image.")
        return _load_path(Path(source.removeprefix("file://")).expanduser())
    raise InvalidImageError(
        f"cannot use a {type(source).__name__} as an image; pass a path, bytes, a data: URL "
        "or a PIL.Image.")


def _load_path(path: Path) -> ImageItem:
    if not path.is_file():
        raise ImageNotFoundError(f"image file {str(path)!r} does not exist or is not a file.")
    try:
        raw = path.read_bytes()
    except OSError as error:
        raise ImageNotFoundError(f"image file {str(path)!r} cannot be read: {error}") from error
    return _decode(raw, str(path))


def _parse_data_url(url: str) -> bytes:
    header, sep, payload = url.partition(",")
    if not sep or ";base64" not in header:
        raise InvalidImageError("a data: URL must look like data:image/png;base64,<data>.")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as error:
        raise InvalidImageError(f"the data: URL's base64 payload is invalid: {error}") from error


def _decode(raw: bytes, source: str) -> ImageItem:
    from PIL import Image, UnidentifiedImageError

    if not raw:
        raise InvalidImageError(f"{source}: the image is empty (0 bytes).")
    try:
        with Image.open(io.BytesIO(raw)) as opened:
            image_format = opened.format
            if image_format not in SUPPORTED_FORMATS:
                raise InvalidImageError(
                    f"{source}: image format {image_format} is not supported; use one of "
                    f"{', '.join(SUPPORTED_FORMATS)}.")
            if opened.width * opened.height > MAX_IMAGE_PIXELS:
                raise InvalidImageError(
                    f"{source}: the image is {opened.width}x{opened.height} pixels, more than "
                    f"{MAX_IMAGE_PIXELS} to decode; send a smaller image.")
            opened.load()  # decodes every pixel: a truncated file fails here, not later
            image = _to_rgb(opened, source)
    except InvalidImageError:
        raise
    except Image.DecompressionBombError as error:  # PIL's pixel limit (Image.MAX_IMAGE_PIXELS)
        raise InvalidImageError(
            f"{source}: the image has too many pixels to decode safely ({error}); send a smaller image.") from None
    except UnidentifiedImageError as error:
        raise InvalidImageError(
            f"{source}: not a recognised image ({len(raw)} bytes); supported formats: "
            f"{', '.join(SUPPORTED_FORMATS)}.") from error
    except (OSError, SyntaxError, ValueError) as error:  # PIL's truncated/corrupt errors
        raise InvalidImageError(f"{source}: the image is corrupt or truncated: {error}") from error
    return ImageItem(image, raw, source)


def _to_rgb(image: Any, source: str) -> Any:
    if image.width < 1 or image.height < 1:
        raise InvalidImageError(f"{source}: the image has no pixels ({image.width}x{image.height}).")
    return image.convert("RGB") if image.mode != "RGB" else image.copy()
