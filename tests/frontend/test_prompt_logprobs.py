"""prompt_logprobs end to end: equal transformers' log-softmax over the prompt (fp32, 1e-4).

vLLM's semantics: None for the first prompt token, then for each later position a dict with the
actual token (its true rank) and the top-k tokens (ranks 1..k), with decoded text. Checked with
and without chunked prefill, after a prefix-cache hit and across preemptions.
"""

from __future__ import annotations

import random

import pytest
import torch

from lm_console.engine import LLM, SamplingParams

TOL = 1e-4
TOP_K = 3


@pytest.fixture(scope="module")
def prompts(tiny_llama_dir) -> list[list[int]]:
    rng = random.Random(15)
    # 10 prompts of 2..70 tokens: several blocks, some split in chunks of the small budget.
    lengths = [2, 5, 17, 31, 33, 40, 48, 55, 64, 70]
    return [[rng.randrange(3, 250) for _ in range(n)] for n in lengths]


@pytest.fixture(scope="module")
def reference(tiny_llama_dir, prompts) -> list[torch.Tensor]:
    """transformers' fp32 log-softmax at every prompt position, [len - 1, vocab] per prompt."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    with torch.inference_mode():
        return [model(torch.tensor([p])).logits[0, :-1].float().log_softmax(-1) for p in prompts]


def _check(outputs, prompts, reference, tokenizer) -> None:
    for output, prompt, ref in zip(outputs, prompts, reference):
        rows = output.prompt_logprobs
        assert rows is not None and len(rows) == len(prompt) and rows[0] is None
        for position in range(1, len(prompt)):
            row, expected = rows[position], ref[position - 1]
            token = prompt[position]
            actual = row[token]
            assert abs(actual.logprob - expected[token].item()) < TOL, (position, token)
            # The true rank, up to ties within the tolerance.
            assert (1 + int((expected > expected[token] + TOL).sum()) <= actual.rank
                    <= 1 + int((expected > expected[token] - TOL).sum()))
            assert actual.decoded_token == tokenizer.decode([token])
            # The top-k: every entry's logprob is transformers', and none is below its k-th best.
            kth_best = expected.topk(TOP_K).values[-1].item()
            for tid, logprob in row.items():
                assert abs(logprob.logprob - expected[tid].item()) < TOL
                assert tid == token or expected[tid].item() > kth_best - TOL
            assert len(row) in (TOP_K, TOP_K + 1)


def test_prompt_logprobs_equal_transformers_with_a_prefix_hit(tiny_llama_dir, prompts, reference) -> None:
    llm = LLM(str(tiny_llama_dir), dtype="float32", max_model_len=128, num_gpu_blocks_override=96, multiprocess=False)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=TOP_K)
        prompt_dicts = [{"prompt_token_ids": p} for p in prompts]
        _check(llm.generate(prompt_dicts, params, use_tqdm=False), prompts, reference, llm.get_tokenizer())
        # Cache every prompt, then ask again: the hit does not skip a single row.
        llm.generate(prompt_dicts, SamplingParams(max_tokens=1), use_tqdm=False)
        again = llm.generate(prompt_dicts, params, use_tqdm=False)
        _check(again, prompts, reference, llm.get_tokenizer())
        plain = llm.generate(prompt_dicts[4], SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)
        assert plain[0].prompt_logprobs is None and plain[0].num_cached_tokens > 0
        assert [o.outputs[0].token_ids for o in again][4] == plain[0].outputs[0].token_ids
        # prompt_logprobs=0: the actual token only, with its rank.
        zero, = llm.generate(prompt_dicts[2], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
        assert all(len(row) == 1 and prompts[2][i + 1] in row for i, row in enumerate(zero.prompt_logprobs[1:]))
    finally:
        llm.shutdown()


def test_prompt_logprobs_across_chunks_and_preemption(tiny_llama_dir, prompts, reference) -> None:
    # A 24-token budget splits every long prompt; 14 blocks for 10 prompts forces preemptions, so
    # prompts are recomputed: each row must still come out exactly once.
    llm = LLM(str(tiny_llama_dir), dtype="float32", max_model_len=128, max_num_batched_tokens=24,
              num_gpu_blocks_override=14, multiprocess=False)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, prompt_logprobs=TOP_K)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        _check(outputs, prompts, reference, llm.get_tokenizer())
        assert llm.get_stats().num_preemptions_total > 0
    finally:
        llm.shutdown()

