"""Chunk hashing for the offload tiers: 256-token chunks on a hash chain (like the prefix cache's block hashes).

The chain is the engine's own (hash_block_tokens with extra keys), at chunk granularity, but its
root is not the per-process random NONE_HASH: it is a digest of the model's identity and the KV
layout, so two processes, or one process after a restart, agree on every key, and a chunk can
never be loaded into a different model or layout.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lm_console.engine.kv_cache_hashing import _first_mm_idx_at, generate_block_hash_extra_keys, hash_block_tokens

if TYPE_CHECKING:
    from lm_console.engine.request import Request

_LAYOUT_VERSION = 1


def model_fingerprint(model_dir: Path, dtype: str, layout: tuple[int, ...]) -> str:
    """Digest of the model (resolved path, config.json, weight file sizes), the dtype and the KV layout."""
    digest = hashlib.sha256()
    model_dir = Path(model_dir)
    digest.update(str(model_dir.resolve()).encode())
    config_file = model_dir / "config.json"
    if config_file.is_file():
        digest.update(config_file.read_bytes())
    for weights in sorted(model_dir.glob("*.safetensors")) if model_dir.is_dir() else [model_dir]:
        if weights.is_file():
            digest.update(f"{weights.name}:{weights.stat().st_size}".encode())
    digest.update(f"{dtype}:{layout}:{_LAYOUT_VERSION}".encode())
    return digest.hexdigest()


class ChunkHasher:
    """Hashes of a request's full chunks: hash(parent or root, chunk tokens, extra keys).

    Invariant: hashes[i] covers tokens [i * chunk_size, (i + 1) * chunk_size) and depends on every
    token before them, so a hit on hash i implies hits on 0..i-1 having the same content.
    """

    def __init__(self, chunk_size: int, hash_fn: Callable[[Any], bytes], fingerprint: str) -> None:
        self.chunk_size = chunk_size
        self.hash_fn = hash_fn
        self.root = hash_fn(("lmc-offload-root", fingerprint))

    def extend(self, request: Request, hashes: list[bytes], num_tokens: int) -> list[bytes]:
        """Append the hashes of the chunks that became full within the first num_tokens tokens."""
        size = self.chunk_size
        start = len(hashes) * size
        parent = hashes[-1] if hashes else self.root
        mm_idx = _first_mm_idx_at(request, start) if start else 0
        while start + size <= num_tokens:
            extra_keys, mm_idx = generate_block_hash_extra_keys(request, start, start + size, mm_idx)
            parent = hash_block_tokens(self.hash_fn, parent, request.all_token_ids[start:start + size], extra_keys)
            hashes.append(parent)
            start += size
        return hashes
