"""MultiModalHasher: content hash of an mm item (after vLLM's MultiModalHasher).

hash_kwargs(model_id=..., image=..., **processor_kwargs) feeds every keyword, sorted by name,
into one hasher: each value is prefixed by its dotted key path, so that no two different
argument sets share a byte stream. Images hash their original encoded bytes when known
(cheap), else mode + size + decoded pixels.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from typing import Any

from lm_console.engine.errors import InvalidEngineArgsError
from lm_console.engine.multimodal.image import ImageItem


def _blake3_factory() -> Callable[[], Any]:
    import blake3

    return blake3.blake3


def _hasher_factories() -> dict[str, Callable[[], Callable[[], Any]]]:
    return {
        "blake3": _blake3_factory,
        "sha256": lambda: hashlib.sha256,
        "sha512": lambda: hashlib.sha512,
    }


def default_algorithm() -> str:
    """blake3 when the package is installed (fast), else sha256."""
    try:
        import blake3  # noqa: F401
    except ImportError:
        return "sha256"
    return "blake3"


def verify_algorithm(name: str) -> str:
    """Resolve 'auto' and reject unknown names with an actionable message."""
    if name == "auto":
        return default_algorithm()
    if name not in _hasher_factories():
        raise InvalidEngineArgsError(
            f"mm_hasher_algorithm={name!r} is unknown; allowed: auto, {', '.join(_hasher_factories())}.")
    if name == "blake3" and default_algorithm() != "blake3":
        raise InvalidEngineArgsError("mm_hasher_algorithm='blake3' needs `pip install blake3`.")
    return name


class MultiModalHasher:
    """Content hashes of multimodal items with a chosen algorithm (blake3, sha256, sha512)."""

    def __init__(self, algorithm: str = "auto") -> None:
        self.algorithm = verify_algorithm(algorithm)
        self._factory = _hasher_factories()[self.algorithm]()

    def hash_kwargs(self, **kwargs: Any) -> str:
        """Hex digest over every keyword argument, in sorted key order (after vLLM's hash_kwargs)."""
        hasher = self._factory()
        for key, value in sorted(kwargs.items(), key=lambda kv: kv[0]):
            for chunk in self.iter_item_to_bytes(key, value):
                hasher.update(chunk)
        return hasher.hexdigest()

    @classmethod
    def iter_item_to_bytes(cls, key: str, obj: Any) -> Iterator[bytes]:
        """Key path then value bytes, recursing into dicts, lists and tuples."""
        if isinstance(obj, dict):
            for sub_key, value in sorted(obj.items(), key=lambda kv: str(kv[0])):
                yield from cls.iter_item_to_bytes(f"{key}.{sub_key}", value)
        elif isinstance(obj, (list, tuple)):
            yield f"{key}#len{len(obj)}".encode()
            for index, value in enumerate(obj):
                yield from cls.iter_item_to_bytes(f"{key}.{index}", value)
        else:
            key_bytes = key.encode()
            payload = cls.serialize_item(obj)
            # Length prefixes keep ("ab", "c") and ("a", "bc") apart.
            yield len(key_bytes).to_bytes(4, "big") + key_bytes
            yield len(payload).to_bytes(8, "big") + payload

    @staticmethod
    def serialize_item(obj: Any) -> bytes:
        """Bytes of one leaf value (after vLLM's serialize_item)."""
        if isinstance(obj, ImageItem):
            if obj.raw is not None:
                return b"raw:" + obj.raw  # the original JPEG/PNG bytes: no pixel work
            obj = obj.image
        if isinstance(obj, (bytes, bytearray, memoryview)):
            return bytes(obj)
        if isinstance(obj, str):
            return obj.encode()
        if obj is None or isinstance(obj, (bool, int, float)):
            return repr(obj).encode()
        module = type(obj).__module__
        if module.startswith("PIL."):
            import numpy as np

            header = f"pil:{obj.mode}:{obj.width}x{obj.height}:".encode()
            return header + np.asarray(obj).tobytes()
        if module == "numpy" or hasattr(obj, "__array__"):
            import numpy as np

            array = np.ascontiguousarray(obj)
            return f"nd:{array.dtype}:{array.shape}:".encode() + array.tobytes()
        raise TypeError(f"MultiModalHasher cannot hash a {type(obj).__name__}")
