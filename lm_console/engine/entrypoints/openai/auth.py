"""require_api_key: the FastAPI dependency that guards /v1/*, the tokenizer and console routes.

Clients send `Authorization: Bearer <key>` (what the OpenAI SDK sends for api_key=...). The
comparison hashes both sides and compares the digests in constant time, so neither the key's
content nor its length leaks through timing. /health, /metrics and /version stay open, as in
vLLM, so probes and Prometheus need no secret; everything else, /docs, /openapi.json and /redoc
included, needs the key when one is set.
"""

from __future__ import annotations

import hashlib
import hmac
from http import HTTPStatus

from fastapi import Request

from lm_console.engine.entrypoints.openai.errors import OpenAIError


def _digest(value: str) -> bytes:
    return hashlib.sha256(value.encode("utf-8", "surrogateescape")).digest()


def api_key_matches(expected: str, authorization: str | None) -> bool:
    """True when the Authorization header carries `Bearer <expected>`."""
    if not authorization:
        return False
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer":
        return False
    return hmac.compare_digest(_digest(token.strip()), _digest(expected))


def unauthorized(expected: str | None, authorization: bytes | str | None) -> OpenAIError | None:
    """The 401 for a request with this Authorization header, or None when it may pass."""
    if expected is None:
        return None
    if isinstance(authorization, bytes):
        authorization = authorization.decode("latin-1")
    if api_key_matches(expected, authorization):
        return None
    reason = "no API key was sent" if not authorization else "the API key is wrong"
    return OpenAIError(HTTPStatus.UNAUTHORIZED,
                       f"Unauthorized: {reason}; send the header 'Authorization: Bearer <key>'.",
                       code="invalid_api_key")


async def require_api_key(request: Request) -> None:
    """Raise 401 unless the server has no key or the request presents it (ServerGate checks first,
    before the body is read; this guards routes of an app built without the gate)."""
    refused = unauthorized(request.app.state.settings.api_key, request.headers.get("authorization"))
    if refused is not None:
        raise refused
