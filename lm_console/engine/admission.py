"""Type-safe admission: a request is accepted only if the engine core can decode it.

The frontend runs every EngineCoreRequest through the core's own typed msgpack decode before
it sends it (check_decodable), so a value the core would refuse (a bool where an int goes, an
int key in extra_args, a lone surrogate, an int beyond 64 bits, an object msgpack cannot
carry) fails as that request's specific engine.errors exception instead of a dropped message.
The core side uses the same mapping (error_for_path) when a message still fails to decode, and
read_request_ids() to answer every request id it can read from a message it cannot decode.
Torch-free: both processes import it.
"""

from __future__ import annotations

import re
import msgspec

from lm_console.engine.errors import (
    EngineError, InvalidPromptError, InvalidRequestError, InvalidRequestIdError, InvalidSamplingParamsError,
)
from lm_console.engine.protocol import EngineCoreRequest

MAX_REQUEST_ID_CHARS = 1024

# EngineCoreRequest is array_like: field i of the request is "$[i]" in msgspec's error paths.
_FIELD_ERRORS: dict[int, type[EngineError]] = {
    0: InvalidRequestIdError,  # request_id
    1: InvalidPromptError,  # prompt_token_ids
    2: InvalidSamplingParamsError,  # sampling_params
}
_FIELD_NAMES = [f for f in EngineCoreRequest.__struct_fields__]
_CLIENT_INDEX_FIELD = _FIELD_NAMES.index("client_index")

_request_decoder = msgspec.msgpack.Decoder(EngineCoreRequest)


def check_request_id(request_id: object) -> str:
    """The request id if it is a usable str; InvalidRequestIdError otherwise."""
    if not isinstance(request_id, str) or not request_id or len(request_id) > MAX_REQUEST_ID_CHARS:
        shown = repr(request_id) if not isinstance(request_id, str) else f"a str of {len(request_id)} characters"
        raise InvalidRequestIdError(
            f"request_id must be a non-empty str of at most {MAX_REQUEST_ID_CHARS} characters, got {shown[:80]}.")
    try:
        request_id.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidRequestIdError("request_id must be valid Unicode text (it holds a lone surrogate).") from None
    return request_id


def check_decodable(request: EngineCoreRequest) -> None:
    """Raise the request's specific error unless the core's typed decode accepts it.

    Encodes the request as the client will and decodes it as the core does (SamplingParams'
    __post_init__ included). Multimodal tensors are left out: the processor made them, and
    they travel as raw frames the core does not type-check.
    """
    if request.mm_features:
        request = msgspec.structs.replace(
            request, mm_features=[msgspec.structs.replace(f, data=None) for f in request.mm_features])
    try:
        payload = msgspec.msgpack.encode(request)
    except (TypeError, ValueError, OverflowError) as error:  # UnicodeEncodeError is a ValueError
        raise _encode_error(request, error) from None
    try:
        _request_decoder.decode(payload)
    except msgspec.ValidationError as error:
        raise error_for_path(str(error)) from None
    except EngineError:
        raise
    except (TypeError, ValueError) as error:
        raise InvalidSamplingParamsError(f"SamplingParams do not survive the trip to the engine core: {error}") from None


def error_for_path(message: str, where: str = "cannot be sent to the engine core") -> EngineError:
    """The engine.errors exception for a msgspec ValidationError message about one request."""
    match = re.search(r"`\$\[(\d+)\]", message)
    index = int(match.group(1)) if match else -1
    cls = _FIELD_ERRORS.get(index, InvalidRequestError)
    name = _FIELD_NAMES[index] if 0 <= index < len(_FIELD_NAMES) else "request"
    if index == 1:
        name = "prompt_token_ids must be a list of ints (not bools or floats); it"
    return cls(f"{name} {where}: {message}")


def _encode_error(request: EngineCoreRequest, error: BaseException) -> EngineError:
    """Which part of the request cannot be encoded (msgpack gives no path): try each field."""
    for index, name in enumerate(_FIELD_NAMES):
        try:
            msgspec.msgpack.encode(getattr(request, name))
        except (TypeError, ValueError, OverflowError) as field_error:
            cls = _FIELD_ERRORS.get(index, InvalidRequestError)
            return cls(f"{name} cannot be sent to the engine core: {type(field_error).__name__}: {field_error}")
    return InvalidRequestError(f"the request cannot be sent to the engine core: {type(error).__name__}: {error}")


def read_request_ids(raw: bytes | memoryview) -> tuple[str | None, int | None]:
    """(request_id, client_index) of one undecodable request, read loosely; None where unreadable."""
    try:
        item = msgspec.msgpack.decode(raw, ext_hook=lambda code, data: None)
    except Exception:  # noqa: BLE001 - not even msgpack
        return None, None
    if not isinstance(item, (list, tuple)) or not item:
        return None, None
    request_id = item[0] if isinstance(item[0], str) and item[0] else None
    client_index = None
    if len(item) > _CLIENT_INDEX_FIELD:
        value = item[_CLIENT_INDEX_FIELD]
        client_index = value if isinstance(value, int) and not isinstance(value, bool) else None
    elif request_id is not None:
        client_index = 0  # the field's default
    return request_id, client_index


__all__ = ["MAX_REQUEST_ID_CHARS", "check_decodable", "check_request_id", "error_for_path", "read_request_ids"]
