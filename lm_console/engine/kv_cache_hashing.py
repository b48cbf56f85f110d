"""Prefix-cache hashing: block hash chain, NONE_HASH seed, extra keys, request block hasher.

After vLLM's vllm/v1/core/kv_cache_utils.py. The core's prefix cache, the request (its block_hashes),
the KV cache events and the KV connectors (the offload tiers' chunk keys) all use this one chain,
so it lives at the bottom and imports no torch.
"""

from __future__ import annotations

import hashlib
import logging
import os
import struct
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, NewType, Protocol

import cbor2

from lm_console.engine import envs
from lm_console.engine.errors import InvalidEngineArgsError

if TYPE_CHECKING:
    from lm_console.engine.lora.request import LoRARequest
    from lm_console.engine.multimodal.inputs import MultiModalFeatureSpec

logger = logging.getLogger(__name__)

# A block's hash: the digest of (parent, tokens, extra).
BlockHash = NewType("BlockHash", bytes)
# BlockHash + 4-byte big-endian group id, packed into one bytes object so that a map key costs
# one Python object instead of a tuple of two (less GC work on a dict of ~1e5 entries).
BlockHashWithGroupId = NewType("BlockHashWithGroupId", bytes)

_GROUP_ID_BYTES = 4


class HashedRequest(Protocol):
    """What the request block hasher reads of a request (the engine core's Request has it all);
    a protocol, so that this bottom module does not import the request type that uses it."""

    all_token_ids: list[int]
    block_hashes: list[BlockHash]
    cache_salt: str | None
    mm_features: list[MultiModalFeatureSpec]
    lora_request: LoRARequest | None

    @property
    def num_tokens(self) -> int: ...


def make_block_hash_with_group_id(block_hash: BlockHash, group_id: int) -> BlockHashWithGroupId:
    """Pack a block hash and a KV cache group id (after vLLM's BlockHashWithGroupId)."""
    return BlockHashWithGroupId(block_hash + group_id.to_bytes(_GROUP_ID_BYTES, "big", signed=False))


def get_block_hash(key: BlockHashWithGroupId) -> BlockHash:
    """The block hash part of a packed key."""
    return BlockHash(key[:-_GROUP_ID_BYTES])


def get_group_id(key: BlockHashWithGroupId) -> int:
    """The group id part of a packed key."""
    return int.from_bytes(key[-_GROUP_ID_BYTES:], "big", signed=False)


# -- hash functions ----------------------------------------------------------------------------
def sha256_cbor(input: Any) -> bytes:
    """SHA-256 over canonical CBOR: independent of PYTHONHASHSEED and of object identity."""
    return hashlib.sha256(cbor2.dumps(input, canonical=True)).digest()


def sha256(input: Any) -> bytes:
    """SHA-256 over a small deterministic tagged encoding (no pickle: its memo depends on ids)."""
    out = bytearray()
    _encode(input, out)
    return hashlib.sha256(out).digest()


def _encode(obj: Any, out: bytearray) -> None:
    # Tag + length prefix on every item so that distinct values never share an encoding.
    if obj is None:
        out += b"N"
    elif isinstance(obj, bool):
        out += b"T" if obj else b"F"
    elif isinstance(obj, int):
        digits = str(obj).encode()
        out += b"I" + len(digits).to_bytes(4, "big") + digits
    elif isinstance(obj, (bytes, bytearray)):
        out += b"B" + len(obj).to_bytes(8, "big") + obj
    elif isinstance(obj, str):
        data = obj.encode("utf-8")
        out += b"S" + len(data).to_bytes(8, "big") + data
    elif isinstance(obj, (tuple, list)):
        try:  # fast path for token ids: one struct.pack instead of a Python loop
            if all(type(x) is int for x in obj):
                out += b"Q" + len(obj).to_bytes(8, "big") + struct.pack(f">{len(obj)}q", *obj)
                return
        except struct.error:
            pass  # an int beyond 64 bits: fall back to the generic encoding
        out += b"L" + len(obj).to_bytes(8, "big")
        for item in obj:
            _encode(item, out)
    else:
        raise TypeError(f"sha256 cannot hash {type(obj).__name__}; use None/int/bytes/str/tuple")


_HASH_FNS: dict[str, Callable[[Any], bytes]] = {"sha256_cbor": sha256_cbor, "sha256": sha256}


def get_hash_fn_by_name(name: str) -> Callable[[Any], bytes]:
    """Resolve prefix_caching_hash_algo to a hash function."""
    try:
        return _HASH_FNS[name]
    except KeyError:
        raise InvalidEngineArgsError(
            f"prefix_caching_hash_algo={name!r} is unknown; allowed: {sorted(_HASH_FNS)}."
        ) from None


# -- NONE_HASH -----------------------------------------------------------
# The chain's root. Module-level because every request hasher and every process must share it.
NONE_HASH: BlockHash | None = None


def init_none_hash(hash_fn: Callable[[Any], bytes]) -> None:
    """Set NONE_HASH: random without PYTHONHASHSEED, hash_fn(seed) with it (after vLLM's NONE_HASH)."""
    global NONE_HASH
    hash_seed = envs.PYTHONHASHSEED.get() or None
    if hash_seed is None:
        if hash_fn is sha256_cbor:
            logger.warning(
                "PYTHONHASHSEED is not set: prefix-cache hashes will differ between processes "
                "(set it to share hashes with a KV connector)."
            )
        NONE_HASH = BlockHash(os.urandom(32))
    else:
        NONE_HASH = BlockHash(hash_fn(hash_seed))


def hash_block_tokens(
    hash_function: Callable[[Any], bytes],
    parent_block_hash: BlockHash | None,
    curr_block_token_ids: Sequence[int],
    extra_keys: tuple[Any, ...] | None = None,
) -> BlockHash:
    """hash((parent or NONE_HASH, tokens, extra_keys)) (after vLLM's hash_block_tokens)."""
    if not parent_block_hash:
        if NONE_HASH is None:
            init_none_hash(hash_function)  # lazily, so that tests and tools need no setup call
        parent_block_hash = NONE_HASH
    return BlockHash(hash_function((parent_block_hash, tuple(curr_block_token_ids), extra_keys)))


# -- extra keys ----------------------------------------------------------------------------------
def _gen_mm_extra_hash_keys(
    request: HashedRequest, start_token_idx: int, end_token_idx: int, start_mm_idx: int
) -> tuple[list[Any], int]:
    """Identifiers of the mm items overlapping [start, end); features are sorted by offset."""
    mm_features = request.mm_features
    if not mm_features:
        return [], start_mm_idx
    if start_mm_idx < 0:  # -1 means "the last mm item"
        start_mm_idx = max(len(mm_features) + start_mm_idx, 0)
    keys: list[Any] = []
    idx = start_mm_idx
    while idx < len(mm_features):
        feature = mm_features[idx]
        item_end = feature.offset + feature.length
        if item_end <= start_token_idx:  # the block is already past this item
            idx += 1
            continue
        if feature.offset >= end_token_idx:  # this item starts after the block
            break
        keys.append(feature.identifier)
        if item_end > end_token_idx:  # the item continues into the next block: resume here
            break
        idx += 1
    return keys, idx


def generate_block_hash_extra_keys(
    request: HashedRequest, start_token_idx: int, end_token_idx: int, start_mm_idx: int
) -> tuple[tuple[Any, ...] | None, int]:
    """lora + mm + cache_salt keys of one block, None when empty."""
    mm_keys, next_mm_idx = _gen_mm_extra_hash_keys(request, start_token_idx, end_token_idx, start_mm_idx)
    # Every block of an adapter's request carries the adapter (name and id, so an adapter
    # reloaded under its name with a new id shares nothing with the old one): KV computed
    # through one adapter's q/k/v deltas is never another's or the base model's.
    lora = request.lora_request
    lora_keys: list[Any] = [lora.lora_name, lora.lora_int_id] if lora is not None else []
    # The salt only needs to enter the first block: the chain carries it to every later one.
    salt_keys = [request.cache_salt] if start_token_idx == 0 and request.cache_salt else []
    extra_keys = lora_keys + mm_keys + salt_keys
    return (tuple(extra_keys) if extra_keys else None), next_mm_idx


def _first_mm_idx_at(request: HashedRequest, token_idx: int) -> int:
    # Index of the first mm item that ends after token_idx; scanning is fine (few items).
    for idx, feature in enumerate(request.mm_features):
        if feature.offset + feature.length > token_idx:
            return idx
    return len(request.mm_features)


def get_request_block_hasher(
    block_size: int, caching_hash_fn: Callable[[Any], bytes]
) -> Callable[[HashedRequest], list[BlockHash]]:
    """A hasher returning the hashes of the request's NEW full blocks."""
    if NONE_HASH is None:
        init_none_hash(caching_hash_fn)

    def request_block_hasher(request: HashedRequest) -> list[BlockHash]:
        start_token_idx = len(request.block_hashes) * block_size
        num_tokens = request.num_tokens
        if start_token_idx + block_size > num_tokens:
            return []  # no new full block: partial blocks are never hashed
        curr_mm_idx = _first_mm_idx_at(request, start_token_idx) if start_token_idx else 0
        prev_block_hash = request.block_hashes[-1] if request.block_hashes else None
        new_block_hashes: list[BlockHash] = []
        while start_token_idx + block_size <= num_tokens:
            end_token_idx = start_token_idx + block_size
            extra_keys, curr_mm_idx = generate_block_hash_extra_keys(
                request, start_token_idx, end_token_idx, curr_mm_idx
            )
            block_tokens = request.all_token_ids[start_token_idx:end_token_idx]
            prev_block_hash = hash_block_tokens(caching_hash_fn, prev_block_hash, block_tokens, extra_keys)
            new_block_hashes.append(prev_block_hash)
            start_token_idx = end_token_idx
        return new_block_hashes

    return request_block_hasher


class BlockHashListWithBlockSize:
    """Lazy view of hashes at hash_block_size as hashes at a larger block_size.

    After vLLM's BlockHashListWithBlockSize. Invariant: block_size is a multiple of
    hash_block_size; item i is the concatenation of the scale_factor source hashes it covers.
    """

    def __init__(self, block_hashes: Sequence[BlockHash], hash_block_size: int, block_size: int) -> None:
        assert block_size % hash_block_size == 0, (block_size, hash_block_size)
        self.block_hashes = block_hashes
        self.scale_factor = block_size // hash_block_size

    def __len__(self) -> int:
        return len(self.block_hashes) // self.scale_factor

    def _get_value_at(self, idx: int) -> BlockHash:
        base = idx * self.scale_factor
        return BlockHash(b"".join(self.block_hashes[base : base + self.scale_factor]))

    def __getitem__(self, idx: int | slice) -> Any:
        if isinstance(idx, slice):
            return [self._get_value_at(i) for i in range(*idx.indices(len(self)))]
        if idx < 0:
            idx += len(self)
        if not 0 <= idx < len(self):
            raise IndexError(idx)
        return self._get_value_at(idx)

    def __iter__(self) -> Iterator[BlockHash]:
        for idx in range(len(self)):
            yield self._get_value_at(idx)
