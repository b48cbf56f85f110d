"""Image URLs of chat requests -> bytes or data: URLs the engine decodes (with the server's limits).

data: URLs pass through (size-checked); http(s) URLs are fetched with a timeout and a byte cap;
file:// URLs are read only under --allowed-local-media-path (symlinks resolved first, so a link
cannot lead outside it). Anything else is refused. Every failure is a 400 naming the URL, so a
client sees why its image was not used; decoding (corrupt data) is the engine's job.
"""

from __future__ import annotations

import asyncio
import urllib.parse
from pathlib import Path
from typing import Any

from lm_console.engine.entrypoints.openai.errors import bad_request
from lm_console.engine.entrypoints.openai.settings import ServerSettings


class MediaLoader:
    """Resolves the image URLs of one server; owns one httpx client (closed by aclose())."""

    def __init__(self, settings: ServerSettings) -> None:
        self.timeout_s = settings.media_fetch_timeout_s
        self.max_bytes = settings.max_media_bytes
        allowed = settings.allowed_local_media_path
        self.allowed_dir = Path(allowed).expanduser().resolve() if allowed is not None else None
        self._client: Any = None

    async def load(self, url: str) -> str | bytes:
        """A data: URL (unchanged) or the image's bytes."""
        scheme = url.split(":", 1)[0].lower() if ":" in url else ""
        if scheme == "data":
            if len(url) * 3 // 4 > self.max_bytes:
                raise bad_request(f"the data: URL's image is larger than {self.max_bytes} bytes.", "messages",
                                  "image_too_large")
            return url
        if scheme in ("http", "https"):
            return await self._fetch(url)
        if scheme == "file":
            return await asyncio.to_thread(self._read_file, url)
        raise bad_request(f"image_url {_show(url)} must be a data:, http(s):// or file:// URL.", "messages",
                          "invalid_image_url")

    async def _fetch(self, url: str) -> bytes:
        import httpx

        if self._client is None:
            # trust_env=False: no proxy settings or .netrc from the environment reach a fetch.
            self._client = httpx.AsyncClient(timeout=self.timeout_s, follow_redirects=True,
                                             max_redirects=3, trust_env=False)
        try:
            async with self._client.stream("GET", url) as response:
                if response.status_code != 200:
                    raise bad_request(f"fetching image URL {_show(url)} returned HTTP {response.status_code}.",
                                      "messages", "image_fetch_failed")
                declared = response.headers.get("content-length")
                if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
                    raise self._too_large(url)
                chunks: list[bytes] = []
                total = 0
                async for chunk in response.aiter_bytes():
                    total += len(chunk)
                    if total > self.max_bytes:
                        raise self._too_large(url)
                    chunks.append(chunk)
                return b"".join(chunks)
        except httpx.TimeoutException as error:
            raise bad_request(f"fetching image URL {_show(url)} timed out after {self.timeout_s:g} s.",
                              "messages", "image_fetch_failed") from error
        except httpx.HTTPError as error:
            raise bad_request(f"could not fetch image URL {_show(url)}: {error or type(error).__name__}.",
                              "messages", "image_fetch_failed") from error

    def _read_file(self, url: str) -> bytes:
        if self.allowed_dir is None:
            raise bad_request("file:// image URLs are disabled; start the server with "
                              "--allowed-local-media-path DIR to allow files under DIR.", "messages",
                              "file_url_not_allowed")
        parsed = urllib.parse.urlparse(url)
        if parsed.netloc not in ("", "localhost"):
            raise bad_request(f"file:// URL {_show(url)} names a remote host.", "messages", "file_url_not_allowed")
        path = Path(urllib.parse.unquote(parsed.path)).resolve()
        if not path.is_relative_to(self.allowed_dir):
            raise bad_request(f"file:// URL {_show(url)} is outside --allowed-local-media-path "
                              f"({self.allowed_dir}).", "messages", "file_url_not_allowed")
        if not path.is_file():
            raise bad_request(f"file:// URL {_show(url)} names no readable file.", "messages", "image_not_found")
        if path.stat().st_size > self.max_bytes:
            raise self._too_large(url)
        try:
            return path.read_bytes()
        except OSError as error:
            raise bad_request(f"file:// URL {_show(url)} cannot be read: {error}", "messages",
                              "image_not_found") from error

    def _too_large(self, url: str) -> Exception:
        return bad_request(f"the image at {_show(url)} is larger than {self.max_bytes} bytes.", "messages",
                           "image_too_large")

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None


def _show(url: str, limit: int = 100) -> str:
    return repr(url if len(url) <= limit else url[:limit] + "...")
