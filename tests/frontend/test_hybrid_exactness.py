"""A hybrid (sliding-window + global) Gemma3 model end to end: greedy equals HF token by token
(fp32), outputs are unchanged by prefix caching, chunked prefill and preemption, and the
sliding-window groups free the blocks behind the window while a request runs."""

from __future__ import annotations

import pytest

from lm_console.engine import LLM, SamplingParams
from lm_console.engine.kv_cache_interface import SlidingWindowSpec
from lm_console.engine.kv_cache_interface import cdiv
from llm_helpers import compare_greedy, greedy_token_ids, hf_greedy, prefix_sharing_prompts, random_prompts

pytestmark = pytest.mark.slow

MAX_TOKENS = 32
WINDOW = 24  # tiny_gemma3_dir's sliding_window
BLOCK_SIZE = 16
# Small pools keep start-up fast (the default 1 GiB would be ~260k blocks of this tiny model).
NUM_BLOCKS = 1024
# In-process cores: these tests look inside the KV cache manager, and skip the process start-up
# (the multiprocess path is the same engine core; tests/frontend/test_llm*.py cover it). One
# torch thread: on a busy 2-core machine the tiny decode matmuls ran 25x slower with two.
IN_PROCESS = {"multiprocess": False, "dtype": "float32", "num_threads": 1}


def _greedy(n: int = MAX_TOKENS, logprobs: int | None = None) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=logprobs)


def test_gemma3_greedy_matches_hf(make_llm, tiny_gemma3_dir) -> None:
    llm = make_llm(str(tiny_gemma3_dir), **IN_PROCESS, num_gpu_blocks_override=NUM_BLOCKS)
    # Prompts of 5 to 300 tokens: most are longer than the window of 24.
    prompts = random_prompts(llm.config.model_config.vocab_size, 12, 5, 300, seed=1)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], _greedy(logprobs=5), use_tqdm=False)
    exact, failures = compare_greedy(outputs, hf_greedy(tiny_gemma3_dir, prompts, MAX_TOKENS))
    print(f"tiny gemma3: {exact}/{len(prompts)} prompts match HF exactly")
    assert not failures, failures
    assert exact >= len(prompts) - 1


@pytest.fixture(scope="module")
def gemma3_prompts(tiny_gemma3_dir) -> list[list[int]]:
    from transformers import AutoConfig

    return prefix_sharing_prompts(AutoConfig.from_pretrained(tiny_gemma3_dir).vocab_size, 8)


@pytest.fixture(scope="module")
def gemma3_baseline(tiny_gemma3_dir, gemma3_prompts) -> list[list[int]]:
    llm = LLM(str(tiny_gemma3_dir), **IN_PROCESS, enable_prefix_caching=False, num_gpu_blocks_override=NUM_BLOCKS)
    try:
        return greedy_token_ids(llm, gemma3_prompts)
    finally:
        llm.shutdown()


def test_gemma3_prefix_caching_does_not_change_outputs(make_llm, tiny_gemma3_dir, gemma3_prompts,
                                                       gemma3_baseline) -> None:
    llm = make_llm(str(tiny_gemma3_dir), **IN_PROCESS, num_gpu_blocks_override=NUM_BLOCKS)
    assert greedy_token_ids(llm, gemma3_prompts) == gemma3_baseline
    # Second pass: every prompt's blocks are cached in the full group, and the sliding groups
    # hold the blocks of the last window, so the hybrid lookup finds long hits.
    outputs = llm.generate([{"prompt_token_ids": p} for p in gemma3_prompts], _greedy(24), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == gemma3_baseline
    assert all(o.num_cached_tokens >= (len(p) - 1) // BLOCK_SIZE * BLOCK_SIZE - BLOCK_SIZE
               for o, p in zip(outputs, gemma3_prompts))


def test_gemma3_chunked_prefill_does_not_change_outputs(make_llm, tiny_gemma3_dir, gemma3_prompts,
                                                        gemma3_baseline) -> None:
    llm = make_llm(str(tiny_gemma3_dir), **IN_PROCESS, max_num_batched_tokens=32, num_gpu_blocks_override=NUM_BLOCKS)
    assert greedy_token_ids(llm, gemma3_prompts) == gemma3_baseline


def test_gemma3_preemption_does_not_change_outputs(make_llm, tiny_gemma3_dir, gemma3_prompts,
                                                   gemma3_baseline) -> None:
    # 6 groups share the pool: 64 blocks for 12 requests of up to ~215 tokens force preemption
    # (one request needs at most 16 full blocks + 5 sliding groups x 5 blocks with 32-token chunks).
    llm = make_llm(str(tiny_gemma3_dir), **IN_PROCESS, num_gpu_blocks_override=64,
                   max_model_len=256, max_num_batched_tokens=32, enable_prefix_caching=False)
    assert greedy_token_ids(llm, gemma3_prompts) == gemma3_baseline
    assert llm.get_stats().num_preemptions_total > 0


def test_sliding_window_blocks_are_freed_during_generation(make_llm, tiny_gemma3_dir) -> None:
    llm = make_llm(str(tiny_gemma3_dir), **IN_PROCESS, num_gpu_blocks_override=NUM_BLOCKS)
    core = llm.engine_core.engine_core
    kv = core.kv_cache_manager
    specs = [g.kv_cache_spec for g in core.kv_cache_config.kv_cache_groups]
    sliding = [gid for gid, spec in enumerate(specs) if isinstance(spec, SlidingWindowSpec)]
    assert len(sliding) == 5 and len(specs) == 6
    max_real = cdiv(WINDOW, BLOCK_SIZE) + 1
    observed: list[tuple[int, int, int]] = []  # (computed tokens, real sliding blocks, blocks in use)
    schedule = core.scheduler.schedule

    def recording_schedule():  # type: ignore[no-untyped-def]
        out = schedule()
        for request in core.scheduler.running:
            blocks = kv.get_blocks(request.request_id).blocks
            if request.num_computed_tokens > request.num_prompt_tokens:  # decoding
                real = max(sum(1 for b in blocks[g] if not b.is_null) for g in sliding)
                in_use = kv.block_pool.num_gpu_blocks - 1 - kv.num_free_blocks
                observed.append((request.num_computed_tokens, real, in_use))
        return out

    core.scheduler.schedule = recording_schedule
    prompt = random_prompts(llm.config.model_config.vocab_size, 1, 40, 40, seed=3)[0]
    outputs = llm.generate([{"prompt_token_ids": prompt}], _greedy(200), use_tqdm=False)
    assert len(outputs[0].outputs[0].token_ids) == 200
    assert observed and observed[-1][0] >= 230
    assert max(real for _, real, _ in observed) <= max_real
    # At the end the full group holds every block, each sliding group only its window.
    num_tokens, _, in_use = observed[-1]
    assert in_use <= cdiv(num_tokens, BLOCK_SIZE) + len(sliding) * max_real
    assert in_use < 2 * cdiv(num_tokens, BLOCK_SIZE)  # 6 full-attention groups would need 6x


def test_mistral_all_sliding_layers_use_one_sliding_group(make_llm, tiny_mistral_dir) -> None:
    """A window on every layer: one SlidingWindowSpec group (unitary coordinator), HF-exact."""
    llm = make_llm(str(tiny_mistral_dir), **IN_PROCESS, num_gpu_blocks_override=NUM_BLOCKS)
    groups = llm.engine_core.engine_core.kv_cache_config.kv_cache_groups
    assert [g.kv_cache_spec for g in groups] == [SlidingWindowSpec(BLOCK_SIZE, 24)]
    prompts = random_prompts(llm.config.model_config.vocab_size, 4, 30, 120, seed=2)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], _greedy(logprobs=5), use_tqdm=False)
    exact, failures = compare_greedy(outputs, hf_greedy(tiny_mistral_dir, prompts, MAX_TOKENS))
    assert not failures, failures
    assert exact >= len(prompts) - 1
    # Second pass over the same prompts: sliding-window prefix hits, same tokens.
    again = llm.generate([{"prompt_token_ids": p} for p in prompts], _greedy(logprobs=5), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in outputs]
    assert all(o.num_cached_tokens > 0 for o in again)
