"""Greedy output equals HF transformers token by token (fp32), and is unchanged by prefix
caching, forced chunked prefill and preemption."""

from __future__ import annotations

import pytest

from lm_console.engine import LLM, SamplingParams
from broken_variants import block_hash_drops_tokens, rank1_attention_zeroed
from llm_helpers import (compare_greedy, greedy_token_ids, hf_greedy, hf_teacher_forced, prefix_sharing_prompts,
                         random_prompts, text_prompts)

pytestmark = pytest.mark.slow

MAX_TOKENS = 64
MAX_INEXACT = 2  # of 20 prompts, at most 2 may differ from HF (each at a near tie)


def _greedy(n: int = MAX_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=5)


# One tiny model in `make test-fast`; the others with the slow tests.
@pytest.mark.parametrize("model_fixture", ["tiny_llama_dir", pytest.param("tiny_qwen2_dir", marks=pytest.mark.slow),
                                           pytest.param("tiny_qwen3_dir", marks=pytest.mark.slow)])
def test_greedy_matches_hf_on_tiny_models(request, make_llm, model_fixture) -> None:
    model_dir = request.getfixturevalue(model_fixture)
    llm = make_llm(str(model_dir), dtype="float32")
    prompts = random_prompts(llm.config.model_config.vocab_size, 20, 5, 500, seed=1)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], _greedy(), use_tqdm=False)
    _assert_matches_hf(outputs, hf_greedy(model_dir, prompts, MAX_TOKENS), model_fixture)


def _assert_matches_hf(outputs, references, what: str) -> None:  # noqa: ANN001
    exact, failures = compare_greedy(outputs, references)
    print(f"{what}: {exact}/{len(references)} prompts match HF exactly")
    assert not failures, failures
    assert exact >= len(references) - MAX_INEXACT, f"{what}: only {exact}/{len(references)} match HF exactly"


def test_negative_control_rank1_attention_zeroed_fails_the_hf_check(make_llm, tiny_llama_dir) -> None:
    """The HF-exactness check on an engine whose rank-1 heads lost their attention
    (tests/broken_variants.py) must fail (6 prompts, 16 tokens: cheap)."""
    with rank1_attention_zeroed():
        llm = make_llm(str(tiny_llama_dir), dtype="float32", multiprocess=False)
        prompts = random_prompts(llm.config.model_config.vocab_size, 6, 5, 200, seed=1)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], _greedy(16), use_tqdm=False)
    with pytest.raises(AssertionError, match="not a near tie|match HF exactly"):
        _assert_matches_hf(outputs, hf_greedy(tiny_llama_dir, prompts, 16), "broken engine")


@pytest.mark.slow
def test_greedy_matches_hf_on_embedded_model(make_llm, embedded_model_dir) -> None:
    # HF scores our completions in one forward each (hf_teacher_forced: the same check as its
    # greedy generate up to the first difference, which is all compare_greedy reads).
    llm = make_llm(None, dtype="float32")
    prompts = text_prompts(llm.get_tokenizer(), 20, 5, 500)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], _greedy(), use_tqdm=False)
    references = hf_teacher_forced(embedded_model_dir, prompts, [o.outputs[0].token_ids for o in outputs])
    _assert_matches_hf(outputs, references, "embedded model")


@pytest.fixture(scope="module")
def shared_prefix_prompts(tiny_llama_dir) -> list[list[int]]:
    from transformers import AutoConfig

    return prefix_sharing_prompts(AutoConfig.from_pretrained(tiny_llama_dir).vocab_size, 12)


@pytest.fixture(scope="module")
def baseline_ids(tiny_llama_dir, shared_prefix_prompts) -> list[list[int]]:
    llm = LLM(str(tiny_llama_dir), dtype="float32", enable_prefix_caching=False)
    return greedy_token_ids(llm, shared_prefix_prompts)


def test_prefix_caching_does_not_change_outputs(make_llm, tiny_llama_dir, shared_prefix_prompts,
                                                baseline_ids) -> None:
    llm = make_llm(str(tiny_llama_dir), dtype="float32", enable_prefix_caching=True)
    assert greedy_token_ids(llm, shared_prefix_prompts) == baseline_ids
    # Second pass: everything is a prefix hit now.
    outputs = llm.generate([{"prompt_token_ids": p} for p in shared_prefix_prompts],
                           SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == baseline_ids
    assert all(o.num_cached_tokens > 0 for o in outputs)


def test_negative_control_a_hash_that_drops_tokens_changes_outputs(make_llm, tiny_llama_dir, baseline_ids) -> None:
    """The prefix-caching check (outputs equal to those without caching) when block hashes read 4
    of every 16 tokens (tests/broken_variants.py): prompts that agree only on those tokens hit
    each other's blocks, and the check must fail."""
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(tiny_llama_dir).vocab_size
    first = random_prompts(vocab, 1, 40, 40, seed=21)[0]
    # Same tokens at 0, 4, 8, ... of the two full blocks, different elsewhere.
    second = [t if i % 4 == 0 or i >= 32 else (t + 1) % vocab for i, t in enumerate(first)]
    clean = make_llm(str(tiny_llama_dir), dtype="float32", enable_prefix_caching=False, multiprocess=False)
    expected = greedy_token_ids(clean, [first, second])
    with block_hash_drops_tokens():
        llm = make_llm(str(tiny_llama_dir), dtype="float32", enable_prefix_caching=True, multiprocess=False)
        got = [greedy_token_ids(llm, [p])[0] for p in (first, second)]  # the second hits the first's blocks
    assert got[0] == expected[0]
    assert got[1] != expected[1]


def test_chunked_prefill_does_not_change_outputs(make_llm, tiny_llama_dir, shared_prefix_prompts,
                                                 baseline_ids) -> None:
    llm = make_llm(str(tiny_llama_dir), dtype="float32", max_num_batched_tokens=32)
    assert greedy_token_ids(llm, shared_prefix_prompts) == baseline_ids


def test_preemption_does_not_change_outputs(make_llm, tiny_llama_dir, shared_prefix_prompts,
                                            baseline_ids) -> None:
    # 40 blocks of 16 tokens for 16 requests of up to ~215 tokens: preemption is certain.
    llm = make_llm(str(tiny_llama_dir), dtype="float32", num_gpu_blocks_override=40,
                   max_model_len=512)
    assert greedy_token_ids(llm, shared_prefix_prompts) == baseline_ids
    assert llm.get_stats().num_preemptions_total > 0
