"""Block hash chain, packing, extra keys and the incremental request block hasher."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from lm_console.engine.kv_cache_hashing import (
    BlockHash,
    generate_block_hash_extra_keys,
    get_block_hash,
    get_group_id,
    get_hash_fn_by_name,
    hash_block_tokens,
    make_block_hash_with_group_id,
    sha256,
    sha256_cbor,
)
from lm_console.engine import kv_cache_hashing as hashing
from lm_console.engine.kv_cache_hashing import BlockHashListWithBlockSize
from lm_console.engine.errors import InvalidEngineArgsError
from lm_console.engine.request import MultiModalFeatureSpec

REPO_ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize("group_id", [0, 1, 255, 256, 2**32 - 1])
def test_block_hash_with_group_id_round_trip(group_id: int) -> None:
    block_hash = BlockHash(sha256_cbor("x"))
    key = make_block_hash_with_group_id(block_hash, group_id)
    assert isinstance(key, bytes) and len(key) == len(block_hash) + 4
    assert key[-4:] == group_id.to_bytes(4, "big")
    assert get_block_hash(key) == block_hash
    assert get_group_id(key) == group_id


@pytest.mark.parametrize("hash_fn", [sha256_cbor, sha256])
def test_hash_functions_are_deterministic_and_distinguish(hash_fn) -> None:  # type: ignore[no-untyped-def]
    value = (b"parent", (1, 2, 3), ("salt",))
    assert hash_fn(value) == hash_fn(value) and len(hash_fn(value)) == 32
    assert hash_fn(value) != hash_fn((b"parent", (1, 2, 4), ("salt",)))
    assert hash_fn((b"p", (1, 2), None)) != hash_fn((b"p", (1, 2), ("x",)))
    assert hash_fn((b"p", (2**70,), None)) != hash_fn((b"p", (2**70 + 1,), None))  # big ints


def test_sha256_encoding_is_unambiguous() -> None:
    assert sha256(("ab", "c")) != sha256(("a", "bc"))
    assert sha256((1, 2)) != sha256(((1, 2),))
    assert sha256(b"1") != sha256("1") != sha256(1)
    with pytest.raises(TypeError):
        sha256({1, 2})


def test_get_hash_fn_by_name() -> None:
    assert get_hash_fn_by_name("sha256_cbor") is sha256_cbor
    assert get_hash_fn_by_name("sha256") is sha256
    with pytest.raises(InvalidEngineArgsError, match="allowed"):
        get_hash_fn_by_name("md5")


def test_hash_chain_depends_on_parent_and_extra_keys() -> None:
    h0 = hash_block_tokens(sha256_cbor, None, [1, 2, 3, 4])
    assert h0 == hash_block_tokens(sha256_cbor, hashing.NONE_HASH, (1, 2, 3, 4))
    h1 = hash_block_tokens(sha256_cbor, h0, [5, 6, 7, 8])
    assert h1 != hash_block_tokens(sha256_cbor, None, [5, 6, 7, 8])
    assert h0 != hash_block_tokens(sha256_cbor, None, [1, 2, 3, 4], ("salt",))


def test_request_block_hasher_is_incremental(make_request) -> None:  # type: ignore[no-untyped-def]
    request = make_request("r", list(range(10)), block_size=4)
    assert len(request.block_hashes) == 2  # 2 full blocks, the partial one is not hashed
    first_two = list(request.block_hashes)
    request.append_output_token_ids([10])
    assert len(request.block_hashes) == 2
    request.append_output_token_ids(11)  # the third block is now full
    assert request.block_hashes[:2] == first_two and len(request.block_hashes) == 3
    expected = hash_block_tokens(sha256_cbor, first_two[1], [8, 9, 10, 11])
    assert request.block_hashes[2] == expected
    # The hasher only returns blocks beyond len(block_hashes).
    assert request.block_hasher(request) == []


def test_cache_salt_changes_every_hash(make_request) -> None:  # type: ignore[no-untyped-def]
    plain = make_request("a", list(range(12)))
    salted = make_request("b", list(range(12)), cache_salt="tenant-1")
    other = make_request("c", list(range(12)), cache_salt="tenant-2")
    assert len(plain.block_hashes) == len(salted.block_hashes) == 3
    for i in range(3):  # the salt enters block 0 only, the chain carries it on
        assert len({plain.block_hashes[i], salted.block_hashes[i], other.block_hashes[i]}) == 3
    extra0, _ = generate_block_hash_extra_keys(salted, 0, 4, 0)
    extra1, _ = generate_block_hash_extra_keys(salted, 4, 8, 0)
    assert extra0 == ("tenant-1",) and extra1 is None


def test_mm_extra_keys_overlap(make_request) -> None:  # type: ignore[no-untyped-def]
    features = [
        MultiModalFeatureSpec(identifier="img0", offset=2, length=3),  # tokens 2..4
        MultiModalFeatureSpec(identifier="img1", offset=9, length=6),  # tokens 9..14
    ]
    request = make_request("m", list(range(16)), mm_features=features)
    assert generate_block_hash_extra_keys(request, 0, 4, 0) == (("img0",), 0)  # img0 continues
    assert generate_block_hash_extra_keys(request, 4, 8, 0) == (("img0",), 1)  # img0 ends here
    assert generate_block_hash_extra_keys(request, 8, 12, 1) == (("img1",), 1)
    assert generate_block_hash_extra_keys(request, 12, 16, 1) == (("img1",), 2)
    assert generate_block_hash_extra_keys(request, 16, 20, 2) == (None, 2)
    assert generate_block_hash_extra_keys(request, 12, 16, -1) == (("img1",), 2)  # -1: last item
    # Scanning from item 0 skips the items that end before the block.
    assert generate_block_hash_extra_keys(request, 8, 12, 0) == (("img1",), 1)
    # An item that ends exactly where the block starts is not in it (tokens 2..7, block 8..11).
    ends_at_8 = make_request("e", list(range(16)), mm_features=[MultiModalFeatureSpec("img", offset=2, length=6)])
    assert generate_block_hash_extra_keys(ends_at_8, 8, 12, 0) == (None, 1)
    assert generate_block_hash_extra_keys(ends_at_8, 4, 8, 0) == (("img",), 1)
    # -1 starts at the last item even where an earlier one overlaps the block too.
    assert generate_block_hash_extra_keys(request, 4, 12, -1) == (("img1",), 1)
    # A different image in the same place changes the hash of its blocks and everything after.
    other = make_request("n", list(range(16)), mm_features=[features[0], MultiModalFeatureSpec("imgX", 9, 6)])
    assert request.block_hashes[:2] == other.block_hashes[:2]
    assert request.block_hashes[2] != other.block_hashes[2]


def test_mm_keys_in_incremental_blocks(make_request) -> None:  # type: ignore[no-untyped-def]
    # The prompt ends inside block 1, which holds two images; decode tokens complete it.
    features = [MultiModalFeatureSpec("a", 4, 1), MultiModalFeatureSpec("b", 5, 1)]
    request = make_request("m", list(range(6)), mm_features=features)
    request.append_output_token_ids([6, 7])
    extra, _ = generate_block_hash_extra_keys(request, 4, 8, 0)
    assert extra == ("a", "b")
    assert request.block_hashes[1] == hash_block_tokens(sha256_cbor, request.block_hashes[0], [4, 5, 6, 7], extra)


def test_block_hash_list_with_block_size() -> None:
    hashes = [BlockHash(bytes([i]) * 4) for i in range(5)]
    merged = BlockHashListWithBlockSize(hashes, hash_block_size=2, block_size=4)
    assert len(merged) == 2
    assert merged[0] == hashes[0] + hashes[1] and merged[-1] == hashes[2] + hashes[3]
    assert list(merged) == [merged[0], merged[1]] and merged[0:2] == list(merged)
    with pytest.raises(IndexError):
        merged[2]


_HASH_SCRIPT = (
    "from lm_console.engine.kv_cache_hashing import get_request_block_hasher, init_none_hash, {fn}\n"
    "from lm_console.engine.request import Request\n"
    "from lm_console.engine.sampling_params import SamplingParams\n"
    "init_none_hash({fn})\n"
    "r = Request('r', list(range(9)), SamplingParams(), None, cache_salt='s',\n"
    "            block_hasher=get_request_block_hasher(4, {fn}))\n"
    "print(','.join(h.hex() for h in r.block_hashes))\n"
)


def _hashes_in_subprocess(fn: str, seed: str | None) -> str:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    if seed is not None:
        env["PYTHONHASHSEED"] = seed
    result = subprocess.run(
        [sys.executable, "-c", _HASH_SCRIPT.format(fn=fn)],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, check=True, timeout=60,
    )
    return result.stdout.strip()


@pytest.mark.parametrize("fn", ["sha256_cbor", "sha256"])
def test_hashes_reproducible_across_processes_with_pythonhashseed(fn: str) -> None:
    first = _hashes_in_subprocess(fn, "0")
    assert first and first.count(",") == 1  # two full blocks
    assert first == _hashes_in_subprocess(fn, "0")
    assert first != _hashes_in_subprocess(fn, "1")


def test_hashes_random_without_pythonhashseed() -> None:
    # NONE_HASH comes from os.urandom, so two processes disagree.
    assert _hashes_in_subprocess("sha256_cbor", None) != _hashes_in_subprocess("sha256_cbor", None)


# -- every token counts: a hash that reads part of a block must fail these -----------------------
def _drop_12_of_16(monkeypatch: pytest.MonkeyPatch) -> None:
    """The mutation: block hashes that read every 4th token only (12 of 16 ignored)."""
    real = hashing.hash_block_tokens

    def lossy(fn, parent, tokens, extra_keys=None):  # type: ignore[no-untyped-def]
        return real(fn, parent, list(tokens)[::4], extra_keys)

    monkeypatch.setattr(hashing, "hash_block_tokens", lossy)


def _assert_every_token_changes_its_blocks_hash(make_request) -> None:  # type: ignore[no-untyped-def]
    """Changing any one of 48 prompt tokens (blocks of 16) changes the hash of its block and of
    every later block, and of no earlier block."""
    base = list(range(100, 148))
    ref = make_request("ref", base, block_size=16).block_hashes
    assert len(ref) == 3
    for pos in range(len(base)):
        tokens = list(base)
        tokens[pos] += 1000
        hashes = make_request(f"p{pos}", tokens, block_size=16).block_hashes
        block = pos // 16
        assert hashes[:block] == ref[:block], f"token {pos} changed an earlier block's hash"
        assert all(h != r for h, r in zip(hashes[block:], ref[block:])), \
            f"token {pos} left the hash of its block or a later one unchanged"
    for pos in range(16):
        tokens = list(range(16))
        tokens[pos] = 999
        assert hashing.hash_block_tokens(sha256_cbor, None, tokens) != \
            hashing.hash_block_tokens(sha256_cbor, None, list(range(16))), f"token {pos} ignored"


def test_every_token_of_a_block_enters_its_hash(make_request) -> None:  # type: ignore[no-untyped-def]
    _assert_every_token_changes_its_blocks_hash(make_request)


def test_negative_control_a_hash_that_drops_tokens_is_caught(make_request, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    _drop_12_of_16(monkeypatch)
    with pytest.raises(AssertionError, match="unchanged|ignored"):
        _assert_every_token_changes_its_blocks_hash(make_request)


def test_hash_values_are_pinned() -> None:
    """Both encodings are a contract: hashes are shared with KV connectors and across processes,
    so a change of encoding (a tag, a length prefix's width) must be deliberate. Golden digests of
    a value with every kind the block hashes carry (bytes, token ids, str, int, None, a big int)."""
    value = (b"parent", (1, 2, 3), ("salt", 7, None, 2**70))
    assert sha256(value).hex() == "c50172991d0b002d67381727bbb3a71fb2a365349e46f98f99fa7f0c37e2e2fd"
    assert sha256_cbor(value).hex() == "32aa3520476538bd19d5cde25e789a15daadcd600025c2c7d1e395070a62c116"
