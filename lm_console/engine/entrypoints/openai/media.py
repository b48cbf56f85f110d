"""Image URLs of chat requests -> image bytes the engine decodes (with the server's limits).

data: URLs are size-checked and base64-decoded; http(s) URLs are fetched under one deadline for
the whole fetch (redirects included) and a byte cap, and only from public addresses: a URL
whose host resolves to a loopback, private, link-local or otherwise non-public address is
refused, at every redirect, unless --allow-private-media-urls is set, and the fetch dials the
address that was checked (a second DNS answer cannot point it elsewhere); file:// URLs are read only
under --allowed-local-media-path (symlinks resolved first, so a link cannot lead outside it).
Anything else is refused. Every failure is a 400 naming the URL, so a client sees why its image
was not used, but never how the network behind the server answered (a refused port and a silent
one read the same). check_image reads an image's header, not its pixels: one with more than
--max-image-pixels is refused before anything decodes it.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import io
import ipaddress
import socket
import urllib.parse
from pathlib import Path
from typing import Any

from lm_console.engine.entrypoints.openai.errors import bad_request
from lm_console.engine.entrypoints.openai.settings import ServerSettings

MAX_REDIRECTS = 3


class MediaLoader:
    """Resolves the image URLs of one server; owns one httpx client (closed by aclose())."""

    def __init__(self, settings: ServerSettings) -> None:
        self.timeout_s = settings.media_fetch_timeout_s
        self.max_bytes = settings.max_media_bytes
        self.max_pixels = settings.max_image_pixels
        self.allow_private = settings.allow_private_media_urls
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
            # Redirects are followed by hand, so that each hop's address is checked.
            self._client = httpx.AsyncClient(timeout=self.timeout_s, follow_redirects=False, trust_env=False)
        try:
            # One deadline for the whole fetch: a server sending a byte every few seconds cannot
            # hold the request past it (httpx's timeout is per read).
            return await asyncio.wait_for(self._fetch_following(url), self.timeout_s)
        except (asyncio.TimeoutError, httpx.HTTPError, httpx.InvalidURL, UnicodeError):
            # One text for a refused, a silent and a dropped connection: how the network behind
            # the server answered is not the client's business.
            raise self._no_image(url) from None

    async def _fetch_following(self, url: str) -> bytes:
        import httpx

        current = url
        for _ in range(MAX_REDIRECTS + 1):
            addresses = await self._check_host(url, current)
            candidates: list[str | None] = list(addresses) if addresses is not None else [None]
            for index, address in enumerate(candidates):
                try:
                    result = await self._get(url, current, address)
                    break
                except httpx.ConnectError:  # the next address, as a browser would
                    if index == len(candidates) - 1:
                        raise
            if isinstance(result, bytes):
                return result
            current = result  # a redirect: its address is checked like the first one
        raise bad_request(f"image URL {_show(url)} redirects more than {MAX_REDIRECTS} times.", "messages",
                          "image_fetch_failed")

    async def _get(self, url: str, current: str, address: str | None) -> bytes | str:
        """One GET of `current` (from `address` when given): the image's bytes, or where it redirects."""
        target, headers, extensions = current, {}, {}
        if address is not None:
            # Connect to the address just checked, not to whatever a second DNS answer says (DNS
            # rebinding); the Host header and the TLS name stay the URL's own.
            parsed = urllib.parse.urlsplit(current)
            host = f"[{address}]" if ":" in address else address
            userinfo, at, hostport = parsed.netloc.rpartition("@")
            netloc = userinfo + at + host + (f":{parsed.port}" if parsed.port else "")
            target = urllib.parse.urlunsplit(parsed._replace(netloc=netloc))
            headers = {"Host": hostport}
            extensions = {"sni_hostname": parsed.hostname}
        async with self._client.stream("GET", target, headers=headers, extensions=extensions) as response:
            if response.is_redirect:
                location = urllib.parse.urljoin(current, response.headers.get("location", ""))
                if urllib.parse.urlparse(location).scheme not in ("http", "https"):
                    raise bad_request(f"image URL {_show(url)} redirects to a non-http(s) URL.", "messages",
                                      "image_fetch_failed")
                return location
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

    async def _check_host(self, url: str, current: str) -> list[str] | None:
        """The public addresses to fetch `current` from (tried in order); 400 when its host resolves
        to any non-public address. None when private addresses are allowed (fetched as it is)."""
        if self.allow_private:
            return None
        parsed = urllib.parse.urlparse(current)
        host = parsed.hostname
        if not host:
            raise bad_request(f"image URL {_show(url)} has no host.", "messages", "invalid_image_url")
        try:
            port = parsed.port or 443
            infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except (OSError, UnicodeError, ValueError):
            raise self._no_image(url) from None
        addresses = [str(info[4][0]).split("%", 1)[0] for info in infos]
        if not addresses or not all(_is_public(address) for address in addresses):
            raise bad_request(
                f"image URL {_show(url)} leads to a loopback, private or link-local address, which the "
                "server does not fetch from (--allow-private-media-urls allows it).", "messages",
                "image_url_not_allowed")
        return addresses

    def check_image(self, source: str | bytes) -> bytes:
        """The image's bytes, once its header says it has at most max_pixels pixels (no pixel
        is decoded here; call it in the serving pool)."""
        from PIL import Image, UnidentifiedImageError

        raw = _data_url_bytes(source) if isinstance(source, str) else source
        try:
            with Image.open(io.BytesIO(raw)) as opened:  # lazy: reads the header only
                width, height = opened.size
        except (UnidentifiedImageError, OSError, SyntaxError, ValueError):
            return raw  # not an image PIL knows: the engine's decoder says why, with the formats it takes
        except Image.DecompressionBombError:
            width = height = self.max_pixels + 1  # PIL refuses it outright: beyond any limit we set
        if width * height > self.max_pixels:
            raise bad_request(f"the image is {width}x{height} = {width * height} pixels; at most "
                              f"{self.max_pixels} are allowed (--max-image-pixels).", "messages", "image_too_large")
        return raw

    def _read_file(self, url: str) -> bytes:
        if self.allowed_dir is None:
            raise bad_request("file:// image URLs are disabled; start the server with "
                              "--allowed-local-media-path DIR to allow files under DIR.", "messages",
                              "file_url_not_allowed")
        parsed = urllib.parse.urlparse(url)
        if parsed.netloc not in ("", "localhost"):
            raise bad_request(f"file:// URL {_show(url)} names a remote host.", "messages", "file_url_not_allowed")
        raw_path = urllib.parse.unquote(parsed.path)
        if "\0" in raw_path:
            raise bad_request(f"file:// URL {_show(url)} has a NUL byte (%00) in its path.", "messages",
                              "invalid_image_url")
        try:
            # strict: a symlink loop or a missing file fails here (RuntimeError before Python 3.13).
            path = Path(raw_path).resolve(strict=True)
        except (OSError, RuntimeError, ValueError):
            raise bad_request(f"file:// URL {_show(url)} names no readable file (missing, or a symlink loop).",
                              "messages", "image_not_found") from None
        if not path.is_relative_to(self.allowed_dir):
            raise bad_request(f"file:// URL {_show(url)} is outside --allowed-local-media-path "
                              f"({self.allowed_dir}).", "messages", "file_url_not_allowed")
        try:
            if not path.is_file():
                raise bad_request(f"file:// URL {_show(url)} names no readable file.", "messages", "image_not_found")
            if path.stat().st_size > self.max_bytes:
                raise self._too_large(url)
            return path.read_bytes()
        except OSError as error:
            raise bad_request(f"file:// URL {_show(url)} cannot be read: {error.strerror or 'I/O error'}.",
                              "messages", "image_not_found") from None

    def _no_image(self, url: str) -> Exception:
        return bad_request(f"could not fetch image URL {_show(url)}: no complete image arrived within "
                           f"{self.timeout_s:g} s.", "messages", "image_fetch_failed")

    def _too_large(self, url: str) -> Exception:
        return bad_request(f"the image at {_show(url)} is larger than {self.max_bytes} bytes.", "messages",
                           "image_too_large")

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None


def _is_public(address: str) -> bool:
    """Whether an address is a public unicast one (an IPv4-mapped IPv6 address is judged as IPv4)."""
    ip = ipaddress.ip_address(address.split("%", 1)[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return not (ip.is_private or ip.is_loopback or ip.is_link_local or ip.is_multicast or ip.is_reserved
                or ip.is_unspecified or not ip.is_global)


def _data_url_bytes(url: str) -> bytes:
    header, sep, payload = url.partition(",")
    if not sep or ";base64" not in header:
        raise bad_request("a data: URL must look like data:image/png;base64,<data>.", "messages", "invalid_image")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as error:
        raise bad_request(f"the data: URL's base64 payload is invalid: {error}", "messages",
                          "invalid_image") from None


def _show(url: str, limit: int = 100) -> str:
    return repr(url if len(url) <= limit else url[:limit] + "...")
