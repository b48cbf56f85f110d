"""Helpers shared by the KV cache tests (a uniquely named module: conftest is not importable)."""

from __future__ import annotations

from collections.abc import Callable

from lm_console.engine.kv_cache_hashing import get_request_block_hasher, init_none_hash, sha256_cbor
from lm_console.engine.request import MultiModalFeatureSpec, Request
from lm_console.engine.sampling_params import SamplingParams

init_none_hash(sha256_cbor)


def build_request(
    request_id: str,
    token_ids: list[int],
    block_size: int = 4,
    *,
    cache_salt: str | None = None,
    mm_features: list[MultiModalFeatureSpec] | None = None,
    prompt_logprobs: int | None = None,
    hash_fn: Callable[[object], bytes] = sha256_cbor,
) -> Request:
    """A request whose block_hashes are kept up to date at block_size granularity."""
    return Request(
        request_id=request_id,
        prompt_token_ids=list(token_ids),
        sampling_params=SamplingParams(max_tokens=16, prompt_logprobs=prompt_logprobs),
        eos_token_id=None,
        cache_salt=cache_salt,
        mm_features=mm_features or [],
        block_hasher=get_request_block_hasher(block_size, hash_fn),
    )
