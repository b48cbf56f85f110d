"""cache_salt from the prompt dict (vLLM's TextPrompt/TokensPrompt key): tenants' prefixes apart."""

from __future__ import annotations

import time

import pytest

from engine import LLM, SamplingParams
from engine.errors import InvalidPromptError
from engine.kv_cache_hashing import hash_block_tokens, sha256_cbor
from engine.metrics.kv_events import BlockStored, KVEventSubscriber

BLOCK_SIZE = 16
HASH_SEED = "15"  # the engine core's NONE_HASH = sha256_cbor(PYTHONHASHSEED): hashes we can recompute


@pytest.fixture(scope="module")
def salted_llm(tiny_llama_dir):
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PYTHONHASHSEED", HASH_SEED)  # the engine core process inherits it
        llm = LLM(str(tiny_llama_dir), dtype="float32", max_model_len=256, num_gpu_blocks_override=64,
                  enable_kv_cache_events=True)
    subscriber = KVEventSubscriber(llm.kv_events_endpoint)
    time.sleep(0.2)  # let the subscription reach the publisher
    yield llm, subscriber
    subscriber.close()
    llm.shutdown()


def _stored_events(subscriber: KVEventSubscriber) -> list[BlockStored]:
    stored = []
    while (message := subscriber.receive(0.3)) is not None:
        stored.extend(e for e in message[1].events if isinstance(e, BlockStored))
    return stored


def _expected_chain(token_ids: list[int], salt: str | None) -> list[bytes]:
    """The hash of every full block: the salt enters the first block's extra keys only."""
    none_hash = sha256_cbor(HASH_SEED)
    hashes: list[bytes] = []
    for start in range(0, len(token_ids) - BLOCK_SIZE + 1, BLOCK_SIZE):
        block = token_ids[start:start + BLOCK_SIZE]
        extra = (salt,) if start == 0 and salt else None
        parent = hashes[-1] if hashes else none_hash
        hashes.append(hash_block_tokens(sha256_cbor, parent, block, extra))
    return hashes


def test_salts_separate_blocks_and_events_carry_salted_hashes(salted_llm) -> None:
    llm, subscriber = salted_llm
    params = SamplingParams(temperature=0.0, max_tokens=1)
    tokens = list(range(300, 300 + 3 * BLOCK_SIZE + 5))  # 3 full blocks

    def run(salt: str | None) -> tuple[int, list[bytes]]:
        prompt: dict = {"prompt_token_ids": tokens}
        if salt is not None:
            prompt["cache_salt"] = salt
        output, = llm.generate(prompt, params, use_tqdm=False)
        return output.num_cached_tokens, [h for e in _stored_events(subscriber) for h in e.block_hashes]

    cached, stored_a = run("tenant-a")
    assert cached == 0 and stored_a == _expected_chain(tokens, "tenant-a")
    cached, stored_again = run("tenant-a")
    assert cached == 3 * BLOCK_SIZE and stored_again == []  # the same salt shares every block
    cached, stored_b = run("tenant-b")
    assert cached == 0 and stored_b == _expected_chain(tokens, "tenant-b")
    cached, stored_plain = run(None)
    assert cached == 0 and stored_plain == _expected_chain(tokens, None)
    assert not set(stored_a) & set(stored_b) and not set(stored_plain) & (set(stored_a) | set(stored_b))
    live = set(llm.engine_core.call_utility("get_prefix_cache_hashes"))
    assert set(stored_a) | set(stored_b) | set(stored_plain) <= live


def test_text_prompt_salt_and_concurrent_tenants(salted_llm) -> None:
    llm, subscriber = salted_llm
    text = "Tenants must not see each other's cached prefixes. " * 6
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    # Two salts in one batch, same text: each writes its own blocks; outputs are identical.
    out_x, out_y = llm.generate([{"prompt": text, "cache_salt": "x"}, {"prompt": text, "cache_salt": "y"}],
                                params, use_tqdm=False)
    assert out_x.outputs[0].token_ids == out_y.outputs[0].token_ids
    stored = [h for e in _stored_events(subscriber) for h in e.block_hashes]
    num_blocks = len(out_x.prompt_token_ids) // BLOCK_SIZE
    assert len(stored) == len(set(stored)) == 2 * num_blocks  # no block shared across the salts
    again, = llm.generate({"prompt": text, "cache_salt": "y"}, params, use_tqdm=False)
    assert again.num_cached_tokens == num_blocks * BLOCK_SIZE


@pytest.mark.parametrize("salt", ["", 5, b"x", ["a"]])
def test_bad_salt_is_refused(salted_llm, salt) -> None:
    llm, _ = salted_llm
    with pytest.raises(InvalidPromptError, match="cache_salt must be a non-empty str"):
        llm.generate({"prompt": "hello", "cache_salt": salt}, SamplingParams(max_tokens=1), use_tqdm=False)
    with pytest.raises(InvalidPromptError, match="cache_salt"):
        llm.generate({"prompt_token_ids": [1, 2, 3], "cache_salt": salt}, SamplingParams(max_tokens=1),
                     use_tqdm=False)
