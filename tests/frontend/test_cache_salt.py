"""cache_salt from the prompt dict (vLLM's TextPrompt/TokensPrompt key): tenants' prefixes apart.

The engine core runs in this process (multiprocess=False), so its NONE_HASH (the chain's root)
is this module's and the salted hashes the KV events carry can be recomputed exactly. The events
are those the core attaches to its outputs (what the PUB socket and kv_events_stream publish).
"""

from __future__ import annotations

import pytest

from lm_console.engine import LLM, SamplingParams
from lm_console.engine import kv_cache_hashing
from lm_console.engine.errors import InvalidPromptError
from lm_console.engine.kv_cache_hashing import hash_block_tokens, sha256_cbor
from lm_console.engine.metrics.kv_events import BlockStored

BLOCK_SIZE = 16


@pytest.fixture(scope="module")
def salted_llm(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), dtype="float32", max_model_len=256, num_gpu_blocks_override=64,
              enable_kv_cache_events=True, multiprocess=False)
    stored: list[bytes] = []
    get_output = llm.engine_core.get_output

    def recording_get_output():  # type: ignore[no-untyped-def]
        outputs = get_output()
        if outputs.kv_events is not None:
            stored.extend(h for e in outputs.kv_events.events if isinstance(e, BlockStored) for h in e.block_hashes)
        return outputs

    llm.engine_core.get_output = recording_get_output  # type: ignore[method-assign]
    yield llm, stored
    llm.shutdown()


def _expected_chain(token_ids: list[int], salt: str | None) -> list[bytes]:
    """The hash of every full block: the salt enters the first block's extra keys only."""
    hashes: list[bytes] = []
    for start in range(0, len(token_ids) - BLOCK_SIZE + 1, BLOCK_SIZE):
        extra = (salt,) if start == 0 and salt else None
        parent = hashes[-1] if hashes else kv_cache_hashing.NONE_HASH
        hashes.append(hash_block_tokens(sha256_cbor, parent, token_ids[start:start + BLOCK_SIZE], extra))
    return hashes


def test_salts_separate_blocks_and_events_carry_salted_hashes(salted_llm) -> None:
    llm, stored = salted_llm
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    tokens = list(range(300, 300 + 3 * BLOCK_SIZE + 5))  # 3 full blocks

    def run(prompts: list[dict]) -> tuple[list, list[bytes]]:
        stored.clear()
        return llm.generate(prompts, params, use_tqdm=False), list(stored)

    (out,), stored_a = run([{"prompt_token_ids": tokens, "cache_salt": "tenant-a"}])
    assert out.num_cached_tokens == 0 and stored_a == _expected_chain(tokens, "tenant-a")
    (out,), again = run([{"prompt_token_ids": tokens, "cache_salt": "tenant-a"}])
    assert out.num_cached_tokens == 3 * BLOCK_SIZE and again == []  # the same salt shares every block
    (out,), stored_b = run([{"prompt_token_ids": tokens, "cache_salt": "tenant-b"}])
    assert out.num_cached_tokens == 0 and stored_b == _expected_chain(tokens, "tenant-b")
    (out,), stored_plain = run([{"prompt_token_ids": tokens}])
    assert out.num_cached_tokens == 0 and stored_plain == _expected_chain(tokens, None)
    assert not set(stored_a) & set(stored_b) and not set(stored_plain) & (set(stored_a) | set(stored_b))
    # Text prompts, two salts in one batch: each writes its own blocks; the outputs agree.
    text = "Tenants must not see each other's cached prefixes. " * 6
    (x, y), both = run([{"prompt": text, "cache_salt": "x"}, {"prompt": text, "cache_salt": "y"}])
    assert x.outputs[0].token_ids == y.outputs[0].token_ids
    num_blocks = len(x.prompt_token_ids) // BLOCK_SIZE
    assert len(both) == len(set(both)) == 2 * num_blocks  # no block shared across the salts
    (hit,), _ = run([{"prompt": text, "cache_salt": "y"}])
    assert hit.num_cached_tokens == num_blocks * BLOCK_SIZE


@pytest.mark.parametrize("salt", ["", 5, b"x", ["a"]])
def test_bad_salt_is_refused(salted_llm, salt) -> None:
    llm, _ = salted_llm
    with pytest.raises(InvalidPromptError, match="cache_salt must be a non-empty str"):
        llm.generate({"prompt": "hello", "cache_salt": salt}, SamplingParams(max_tokens=1), use_tqdm=False)
    with pytest.raises(InvalidPromptError, match="cache_salt"):
        llm.generate({"prompt_token_ids": [1, 2, 3], "cache_salt": salt}, SamplingParams(max_tokens=1),
                     use_tqdm=False)
